"""Plan IR: which layers form each stage, which devices run it, and how it is scheduled.

A Plan is what every planner returns and what the staging pass consumes. Stages form a DAG
(``edges``); each stage runs on a set of devices (data parallel inside the stage when it has
several) and a micro-batch size. Two stages' device sets are either disjoint or the same:
stages on the same devices share them ("several stages per device", ``Plan.places``), and the
schedule says in which order those devices run them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from gpp_jax.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage.

  Attributes:
    index: position of the stage in ``Plan.stages``.
    layers: names of the LayerGraph layers this stage computes.
    devices: indices into the device list the plan is run on (one data-parallel group).
    microbatch_size: samples per micro-batch at this stage (None: batch / num_microbatches).
    in_flight: micro-batches whose activations this stage holds at most (None: not computed).
    inner: over a mesh (``graph_pipeline(mesh=)``), the sizes this stage gives the mesh's
      axes after the first, each dividing the mesh's own (None: the mesh's). A stage that
      narrows an axis (say "model" from 4 to 2) runs the devices it frees as more rows of the
      first axis: less tensor parallelism, more data parallelism, on the same devices. The
      planners choose it per stage (``passes.partition.stage_shapes``).
  """

  index: int
  layers: tuple[str, ...]
  devices: tuple[int, ...]
  microbatch_size: int | None = None
  in_flight: int | None = None
  inner: tuple[int, ...] | None = None

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    if self.inner is None:
      del d["inner"]
    else:
      d["inner"] = list(self.inner)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Stage:
    return cls(
      index=int(d["index"]),
      layers=tuple(d["layers"]),
      devices=tuple(d["devices"]),
      microbatch_size=d.get("microbatch_size"),
      in_flight=d.get("in_flight"),
      inner=None if d.get("inner") is None else tuple(int(n) for n in d["inner"]),
    )


