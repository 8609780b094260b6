"""Plans do not change with timing noise, and a saved plan reruns exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_ir_and_layering import _layered

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.cost.host import HostCosts
from gpp_jax.cost.simulator import measured_width_times
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.passes.calibrate import LayerTiming, measure_layers, robust_time, snap
from gpp_jax.passes.partition import get_planner
from gpp_jax.passes.simulation import simulate
from gpp_jax.runtime.placement import StagePlacement

W = 128


def branchy(p, x):
  """Three branches of four identical layers, joined by a head."""
  hs = []
  for br in "abc":
    h = x
    for i in range(4):
      h = jnp.tanh(h @ p[f"{br}{i}"])
    hs.append(h)
  return jnp.mean((jnp.concatenate(hs, -1) @ p["head"]) ** 2)


@pytest.fixture(scope="module")
def layered():
  p = {f"{br}{i}": jnp.full((W, W), 0.01) for br in "abc" for i in range(4)}
  p["head"] = jnp.ones((3 * W, 8))
  return _layered(branchy, p, jnp.ones((64, W)))


def noisy_timer(graph, seed, calls=None):
  """Times proportional to the layers' FLOPs (the gradient sum's zeroing a tenth of the
  forward), each sample up to 30% slower at random."""
  rng = np.random.default_rng(seed)

  def timer(layer, role, fn):
    if calls is not None:
      calls[layer] = calls.get(layer, 0) + 1
    scale = {"fwd": 1.0, "bwd": 2.0, "zeros": 0.1}[role]
    base = 1e-4 * (1 + graph.nodes[layer]["flops"] / 1e6) * scale
    return base * (1 + rng.uniform(0, 0.3))

  return timer


def timed_layers(layered, timer, placement=None, **options):
  """``layered``'s layers timed on the first device by ``timer`` (``measure_layers``)."""
  closed, L = layered
  timing = LayerTiming(timer=timer, **options)
  return measure_layers(closed, L, jax.devices()[0], timing, placement)


def graphpipe_fingerprint(layered, seed, **options):
  _, L = layered
  cal = timed_layers(layered, noisy_timer(L.graph, seed), **options)
  graph = lg.scaled(cal.apply(L.graph), 64)
  return get_planner("graphpipe")(graph, cpu_cluster(4), 64, num_microbatches=4).fingerprint()


def test_robust_time_takes_a_low_quantile_until_it_settles():
  rng = np.random.default_rng(0)
  t, n = robust_time(lambda: 1.0 + rng.uniform(0, 1.0), repeats=5, max_rounds=8, rel_tol=0.02)
  assert 1.0 <= t < 1.35 and 10 <= n <= 40  # near the fast end, after several rounds
  t, n = robust_time(lambda: 2.0, repeats=5)
  assert t == 2.0 and n == 10  # a constant settles after two rounds


def test_snap_rounds_to_a_geometric_grid():
  assert snap(1.0, 0.05) == pytest.approx(1.0)
  assert snap(1.02, 0.05) == pytest.approx(1.0)
  assert snap(1.04, 0.05) == pytest.approx(1.05)
  assert snap(3e-4, 0.0) == 3e-4


def test_identical_layers_are_timed_once_and_share_the_time(layered) -> None:
  _, L = layered
  calls: dict[str, int] = {}
  cal = timed_layers(layered, noisy_timer(L.graph, 0, calls))
  assert set(calls) < set(cal.time_f)  # some layers were not timed at all
  # The middle layers of the three branches run the same program: one measurement for all.
  assert cal.groups["b2"] == cal.groups["c2"] == cal.groups["a2"]
  assert cal.time_f["a2"] == cal.time_f["b2"] == cal.time_f["c2"]
  assert set(cal.time_f) == set(L.graph.nodes)


def test_the_backward_time_leaves_out_zeroing_its_gradient_sum(layered) -> None:
  """Each timed backward consumes a zeroed gradient sum made by a call of its own, which a
  stage makes once per step, not once per backward: that call is timed apart (role "zeros")
  and taken out of the backward's time; a layer keeps at least a quarter of it."""
  _, L = layered
  zeroed = {}

  def timer(layer, role, fn):
    if role == "zeros":
      zeroed[layer] = jax.block_until_ready(fn())
    return {"fwd": 1e-3, "bwd": 3e-3, "zeros": 1e-3}[role]

  cal = timed_layers(layered, timer, share_identical=False, resolution=0.0)
  assert set(zeroed) == set(L.graph.nodes)
  # What is zeroed is the layer's gradient sum: zeros shaped like its parameters.
  assert [x.shape for x in zeroed["a0"]] == [(W, W)] and not np.any(zeroed["a0"][0])
  assert all(cal.time_f[n] == 1e-3 and cal.time_b[n] == pytest.approx(2e-3) for n in L.graph)
  # A stage zeroes its sums once per step, with its UPDATE: priced per parameter byte.
  nbytes = {n: L.graph.nodes[n]["param_bytes"] for n in L.graph}
  per_byte = sum(1e-3 for n in L.graph if nbytes[n]) / sum(nbytes.values())
  assert cal.settings["zero_per_byte"] == pytest.approx(per_byte)
  graph = lg.scaled(cal.apply(L.graph), 64)
  assert graph.graph["zero_per_byte"] == pytest.approx(per_byte)
  plan = get_planner("balanced")(graph, cpu_cluster(2), 64, num_microbatches=4)
  host = HostCosts(per_op={"F": 1e-5, "B": 1e-5}, parallel=None)

  def updates():
    res = simulate(plan, graph, cpu_cluster(2), host=host)
    return {a.stage: a.end - a.start for a in res.actions if a.kind == "UPDATE"}

  zeroed = updates()
  graph.graph["zero_per_byte"] = 0.0
  plain = updates()
  for s in plan.stages:
    stage_bytes = sum(nbytes[n] for n in s.layers)
    assert zeroed[s.index] - plain[s.index] == pytest.approx(per_byte * stage_bytes)

  def slow_zeros(layer, role, fn):
    return {"fwd": 1e-3, "bwd": 3e-3, "zeros": 5e-3}[role]

  cal = timed_layers(layered, slow_zeros, share_identical=False, resolution=0.0)
  assert all(cal.time_b[n] == pytest.approx(0.75e-3) for n in L.graph)


