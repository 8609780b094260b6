"""Simulator, in-flight counts, the graph-1F1B schedule and the series-parallel pass."""

import dataclasses
import json

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.cost.cost_model import plan_costs
from gpp_jax.cost.simulator import SimResult, chrome_trace, write_chrome_trace
from gpp_jax.errors import ScheduleError
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.ir.program import BufferKind, Transfer
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.inflight import graph_1f1b, inflight_counts, longest_path_to_sink
from gpp_jax.passes.schedules import gpipe, make_schedule, one_f_one_b
from gpp_jax.passes.series_parallel import SPDecomposition, sp_decompose, with_ordering_edges
from gpp_jax.passes.simulation import HostSide, StageTimes, simulate, simulate_times


def chain(S):
  return [(i, i + 1) for i in range(S - 1)]


@pytest.mark.parametrize("gen", [gpipe, one_f_one_b, graph_1f1b])
@pytest.mark.parametrize(
  "S,M,tf,tb",
  [(1, 1, 1.0, 2.0), (4, 8, 1.0, 2.0), (3, 2, 0.5, 1.5), (6, 12, 2.0, 3.0), (5, 5, 1.0, 1.0)],
)
def test_closed_form_on_uniform_chains(gen, S, M, tf, tb):
  res = simulate_times(gen(S, chain(S), M), StageTimes([tf] * S, [tb] * S))
  assert res.iteration_time == pytest.approx((M + S - 1) * (tf + tb))
  for b in res.bubble:
    assert b == pytest.approx((S - 1) / (M + S - 1))


def test_transfers_add_their_latency_on_the_critical_path():
  S, M, tf, tb, c = 4, 6, 1.0, 2.0, 0.25
  xfer = dict.fromkeys(chain(S), c)
  res = simulate_times(
    gpipe(S, chain(S), M), StageTimes([tf] * S, [tb] * S, activation_transfer=xfer)
  )
  assert res.iteration_time == pytest.approx((M + S - 1) * (tf + tb) + 2 * (S - 1) * c)
  assert len(res.transfers) == 2 * (S - 1) * M
  # 1F1B also waits for round trips in its steady state, so it pays at least as much.
  one = simulate_times(
    one_f_one_b(S, chain(S), M), StageTimes([tf] * S, [tb] * S, activation_transfer=xfer)
  )
  assert one.iteration_time >= res.iteration_time - 1e-9
  assert (
    one.iteration_time
    > simulate_times(one_f_one_b(S, chain(S), M), StageTimes([tf] * S, [tb] * S)).iteration_time
  )


def test_in_flight_and_memory():
  S, M = 4, 8
  one = simulate_times(
    one_f_one_b(S, chain(S), M),
    StageTimes(
      [1.0] * S,
      [2.0] * S,
      static_memory=[100.0] * S,
      activation_memory=[10.0] * S,
      stage_devices=[(0,), (1,), (2, 3), (4,)],
    ),
  )
  assert one.peak_in_flight == (4, 3, 2, 1)
  assert one.stage_memory == (140.0, 130.0, 120.0, 110.0)
  assert one.peak_memory == {0: 140.0, 1: 130.0, 2: 120.0, 3: 120.0, 4: 110.0}
  gp = simulate_times(
    gpipe(S, chain(S), M), StageTimes([1.0] * S, [2.0] * S, activation_memory=[10.0] * S)
  )
  assert gp.peak_in_flight == (M,) * S


def test_update_runs_after_the_last_backward():
  S, M = 2, 3
  res = simulate_times(
    one_f_one_b(S, chain(S), M), StageTimes([1.0] * S, [1.0] * S, update=[5.0, 0.5])
  )
  upd = {a.stage: a for a in res.actions if a.kind == "UPDATE"}
  last_b = max(a.end for a in res.actions if a.kind == "B" and a.stage == 0)
  assert upd[0].start == pytest.approx(last_b)
  assert res.iteration_time == pytest.approx(upd[0].end)


def test_per_action_times_replay_measurements():
  S, M = 2, 3
  sched = one_f_one_b(S, chain(S), M)
  fw = [[1.0, 2.0, 1.0], 1.0]
  res = simulate_times(sched, StageTimes(fw, [2.0, 2.0]))
  start, end = res.time_of(Action("F", 0, 1))
  assert end - start == 2.0
  assert res.time_of(Action("F", 1, 1))[0] >= end
  with pytest.raises(KeyError):
    res.time_of(Action("F", 5, 0))