@dataclasses.dataclass(frozen=True)
class Plan:
  """A stage DAG with devices and a micro-batch schedule.

  Attributes:
    stages: the stages, ``stages[i].index == i``.
    edges: stage-graph edges ``(i, j)``: stage i's forward feeds stage j.
    num_microbatches: micro-batches per mini-batch (for uniform micro-batch sizes; stages with
      different ``microbatch_size``s run ``batch_size / microbatch_size`` each, see
      ``stage_microbatch_sizes``).
    schedule: name of the schedule generator ("1f1b", "gpipe").
    planner: name of the planner that produced the plan.
    batch_size: mini-batch size the plan was made for (None if not known).
    predicted: what the planner's cost model predicts (iteration_time, memory per stage...).
    param_sharding: how a stage over several devices holds its parameters, their optimizer
      state and gradient sums: ``"model"`` by the model's own partition specs (replicated
      where it has none), ``"replicated"`` on every device of the stage, ``"fsdp"`` each
      sharded over all of the stage's devices along its largest dimension they divide
      (``runtime.sharding``).
    sequential: the stages form a chain in their order (a sequential planner's pipeline:
      PipeDream's, Piper's, ...): a local search on the plan keeps it a chain
      (``passes.partition.refine``). It does not change how the plan runs.
  """

  stages: tuple[Stage, ...]
  edges: tuple[tuple[int, int], ...]
  num_microbatches: int
  schedule: str = "1f1b"
  planner: str = "manual"
  batch_size: int | None = None
  predicted: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
  param_sharding: str = "model"
  sequential: bool = False

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def stage_graph(self) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(self.num_stages))
    g.add_edges_from(self.edges)
    return g

  def places(self) -> tuple[int, ...] | None:
    """Per stage, its device set as a number (stages on the same devices share a number, in
    order of first use), or None where every stage has devices of its own."""
    seen: dict[frozenset[int], int] = {}
    out = tuple(seen.setdefault(frozenset(s.devices), len(seen)) for s in self.stages)
    return out if len(seen) < len(out) else None

  @property
  def num_places(self) -> int:
    """How many device sets the stages run on (stages sharing devices count once)."""
    return len({frozenset(s.devices) for s in self.stages})

  @property
  def stages_per_device(self) -> int:
    """The most stages any device runs (1 where every stage has devices of its own)."""
    places = self.places()
    if places is None:
      return 1
    return max(places.count(p) for p in set(places))

  def stage_of_layer(self) -> dict[str, int]:
    return {l: s.index for s in self.stages for l in s.layers}

  def depth(self) -> int:
    """Pipeline depth: number of stages on the longest path of the stage graph.

    Counted over the edges in topological order (the planners ask it of every candidate;
    building a networkx graph for it cost more than the count); networkx counts it, or names
    the cycle, where an edge names no stage or the edges close a cycle."""
    n = self.num_stages
    succ: list[list[int]] = [[] for _ in range(n)]
    waiting = [0] * n
    for i, j in self.edges:
      if not (0 <= i < n and 0 <= j < n):
        return nx.dag_longest_path_length(self.stage_graph()) + 1
      succ[i].append(j)
      waiting[j] += 1
    level = [0] * n  # edges on the longest path ending at each stage
    ready = [s for s in range(n) if not waiting[s]]
    for i in ready:  # grows while it is read: Kahn's order
      for j in succ[i]:
        if level[i] + 1 > level[j]:
          level[j] = level[i] + 1
        waiting[j] -= 1
        if not waiting[j]:
          ready.append(j)
    if len(ready) < n:  # a cycle
      return nx.dag_longest_path_length(self.stage_graph()) + 1
    return max(level, default=0) + 1

  def replace(self, **kw) -> Plan:
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict[str, Any]:
    d = {
      "stages": [s.to_dict() for s in self.stages],
      "edges": [list(e) for e in self.edges],
      "num_microbatches": self.num_microbatches,
      "schedule": self.schedule,
      "planner": self.planner,
      "batch_size": self.batch_size,
      "predicted": dict(self.predicted),
    }
    if self.param_sharding != "model":
      d["param_sharding"] = self.param_sharding
    if self.sequential:
      d["sequential"] = True
    return d

  def to_json(self, indent: int | None = 1) -> str:
    return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Plan:
    return cls(
      stages=tuple(Stage.from_dict(s) for s in d["stages"]),
      edges=tuple(tuple(e) for e in d["edges"]),
      num_microbatches=int(d["num_microbatches"]),
      schedule=d.get("schedule", "1f1b"),
      planner=d.get("planner", "manual"),
      batch_size=d.get("batch_size"),
      predicted=dict(d.get("predicted", {})),
      param_sharding=d.get("param_sharding", "model"),
      sequential=bool(d.get("sequential", False)),
    )

  @classmethod
  def from_json(cls, s: str) -> Plan:
    return cls.from_dict(json.loads(s))

  def save(self, path: str) -> None:
    """Writes the plan as JSON; ``Plan.load(path)`` reads it back (for ``planner=``)."""
    with open(path, "w") as f:
      f.write(self.to_json() + "\n")

  @classmethod
  def load(cls, path: str) -> Plan:
    """A plan written by ``save`` (or the ``plan.json`` of a training run folder)."""
    with open(path) as f:
      text = f.read()
    try:
      return cls.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
      raise PlanError(f"{path} is not a gpp_jax plan ({type(e).__name__}: {e})") from e

  def fingerprint(self) -> str:
    """A hash of what the runtime executes (stages, devices, edges, micro-batches, schedule),
    not of the planner's predictions: equal for plans that run identically."""
    d = self.to_dict()
    del d["predicted"], d["planner"]
    d.pop("sequential", None)  # how a search may move it, not how it runs
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

  def __str__(self) -> str:
    p = self.predicted
    head = (
      f"Plan by {self.planner}: {_count(self.num_stages, 'stage')}, depth {self.depth()}, "
      f"{_count(self.num_microbatches, 'micro-batch', 'micro-batches')}, "
      f"schedule {self.schedule}"
    )
    if "iteration_time" in p:
      head += f", predicted iteration {p['iteration_time'] * 1e3:.3f} ms"
    idle = p.get("idle_devices") or ()
    if idle:  # and why, where the planner says (``passes.partition.idle``)
      head += f"\n{_count(len(idle), 'device')} idle" + (
        f": {p['idle_reason']}" if p.get("idle_reason") else ""
      )
    places = self.places()
    if places is not None:
      shared = {
        q: [s for s in range(self.num_stages) if places[s] == q] for q in sorted(set(places))
      }
      groups = "; ".join(
        f"stages {','.join(map(str, ss))} on {_on(self.stages[ss[0]].devices)}"
        for ss in shared.values()
        if len(ss) > 1
      )
      head += f"\n{self.stages_per_device} stages per device at most: {groups}"
    shaped = any(s.inner is not None for s in self.stages)  # a stage narrows the mesh
    rows = [
      head,
      f"{'stage':>5s} {'devices':>12s}{' inner' if shaped else ''} {'mb':>4s} {'flight':>6s}"
      f" {'mem MiB':>9s} {'next':>8s}  layers",
    ]
    mem = p.get("stage_memory", {})
    for s in self.stages:
      nxt = ",".join(str(j) for i, j in self.edges if i == s.index) or "-"
      m = mem.get(str(s.index), mem.get(s.index))
      layers = ", ".join(s.layers)
      if len(layers) > 80:
        layers = f"{s.layers[0]} ... {s.layers[-1]} ({len(s.layers)} layers)"
      inner = "x".join(map(str, s.inner)) if s.inner is not None else "-"
      rows.append(
        f"{s.index:5d} {_devs(s.devices):>12s}{f' {inner:>5s}' if shaped else ''} "
        f"{s.microbatch_size or '-':>4} "
        f"{s.in_flight or '-':>6} {'-' if m is None else f'{m / 2**20:.1f}':>9s}"
        f" {nxt:>8s}  {layers}"
      )
    return "\n".join(rows)


