"""The validator rejects every schedule with one action removed or two actions swapped, and
names the action; a swap that leaves a runnable schedule is accepted (an independent check
decides which)."""

import itertools
from fractions import Fraction

import networkx as nx
import pytest

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.program import Op
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.schedules import GENERATORS

DAG = [(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)]  # branches and a skip edge
M = 3


def overlaps(s, m, t, k, counts):
  """Whether chunk m of stage s and chunk k of stage t share a sample (stage s cuts the batch
  into counts[s] chunks)."""
  a0, a1 = Fraction(m, counts[s]), Fraction(m + 1, counts[s])
  b0, b1 = Fraction(k, counts[t]), Fraction(k + 1, counts[t])
  return a0 < b1 and b0 < a1


def runnable(sched: Schedule) -> bool:
  """Independent check: complete (every stage runs its own count of each kind), per-stage order
  respected, and the lanes run to the end with dependencies from the sample-overlap rule."""
  g, counts = sched.stage_graph(), sched.stage_counts
  kinds = {a.kind for lane in sched.lanes for a in lane} - {"UPDATE"}
  updates = [lane[-1:] == (Action(Op.UPDATE, s),) for s, lane in enumerate(sched.lanes)]
  if any(updates) and not all(updates):
    return False
  for s, lane in enumerate(sched.lanes):
    body = [a for a in lane if a.kind != "UPDATE"]
    if len(body) != len(lane) - updates[s]:
      return False  # an UPDATE not at the end
    want = {Action(k, s, m) for k in kinds for m in range(counts[s])}
    if set(body) != want or len(body) != len(want):
      return False
    pos = {a: i for i, a in enumerate(body)}
    for m in range(counts[s]):
      chain = [Action(Op(k), s, m) for k in ("F", "B", "W") if k in kinds]
      if [pos[a] for a in chain] != sorted(pos[a] for a in chain):
        return False
      if m and any(pos[Action(k, s, m - 1)] > pos[Action(k, s, m)] for k in kinds):
        return False

  def deps(a):
    if a.kind not in ("F", "B"):
      return []
    others = g.predecessors(a.stage) if a.kind == "F" else g.successors(a.stage)
    return [
      Action(a.kind, t, k)
      for t in others
      for k in range(counts[t])
      if overlaps(a.stage, a.microbatch, t, k, counts)
    ]

  done, at = set(), [0] * len(sched.lanes)
  while True:
    moved = False
    for s, lane in enumerate(sched.lanes):
      while at[s] < len(lane) and all(d in done for d in deps(lane[at[s]])):
        done.add(lane[at[s]])
        at[s] += 1
        moved = True
    if not moved:
      return all(p == len(l) for p, l in zip(at, sched.lanes))


def with_lanes(sched, lanes):
  return Schedule(
    sched.name, sched.num_microbatches, sched.edges, tuple(map(tuple, lanes)), sched.counts
  )


SCHEDULES = sorted(GENERATORS)


# Stages with their own micro-batch counts (per-stage micro-batch sizes) too.
PER_STAGE_COUNTS = {"1f1b, counts 4 8 2 2": (4, 8, 2, 2), "1f1b, counts 2 8 4 8": (2, 8, 4, 8)}


@pytest.fixture(scope="module", params=SCHEDULES + sorted(PER_STAGE_COUNTS))
def sched(request):
  if request.param in PER_STAGE_COUNTS:
    s = GENERATORS["1f1b"](4, DAG, 8, counts=PER_STAGE_COUNTS[request.param])
  else:
    s = GENERATORS[request.param](4, DAG, M)
  assert nx.is_directed_acyclic_graph(s.stage_graph())
  return s


def test_generated_schedules_pass_both_checks(sched):
  validate_schedule(sched)
  assert runnable(sched)


def test_one_action_removed_is_rejected_naming_it(sched):
  for s, lane in enumerate(sched.lanes):
    for i, a in enumerate(lane):
      lanes = [list(l) for l in sched.lanes]
      del lanes[s][i]
      with pytest.raises(ScheduleError) as err:
        validate_schedule(with_lanes(sched, lanes))
      assert str(a) in str(err.value).split("\n")[0], (a, str(err.value))


def test_two_actions_swapped_are_rejected_naming_one(sched):
  rejected = 0
  for s, lane in enumerate(sched.lanes):
    for i, j in itertools.combinations(range(len(lane)), 2):
      lanes = [list(l) for l in sched.lanes]
      lanes[s][i], lanes[s][j] = lanes[s][j], lanes[s][i]
      bad = with_lanes(sched, lanes)
      if runnable(bad):
        validate_schedule(bad)  # a different, valid order: accepted
        continue
      rejected += 1
      with pytest.raises(ScheduleError) as err:
        validate_schedule(bad)
      head = str(err.value).split("\n")[0]
      assert str(lane[i]) in head or str(lane[j]) in head, (lane[i], lane[j], head)
  assert rejected > 0


def test_actions_swapped_between_lanes_are_rejected(sched):
  lanes = [list(l) for l in sched.lanes]
  lanes[0][0], lanes[1][0] = lanes[1][0], lanes[0][0]
  with pytest.raises(ScheduleError, match=rf"action {lanes[0][0]} is in the lane of stage 0"):
    validate_schedule(with_lanes(sched, lanes))