def test_dag_join_waits_for_every_branch():
  # 0 -> {1, 2} -> 3 with a slow branch 2.
  edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
  res = simulate_times(
    one_f_one_b(4, edges, 1), StageTimes([1.0, 1.0, 5.0, 1.0], [1.0, 1.0, 1.0, 1.0])
  )
  assert res.time_of(Action("F", 3, 0))[0] == pytest.approx(6.0)
  assert res.time_of(Action("B", 0, 0))[0] == pytest.approx(9.0)  # after B of branch 2


def test_a_deadlocked_schedule_is_reported():
  lanes = ((Action("B", 0, 0), Action("F", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0)))
  bad = Schedule("bad", 1, ((0, 1),), lanes)
  with pytest.raises(ScheduleError, match="deadlock"):
    simulate_times(bad, StageTimes([1.0, 1.0], [1.0, 1.0]))
  with pytest.raises(ValueError, match="per-stage"):
    simulate_times(one_f_one_b(2, [(0, 1)], 2), StageTimes([1.0], [1.0, 1.0]))


def test_result_json_and_chrome_trace(tmp_path):
  res = simulate_times(
    one_f_one_b(3, chain(3), 4),
    StageTimes(
      [1e-3] * 3,
      [2e-3] * 3,
      activation_transfer={(0, 1): 1e-4, (1, 2): 1e-4},
      stage_devices=[(0,), (1,), (2,)],
    ),
  )
  back = SimResult.from_json(res.to_json())
  assert back == res
  path = tmp_path / "trace.json"
  write_chrome_trace(res, str(path))
  trace = json.loads(path.read_text())
  xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert len(xs) == len(res.actions) + len(res.transfers)
  f00 = next(e for e in xs if e["name"] == "F0.0")
  assert f00["dur"] == pytest.approx(1e3)  # microseconds
  assert trace == chrome_trace(res)
  assert "iteration" in str(res)


def test_simulate_plan_uses_the_cost_model():
  g = mg.chain(batch_size=8, layers=4, hidden=256)
  cl = cpu_cluster(2)
  plan = Plan(
    stages=(Stage(0, ("fc0", "fc1"), (0,), 4), Stage(1, ("fc2", "fc3"), (1,), 4)),
    edges=((0, 1),),
    num_microbatches=2,
    batch_size=8,
  )
  res = simulate(plan, g, cl)
  pc = plan_costs(plan, g, cl)
  ref = simulate_times(
    one_f_one_b(2, [(0, 1)], 2),
    StageTimes(
      pc.forward,
      pc.backward,
      update=pc.update,
      activation_transfer=pc.activation_transfer,
      static_memory=pc.static_memory,
      activation_memory=pc.activation_memory,
    ),
  )
  assert res.iteration_time == pytest.approx(ref.iteration_time)
  assert res.peak_memory[0] == pytest.approx(pc.static_memory[0] + 2 * pc.activation_memory[0])


# -- in-flight counts and graph-1F1B ---------------------------------------------------------


def test_inflight_rules_reproduce_the_papers_figure_5():
  edges = chain(3)
  assert inflight_counts(3, edges, [4, 4, 4]).samples == (12, 8, 4)
  per_stage = inflight_counts(3, edges, [1, 2, 4])
  assert per_stage.samples == (10, 8, 4)
  assert per_stage.microbatches == (10, 4, 1)
  assert inflight_counts(4, [(0, 1), (0, 2), (1, 3), (2, 3)]).microbatches == (3, 2, 2, 1)
  assert inflight_counts(3, edges, num_microbatches=2).microbatches == (2, 2, 1)
  assert "in flight" in str(per_stage)
  with pytest.raises(ScheduleError, match="cycle"):
    inflight_counts(2, [(0, 1), (1, 0)])


def test_graph_1f1b_equals_classic_1f1b_on_chains():
  for S, M in [(1, 3), (3, 3), (4, 9), (5, 2)]:
    assert graph_1f1b(S, chain(S), M).lanes == one_f_one_b(S, chain(S), M).lanes
  assert make_schedule("graph-1f1b", 3, chain(3), 4).name == "graph-1f1b"


@st.composite
def stage_dags(draw):
  n = draw(st.integers(1, 6))
  edges = [(i, j) for i in range(n) for j in range(i + 1, n) if draw(st.booleans())]
  return n, edges


