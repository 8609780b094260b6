"""Schedules for stage DAGs whose stages share devices: interleaved 1F1B, looped BFS, ZB-V.

Several stages on one device ("virtual stages") shrink the pipeline bubble without more
micro-batches: Megatron-LM's interleaved schedule takes the bubble of a chain of p devices from
(p - 1)/m to (p - 1)/(v m) with v stages per device; the V-shaped zero-bubble schedule (ZB-V)
puts two stages on each device in a V and fills the rest of the bubble with weight gradients.
Here the stages form a DAG (branches, fan-in, skip edges), not only a chain, and a device may
hold any number of them (``Schedule.places``).

Each generator orders every place's actions by list scheduling: the places run their actions
in unit time steps (F 1, B 2, or B 1 and W 1 where the backward is split), and a place that is
free takes, of the actions whose inputs are done, the first by its schedule's rule:

  interleaved-1f1b: Megatron's depth-first order. Forwards go in groups of P micro-batches
      (P places) through the place's stages in topological order, backwards through them in
      reverse; a place first runs ``warm-up`` forwards (Megatron's count, (P - d - 1) * 2 +
      (v - 1) * P for a place with v stages whose first stage has depth d, P the places on
      the longest path of stages; P - d - 1 with one stage), then a
      forward whenever fewer than ``warm-up + 1`` micro-batches are in flight, else a
      backward: one of each in turn, as Megatron's steady state runs them. Two more rules
      run a ready backward before any forward (under the same bound), by micro-batch or by
      Megatron's groups, and each of the three also lists with an activation or cotangent
      between two places taking half a forward (a hand-over on one place none); of the six
      orders the one whose replay in those times (``_makespan``) ends first is kept,
      Megatron's where they tie. On a chain with Megatron's placement that is Megatron's
      order (``tests/test_shared_devices.py``); on a DAG whose places hold stages of unequal
      depth (a tower's piece beside the head's) Megatron's warm-up can fill a place with
      forwards while the place after it waits for a backward.
  looped-bfs: breadth first, every forward before any backward on a place, its stages in
      topological order (forwards) and reverse (backwards), all micro-batches of one stage
      before the next (torch's ScheduleLoopedBFS).
  zb-v: the backward split into B (input cotangents) and W (weight gradients); a place runs a B
      whenever one is ready, a forward while fewer than 2P micro-batches hold activations
      (a forward's activations are held until its W), and a W when neither is ready.
      ``v_places`` puts 2P stages of a chain in the V that ZB-V names (device d holds stages d
      and 2P - 1 - d).

A place whose next action is held back only by its in-flight bound, while no place can run
anything else, runs it anyway: the orders are complete and free of deadlock by construction,
and ``validate_schedule`` checks them as it checks every schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable, Sequence

import networkx as nx

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.program import Op
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule

SHARED_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "zb-v")


def v_places(num_stages: int) -> tuple[int, ...]:
  """ZB-V's placement of a chain of 2P stages on P places: place d holds stages d and
  2P - 1 - d (an odd stage count leaves the middle stage a place of its own)."""
  half = (num_stages + 1) // 2
  return tuple(s if s < half else num_stages - 1 - s for s in range(num_stages))


def round_robin_places(num_stages: int, num_places: int) -> tuple[int, ...]:
  """Megatron's interleaved placement of a chain: stage s on place s mod P."""
  return tuple(s % num_places for s in range(num_stages))


def stage_depths(g: nx.DiGraph) -> dict[int, int]:
  """Each stage's depth: the stages on the longest path from a source to it, less one."""
  depth: dict[int, int] = {}
  for s in nx.topological_sort(g):
    depth[s] = max((depth[p] + 1 for p in g.predecessors(s)), default=0)
  return depth


