"""A certified lower bound on the simulated iteration time of every plan: LayerGraph + Cluster ->
seconds, from a mixed-integer program (``scipy.optimize.milp``, HiGHS).

What every plan of the planners' space must pay, by the simulator's own rules: each stage runs
its M forwards and M backwards one after another on its devices and then its UPDATE (gradient
all-reduce + optimizer), so for every stage s

    iteration >= M * (F_s + B_s)(b / d_s) + U_s(d_s)

with F_s + B_s the sum of its layers' times at b / d_s samples per device (the cost model's
``stage_time``) and U_s the all-reduce's bandwidth term plus the optimizer traffic (the
all-reduce's latency term, never negative, is left out). The program minimises the largest of
these over a *relaxation* of the plan space: layers are split into groups with any device
count d dividing the micro-batch (sum of d <= K), without memory, the transfers other than the
one below and the convexity of stages other than the sink's (below), and with the pipeline fill
and drain of one stage only (below). Its optimum is therefore at most the iteration time of
every plan whose stages all run micro-batch b, and the minimum over micro-batch sizes is a lower
bound for every such plan (plans with a micro-batch size per stage, ``stage_microbatches``, are
outside it).
It is exact for the relaxation, not for the plans: the gap to the best plan includes what the
relaxation leaves out.

Pipeline fill and drain (``fill=True``, default). Take the sink layer v that ends the heaviest
path (by the layers' smallest F + B), the stage S holding v (group 0 of the program), and from
each source layer that reaches v (up to ``fill_paths`` of them, heaviest first) the heaviest
path to v. A stage runs a micro-batch's forward once all its inputs are there, so S cannot
start its first forward before micro-batch 0 has gone forward through every such path's layers
outside S (stages are convex, so those precede S on the path), each on its own group's devices
(its forward time at that group's device count), plus one transfer over the fastest link of the
path's smallest edge when some of its layers lie outside S; after its M forwards and M
backwards, its update follows, and the last micro-batch's backward must still travel back along
the same layers (the drain). So, for every path,

    iteration >= fill + M * (F_S + B_S) + U_S   and   iteration >= fill + M * (F_S + B_S) + drain

The drain term holds when a stage's last input-gradient backward is its last computation, which
is not so for schedules that split the backward (``split_backward=True`` drops it). The paths'
layers are kept in classes apart from the other layers (the layers of a class lie on the same
paths), and the sink in a class of its own, so the program knows on which group each path's
layers lie; identical layers of a path (a branch of identical layers) still share one class.

The sink's stage is convex: if S holds a layer u, it holds every layer on a path from u to v.
Where every layer of a class lies on such a path from every layer of another class, the program
says so (``sink_closure``). Without it the program can put the sink alone, or with a layer far
from it, on one device and leave its other inputs (a Transformer's head behind the towers'
concatenation) to any group, which no stage graph allows.

Symmetry breaking and form. Layers with identical costs (the layers of identical branches) are
interchangeable in the relaxation, so each class of identical layers is one integer variable
per group (how many of its layers the group holds) instead of one binary per layer. The groups
are slots of a fixed device count each (up to min(K // d, n) of count d; group 0 one slot per
count, exactly one used), so a group's time is linear in its counts without big-M terms, and the
slots of one count, which are interchangeable, are ordered by non-increasing time. (With the
sink's convexity, a program with a device-count variable per group and big-M terms for its time
did not close on MMT at 32 devices in 60 s: its dual bound stayed at the bound without the
fill.)

If the solver stops at ``time_limit`` the bound is its proven dual bound (still a lower bound);
with the fill, never below the bound without it (solved first, over the coarser classes, and
given to the program as a floor of its objective).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel
from gpp_jax.passes.partition.plan_assembly import (
  data_parallel_degrees,
  microbatch_sizes,
  planner_inputs,
)


@dataclasses.dataclass(frozen=True)
class LowerBound:
  """``seconds``: the bound; ``per_size``: micro-batch size -> its bound; ``classes``: how
  many classes of identical layers the program used (of ``layers``); ``optimal``: every
  program was solved to optimality (else dual bounds were used)."""

  seconds: float
  per_size: dict[int, float]
  layers: int
  classes: int
  optimal: bool


def _layer_classes(rows: np.ndarray) -> list[list[int]]:
  """Indices of identical rows (to 12 significant digits), grouped."""
  keyed: dict[tuple[float, ...], list[int]] = {}
  for i, r in enumerate(rows):
    keyed.setdefault(tuple(float(f"{x:.12g}") for x in r), []).append(i)
  return list(keyed.values())


@dataclasses.dataclass(frozen=True, eq=False)
class Classes:
  """Classes of interchangeable layers: class c holds ``size[c]`` layers, each costing
  ``cost[c, k]`` in a group on ``dps[k]`` devices (``Slots``)."""

  cost: np.ndarray
  size: list[int]

  @classmethod
  def of(cls, rows: np.ndarray, classes: list[list[int]]) -> Classes:
    """The classes of layers ``classes`` (indices into ``rows``; ``_layer_classes``), each
    layer costing its row of ``rows``."""
    return cls(np.array([rows[c[0]] for c in classes]), [len(c) for c in classes])


@dataclasses.dataclass(frozen=True)
class Slots:
  """The groups the program may form: each on one of ``dps`` devices, at most ``per_count``
  groups of each device count, their devices at most ``num_devices`` in all."""

  dps: list[int]
  num_devices: int
  per_count: int


@dataclasses.dataclass(frozen=True)
class Fill:
  """The pipeline fill and drain of the stage (group 0) that holds the sink layer ``sink`` (its
  class, the sink alone) of the paths into it: ``paths[p]`` the class of each layer of path p
  in order, the sink last (a class lies on a path entirely or not at all; identical layers of
  the same paths are one class) and ``transfer[p]`` the smallest time of one micro-batch
  crossing one of its edges;
  ``fwd[c, k]``, ``bwd[c, k]`` the forward and backward times of one micro-batch through a
  class-c layer on ``dps[k]`` devices, and ``compute[c, k]`` its M forwards and backwards
  alone (without the update). ``closure``: pairs (class a, classes cs) such that every layer of
  every class in cs lies on a path from every layer of a to the sink; the sink's stage is
  convex, so if it holds a layer of a it holds all of cs."""

  sink: int
  paths: list[list[int]]
  fwd: np.ndarray
  bwd: np.ndarray
  transfer: list[float]
  compute: np.ndarray
  drain: bool
  closure: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)


class _Rows:
  """A sparse constraint matrix built row by row: ``add({column: coefficient}, lo, hi)``."""

  def __init__(self) -> None:
    self.r: list[int] = []
    self.c: list[int] = []
    self.v: list[float] = []
    self.lo: list[float] = []
    self.hi: list[float] = []

  def add(self, entries: dict[int, float], lo: float, hi: float) -> None:
    i = len(self.lo)
    for col, val in entries.items():
      self.r.append(i)
      self.c.append(col)
      self.v.append(val)
    self.lo.append(lo)
    self.hi.append(hi)

  def constraint(self, n: int) -> LinearConstraint:
    A = coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lo), n)).tocsr()
    return LinearConstraint(A, np.array(self.lo), np.array(self.hi))


def _min_max_groups(
  classes: Classes,
  groups: Slots,
  time_limit: float,
  fill: Fill | None = None,
  floor: float = 0.0,
) -> tuple[float, bool]:
  """min over groupings of max group time: class c holds ``size[c]`` interchangeable layers,
  each costing ``a[c, k]`` in a group on ``dps[k]`` devices (``classes``); at most J groups of
  each device count, sum of devices <= K (``groups``); with ``fill``, group 0 holds the sink and
  also pays the fill (and drain) of the path layers outside it. The solver stops at
  ``time_limit`` seconds; ``floor`` bounds the objective from below. Returns (the optimum or
  the solver's dual bound, solved to optimality).

  The groups are slots of a fixed device count (up to min(K // d, J) of each count d), so a
  group's time is linear in its counts (no big-M); slots of one count are interchangeable and
  ordered by non-increasing time. Group 0 is one slot per device count, exactly one used."""
  a, size = classes.cost, classes.size
  dps, K, J = groups.dps, groups.num_devices, groups.per_count
  C, D = a.shape
  slots = [(k, s) for k, d in enumerate(dps) for s in range(min(K // d, J))]
  S = len(slots)
  P = len(fill.paths) if fill is not None else 0
  Q = len(fill.closure) if fill is not None else 0
  G = C * D + D if fill is not None else 0
  # Variables: cnt[c, i] (integer: class-c layers in slot i), used[i] (binary), z (the
  # objective), then with the fill: cnt0[c, k] and used0[k] (group 0 on dps[k] devices), w[p]
  # (binary: some layer of path p lies outside group 0) and u[q] (binary: group 0 holds a layer
  # of the closure's class q).
  nv = C * S + S + 1 + G + P + Q
  cnt = lambda c, i: c * S + i
  used = lambda i: C * S + i
  z = C * S + S
  cnt0 = lambda c, k: z + 1 + c * D + k
  used0 = lambda k: z + 1 + C * D + k
  wv = lambda p: z + 1 + G + p
  uv = lambda q: z + 1 + G + P + q
  rows = _Rows()
  for c in range(C):  # every layer in some group
    e = {cnt(c, i): 1.0 for i in range(S)}
    if fill is not None:
      e.update({cnt0(c, k): 1.0 for k in range(D)})
    rows.add(e, size[c], size[c])
  for i, (k, _) in enumerate(slots):
    for c in range(C):  # a slot with layers has its devices
      rows.add({cnt(c, i): 1.0, used(i): -float(size[c])}, -np.inf, 0.0)
    load = {cnt(c, i): float(a[c, k]) for c in range(C)}
    rows.add({**load, z: -1.0}, -np.inf, 0.0)  # z >= the slot's time
    if i + 1 < S and slots[i + 1][0] == k:  # the next slot of this count: no busier
      rows.add({used(i): 1.0, used(i + 1): -1.0}, 0.0, np.inf)
      nxt = {cnt(c, i + 1): -float(a[c, k]) for c in range(C)}
      rows.add({**load, **nxt}, 0.0, np.inf)
  devices = {used(i): float(dps[k]) for i, (k, _) in enumerate(slots)}
  if fill is not None:
    devices.update({used0(k): float(d) for k, d in enumerate(dps)})
  rows.add(devices, 0.0, K)
  if fill is not None:
    holds = lambda c: {cnt0(c, k): 1.0 for k in range(D)}  # group 0's count of class c
    rows.add({used0(k): 1.0 for k in range(D)}, 1.0, 1.0)
    for c in range(C):
      for k in range(D):
        rows.add({cnt0(c, k): 1.0, used0(k): -float(size[c])}, -np.inf, 0.0)
    rows.add(holds(fill.sink), 1.0, 1.0)
    for q, (c, later) in enumerate(fill.closure):  # group 0 is a convex stage
      rows.add({**holds(c), uv(q): -float(size[c])}, -np.inf, 0.0)
      for x in later:
        rows.add({**holds(x), uv(q): -float(size[x])}, 0.0, np.inf)
    own = {cnt0(c, k): float(a[c, k]) for c in range(C) for k in range(D)}
    rows.add({**own, z: -1.0}, -np.inf, 0.0)
    for p, (layers, transfer) in enumerate(zip(fill.paths, fill.transfer, strict=True)):
      path = sorted(set(layers[:-1]))
      for c in path:  # w[p] = 1 when some layer of path class c is outside group 0
        rows.add({**holds(c), wv(p): float(size[c])}, float(size[c]), np.inf)
      # z >= fill + M (F + B) + update of group 0: the fill is the path's layers outside it,
      # each on its own group's devices, and one transfer; z >= fill + M (F + B) + drain (the
      # backward back along the same layers, and one transfer back).
      for drain in (False, True) if fill.drain else (False,):
        t = fill.fwd + fill.bwd if drain else fill.fwd
        mine = fill.compute if drain else a
        e = {cnt0(c, k): -float(mine[c, k]) for c in range(C) for k in range(D)}
        for c in path:
          e.update({cnt(c, i): -float(t[c, k]) for i, (k, _) in enumerate(slots)})
        e[z], e[wv(p)] = 1.0, -(2 if drain else 1) * transfer
        rows.add(e, 0.0, np.inf)
  cost = np.zeros(nv)
  cost[z] = 1.0
  integrality = np.ones(nv)
  integrality[z] = 0
  lb, ub = np.zeros(nv), np.ones(nv)
  lb[z], ub[z] = floor, np.inf
  for c in range(C):
    ub[cnt(c, 0) : cnt(c, 0) + S] = size[c]
    if fill is not None:
      ub[cnt0(c, 0) : cnt0(c, 0) + D] = size[c]
  res = milp(
    cost,
    constraints=rows.constraint(nv),
    integrality=integrality,
    bounds=Bounds(lb, ub),
    options={"time_limit": time_limit},
  )
  bound = getattr(res, "mip_dual_bound", None)
  proven = float(bound) if bound is not None and np.isfinite(bound) else None
  if res.status == 0:
    # Solved within HiGHS's relative gap (1e-4 by default): the dual bound, not the solution
    # found, is what is proven.
    return (float(res.fun) if proven is None else min(float(res.fun), proven)), True
  return (0.0 if proven is None else proven), False


def heaviest_path(n: int, edges, weight: np.ndarray) -> list[int]:
  """The path (layer positions, topological order) of largest total ``weight`` that ends at a
  sink; positions are topological, so one pass in index order suffices."""
  preds: list[list[int]] = [[] for _ in range(n)]
  has_out = np.zeros(n, dtype=bool)
  for u, v, _ in edges:
    preds[v].append(u)
    has_out[u] = True
  best = weight.astype(float).copy()
  back = [-1] * n
  for v in range(n):
    if preds[v]:
      u = max(preds[v], key=lambda x: best[x])
      best[v] += best[u]
      back[v] = u
  v = max((x for x in range(n) if not has_out[x]), key=lambda x: best[x])
  path = [v]
  while back[path[-1]] >= 0:
    path.append(back[path[-1]])
  return path[::-1]


def paths_into(n: int, edges, weight: np.ndarray, sink: int, limit: int) -> list[list[int]]:
  """From each source layer that reaches ``sink``, the heaviest path (by ``weight``) to it,
  heaviest first, at most ``limit`` of them (positions in topological order)."""
  succs: list[list[int]] = [[] for _ in range(n)]
  has_in = np.zeros(n, dtype=bool)
  for u, v, _ in edges:
    succs[u].append(v)
    has_in[v] = True
  to_sink = np.full(n, -np.inf)  # heaviest path from a layer to the sink, sink included
  nxt = [-1] * n
  to_sink[sink] = float(weight[sink])
  for u in range(sink - 1, -1, -1):
    for v in succs[u]:
      if to_sink[v] + weight[u] > to_sink[u]:
        to_sink[u], nxt[u] = to_sink[v] + weight[u], v
  sources = sorted(
    (u for u in range(n) if not has_in[u] and np.isfinite(to_sink[u]) and u != sink),
    key=lambda u: -to_sink[u],
  )
  paths = []
  for u in sources[:limit]:
    path = [u]
    while path[-1] != sink:
      path.append(nxt[path[-1]])
    paths.append(path)
  return paths


def sink_closure(n: int, edges, sink: int, classes: list[list[int]]) -> list[tuple[int, list[int]]]:
  """For each class a (an index into ``classes``), the other classes whose every layer lies on
  a path from every layer of a to ``sink`` (positions in topological order); classes with none
  are left out. A convex stage holding the sink and a layer of a holds all of them."""
  succs: list[list[int]] = [[] for _ in range(n)]
  for u, v, _ in edges:
    succs[u].append(v)
  below = [0] * n  # bit set of each layer's descendants, itself included
  for u in range(n - 1, -1, -1):
    below[u] = 1 << u
    for v in succs[u]:
      below[u] |= below[v]
  # Layers on a path from u to the sink: u's descendants that reach the sink.
  to_sink = sum(1 << x for x in range(n) if below[x] >> sink & 1)
  masks = [sum(1 << x for x in c) for c in classes]
  out = []
  for a, ca in enumerate(classes):
    if not all(below[x] >> sink & 1 for x in ca):
      continue
    common = to_sink
    for x in ca:
      common &= below[x] & ~(1 << x)
    later = [e for e, m in enumerate(masks) if e != a and m & common == m]
    if later:
      out.append((a, later))
  return out


def iteration_lower_bound(
  layer_graph: nx.DiGraph,
  cluster: Cluster | int | None = None,
  batch_size: int | None = None,
  *,
  num_microbatches: int | None = None,
  cost_model: CostModel | None = None,
  sizes: Sequence[int] | None = None,
  time_limit: float = 60.0,
  fill: bool = True,
  fill_paths: int = 8,
  split_backward: bool = False,
  convex_sink: bool = True,
) -> LowerBound:
  """The lower bound (see the module docstring) over ``sizes`` (default: the planners' sweep of
  micro-batch sizes). ``fill``: add the sink stage's pipeline fill and drain along the paths
  from up to ``fill_paths`` source layers into its sink (more paths: a tighter bound and a
  larger program); the drain term
  holds when a stage's last input-gradient backward is its last computation, i.e. not for
  schedules that split the backward (``split_backward=True`` leaves it out, for zero-bubble).
  ``convex_sink``: the sink's stage holds every layer between any of its layers and the sink
  (off: the program without it, to see what it adds)."""
  cluster, cm, B, costs = planner_inputs(layer_graph, cluster, batch_size, cost_model)
  K = cluster.num_devices
  n = len(costs)
  J = min(K, n)
  sizes = list(sizes) if sizes is not None else microbatch_sizes(B, num_microbatches)
  links = [cluster.intra_link] + ([cluster.inter_link] if cluster.inter_link is not None else [])
  per_size: dict[int, float] = {}
  optimal = True
  n_classes = n
  for b in sizes:
    M = B // b
    dps = data_parallel_degrees(b, K)
    groups = Slots(dps, K, J)
    # Per layer and d: M * (F + B) at b/d samples per device + its share of the update.
    compute = np.zeros((n, len(dps)))
    work = np.zeros((n, len(dps)))
    fwd, bwd = np.zeros((n, len(dps))), np.zeros((n, len(dps)))
    for k, d in enumerate(dps):
      tf, tb = cm.planner_layer_times(costs, cluster, b / d)
      fwd[:, k], bwd[:, k] = tf, tb
      if d > 1:
        c = cluster
        inter = c.devices_per_node is not None and d > c.devices_per_node
        link = c.inter_link if inter and c.inter_link is not None else c.intra_link
        ar = 2 * (d - 1) / d / link.beta
      else:
        ar = 0.0
      per_byte = ar + cm.update_traffic / cluster.device.memory_bandwidth
      compute[:, k] = M * (tf + tb)
      work[:, k] = compute[:, k] + per_byte * costs.held_param_bytes
    # The paths' layers are classes apart from the others (a class lies on the same paths), and
    # the sink a class of its own (group 0 holds it). The fill and drain only count the path
    # layers outside group 0, so identical layers of a path (a branch of identical layers) can
    # be one class.
    paths = []
    if fill:
      fastest = (fwd + bwd).min(axis=1)  # each layer's smallest F + B over the device counts
      sink = heaviest_path(n, costs.edges, fastest)[-1]
      into = paths_into(n, costs.edges, fastest, sink, fill_paths)
      paths = [p for p in into if len(p) > 1]
    mark = np.zeros((n, 1))
    for i, path in enumerate(paths):
      mark[path[:-1], 0] += 2.0**i
      mark[path[-1], 0] = -1.0
    classes = _layer_classes(np.hstack([work, compute, fwd, bwd, mark]))
    n_classes = len(classes)
    of = {l: ci for ci, c in enumerate(classes) for l in c}
    fill_terms = None
    if paths:
      transfer = []
      for path in paths:
        on_path = set(itertools.pairwise(path))
        nbytes = [by * b for u, v, by in costs.edges if (u, v) in on_path]
        transfer.append(min(min(link.time(x) for link in links) for x in nbytes))
      fill_terms = Fill(
        sink=of[paths[0][-1]],
        closure=sink_closure(n, costs.edges, paths[0][-1], classes) if convex_sink else [],
        paths=[[of[l] for l in path] for path in paths],
        fwd=np.array([fwd[c[0]] for c in classes]),
        bwd=np.array([bwd[c[0]] for c in classes]),
        transfer=transfer,
        compute=np.array([compute[c[0]] for c in classes]),
        drain=not split_backward,
      )
    floor = 0.0
    if fill_terms is not None:
      # The program without the fill, over the coarser classes (fast where the path's layers
      # are many classes), bounds the one with it from below: a floor for its objective, so
      # that a program stopped at the time limit still gives at least that bound.
      plain = Classes.of(work, _layer_classes(work))
      floor, _ = _min_max_groups(plain, groups, time_limit)
    value, solved = _min_max_groups(
      Classes.of(work, classes), groups, time_limit, fill_terms, floor
    )
    per_size[b] = max(value, floor)
    optimal = optimal and solved
  return LowerBound(
    seconds=min(per_size.values()),
    per_size=per_size,
    layers=n,
    classes=n_classes,
    optimal=optimal,
  )
