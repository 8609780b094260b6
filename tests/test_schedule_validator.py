"""The validator rejects every schedule with one action removed or two actions swapped, and
names the action; a swap that leaves a runnable schedule is accepted (an independent check
decides which)."""

import itertools

import networkx as nx
import pytest

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.schedules import GENERATORS

DAG = [(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)]  # branches and a skip edge
M = 3


def _runnable(sched: Schedule) -> bool:
  """Independent check: complete, per-stage order respected, and the lanes run to the end."""
  g = sched.stage_graph()
  kinds = {a.kind for lane in sched.lanes for a in lane} - {"UPDATE"}
  updates = [lane[-1:] == (Action("UPDATE", s),) for s, lane in enumerate(sched.lanes)]
  if any(updates) and not all(updates):
    return False
  for s, lane in enumerate(sched.lanes):
    body = [a for a in lane if a.kind != "UPDATE"]
    if len(body) != len(lane) - updates[s]:
      return False  # an UPDATE not at the end
    want = {Action(k, s, m) for k in kinds for m in range(M)}
    if set(body) != want or len(body) != len(want):
      return False
    pos = {a: i for i, a in enumerate(body)}
    for m in range(M):
      chain = [Action(k, s, m) for k in ("F", "B", "W") if k in kinds]
      if [pos[a] for a in chain] != sorted(pos[a] for a in chain):
        return False
      if m and any(pos[Action(k, s, m - 1)] > pos[Action(k, s, m)] for k in kinds):
        return False

  def deps(a):
    if a.kind == "F":
      return [Action("F", p, a.microbatch) for p in g.predecessors(a.stage)]
    if a.kind == "B":
      return [Action("B", c, a.microbatch) for c in g.successors(a.stage)]
    return []

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


def _with_lanes(sched, lanes):
  return Schedule(sched.name, sched.num_microbatches, sched.edges, tuple(map(tuple, lanes)))


SCHEDULES = sorted(GENERATORS)


@pytest.fixture(scope="module", params=SCHEDULES)
def sched(request):
  s = GENERATORS[request.param](4, DAG, M)
  assert nx.is_directed_acyclic_graph(s.stage_graph())
  return s


def test_generated_schedules_pass_both_checks(sched):
  validate_schedule(sched)
  assert _runnable(sched)


def test_one_action_removed_is_rejected_naming_it(sched):
  for s, lane in enumerate(sched.lanes):
    for i, a in enumerate(lane):
      lanes = [list(l) for l in sched.lanes]
      del lanes[s][i]
      with pytest.raises(ScheduleError) as err:
        validate_schedule(_with_lanes(sched, lanes))
      assert str(a) in str(err.value).split("\n")[0], (a, str(err.value))


def test_two_actions_swapped_are_rejected_naming_one(sched):
  rejected = 0
  for s, lane in enumerate(sched.lanes):
    for i, j in itertools.combinations(range(len(lane)), 2):
      lanes = [list(l) for l in sched.lanes]
      lanes[s][i], lanes[s][j] = lanes[s][j], lanes[s][i]
      bad = _with_lanes(sched, lanes)
      if _runnable(bad):
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
    validate_schedule(_with_lanes(sched, lanes))