@dataclasses.dataclass(frozen=True)
class _Layout:
  """A schedule's stages on their places, as its list scheduling reads them.

  Attributes:
    name: the schedule.
    num_microbatches: M.
    graph: the stage graph (a DAG on stages 0..S-1).
    places: per stage, its place.
    members: per place, its stages by depth (then index).
    bound: per place, how many micro-batches may hold activations at once before its
      forwards wait for a backward (``_bound``).
    split: whether the backward is split into B and W.
  """

  name: str
  num_microbatches: int
  graph: nx.DiGraph
  places: tuple[int, ...]
  members: list[list[int]]
  bound: list[float]
  split: bool


def _one_microbatch_size(name: str, counts: Sequence[int] | None) -> None:
  """Raises ScheduleError where the stages' micro-batch ``counts`` differ: the schedules for
  shared devices run one micro-batch size."""
  if counts is not None and len(set(counts)) > 1:
    raise ScheduleError(
      f"schedule {name!r} needs one micro-batch size for every stage, but the stages run "
      f"{list(counts)} micro-batches; give every stage the same micro-batch size"
    )


def _shared_schedule(
  name: str,
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  places: Sequence[int] | None,
) -> Schedule:
  places = tuple(places) if places is not None else tuple(range(num_stages))
  return _scheduled(name, num_stages, tuple(edges), num_microbatches, places)


# A schedule depends only on the stage graph, the places and M, not on what the stages hold:
# a planner that prices several plans of one shape (the same chain cut at other layers) lists
# their orders once. Schedules are immutable, so one may serve them all. A few are kept (one of
# a long pipeline's holds over a hundred thousand actions).
@functools.lru_cache(maxsize=8)
def _scheduled(
  name: str,
  num_stages: int,
  edges: tuple[tuple[int, int], ...],
  num_microbatches: int,
  places: tuple[int, ...],
) -> Schedule:
  S, M = num_stages, num_microbatches
  if len(places) != S:
    raise ScheduleError(f"places {list(places)} must give one place to each of {S} stages")
  Q = max(places) + 1  # places
  g = nx.DiGraph()
  g.add_nodes_from(range(S))
  g.add_edges_from(edges)
  if not nx.is_directed_acyclic_graph(g):
    raise ScheduleError(f"stage graph has a cycle {nx.find_cycle(g)}")
  depth = stage_depths(g)
  members: list[list[int]] = [[] for _ in range(Q)]
  for s in sorted(range(S), key=lambda s: (depth[s], s)):
    members[places[s]].append(s)
  if any(not m for m in members):
    raise ScheduleError(f"places {list(places)} leave a place without stages; number them 0..")
  chunk = {s: members[places[s]].index(s) for s in range(S)}
  # The pipeline's length in places: the places on the longest path of stages (P on a chain
  # of P places; fewer where branches run side by side on places of their own). Megatron's
  # groups of micro-batches and warm-up count are in these.
  path = nx.dag_longest_path(g)
  P = max(1, len({places[s] for s in path}))
  rank = {q: min(depth[m[0]], P - 1) for q, m in enumerate(members)}  # where q joins the pipe
  bound = _bound(name, P, members, rank, M)
  layout = _Layout(name, M, g, places, members, bound, split=name == "zb-v")
  # Interleaved 1F1B: Megatron's rule and two that run a ready backward first, each listed
  # with transfers free and with a transfer between places half a forward; the order whose
  # replay ends first is kept, the first (Megatron's, transfers free) where they tie.
  if name == "interleaved-1f1b":
    tries = [(rule, hop) for hop in (0, 1) for rule in _INTERLEAVED_VARIANTS]
  else:
    tries = [(_RULES[name], 0)]
  best: tuple[int, list[list[Action]]] | None = None
  for rule, hop in tries:
    orders = _list_schedule(layout, rule(P, chunk), hop)
    end = _makespan(orders, layout) if len(tries) > 1 else 0
    if best is None or end < best[0]:
      best = (end, orders)
  assert best is not None
  orders = best[1]
  for q in range(Q):
    orders[q].extend(Action(Op.UPDATE, s) for s in members[q])
  lanes = tuple(tuple(a for a in orders[places[s]] if a.stage == s) for s in range(S))
  sched = Schedule(
    name,
    M,
    tuple(sorted(edges)),
    lanes,
    places=places,
    orders=tuple(map(tuple, orders)),
  )
  validate_schedule(sched)
  return sched


