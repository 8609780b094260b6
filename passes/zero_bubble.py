"""Zero-bubble schedule on a stage DAG: stage DAG + memory bound -> Schedule with B and W split.

Zero-bubble pipelining (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
arXiv:2401.10241) splits a stage's backward into B, the cotangents of the stage's inputs (what
the upstream stages wait for), and W, the gradients of its parameters (what nobody waits for
until the update). B stays on the critical path; W is deferred into the bubbles that synchronous
1F1B leaves idle. The paper's handcrafted schedules are for chains; here the lanes come from list
scheduling on the stage DAG, so they work for branches and skip edges too:

  whenever a stage is idle it runs, in this priority,
    1. its next B, if the cotangents of that micro-batch have arrived from every successor
       (B unblocks upstream stages, so it goes first);
    2. its next F, if the activations have arrived from every predecessor and fewer than
       ``memory_bound[s]`` micro-batches are held (forward done, W not yet done);
    3. its next W, if its B has run;
  else it waits for the next action of another stage to end.

Memory: a stage holds a micro-batch's residuals from its F to its W (B needs them, and W needs
them again), so the bound counts micro-batches between F and W. The default bound is the
in-flight count of synchronous 1F1B on the same DAG (``inflight_counts``, the longest path to a
sink, capped at M), so the schedule's peak activation memory equals 1F1B's (the paper's ZB-H1);
a planner with memory to spare passes a larger bound (up to M; twice 1F1B's is ZB-H2's). A stage
can always make progress: with the bound reached it runs its pending W, which frees a slot.

Durations (default F = B = W = 1, the paper's assumption T_F = T_B = T_W) only order the lanes;
the simulator and the runtime read the lanes, not these times.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import networkx as nx

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.program import Op
from gpp_jax.ir.schedule import Action, Schedule, overlapping, validate_schedule
from gpp_jax.passes.inflight import _stage_graph, one_f_one_b_in_flight, stage_counts


def zero_bubble(
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  memory_bound: Sequence[int] | None = None,
  forward: Sequence[float] | None = None,
  backward: Sequence[float] | None = None,
  weight: Sequence[float] | None = None,
  update: bool = True,
  counts: Sequence[int] | None = None,
) -> Schedule:
  """Stage DAG -> zero-bubble Schedule (F, B, W per micro-batch; see the module docstring).

  Args:
    num_stages, edges: the stage DAG.
    num_microbatches: M.
    memory_bound: per stage, the most micro-batches whose residuals it may hold (F done, W not
      done); default: synchronous 1F1B's in-flight counts, so peak memory matches 1F1B.
    forward, backward, weight: per-stage durations of F, B (input cotangents only) and W used
      to order the lanes (default 1 each).
    update: end every lane with an UPDATE action.
    counts: micro-batches per stage when they differ (None: M everywhere); an action waits
      for every chunk of a neighbouring stage that overlaps its samples, and the default bound
      is 1F1B's in-flight samples in the stage's own chunks (``inflight_chunks``).
  """
  S, M = num_stages, num_microbatches
  g = _stage_graph(S, edges)
  cs = stage_counts(S, M, counts)
  Ms = [M] * S if cs is None else list(cs)
  L = one_f_one_b_in_flight(S, edges, M, cs)
  if memory_bound is None:
    cap = list(L)
  else:
    cap = [int(c) for c in memory_bound]
    if len(cap) != S or any(c < 1 for c in cap):
      raise ScheduleError(
        f"memory_bound needs one count >= 1 per stage ({S} stages), got {list(memory_bound)}; "
        "a stage must hold at least the micro-batch it is working on"
      )
  cap = [min(c, m) for c, m in zip(cap, Ms)]
  tf = [1.0] * S if forward is None else [float(x) for x in forward]
  tb = [1.0] * S if backward is None else [float(x) for x in backward]
  tw = [1.0] * S if weight is None else [float(x) for x in weight]
  # Candidates differ in how many micro-batches a stage holds before a pending W goes ahead of
  # its next F ("soft" bound <= the memory bound); the shortest list schedule wins.
  softs = {tuple(cap)} | {tuple(min(c, l) for c, l in zip(cap, L))}
  softs |= {tuple(max(1, c - d) for c in cap) for d in (1, 2)}
  durations = _Durations(tf, tb, tw)
  best = None
  for soft in sorted(softs, reverse=True):
    got = _list_schedule(g, Ms, cap, list(soft), durations)
    if best is None or got[0] < best[0] - 1e-12:
      best = got
  assert best is not None
  lanes = best[1]
  if update:
    for s in range(S):
      lanes[s].append(Action(Op.UPDATE, s))
  sched = Schedule(
    "zero-bubble",
    M,
    tuple(sorted((u, v) for u, v in edges)),
    tuple(tuple(l) for l in lanes),
    cs,
  )
  validate_schedule(sched)
  return sched


@dataclasses.dataclass(frozen=True)
class _Durations:
  """Per stage, the durations of an F, a B and a W that order the lanes."""

  forward: list[float]
  backward: list[float]
  weight: list[float]


def _list_schedule(
  g: nx.DiGraph, Ms: list[int], cap: list[int], soft: list[int], durations: _Durations
) -> tuple[float, list[list[Action]]]:
  """One list schedule: (makespan under ``durations``, lanes); ``Ms[s]``: stage s's
  micro-batches; ``cap[s]``: the most it may hold, ``soft[s]`` how many it holds before a
  pending W goes ahead of its next F."""
  S = len(cap)
  tf, tb, tw = durations.forward, durations.backward, durations.weight
  preds = [list(g.predecessors(s)) for s in range(S)]
  succs = [list(g.successors(s)) for s in range(S)]
  nxt = {k: [0] * S for k in "FBW"}
  busy_until = [0.0] * S
  done: dict[tuple[str, int, int], float] = {}
  lanes: list[list[Action]] = [[] for _ in range(S)]
  events: list[float] = []
  now = 0.0
  remaining = 3 * sum(Ms)
  inf = float("inf")

  def ended(kind: str, s: int, m: int, others: list[int]) -> bool:
    """Whether every ``kind`` action of the stages ``others`` overlapping chunk m of s ended."""
    return all(
      done.get((kind, t, k), inf) <= now for t in others for k in overlapping(m, Ms[s], Ms[t])
    )

  while remaining:
    for s in range(S):
      if busy_until[s] > now:
        continue
      f, b, w = nxt["F"][s], nxt["B"][s], nxt["W"][s]
      w_ready = w < b and done[("B", s, w)] <= now
      f_ready = (
        f < Ms[s] and f - w < (soft[s] if w_ready else cap[s]) and ended("F", s, f, preds[s])
      )
      if b < f and done[("F", s, b)] <= now and ended("B", s, b, succs[s]):
        kind, m, dur = Op.B, b, tb[s]
      elif f_ready:
        kind, m, dur = Op.F, f, tf[s]
      elif w_ready:
        kind, m, dur = Op.W, w, tw[s]
      else:
        continue
      nxt[kind][s] += 1
      lanes[s].append(Action(kind, s, m))
      done[(kind, s, m)] = now + dur
      busy_until[s] = now + dur
      heapq.heappush(events, now + dur)
      remaining -= 1
    if not remaining:
      break
    while events and events[0] <= now:
      heapq.heappop(events)
    if not events:
      raise ScheduleError(
        f"zero-bubble cannot progress with memory bounds {cap}; every stage needs a bound >= 1"
      )
    now = heapq.heappop(events)
  return max(done.values(), default=0.0), lanes