def _on(devs: Sequence[int]) -> str:
  return f"device {devs[0]}" if len(devs) == 1 else f"devices {_devs(devs)}"


def _devs(devs: Sequence[int]) -> str:
  devs = list(devs)
  if len(devs) > 2 and devs == list(range(devs[0], devs[-1] + 1)):
    return f"{devs[0]}-{devs[-1]}"
  return ",".join(map(str, devs))


def stage_edges(
  layer_graph: nx.DiGraph, stage_of_layer: Mapping[str, int]
) -> tuple[tuple[int, int], ...]:
  """Stage-graph edges induced by the layer graph (constraint C2 of GraphPipe)."""
  return tuple(
    sorted(
      {
        (stage_of_layer[u], stage_of_layer[v])
        for u, v in layer_graph.edges
        if stage_of_layer[u] != stage_of_layer[v]
      }
    )
  )


def has_mixed_microbatches(plan: Plan) -> bool:
  """Whether the stages of ``plan`` name different micro-batch sizes (a None next to an
  explicit size counts as different; ``stage_microbatch_sizes`` resolves None to
  batch / num_microbatches)."""
  return len({s.microbatch_size for s in plan.stages}) > 1


def stage_microbatch_sizes(plan: Plan, batch_size: int) -> tuple[int, ...]:
  """b_s per stage for a mini-batch of ``batch_size`` samples.

  A plan whose stages all give the same size (or none) is uniform: every stage runs
  ``batch_size / num_microbatches`` samples per micro-batch, whatever size the stages name
  (``num_microbatches`` decides, as for plans without sizes). Otherwise each stage runs its own
  ``microbatch_size`` (None: ``batch_size / num_microbatches``). Raises PlanError when a size
  does not divide the batch.
  """
  if batch_size % plan.num_microbatches:
    raise PlanError(
      f"the batch of {batch_size} samples does not split into {plan.num_microbatches} "
      f"micro-batches; use a num_microbatches that divides {batch_size}"
    )
  uniform = batch_size // plan.num_microbatches
  if not has_mixed_microbatches(plan):
    return (uniform,) * plan.num_stages
  sizes = tuple(s.microbatch_size or uniform for s in plan.stages)
  for s, b in enumerate(sizes):
    if b < 1 or batch_size % b:
      raise PlanError(
        f"stage {s} has micro-batch size {b}, which does not divide the batch of "
        f"{batch_size} samples; give stage {s} a size that divides {batch_size}"
      )
  return sizes