def _list_schedule(layout: _Layout, prefer: Callable, hop: int = 0) -> list[list[Action]]:
  """Each place's order by list scheduling in half units (F 2, B 4; B 2 and W 2 when the
  layout splits the backward; an activation or cotangent between two places ``hop``, a
  hand-over on one place 0) under ``prefer`` and the places' in-flight bound. Actions are
  (kind, stage, micro-batch) tuples here; ``dependencies`` (``ir.schedule``) is what the
  readiness test spells out."""
  g, members, bound, split = layout.graph, layout.members, layout.bound, layout.split
  S, M, Q = g.number_of_nodes(), layout.num_microbatches, len(members)
  dur = {Op.F: 2, Op.B: 2 if split else 4, Op.W: 2}
  kinds = (Op.F, Op.B, Op.W) if split else (Op.F, Op.B)
  never = 1 << 62
  place = {s: q for q, ms in enumerate(members) for s in ms}
  done = {k: [[never] * M for _ in range(S)] for k in kinds}  # when each action ends
  # Each producer (consumer) of a stage, with the time its activation (cotangent) takes over.
  preds = [[(p, hop * (place[p] != place[s])) for p in g.predecessors(s)] for s in range(S)]
  succs = [[(c, hop * (place[c] != place[s])) for c in g.successors(s)] for s in range(S)]
  fdone, bdone = done[Op.F], done[Op.B]
  # What each kind of action of a stage waits for: (ends of that kind of the stage, hop).
  needs: dict[tuple[int, Op], list[tuple[list[int], int]]] = {}
  for s in range(S):
    needs[s, Op.F] = [(fdone[p], x) for p, x in preds[s]]
    needs[s, Op.B] = [(fdone[s], 0), *((bdone[c], x) for c, x in succs[s])]
    needs[s, Op.W] = [(bdone[s], 0)]
  # When each stage's next action of a kind may start, once its inputs are all done.
  known: dict[Op, list[int | None]] = {k: [None] * S for k in kinds}

  def ready(k: Op, s: int, m: int, t: int) -> bool:
    at = known[k][s]
    if at is None:
      at = 0
      for ends, x in needs[s, k]:
        e = ends[m]
        if e == never:
          return False
        at = max(at, e + x)
      known[k][s] = at
    return at <= t

  nxt = {k: [0] * S for k in kinds}  # each stage runs each kind in order: the next one
  held = [0] * Q  # micro-batches holding activations on each place (F run, B or W not yet)
  orders: list[list[Action]] = [[] for _ in range(Q)]
  free = [0] * Q
  # A place is looked at only at the times something it may run waits for arrives: its own
  # last action ends, or an activation (cotangent) of a neighbouring stage reaches it. Between
  # those times what it may run stays as it was (the readiness test, its in-flight count and
  # its stages' next actions change only then), so the orders are those of looking at every
  # free place at every time, in a fraction of the work on long pipelines.
  wake: dict[int, set[int]] = {0: set(range(Q))}
  events: list[int] = [0]

  def rouse(q: int, at: int) -> None:
    if at not in wake:
      wake[at] = set()
      heapq.heappush(events, at)
    wake[at].add(q)

  left = S * M * len(kinds)
  while left:
    t = heapq.heappop(events)
    woken = sorted(wake.pop(t, ()))
    for force in (False, True):
      picked = False
      for q in woken:
        if free[q] > t:
          continue
        cands = []
        for st in members[q]:
          for k in kinds:
            m = nxt[k][st]
            if m < M and ready(k, st, m, t):
              cands.append((k, st, m))
        pick = _choose(cands, prefer, held[q], bound[q], force)
        if pick is None:
          continue
        picked = True
        k, st, m = pick
        nxt[k][st] += 1
        known[k][st] = None
        orders[q].append(Action(k, st, m))
        left -= 1
        end = t + dur[k]
        done[k][st][m] = end
        free[q] = end
        held[q] += 1 if k is Op.F else -1 if k is kinds[-1] else 0
        rouse(q, end)
        if k is Op.F:
          for c, x in succs[st]:
            rouse(place[c], end + x)
        elif k is Op.B:
          for p, x in preds[st]:
            rouse(place[p], end + x)
      if picked or any(f > t for f in free) or events:
        break
      # Nothing runs and nothing will arrive: every place held back only by its bound runs
      # its next action anyway (below, ``force``).
      woken = list(range(Q))
    else:  # pragma: no cover - a DAG always has a ready action when nothing runs
      raise ScheduleError(f"schedule {layout.name!r}: no place can run anything at time {t}")
  return orders


