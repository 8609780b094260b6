"""Plans whose stages share devices: any planner's plan on a virtual cluster, folded.

``stages_per_device=v`` asks a planner for a plan in which each device runs up to v stages
(Megatron's interleaving, generalised to stage DAGs). The planner searches as it always does,
on a virtual cluster of v times as many devices, each with 1/v of a device's speed and memory.
Its plan is then folded onto the real devices (``fold``): stages of one width share blocks of
that many devices, up to v on a block, dealt round robin in topological order. On a chain of
one device per stage that is Megatron's placement (stage s on device s mod N); on a DAG,
stages at the same depth (concurrent branches) and consecutive ones land on different
devices.

Each v also gets a second candidate: the planner's own plan for the real devices, each stage
cut into v (``split_stages``) and folded the same way. The candidates are simulated on the real
cluster under a schedule for shared devices (``interleaved-1f1b`` unless another is asked for),
devices running their stages one at a time, memory per device the sum of its stages'. With
``stages_per_device="auto"`` the planner chooses v among 1, 2 and 4 by that prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import networkx as nx

from gpp_jax.cost.cluster import Cluster
from gpp_jax.errors import PlanError, ScheduleError
from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import Plan, Stage, stage_edges
from gpp_jax.passes.shared_devices import SHARED_SCHEDULES, stage_depths

AUTO_STAGES_PER_DEVICE = (1, 2, 4)


def virtual_cluster(cluster: Cluster, v: int) -> Cluster:
  """``cluster`` with each device cut into ``v`` virtual devices: v times as many, each with
  1/v of the speed, memory bandwidth and memory (links as they were)."""
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
    devices_per_node=None if cluster.devices_per_node is None else cluster.devices_per_node * v,
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


def split_stages(plan: Plan, layer_graph: nx.DiGraph, v: int) -> Plan | None:
  """Each stage of ``plan`` cut into up to ``v`` stages of about equal FLOPs, consecutive in
  its layers' topological order (each piece convex, as its stage was), on the stage's width;
  the pieces then folded onto the devices of the plan (``fold``): Megatron's interleaving of a
  chain when every stage has one device. None where no stage has two layers to cut."""
  order = {l: k for k, l in enumerate(topo_layers(layer_graph))}
  assign: dict[str, int] = {}
  pieces: list[tuple[tuple[str, ...], int]] = []  # (layers, width)
  for st in plan.stages:
    layers = sorted(st.layers, key=order.__getitem__)
    flops = [float(layer_graph.nodes[l].get("flops", 0.0)) or 1.0 for l in layers]
    total, k = sum(flops), min(v, len(layers))
    cuts: list[int] = []
    acc = 0.0
    for i, f in enumerate(flops[:-1]):
      acc += f
      if (
        len(cuts) < k - 1
        and acc >= total * (len(cuts) + 1) / k
        and len(layers) - i - 1 >= k - 1 - len(cuts)
      ):
        cuts.append(i + 1)
    for a, b in zip([0, *cuts], [*cuts, len(layers)]):
      for l in layers[a:b]:
        assign[l] = len(pieces)
      pieces.append((tuple(layers[a:b]), len(st.devices)))
  if len(pieces) == plan.num_stages:
    return None
  stages = tuple(
    Stage(i, layers, tuple(range(w))) for i, (layers, w) in enumerate(pieces)
  )  # devices: the width; ``fold`` deals them onto blocks
  cut = plan.replace(stages=stages, edges=stage_edges(layer_graph, assign))
  used = len({d for st in plan.stages for d in st.devices})
  return fold(_widths_as_virtual(cut), used, v)


def _widths_as_virtual(plan: Plan) -> Plan:
  """The plan with stage i's devices distinct virtual ones of its width (``fold`` reads only
  the widths and the stage graph)."""
  first, stages = 0, []
  for st in plan.stages:
    w = len(st.devices)
    stages.append(dataclasses.replace(st, devices=tuple(range(first, first + w))))
    first += w
  return plan.replace(stages=tuple(stages))


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
  or ``"auto"``: the best predicted of 1, 2 and 4); see the module docstring.

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
  shared_schedule = schedule or "interleaved-1f1b"
  own = {} if schedule is None or schedule in SHARED_SCHEDULES else {"schedule": schedule}
  host = kw.get("host")
  cost_model = kw.get("cost_model")  # the candidates are priced as the planner prices its own
  one = planner(layer_graph, cluster, batch_size, num_microbatches=num_microbatches, **own, **kw)
  best: Plan | None = one if 1 in choices else None
  tried: list[str] = []

  def consider(plan: Plan | None, v: int, how: str) -> None:
    nonlocal best
    if plan is None or plan.places() is None:
      tried.append(f"v={v} ({how}): no two stages share devices")
      return
    plan = plan.replace(schedule=shared_schedule, num_microbatches=one.num_microbatches)
    try:
      res = simulate(plan, layer_graph, cluster, cost_model=cost_model, timeline=False, host=host)
    except ScheduleError as e:
      tried.append(f"v={v} ({how}): {e}")
      return
    peak = max(res.peak_memory.values(), default=0.0)
    info = {
      "stages_per_device": plan.stages_per_device,
      "shared_devices": how,
      "max_memory": peak,
      "memory_ok": bool(peak <= cluster.memory_per_device),
    }
    plan = plan.replace(predicted=prediction(res, plan, cluster, info=info))
    if peak > cluster.memory_per_device:
      tried.append(f"v={v} ({how}): needs {peak / 2**20:.2f} MiB on a device")
      return
    best = better(best, plan)

  for v in choices:
    if v == 1:
      continue
    consider(split_stages(one, layer_graph, v), v, "the stages cut and interleaved")
    try:
      vplan = planner(
        layer_graph,
        virtual_cluster(cluster, v),
        batch_size,
        num_microbatches=num_microbatches,
        **own,
        **kw,
      )
    except PlanError as e:
      tried.append(f"v={v} (planned on {cluster.num_devices * v} virtual devices): {e}")
      continue
    consider(
      fold(vplan, cluster.num_devices, v),
      v,
      f"planned on {cluster.num_devices * v} virtual devices",
    )
  if best is None:
    raise PlanError(
      f"no plan with stages_per_device={stages_per_device}: "
      + "; ".join(tried)
      + ". Ask for fewer stages per device, or use more micro-batches or devices"
    )
  return best