def stage_microbatch_counts(plan: Plan, batch_size: int) -> tuple[int, ...]:
  """M_s = batch / b_s per stage: the micro-batches stage s runs per step."""
  return tuple(batch_size // b for b in stage_microbatch_sizes(plan, batch_size))


def check_microbatch_sizes(plan: Plan, batch_size: int) -> None:
  """Per-stage sizes divide the batch, align along every stage edge (the larger a multiple of
  the smaller, so a chunk of one stage is a union of whole chunks of the other), and split
  over each data-parallel stage's devices."""
  sizes = stage_microbatch_sizes(plan, batch_size)
  for i, j in plan.edges:
    small, big = sorted((sizes[i], sizes[j]))
    if big % small:
      raise PlanError(
        f"stages {i} and {j} are connected but their micro-batch sizes {sizes[i]} and "
        f"{sizes[j]} do not align (the larger must be a multiple of the smaller, so chunks "
        f"line up); change stage {i} or {j} to a size that divides or is a multiple of the "
        "other's"
      )
  for s, b in zip(plan.stages, sizes):
    k = len(s.devices)
    if k > 1 and b % k:
      raise PlanError(
        f"stage {s.index} spans {k} devices but a micro-batch has {b} samples, which do "
        f"not split {k} ways; give stage {s.index} a micro-batch size divisible by {k} or "
        "fewer devices"
      )


def _count(n: int, one: str, many: str | None = None) -> str:
  """``1 stage``, ``2 stages``."""
  return f"{n} {one if n == 1 else many or one + 's'}"


def validate_plan(
  plan: Plan,
  layer_graph: nx.DiGraph | None = None,
  num_devices: int | None = None,
  batch_size: int | None = None,
) -> None:
  """Raises PlanError naming the first problem with ``plan`` and how to fix it.

  Checks: stage indices; every layer in exactly one stage; each stage convex (no path leaves
  it and re-enters); the stage graph acyclic and equal to the one the layer graph induces;
  devices non-empty, within ``num_devices``, and for two stages either disjoint or the same
  (stages sharing devices). With ``batch_size`` (default: the
  plan's), per-stage micro-batch sizes divide it, align along every stage edge, and split
  over each stage's devices (``stage_microbatch_sizes``).
  """
  for i, s in enumerate(plan.stages):
    if s.index != i:
      raise PlanError(f"stage at position {i} has index {s.index}; stages must be numbered 0..n-1")
    if not s.devices:
      raise PlanError(f"stage {i} has no device; give every stage at least one device")
  if plan.num_microbatches < 1:
    raise PlanError(f"num_microbatches must be >= 1, got {plan.num_microbatches}")
  if num_devices is not None and plan.num_places > num_devices:
    raise PlanError(
      f"the plan has {plan.num_stages} stages but only {num_devices} devices; "
      "merge stages, pass more devices, or give several stages the same devices"
    )
  seen: dict[int, int] = {}
  for s in plan.stages:
    for d in s.devices:
      if d in seen and set(plan.stages[seen[d]].devices) != set(s.devices):
        raise PlanError(
          f"device {d} is used by stages {seen[d]} (devices "
          f"{list(plan.stages[seen[d]].devices)}) and {s.index} (devices {list(s.devices)}); "
          "two stages run either on disjoint devices or on the same ones (several stages per "
          "device): give them the same devices or disjoint ones"
        )
      seen.setdefault(d, s.index)
      if num_devices is not None and not 0 <= d < num_devices:
        raise PlanError(
          f"stage {s.index} uses device {d}, but only {num_devices} devices are "
          f"available (indices 0..{num_devices - 1})"
        )
  if layer_graph is not None:
    _check_layers(plan, layer_graph)
  sg = plan.stage_graph()
  if not nx.is_directed_acyclic_graph(sg):
    raise PlanError(f"the stage graph has a cycle {nx.find_cycle(sg)}; stages must form a DAG")
  batch = batch_size if batch_size is not None else plan.batch_size
  if has_mixed_microbatches(plan):
    if batch is None:
      raise PlanError(
        f"the stages have different micro-batch sizes "
        f"{[s.microbatch_size for s in plan.stages]} but the plan has no batch_size; set "
        "Plan.batch_size so the sizes can be checked against the batch"
      )
    check_microbatch_sizes(plan, batch)


def _check_layers(plan: Plan, layer_graph: nx.DiGraph) -> None:
  where: dict[str, int] = {}
  for s in plan.stages:
    for l in s.layers:
      if l not in layer_graph:
        raise PlanError(
          f"stage {s.index} names unknown layer {l!r}; known layers: "
          f"{sorted(layer_graph.nodes)[:20]}"
        )
      if l in where:
        raise PlanError(
          f"layer {l!r} is in stages {where[l]} and {s.index}; each layer belongs "
          "to exactly one stage"
        )
      where[l] = s.index
  missing = [l for l in layer_graph if l not in where]
  if missing:
    raise PlanError(f"layers {missing[:10]} are in no stage; assign every layer to a stage")
  induced = stage_edges(layer_graph, where)
  q = nx.DiGraph()
  q.add_nodes_from(range(plan.num_stages))
  q.add_edges_from(induced)
  if not nx.is_directed_acyclic_graph(q):
    cyc = nx.find_cycle(q)
    s = cyc[0][0]
    through = [
      f"{u} -> {v} ({a} -> {b})"
      for a, b in cyc
      for u, v in sorted(layer_graph.edges)
      if where[u] == a and where[v] == b
    ]
    raise PlanError(
      f"stage {s} is not convex: a path leaves it and re-enters it (stage cycle {cyc}, "
      f"through the layer edges {through[:8]}). Move the layers between the two visits into "
      f"stage {s}, or split it."
    )
  if set(induced) - set(plan.edges):
    raise PlanError(
      f"plan.edges {sorted(plan.edges)} lack the stage edges "
      f"{sorted(set(induced) - set(plan.edges))} that the layer graph induces"
    )