@settings(max_examples=40, deadline=None, derandomize=True)
@given(stage_dags(), st.integers(1, 6), st.lists(st.floats(0.1, 3.0), min_size=6, max_size=6))
def test_graph_1f1b_on_random_stage_dags(dag, M, times):
  n, edges = dag
  sched = graph_1f1b(n, edges, M, forward=times[:n], backward=[2 * t for t in times[:n]])
  validate_schedule(sched)
  res = simulate_times(sched, StageTimes(times[:n], [2 * t for t in times[:n]]))
  L = longest_path_to_sink(n, edges)
  assert all(res.peak_in_flight[s] <= min(L[s], M) for s in range(n))
  # Backward as early as possible: whenever a stage starts a forward, its next backward was
  # not ready yet (its own forward or a successor's backward had not finished).
  g = sched.stage_graph()
  end = {(a.kind, a.stage, a.microbatch): a.end for a in res.actions}
  for a in res.actions:
    if a.kind != "F":
      continue
    nb = sum(1 for b in res.actions if b.kind == "B" and b.stage == a.stage and b.start < a.start)
    if nb < a.microbatch:
      deps = [end[("F", a.stage, nb)]] + [end[("B", c, nb)] for c in g.successors(a.stage)]
      assert max(deps) > a.start - 1e-9


# -- series-parallel decomposition -----------------------------------------------------------


def _convex(g, layers):
  s = set(layers)
  out = {v for u in s for v in g.successors(u)} - s
  reach = set()
  for v in out:
    reach |= nx.descendants(g, v) | {v}
  return not (reach & s)


def _walk(node):
  yield node
  for c in node.children:
    yield from _walk(c)


def test_sp_of_a_fork_join():
  g = mg.random_branches(3, branches=3, fork=True, join=True, identical=True)
  d = sp_decompose(g)
  assert d.is_series_parallel
  assert d.root.kind == "series" and d.root.children[1].kind == "parallel"
  assert d.root.children[0].layer == "fork" and d.root.children[-1].layer == "join"
  assert SPDecomposition.from_json(d.to_json()) == d
  assert "parallel" in str(d)


def test_sp_ization_of_the_n_graph_adds_an_ordering_edge():
  g = mg.random_dag(0, num_layers=4, edge_prob=0.0)
  for u, v in [("l0", "l2"), ("l1", "l2"), ("l1", "l3")]:
    g.add_edge(u, v, bytes=1.0)
  d = sp_decompose(g)
  assert not d.is_series_parallel
  assert d.added_edges == (("l0", "l3"),)
  assert [c.kind for c in d.root.children] == ["parallel", "parallel"]
  h = with_ordering_edges(g, d)
  assert h.edges["l0", "l3"]["ordering"] and sp_decompose(h).is_series_parallel


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(1, 9), st.floats(0.0, 0.8))
def test_sp_tree_covers_every_layer_once_with_convex_nodes(seed, n, p):
  g = mg.random_dag(seed, num_layers=n, edge_prob=p)
  d = sp_decompose(g)
  assert sorted(d.root.layers) == sorted(g.nodes)
  h = with_ordering_edges(g, d)
  assert nx.is_directed_acyclic_graph(h)
  for node in _walk(d.root):
    assert _convex(g, node.layers)
    if node.kind == "series":  # every earlier child reaches every later one in h
      for a, b in zip(node.children, node.children[1:]):
        assert all(nx.has_path(h, u, v) for u in a.layers for v in b.layers)
    if node.kind == "parallel":
      for a in node.children:
        for b in node.children:
          if a is not b:
            assert not any(nx.has_path(g, u, v) for u in a.layers for v in b.layers)
  if sp_decompose(mg.random_sp_dag(seed, num_layers=n)).added_edges:
    pytest.fail("a series-parallel graph needed ordering edges")


