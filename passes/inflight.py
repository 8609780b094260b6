"""In-flight counts and the graph-1F1B schedule: stage DAG -> in-flight per stage -> Schedule.

In-flight count of a stage = the most micro-batches whose activations it holds at once, i.e.
the forwards it issues before its first backward in synchronous 1F1B. It is computed from the
sinks back to the sources, because a stage's count depends on the schedules of all its
successors (GraphPipe, section 5).

Uniform micro-batch size (the default): ``L(s) = 1`` for a sink, else
``1 + max over successors t of L(t)``: the number of stages on the longest path from s to a
sink. For a chain of S stages this is the classic ``S - i`` warm-up of stage i.

Per-stage micro-batch sizes ``b(s)`` (the values of Table 2 of GraphPipe, Jeon et al., ASPLOS
2025, arXiv:2406.17145, were not available; this rule reproduces the paper's Fig. 5 numbers
12/8/4 -> 10/8/4 and the in-flight buffers of its ResNet example), counted in samples:
``N(s) = b(s)`` for a sink, else ``max over successors t of N(t) + max(b(s), b(t))``;
in the stage's own micro-batches that is ``ceil(N(s) / b(s))``.

``graph_1f1b`` builds synchronous 1F1B on a stage DAG by list scheduling: whenever a stage is
idle it runs its next backward if that backward's inputs are there (backward as early as
possible, which frees activation memory soonest), else its next forward if its inputs are there
and fewer than ``in_flight(s)`` micro-batches are stashed, else it waits. Durations come from
per-stage times (default: forward 1, backward 2) with free transfers; the resulting lanes are
validated with ``validate_schedule``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Iterable, Sequence

import networkx as nx

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.program import Op
from gpp_jax.ir.schedule import Action, Schedule, overlapping, validate_schedule


def _stage_graph(num_stages: int, edges: Sequence[tuple[int, int]]) -> nx.DiGraph:
  g = nx.DiGraph()
  g.add_nodes_from(range(num_stages))
  g.add_edges_from(edges)
  if not nx.is_directed_acyclic_graph(g):
    raise ScheduleError(f"the stage graph has a cycle {nx.find_cycle(g)}; stages must form a DAG")
  return g


@dataclasses.dataclass(frozen=True)
class InFlight:
  """In-flight counts per stage.

  Attributes:
    samples: samples whose activations each stage holds at most.
    microbatches: the same in the stage's own micro-batches (``ceil(samples / b(s))``).
    microbatch_sizes: b(s) per stage (all 1 when counts are in micro-batches of equal size).
  """

  samples: tuple[int, ...]
  microbatches: tuple[int, ...]
  microbatch_sizes: tuple[int, ...]

  def __str__(self) -> str:
    return "\n".join(
      f"stage {s:3d}: micro-batch {b:4d}, in flight {m:3d} ({n} samples)"
      for s, (n, m, b) in enumerate(zip(self.samples, self.microbatches, self.microbatch_sizes))
    )


def inflight_counts(
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  microbatch_sizes: Sequence[int] | None = None,
  num_microbatches: int | None = None,
) -> InFlight:
  """Stage DAG (+ per-stage micro-batch sizes) -> InFlight, computed sink to source.

  Args:
    num_stages, edges: the stage DAG.
    microbatch_sizes: b(s) per stage; None means all equal (counts in micro-batches).
    num_microbatches: with uniform sizes, caps every count at M (a stage never holds more
      micro-batches than there are).
  """
  sizes = None if microbatch_sizes is None else tuple(int(x) for x in microbatch_sizes)
  return _inflight_counts(num_stages, tuple(map(tuple, edges)), sizes, num_microbatches)


@functools.lru_cache(maxsize=4096)
def _inflight_counts(
  num_stages: int,
  edges: tuple[tuple[int, int], ...],
  microbatch_sizes: tuple[int, ...] | None,
  num_microbatches: int | None,
) -> InFlight:
  """``inflight_counts``, kept for the stage graphs a planner sees again and again."""
  b = [1] * num_stages if microbatch_sizes is None else list(microbatch_sizes)
  if len(b) != num_stages or any(x < 1 for x in b):
    raise ValueError(f"need one positive micro-batch size per stage, got {microbatch_sizes}")
  # Sinks first (the reversed graph's topological order) over plain lists: a planner's
  # search meets hundreds of stage graphs, and building each as a networkx graph cost most
  # of this; the counts are maxima, the same in any such order.
  succs: list[list[int]] = [[] for _ in range(num_stages)]
  for u, v in set(edges):
    succs[u].append(v)
  order = topological_order(succs)
  if order is None:
    _stage_graph(num_stages, edges)  # raises, naming the cycle
  assert order is not None
  N = [0] * num_stages
  for s in order:
    succ = succs[s]
    N[s] = b[s] if not succ else max(N[t] + max(b[s], b[t]) for t in succ)
  mbs = [-(-N[s] // b[s]) for s in range(num_stages)]
  if num_microbatches is not None:
    mbs = [min(m, num_microbatches) for m in mbs]
    N = [min(n, num_microbatches * b[s]) for s, n in enumerate(N)]
  return InFlight(tuple(N), tuple(mbs), tuple(b))


def inflight_chunks(
  num_stages: int, edges: Sequence[tuple[int, int]], counts: Sequence[int]
) -> tuple[int, ...]:
  """In-flight micro-batches per stage when stage s cuts the batch into ``counts[s]`` chunks:
  the rule above in samples (sizes proportional to ``1 / counts[s]``), converted to each
  stage's own chunks and capped at its count. The 1F1B warm-up with per-stage sizes."""
  unit = math.lcm(*counts)
  fl = inflight_counts(num_stages, edges, microbatch_sizes=[unit // c for c in counts])
  return tuple(min(f, c) for f, c in zip(fl.microbatches, counts))


def stage_counts(
  num_stages: int, num_microbatches: int, counts: Sequence[int] | None
) -> tuple[int, ...] | None:
  """``counts`` checked (one positive count per stage), or None when every stage runs
  ``num_microbatches`` (then the schedule is the uniform one, exactly)."""
  if counts is None:
    return None
  c = tuple(int(x) for x in counts)
  if len(c) != num_stages or any(x < 1 for x in c):
    raise ScheduleError(
      f"counts {list(counts)} must give a positive micro-batch count for each of the "
      f"{num_stages} stages"
    )
  return None if all(x == num_microbatches for x in c) else c


def one_f_one_b_in_flight(
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  counts: tuple[int, ...] | None,
) -> list[int]:
  """Synchronous 1F1B's in-flight micro-batches per stage, in each stage's own chunks: L(s)
  capped at M with one size, ``inflight_chunks`` with per-stage ``counts`` (as returned by
  ``stage_counts``). The default warm-up of the 1F1B generators and bound of zero-bubble."""
  if counts is None:
    return list(inflight_counts(num_stages, edges, num_microbatches=num_microbatches).microbatches)
  return list(inflight_chunks(num_stages, edges, counts))


def longest_path_to_sink(num_stages: int, edges: Sequence[tuple[int, int]]) -> list[int]:
  """L(s): stages on the longest path from s to a sink (sinks have L = 1)."""
  return list(inflight_counts(num_stages, edges).microbatches)


def graph_1f1b(
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  in_flight: Sequence[int] | None = None,
  forward: Sequence[float] | None = None,
  backward: Sequence[float] | None = None,
  update: bool = True,
  counts: Sequence[int] | None = None,
) -> Schedule:
  """Stage DAG -> synchronous graph-1F1B Schedule, backward as early as possible.

  Args:
    num_stages, edges: the stage DAG.
    num_microbatches: M.
    in_flight: cap on stashed micro-batches per stage (default: ``L(s)``, capped at M; with
      ``counts``, the in-flight samples of ``inflight_counts`` in the stage's own chunks).
    forward, backward: per-stage durations used to order the lanes (default 1 and 2).
    update: end every lane with an UPDATE action.
    counts: micro-batches per stage when they differ (None: M everywhere); an action waits
      for every chunk of a neighbouring stage that overlaps its samples.
  """
  S = num_stages
  g = _stage_graph(S, edges)
  cs = stage_counts(S, num_microbatches, counts)
  Ms = [num_microbatches] * S if cs is None else list(cs)
  if in_flight is not None:
    cap = list(in_flight)
  else:
    cap = one_f_one_b_in_flight(S, edges, num_microbatches, cs)
  cap = [max(1, min(int(c), Ms[s])) for s, c in enumerate(cap)]
  tf = list(forward) if forward is not None else [1.0] * S
  tb = list(backward) if backward is not None else [2.0] * S
  preds = [list(g.predecessors(s)) for s in range(S)]
  succs = [list(g.successors(s)) for s in range(S)]
  f_next = [0] * S
  b_next = [0] * S
  busy_until = [0.0] * S
  done: dict[tuple[str, int, int], float] = {}
  lanes: list[list[Action]] = [[] for _ in range(S)]
  events = [0.0]
  now = 0.0
  remaining = 2 * sum(Ms)

  def ready(kind: str, s: int, m: int, others: list[int]) -> bool:
    """Whether every ``kind`` action of the stages ``others`` overlapping chunk m of s ended."""
    return all(
      done.get((kind, t, k), float("inf")) <= now
      for t in others
      for k in overlapping(m, Ms[s], Ms[t])
    )

  while remaining:
    started = False
    for s in range(S):
      if busy_until[s] > now:
        continue
      m = b_next[s]
      if m < f_next[s] and ready("B", s, m, succs[s]) and done[("F", s, m)] <= now:
        kind, dur = Op.B, tb[s]
        b_next[s] += 1
      else:
        m = f_next[s]
        if m < Ms[s] and m - b_next[s] < cap[s] and ready("F", s, m, preds[s]):
          kind, dur = Op.F, tf[s]
          f_next[s] += 1
        else:
          continue
      lanes[s].append(Action(kind, s, m))
      done[(kind, s, m)] = now + dur
      busy_until[s] = now + dur
      heapq.heappush(events, now + dur)
      remaining -= 1
      started = True
    if started and remaining:
      continue
    while events and events[0] <= now:
      heapq.heappop(events)
    if not events:
      if remaining:
        raise ScheduleError(
          f"graph-1F1B cannot progress with in-flight caps {cap}: a stage "
          "waits for a micro-batch its cap forbids; raise the caps "
          "(the default L(s) always progresses)"
        )
      break
    now = heapq.heappop(events)
  if update:
    for s in range(S):
      lanes[s].append(Action(Op.UPDATE, s))
  sched = Schedule(
    "graph-1f1b",
    num_microbatches,
    tuple(sorted((u, v) for u, v in edges)),
    tuple(tuple(l) for l in lanes),
    cs,
  )
  validate_schedule(sched)
  return sched


def topological_order(preds: Sequence[Iterable[int]]) -> list[int] | None:
  """The stages in an order where each comes after its predecessors (``preds[s]``), or None
  when the stage graph has a cycle (Kahn's algorithm)."""
  n = len(preds)
  succs: list[list[int]] = [[] for _ in range(n)]
  waiting = [0] * n
  for v, ps in enumerate(preds):
    for u in ps:
      succs[u].append(v)
      waiting[v] += 1
  order = [s for s in range(n) if not waiting[s]]
  for u in order:  # ``order`` grows while it is walked
    for v in succs[u]:
      waiting[v] -= 1
      if not waiting[v]:
        order.append(v)
  return order if len(order) == n else None