def test_layers_timed_over_devices_leave_their_own_all_reduce_to_the_stage(layered) -> None:
  """Over several devices, a layer's backward timed alone pays an all-reduce of its gradients,
  while XLA combines a stage's into one: the all-reduce of a tiny array is timed apart (role
  "allreduce"), taken out of each layer with parameters, and paid once per stage's backward
  (``measured_width_times``)."""
  _, L = layered
  times = {"fwd": 1e-3, "bwd": 3e-3, "zeros": 0.0, "allreduce": 0.5e-3}
  placement = StagePlacement(tuple(jax.devices()[:2]), 64)
  cal = timed_layers(
    layered, lambda layer, role, fn: times[role], placement=placement, resolution=0.0
  )
  assert cal.settings["allreduce_call"] == pytest.approx(0.5e-3)
  with_params = {n for n in L.graph if L.graph.nodes[n]["param_bytes"]}
  assert with_params and all(
    cal.time_b[n] == pytest.approx(2.5e-3 if n in with_params else 3e-3) for n in L.graph
  )
  graph = lg.scaled(cal.apply(cal.apply(L.graph), width=2), 64)
  assert graph.graph["allreduce_call_at"] == {"2": pytest.approx(0.5e-3)}
  layers = tuple(lg.topo_layers(graph))
  plan = Plan((Stage(0, layers, (0, 1)),), (), 1, batch_size=64)
  wide = measured_width_times(plan, graph, cpu_cluster(4))
  graph.graph["allreduce_call_at"] = {"2": 0.0}
  without = measured_width_times(plan, graph, cpu_cluster(4))
  assert wide[0][0] == without[0][0] and wide[0][1] == pytest.approx(without[0][1] + 0.5e-3)
  # On one device nothing is all-reduced.
  one = timed_layers(layered, lambda layer, role, fn: times[role])
  assert one.settings["allreduce_call"] == 0.0


def test_graphpipe_plans_alike_under_timing_noise(layered):
  stable = {graphpipe_fingerprint(layered, seed) for seed in range(4)}
  assert len(stable) == 1
  # The same noise without the stabilisation (one round, median, no snapping, every layer
  # timed on its own) gives different plans: the noise is large enough to matter.
  raw = {
    graphpipe_fingerprint(
      layered, seed, max_rounds=1, quantile=0.5, resolution=0.0, share_identical=False
    )
    for seed in range(4)
  }
  assert len(raw) > 1


def test_a_saved_plan_reruns_exactly(tmp_path):
  tx = optax.adam(1e-2)
  ks = jax.random.split(jax.random.key(1), 5)
  params = {f"l{i}": jax.random.normal(ks[i], (16, 16)) / 4 for i in range(4)}
  batch = {"x": np.ones((32, 16), np.float32), "y": np.zeros((32, 16), np.float32)}

  def step(params, opt_state, batch):
    def loss_fn(p):
      h = batch["x"]
      for k in sorted(p):
        h = jnp.tanh(h @ p[k])
      return jnp.mean((h - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def run(planner):
    pp = gpp_jax.graph_pipeline(
      step, num_microbatches=4, devices=jax.devices()[:4], planner=planner
    )
    p, o = params, tx.init(params)
    for _ in range(2):
      p, o, loss = pp(p, o, batch)
    return pp.plan, jax.device_get((p, o, loss))

  plan, first = run("pipedream")
  path = str(tmp_path / "plan.json")
  plan.save(path)
  again_plan, again = run(gpp_jax.Plan.load(path))
  assert again_plan == plan and again_plan.fingerprint() == plan.fingerprint()
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(a, b)  # bit for bit


def test_loading_something_else_names_the_file(tmp_path):
  path = tmp_path / "not_a_plan.json"
  path.write_text('{"layers": []}')
  with pytest.raises(gpp_jax.PlanError, match="not_a_plan.json is not a gpp_jax plan"):
    gpp_jax.Plan.load(str(path))