def _makespan(orders: Sequence[Sequence[Action]], layout: _Layout) -> int:
  """When the places' ``orders`` end, each place running its order one action after another,
  in half units: F 2, B 4 (B 2 and W 2 where the layout splits the backward), an activation
  or cotangent between two places 1, a hand-over on one place 0."""
  g, places, split = layout.graph, layout.places, layout.split
  S, M, Q = g.number_of_nodes(), layout.num_microbatches, len(orders)
  dur = {Op.F: 2, Op.B: 2 if split else 4, Op.W: 2}
  # What each kind of action of a stage waits for: (kind, stage, hop) per input, hop 1 for an
  # activation or cotangent between two places.
  needs: dict[tuple[Op, int], list[tuple[Op, int, int]]] = {}
  for s in range(S):
    needs[Op.F, s] = [(Op.F, p, int(places[p] != places[s])) for p in g.predecessors(s)]
    needs[Op.B, s] = [(Op.F, s, 0)]
    needs[Op.B, s] += [(Op.B, c, int(places[c] != places[s])) for c in g.successors(s)]
    needs[Op.W, s] = [(Op.B, s, 0)]
  never = -1
  end = {k: [[never] * M for _ in range(S)] for k in (Op.F, Op.B, Op.W)}
  nxt = [0] * Q
  free = [0] * Q
  # Each place runs its order as far as the ends it waits for are known, then waits on the
  # first one missing; the place that writes that end wakes it. An action's end depends only
  # on its place's previous action and its inputs, so the order of the replay does not matter.
  waiting: dict[tuple[Op, int, int], list[int]] = {}
  todo = list(range(Q))
  while todo:
    q = todo.pop()
    order = orders[q]
    while nxt[q] < len(order):
      a = order[nxt[q]]
      k, s, m = a.kind, a.stage, a.microbatch
      start = free[q]
      for dk, ds, x in needs[k, s]:
        e = end[dk][ds][m]
        if e == never:
          waiting.setdefault((dk, ds, m), []).append(q)
          break
        start = max(start, e + x)
      else:
        end[k][s][m] = free[q] = start + dur[k]
        nxt[q] += 1
        todo.extend(waiting.pop((k, s, m), ()))
        continue
      break
  if any(n < len(o) for n, o in zip(nxt, orders)):  # pragma: no cover - list scheduling's
    raise ScheduleError("the places' orders wait on each other")  # orders are free of deadlock
  return max(free, default=0)


def _bound(
  name: str, P: int, members: Sequence[Sequence[int]], rank: dict[int, int], M: int
) -> list[float]:
  """Per place, how many micro-batches may hold activations at once before its forwards wait
  for a backward (the schedule's memory bound)."""
  out: list[float] = []
  for q, stages in enumerate(members):
    v, d = len(stages), rank[q]
    if name == "interleaved-1f1b":
      warmup = (P - d - 1) * 2 + (v - 1) * P if v > 1 else P - d - 1
      out.append(min(warmup, M * v) + 1)
    elif name == "zb-v":
      out.append(2 * P)
    else:
      out.append(float("inf"))
  return out