def test_host_dispatch_mode_limits():
  from gpp_jax.passes.schedules import one_f_one_b
  from gpp_jax.passes.simulation import simulate_times

  S, M, tf, tb = 3, 4, 1.0, 2.0
  sched = one_f_one_b(S, [(0, 1), (1, 2)], M)
  free = simulate_times(sched, StageTimes([tf] * S, [tb] * S))
  assert simulate_times(
    sched, StageTimes([tf] * S, [tb] * S), HostSide(dispatch=0.0)
  ).iteration_time == pytest.approx(free.iteration_time)
  # One core: everything runs one after another.
  one = simulate_times(sched, StageTimes([tf] * S, [tb] * S), HostSide(dispatch=0.0, cores=1))
  assert one.iteration_time == pytest.approx(S * M * (tf + tb))
  # A slow host: the last action cannot start before all of them were issued.
  n = sum(len(l) for l in sched.lanes)
  slow = simulate_times(sched, StageTimes([tf] * S, [tb] * S), HostSide(dispatch=10.0))
  assert slow.iteration_time >= n * 10.0


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
  stage_dags(),
  st.integers(1, 5),
  st.sampled_from(["gpipe", "1f1b", "graph-1f1b", "zero-bubble", "2bw"]),
  st.lists(st.floats(0.0, 3.0), min_size=24, max_size=24),
  st.booleans(),
  st.integers(1, 3),
)
def test_the_planners_fast_path_times_the_lowered_program(dag, M, name, xs, mixed, steps):
  """``simulate_times`` without a host runs on the schedule itself (what planners simulate
  hundreds of times); it must equal the lowered program's simulation action by action and
  transfer by transfer: every generator, per-action times, transfers, per-stage micro-batch
  counts, streams of several steps."""
  from gpp_jax.cost import simulator as sim
  from gpp_jax.passes.schedules import PER_STAGE_COUNTS, stream_schedule
  from gpp_jax.passes.simulation import lowered_schedule

  n, edges = dag
  counts = [M * (1 + (s % 2)) for s in range(n)] if mixed and name in PER_STAGE_COUNTS else None
  sched = make_schedule(name, n, edges, M, counts=counts)
  if steps > 1 and counts is None:
    sched = stream_schedule(sched, steps)
  per = sched.stage_counts
  fwd = [[xs[(s + m) % 24] for m in range(per[s] * steps)] for s in range(n)]
  bwd = [[xs[(3 * s + m + 5) % 24] for m in range(per[s] * steps)] for s in range(n)]
  wgt = [xs[(s + 11) % 24] for s in range(n)]
  kw = dict(
    weight=wgt,
    update=[xs[(s + 7) % 24] for s in range(n)],
    activation_transfer={e: xs[(e[0] + 2 * e[1]) % 24] for e in edges},
    cotangent_transfer={e: xs[(e[1] + 3 * e[0] + 1) % 24] / 2 for e in edges},
    static_memory=[10.0 * s for s in range(n)],
    activation_memory=[1.0 + s for s in range(n)],
    stage_devices=[(s,) for s in range(n)],
  )
  fast = simulate_times(sched, StageTimes(fwd, bwd, **kw))
  tf, tb, tw = (sim._per_action(t, "x", n) for t in (fwd, bwd, wgt))
  program = lowered_schedule(sched)
  durations = []
  for i in program.instrs:
    if i.op.value in ("F", "B", "W"):
      durations.append({"F": tf, "B": tb, "W": tw}[i.op.value](i.stage, i.mb))
    elif i.op.value == "SEND":
      act = i.arg == Transfer(BufferKind.ACT)
      x = kw["activation_transfer"] if act else kw["cotangent_transfer"]
      durations.append(x.get((i.lane, i.peer) if act else (i.peer, i.lane), 0.0))
    elif i.op.value == "UPDATE":
      durations.append(kw["update"][i.stage])
    else:
      durations.append(0.0)
  slow = sim.simulate_program(
    program,
    durations,
    memory=sim.StageMemory(kw["static_memory"], kw["activation_memory"], kw["stage_devices"]),
    num_microbatches=sched.num_microbatches,
  )
  assert fast == slow
  # What planners ask for: the same times, bubbles and memory without the records.
  lean = simulate_times(sched, StageTimes(fwd, bwd, **kw), timeline=False)
  assert lean == dataclasses.replace(fast, actions=(), transfers=())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
  stage_dags(),
  st.integers(1, 6),
  st.sampled_from(["gpipe", "1f1b", "graph-1f1b", "zero-bubble", "2bw"]),
  st.lists(st.floats(0.0, 3.0), min_size=18, max_size=18),
)
def test_the_polish_bound_is_below_every_schedule(dag, M, name, xs):
  """The polish skips a candidate whose ``pipeline_lower_bound`` is not below the time to
  beat; it must not exceed the simulated iteration time of any generator's schedule (W split
  off by zero-bubble: no drain term), whatever the transfers and updates."""
  from gpp_jax.passes.partition.refine import BoundTimes, pipeline_lower_bound, topological_order

  n, edges = dag
  sched = make_schedule(name, n, edges, M)
  fwd, bwd = xs[:n], xs[6 : 6 + n]
  split = sched.splits_backward
  weight = [b / 3 for b in bwd] if split else None
  res = simulate_times(
    sched,
    StageTimes(
      fwd,
      [b - w for b, w in zip(bwd, weight)] if weight else bwd,
      weight=weight,
      update=xs[12 : 12 + n],
      activation_transfer={e: xs[12 + (e[0] + e[1]) % 6] for e in edges},
    ),
  )
  preds = [[u for u, v in edges if v == s] for s in range(n)]
  order = topological_order(preds)
  assert order is not None and sorted(order) == list(range(n))
  bound = pipeline_lower_bound(
    BoundTimes(fwd, bwd, xs[12 : 12 + n]), order, preds, M, drains=not split
  )
  assert bound <= res.iteration_time * (1 + 1e-12) + 1e-12
  # A cycle has no order.
  assert topological_order([[2], [0], [1]]) is None
