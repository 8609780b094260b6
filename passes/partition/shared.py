"""Plans whose stages share devices: any planner's plan on a virtual cluster, folded.

``stages_per_device=v`` asks a planner for a plan in which each device runs up to v stages
(Megatron's interleaving, generalised to stage DAGs). The planner searches as it always does,
on a virtual cluster of v times as many devices, each with 1/v of a device's speed and memory.
Its plan is then folded onto the real devices (``fold``): stages of one width share blocks of
that many devices, up to v on a block, dealt round robin in topological order. On a chain of
one device per stage that is Megatron's placement (stage s on device s mod N); on a DAG,
stages at the same depth (concurrent branches) and consecutive ones land on different
devices.

Each v also gets candidates cut from plans for the real devices (``split_stages``: each stage
cut into v consecutive pieces, folded the same way; a linearised plan's ordering edges kept,
so a chain stays a chain), each cut two ways: where the pieces' FLOPs reach their shares, and
into pieces of balanced seconds under the cost model (``balanced_cuts``, ``layer_seconds``):

  * the planner's own plan;
  * the planner's plan for v times as many micro-batches, run at the planner's count: its
    stages and widths are chosen for the bubble of v M micro-batches, about what interleaving
    v stages per device leaves at M, where the plan for M is chosen for a bubble interleaving
    shrinks (five of the six configurations of ``benchmarks/shared_devices.py`` where v = 2
    is 15% faster than v = 1 and than the chain).

The candidates are simulated on the real cluster under a schedule for shared devices
(``interleaved-1f1b`` unless another is asked for; ZB-V too where the backward may be split,
``shared_schedules``), devices running their stages one at a time, memory per device the sum
of its stages'; the fastest within memory is kept. With ``stages_per_device="auto"`` the
planner chooses v among 1, 2 and 4 by that prediction, keeping v > 1 only where it is
predicted ``auto_min_gain`` faster (10% on CPU devices, 3% on accelerators), and searching
for it only where the plan of one stage per device leaves room for that gain in its bubble
(``bubble_leaves_room``), and for v = 4 only where some v = 2 plan was predicted faster
than v = 1. Where it searches it plans up to three more times per v and simulates every
candidate.

Where the user gives no ``stages_per_device``, ``graph_pipeline`` and the command lines ask
for ``"auto"`` on accelerators and for 1 on CPU devices (``default_stages_per_device``): on
CPU devices every v = 2 measured ran slower than v = 1 where the model predicted it faster
(docs/results/schedules.md). A planner called directly plans one stage per device unless
asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from gpp_jax.cost.cluster import CPU, Cluster
from gpp_jax.cost.cost_model import DEFAULT_COST_MODEL, layer_costs
from gpp_jax.errors import PlanError, ScheduleError
from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import (
  Plan,
  Stage,
  check_microbatch_sizes,
  has_mixed_microbatches,
  stage_edges,
)
from gpp_jax.passes.shared_devices import SHARED_SCHEDULES, stage_depths

AUTO_STAGES_PER_DEVICE = (1, 2, 4)
# "auto" keeps several stages per device only where they are predicted this much faster than
# one, and searches for them only where the plan of one stage per device leaves every stage
# idle enough for that (interleaving shrinks the bubble, not the busiest stage's own work).
# On CPU devices, or predicted with the host's measured costs, 10%: there every v = 2 measured
# ran slower than v = 1 where the model gave it up to 14% (docs/results/schedules.md); one
# host thread issues v times the instructions. On accelerators planned devices-only, 3%.
AUTO_MIN_GAIN = 0.10
AUTO_MIN_GAIN_DEVICES = 0.03


def default_stages_per_device(cluster: Cluster) -> int | str:
  """What ``stages_per_device`` is where the user gives none (``graph_pipeline``'s planner,
  the ``gpp_jax.plan`` and ``gpp_jax.train`` command lines): ``"auto"`` (v chosen by
  prediction) on accelerators, 1 on CPU devices. On CPU devices one host thread issues every
  instruction and the devices share its cores: every v = 2 measured there ran slower than
  v = 1 (0.74-0.96x), where the model gave it 1.03-1.25x (docs/results/schedules.md), so the
  prediction ``"auto"`` would choose by is not to be trusted there. A planner called
  directly plans one stage per device unless asked."""
  return 1 if cluster.device.name == CPU.name else "auto"


def auto_min_gain(cluster: Cluster, host: Any = None) -> float:
  """The gain ``"auto"`` asks of several stages per device on ``cluster`` (see above)."""
  if host is not None or cluster.device.name == CPU.name:
    return AUTO_MIN_GAIN
  return AUTO_MIN_GAIN_DEVICES


def pays(shared: Plan, one: Plan, gain: float) -> bool:
  """Whether ``shared`` (stages sharing devices) is predicted ``gain`` faster than ``one``
  (one stage per device), as ``"auto"`` asks before it keeps it."""
  if shared is one:
    return True
  return shared.predicted["iteration_time"] * (1 + gain) <= one.predicted["iteration_time"]


def bubble_leaves_room(plan: Plan, gain: float) -> bool:
  """Whether ``plan`` (one stage per device) could be ``gain`` faster with its bubble gone:
  at least two stages, and the busiest one idle at least 1 - 1/(1 + gain) of the step."""
  bubble = plan.predicted.get("bubble") or ()
  return plan.num_stages >= 2 and bool(bubble) and min(bubble) >= 1 - 1 / (1 + gain)


def virtual_cluster(cluster: Cluster, v: int) -> Cluster:
  """``cluster`` with each device cut into ``v`` virtual devices: v times as many, each with
  1/v of the speed, memory bandwidth and memory (links as they were). Nodes keep their size
  in devices: ``fold`` puts a virtual stage of w devices on w real ones, so its all-reduce
  and transfers cross the links of w real devices (a stage of 8 on nodes of 4 crosses
  nodes, as it does folded)."""
  dev = dataclasses.replace(
    cluster.device,
    peak_flops=cluster.device.peak_flops / v,
    memory_bandwidth=cluster.device.memory_bandwidth / v,
  )
  return dataclasses.replace(
    cluster,
    num_devices=cluster.num_devices * v,
    device=dev,
    memory_per_device=cluster.memory_per_device / v,
    name=f"{cluster.name} (x{v} virtual)",
  )


def fold(plan: Plan, num_devices: int, v: int) -> Plan | None:
  """The virtual plan on ``num_devices`` devices, up to ``v`` stages on each. Stages of one
  width w share blocks of w devices: in topological order (by depth), each stage goes to the
  block of its width with the fewest stages so far (at most v) that holds none of its
  neighbours in the stage graph and none of the stages at its depth, where one does (the
  first such block). On a chain of one device per stage that is Megatron's placement (stage s
  on device s mod N); on a DAG, concurrent branches and consecutive stages land on different
  devices. None where the blocks need more than ``num_devices`` devices."""
  g = plan.stage_graph()
  depth = stage_depths(g)
  by_width: dict[int, list[int]] = {}
  for s in sorted(range(plan.num_stages), key=lambda s: (depth[s], s)):
    by_width.setdefault(len(plan.stages[s].devices), []).append(s)
  blocks = {w: -(-len(ss) // v) for w, ss in by_width.items()}
  if sum(w * n for w, n in blocks.items()) > num_devices:
    return None
  devices: dict[int, tuple[int, ...]] = {}
  first = 0
  for w in sorted(by_width, reverse=True):  # widest first: blocks stay aligned
    held: list[list[int]] = [[] for _ in range(blocks[w])]
    for s in by_width[w]:
      near = set(g.predecessors(s)) | set(g.successors(s))
      open_ = [b for b in range(blocks[w]) if len(held[b]) < v]
      least = min(len(held[b]) for b in open_)
      clash = {
        b: sum(t in near or depth[t] == depth[s] for t in held[b]) for b in open_
      }  # neighbours and stages at its depth already on block b
      b = min(open_, key=lambda b: (len(held[b]) > least, clash[b], b))
      held[b].append(s)
      devices[s] = tuple(range(first + w * b, first + w * (b + 1)))
    first += w * blocks[w]
  mb = plan.batch_size // plan.num_microbatches if plan.batch_size else None  # one size for all
  stages = tuple(
    dataclasses.replace(st, devices=devices[st.index], microbatch_size=mb, in_flight=None)
    for st in plan.stages
  )
  return plan.replace(stages=stages)


def split_stages(
  plan: Plan,
  layer_graph: nx.DiGraph,
  v: int,
  weights: Mapping[str, float] | None = None,
) -> Plan | None:
  """Each stage of ``plan`` cut into up to ``v`` stages, consecutive in its layers'
  topological order (each piece convex, as its stage was), on the stage's width; the pieces
  then folded onto the devices of the plan (``fold``): Megatron's interleaving of a chain when
  every stage has one device. Without ``weights`` a piece ends where the running sum of the
  layers' FLOPs first reaches its share; with ``weights`` (seconds per layer, ``layer_seconds``)
  the cuts make the largest piece as small as the layers allow (``balanced_cuts``). None where
  no stage has two layers to cut."""
  order = {l: k for k, l in enumerate(topo_layers(layer_graph))}
  assign: dict[str, int] = {}
  pieces: list[tuple[tuple[str, ...], int]] = []  # (layers, width)
  for st in plan.stages:
    layers = sorted(st.layers, key=order.__getitem__)
    if weights is None:
      cuts = _share_cuts([float(layer_graph.nodes[l].get("flops", 0.0)) or 1.0 for l in layers], v)
    else:
      cuts = balanced_cuts([float(weights[l]) for l in layers], v)
    for a, b in zip([0, *cuts], [*cuts, len(layers)]):
      for l in layers[a:b]:
        assign[l] = len(pieces)
      pieces.append((tuple(layers[a:b]), len(st.devices)))
  if len(pieces) == plan.num_stages:
    return None
  stages = tuple(
    Stage(i, layers, tuple(range(w))) for i, (layers, w) in enumerate(pieces)
  )  # devices: the width; ``fold`` deals them onto blocks
  # The plan's ordering edges (no tensor along them: a linearised plan's chain) stay, from
  # the last piece of one stage to the first of the next, so a chain stays a chain.
  data = set(stage_edges(layer_graph, {l: st.index for st in plan.stages for l in st.layers}))
  first = {st.index: assign[min(st.layers, key=order.__getitem__)] for st in plan.stages}
  last = {st.index: assign[max(st.layers, key=order.__getitem__)] for st in plan.stages}
  edges = set(stage_edges(layer_graph, assign))
  edges |= {(last[i], first[j]) for i, j in plan.edges if (i, j) not in data}
  cut = plan.replace(stages=stages, edges=tuple(sorted(edges)))
  used = len({d for st in plan.stages for d in st.devices})
  return fold(_widths_as_virtual(cut), used, v)


def _share_cuts(flops: Sequence[float], v: int) -> list[int]:
  """Cuts into up to ``v`` pieces, each ending where the running sum first reaches its share
  of the total (leaving a layer for each piece still to come)."""
  total, k = sum(flops), min(v, len(flops))
  cuts: list[int] = []
  acc = 0.0
  for i, f in enumerate(flops[:-1]):
    acc += f
    if (
      len(cuts) < k - 1
      and acc >= total * (len(cuts) + 1) / k
      and len(flops) - i - 1 >= k - 1 - len(cuts)
    ):
      cuts.append(i + 1)
  return cuts


def balanced_cuts(weights: Sequence[float], v: int) -> list[int]:
  """Cut positions splitting ``weights`` into min(v, len) consecutive pieces whose largest
  sum is the least possible: the least bound that v greedy pieces fit under (bisection),
  then pieces filled up to it, each leaving a layer for every piece still to come."""
  n = len(weights)
  k = min(v, n)
  if k <= 1:
    return []

  def pieces(bound: float) -> int:
    count, acc = 1, 0.0
    for w in weights:
      if acc + w > bound and acc > 0:
        count, acc = count + 1, w
      else:
        acc += w
    return count

  lo, hi = max(weights), float(sum(weights))
  for _ in range(64):
    mid = (lo + hi) / 2
    if pieces(mid) <= k:
      hi = mid
    else:
      lo = mid
  bound = hi * (1 + 1e-9)
  cuts: list[int] = []
  acc = 0.0
  for i, w in enumerate(weights):
    if i > 0 and len(cuts) < k - 1 and (acc + w > bound or n - i == k - 1 - len(cuts)):
      cuts.append(i)
      acc = 0.0
    acc += w
  return cuts


def layer_seconds(
  plan: Plan, layer_graph: nx.DiGraph, cluster: Cluster, cost_model: Any = None
) -> dict[str, float]:
  """Each layer's forward and backward seconds under the cost model, at the micro-batch each
  device of its stage computes (the plan's micro-batch over the stage's width)."""
  cm = cost_model or DEFAULT_COST_MODEL
  costs = layer_costs(layer_graph)
  mb = (plan.batch_size or layer_graph.graph.get("batch_size", 1)) / plan.num_microbatches
  out: dict[str, float] = {}
  for st in plan.stages:
    tf, tb = cm.layer_times(costs, cluster.device, mb / len(st.devices))
    for l in st.layers:
      i = costs.index[l]
      out[l] = float(tf[i] + tb[i])
  return out


def _widths_as_virtual(plan: Plan) -> Plan:
  """The plan with stage i's devices distinct virtual ones of its width (``fold`` reads only
  the widths and the stage graph)."""
  first, stages = 0, []
  for st in plan.stages:
    w = len(st.devices)
    stages.append(dataclasses.replace(st, devices=tuple(range(first, first + w))))
    first += w
  return plan.replace(stages=tuple(stages))


def shared_schedules(
  schedule: str | None, schedules: Sequence[str] | None = None
) -> tuple[str, ...]:
  """The schedules a plan whose stages share devices is simulated under: ``schedule`` where
  given, else interleaved 1F1B; with ZB-V too where the backward may be split (``schedule``
  is zero-bubble, or the planner's ``schedules`` option names zero-bubble or zb-v), as the
  planner's own plan may then be zero-bubble."""
  out = [schedule or "interleaved-1f1b"]
  if schedule == "zero-bubble" or {"zero-bubble", "zb-v"} & set(schedules or ()):
    out.append("zb-v")
  return tuple(dict.fromkeys(out))


def at_microbatches(plan: Plan, M: int, batch: int | None) -> Plan | str:
  """``plan`` run at M micro-batches of ``batch`` samples: its stages' sizes made
  batch / M where it planned them for another number (as ``stage_microbatch_sizes`` runs a
  plan whose stages name one size), or why it cannot be (``check_microbatch_sizes``: a
  stage's devices do not split that size)."""
  if not batch or has_mixed_microbatches(plan):
    return plan.replace(num_microbatches=M)
  stages = tuple(dataclasses.replace(s, microbatch_size=batch // M) for s in plan.stages)
  sized = plan.replace(stages=stages, num_microbatches=M)
  try:
    check_microbatch_sizes(sized, batch)
  except PlanError as e:
    return str(e)
  return sized


def plan_with_shared_devices(
  planner: Any,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  batch_size: int | None,
  *,
  stages_per_device: int | str,
  num_microbatches: int | None = None,
  schedule: str | None = None,
  **kw: Any,
) -> Plan:
  """``planner``'s best plan with up to ``stages_per_device`` stages on each device (an int,
  or ``"auto"``: the best predicted of 1, 2 and 4, v > 1 only ``auto_min_gain`` faster than
  v = 1); see the module docstring.

  ``schedule``: the schedule of a plan whose stages share devices (default interleaved-1f1b);
  plans of one stage per device keep the planner's own (or ``schedule`` where it is one the
  planner takes)."""
  from gpp_jax.passes.partition.plan_assembly import better, prediction
  from gpp_jax.passes.simulation import simulate

  if stages_per_device == "auto":
    choices: Sequence[int] = AUTO_STAGES_PER_DEVICE
  elif isinstance(stages_per_device, int) and stages_per_device >= 1:
    choices = (stages_per_device,)
  else:
    raise ValueError(
      f"stages_per_device must be a positive int or 'auto', not {stages_per_device!r}"
    )
  shared = shared_schedules(schedule, kw.get("schedules"))
  own = {} if schedule is None or schedule in SHARED_SCHEDULES else {"schedule": schedule}
  host = kw.get("host")
  cost_model = kw.get("cost_model")  # the candidates are priced as the planner prices its own
  one = planner(layer_graph, cluster, batch_size, num_microbatches=num_microbatches, **own, **kw)
  auto = stages_per_device == "auto"
  gain = auto_min_gain(cluster, host)
  if auto and not bubble_leaves_room(one, gain):
    return one
  best: Plan | None = one if 1 in choices else None
  tried: list[str] = []

  def consider(plan: Plan | None, v: int, how: str) -> None:
    nonlocal best
    if plan is None or plan.places() is None:
      tried.append(f"v={v} ({how}): no two stages share devices")
      return
    sized = at_microbatches(plan, one.num_microbatches, batch)
    if isinstance(sized, str):
      tried.append(f"v={v} ({how}): {sized}")
      return
    for name in shared:
      cand = sized.replace(schedule=name)
      try:
        res = simulate(cand, layer_graph, cluster, cost_model=cost_model, timeline=False, host=host)
      except ScheduleError as e:
        tried.append(f"v={v} ({how}, {name}): {e}")
        continue
      peak = max(res.peak_memory.values(), default=0.0)
      info = {
        "stages_per_device": cand.stages_per_device,
        "shared_devices": how,
        "max_memory": peak,
        "memory_ok": bool(peak <= cluster.memory_per_device),
      }
      cand = cand.replace(predicted=prediction(res, cand, cluster, info=info))
      if peak > cluster.memory_per_device:
        tried.append(f"v={v} ({how}, {name}): needs {peak / 2**20:.2f} MiB on a device")
        continue
      best = better(best, cand)

  def split_both(plan: Plan, v: int, how: str) -> None:
    """``plan``'s stages cut into v where their FLOPs reach each share, and cut into v
    pieces of balanced seconds (the two differ where layers are coarse)."""
    consider(split_stages(plan, layer_graph, v), v, how)
    weights = layer_seconds(plan, layer_graph, cluster, cost_model)
    consider(split_stages(plan, layer_graph, v, weights), v, how + ", balanced")

  batch = one.batch_size or batch_size or layer_graph.graph.get("batch_size")
  M = one.num_microbatches
  for v in choices:
    if v == 1:
      continue
    if auto and v > 2 and best is one:
      # Two stages per device gained nothing: four, which halve the stages again and add
      # as many transfers, are not searched (their virtual cluster is the largest search).
      tried.append(f"v={v}: not searched, v=2 was not predicted faster than v=1")
      break
    split_both(one, v, "the stages cut and interleaved")
    # The planner's plan for v times as many micro-batches, cut into v and run at M: its
    # stages and widths are chosen for the bubble of v M micro-batches, about the bubble
    # interleaving v stages per device leaves at M (Megatron: (p - 1)/(v m)).
    if batch and batch % (v * M) == 0:
      try:
        many = planner(layer_graph, cluster, batch_size, num_microbatches=v * M, **own, **kw)
      except PlanError as e:
        tried.append(f"v={v} (planned for {v * M} micro-batches): {e}")
      else:
        split_both(
          many.replace(num_microbatches=M),
          v,
          f"planned for {v * M} micro-batches, the stages cut and interleaved",
        )
    # The planner on a virtual cluster of v x N devices, folded: with its own choice of the
    # micro-batches, and (where that is another number) with M, as the candidates run.
    for count in dict.fromkeys((num_microbatches, M)):
      where = f"planned on {cluster.num_devices * v} virtual devices"
      try:
        vplan = planner(
          layer_graph, virtual_cluster(cluster, v), batch_size, num_microbatches=count, **own, **kw
        )
      except PlanError as e:
        tried.append(f"v={v} ({where}): {e}")
        continue
      if count is None and vplan.num_microbatches == M:
        consider(fold(vplan, cluster.num_devices, v), v, where)
        break
      at_m = f" at M {M}" if num_microbatches is None and count is not None else ""
      consider(fold(vplan, cluster.num_devices, v), v, where + at_m)
  if auto and best is not None and not pays(best, one, gain):
    return one
  if best is None:
    raise PlanError(
      f"no plan with stages_per_device={stages_per_device}: "
      + "; ".join(tried)
      + ". Ask for fewer stages per device, or use more micro-batches or devices"
    )
  return best
