"""Plans do not change with timing noise, and a saved plan reruns exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_ir_and_layering import _layered

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.ir import layer_graph as lg
from gpp_jax.passes.calibrate import measure_layers, robust_time, snap
from gpp_jax.passes.partition import get_planner

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
  """Times proportional to the layers' FLOPs, each sample up to 30% slower at random."""
  rng = np.random.default_rng(seed)

  def timer(layer, role, fn):
    if calls is not None:
      calls[layer] = calls.get(layer, 0) + 1
    base = 1e-4 * (1 + graph.nodes[layer]["flops"] / 1e6) * (2.0 if role == "bwd" else 1.0)
    return base * (1 + rng.uniform(0, 0.3))

  return timer


def graphpipe_fingerprint(layered, seed, **options):
  closed, L = layered
  cal = measure_layers(
    closed,
    L.eqn_layer,
    L.param_layer,
    L.graph,
    jax.devices()[0],
    timer=noisy_timer(L.graph, seed),
    **options,
  )
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
  closed, L = layered
  calls: dict[str, int] = {}
  cal = measure_layers(
    closed,
    L.eqn_layer,
    L.param_layer,
    L.graph,
    jax.devices()[0],
    timer=noisy_timer(L.graph, 0, calls),
  )
  assert set(calls) < set(cal.time_f)  # some layers were not timed at all
  # The middle layers of the three branches run the same program: one measurement for all.
  assert cal.groups["b2"] == cal.groups["c2"] == cal.groups["a2"]
  assert cal.time_f["a2"] == cal.time_f["b2"] == cal.time_f["c2"]
  assert set(cal.time_f) == set(L.graph.nodes)


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
