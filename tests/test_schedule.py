"""Schedule generators and the validator."""

import pytest

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.inflight import longest_path_to_sink
from gpp_jax.passes.schedules import gpipe, make_schedule, one_f_one_b

CHAIN = [(0, 1), (1, 2), (2, 3)]
DAG = [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (0, 4)]


def test_longest_path_warmup():
  assert longest_path_to_sink(4, CHAIN) == [4, 3, 2, 1]
  assert longest_path_to_sink(5, DAG) == [4, 3, 3, 2, 1]


@pytest.mark.parametrize("edges,n", [(CHAIN, 4), (DAG, 5), ([], 3), ([(0, 2), (1, 2)], 3)])
@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("gen", [gpipe, one_f_one_b])
def test_generators_are_valid(edges, n, M, gen):
  s = gen(n, edges, M)
  validate_schedule(s)
  assert Schedule.from_json(s.to_json()) == s
  assert all(lane[-1] == Action("UPDATE", i) for i, lane in enumerate(s.lanes))


def test_1f1b_chain_matches_classic_warmup():
  s = one_f_one_b(4, CHAIN, 8)
  for st, lane in enumerate(s.lanes):
    first_b = next(i for i, a in enumerate(lane) if a.kind == "B")
    assert first_b == 4 - st  # S - i forwards before the first backward


def test_1f1b_in_flight_bounded_by_longest_path():
  s = one_f_one_b(5, DAG, 8)
  L = longest_path_to_sink(5, DAG)
  for st, lane in enumerate(s.lanes):
    inflight = peak = 0
    for a in lane:
      inflight += {"F": 1, "B": -1}.get(a.kind, 0)
      peak = max(peak, inflight)
    assert peak == L[st]


def _bad(lanes, edges=((0, 1),), M=2):
  return Schedule("bad", M, tuple(edges), tuple(tuple(l) for l in lanes))


def test_validator_reports_out_of_order():
  F, B = (lambda s, m: Action("F", s, m)), (lambda s, m: Action("B", s, m))
  s = _bad([[F(0, 1), F(0, 0), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]])
  with pytest.raises(ScheduleError, match=r"out of order.*\n.*\[F0.1\]"):
    validate_schedule(s)


def test_validator_reports_missing_action():
  F, B = (lambda s, m: Action("F", s, m)), (lambda s, m: Action("B", s, m))
  s = _bad([[F(0, 0), F(0, 1), B(0, 0)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]])
  with pytest.raises(ScheduleError, match=r"incomplete: stage 0 never runs B0.1"):
    validate_schedule(s)


def test_validator_reports_deadlock():
  F, B = (lambda s, m: Action("F", s, m)), (lambda s, m: Action("B", s, m))
  # Stage 0 waits for B1.0 before sending F0.1, but stage 1 runs F1.1 before B1.0.
  s = _bad([[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]])
  with pytest.raises(ScheduleError, match=r"deadlocks: .*B0.0 waits for \['B1.0'\]"):
    validate_schedule(s)


def test_validator_rejects_backward_before_forward():
  F, B = (lambda s, m: Action("F", s, m)), (lambda s, m: Action("B", s, m))
  s = _bad([[B(0, 0), F(0, 0)]], edges=(), M=1)
  with pytest.raises(ScheduleError, match="comes before F0.0"):
    validate_schedule(s)


def test_unknown_schedule_name():
  with pytest.raises(ValueError, match="unknown schedule 'zb'"):
    make_schedule("zb", 2, [(0, 1)], 2)


def test_schedule_text_counts_in_the_right_number():
  one = make_schedule("1f1b", 1, [], 1)
  assert str(one).startswith("Schedule 1f1b: 1 stage x 1 micro-batch\n")
  two = make_schedule("1f1b", 2, [(0, 1)], 4)
  assert str(two).startswith("Schedule 1f1b: 2 stages x 4 micro-batches\n")