# A rule orders the ready actions of a place, each a (kind, stage, micro-batch) tuple: the
# first by its key runs (``_choose``).
Ready = tuple[Op, int, int]  # (kind, stage, micro-batch)
Rule = Callable[[Ready], tuple]


def _interleaved_rule(P: int, chunk: dict[int, int]) -> Rule:
  def key(a: Ready) -> tuple:
    # A forward while the bound lets one run (``_choose``), else a backward: the warm-up,
    # then one forward and one backward in turn, then the backwards left.
    k, s, m = a
    group, c = m // P, chunk[s]
    if k == "F":
      return (0, group, c, m)
    return (1, group, -c, m)

  return key


def _interleaved_backward_first_rule(P: int, chunk: dict[int, int]) -> Rule:
  def key(a: Ready) -> tuple:
    # Megatron's groups and chunks, a ready backward before any forward.
    k, s, m = a
    group, c = m // P, chunk[s]
    if k == "F":
      return (1, group, c, m)
    return (0, group, -c, m)

  return key


def _backward_first_rule(P: int, chunk: dict[int, int]) -> Rule:
  def key(a: Ready) -> tuple:
    # A ready backward first, micro-batch by micro-batch (the oldest first, its deepest
    # chunk first), then forwards in the same order (its shallowest chunk first).
    k, s, m = a
    c = chunk[s]
    if k == "F":
      return (1, m, c)
    return (0, m, -c)

  return key


def _bfs_rule(P: int, chunk: dict[int, int]) -> Rule:
  def key(a: Ready) -> tuple:
    k, s, m = a
    c = chunk[s]
    return (0, c, m) if k == "F" else (1, -c, m)

  return key


def _zbv_rule(P: int, chunk: dict[int, int]) -> Rule:
  order = {"B": 0, "F": 1, "W": 2}

  def key(a: Ready) -> tuple:
    k, s, m = a
    c = chunk[s]
    return (order[k], m, -c if k != "F" else c)

  return key


_INTERLEAVED_VARIANTS = (
  _interleaved_rule,
  _backward_first_rule,
  _interleaved_backward_first_rule,
)

_RULES = {
  "interleaved-1f1b": _interleaved_rule,
  "looped-bfs": _bfs_rule,
  "zb-v": _zbv_rule,
}


def _choose(
  ready: Sequence[Ready], prefer: Rule, held: int, bound: float, force: bool
) -> Ready | None:
  """The ready action the rule puts first, a forward only under the bound (or ``force``)."""
  allowed = [a for a in ready if a[0] != "F" or held < bound or force]
  if not allowed:
    return None
  return min(allowed, key=prefer)


def interleaved_1f1b(num_stages, edges, num_microbatches, places=None, counts=None) -> Schedule:
  """Megatron's interleaved 1F1B on a stage DAG whose stages share places (module docstring)."""
  _one_microbatch_size("interleaved-1f1b", counts)
  return _shared_schedule("interleaved-1f1b", num_stages, edges, num_microbatches, places)


def looped_bfs(num_stages, edges, num_microbatches, places=None, counts=None) -> Schedule:
  """Breadth-first looping over a place's stages (module docstring)."""
  _one_microbatch_size("looped-bfs", counts)
  return _shared_schedule("looped-bfs", num_stages, edges, num_microbatches, places)


def zb_v(num_stages, edges, num_microbatches, places=None, counts=None) -> Schedule:
  """The V-shaped zero-bubble schedule on a stage DAG (module docstring); without places, the
  stages go in a V (``v_places``) where the stage graph is a chain."""
  _one_microbatch_size("zb-v", counts)
  if places is None:
    places = v_places(num_stages)
  return _shared_schedule("zb-v", num_stages, edges, num_microbatches, places)
