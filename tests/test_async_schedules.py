"""PipeDream's asynchronous 1F1B (weight stashing, optional vertical sync) and PipeDream-2BW
match their one-device delayed-update reference loops (6 steps, float32, 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
  DAG_STAGES,
  OPTIMIZERS,
  dag_model,
  dag_params,
  make_batch,
  max_diff,
  mse_step,
)

import gpp_jax

TOL = 1e-5
STEPS = 6


# Stage graph 0 -> 1, 0 -> 2, 0 -> 3 (skip), 1 -> 3, 2 -> 3: longest paths to the sink 3, 2, 2, 1.
DELAYS = {
  "pipedream-async": (2, 1, 1, 0),
  "pipedream-async-vsync": (2, 2, 2, 2),
  "2bw": (1, 1, 1, 1),
}


def reference_loop(params, tx, batches, delays):
  """One device: step t computes stage s's gradient with the parameters of version
  max(0, t - d(s)) and applies it to the current parameters with the optimizer."""
  opt_state = tx.init(params)
  history, losses = [params], []

  def loss_fn(p, batch):
    return jnp.mean((dag_model(p, batch["x"]) - batch["y"]) ** 2)

  grad = jax.jit(jax.value_and_grad(loss_fn))
  for t, batch in enumerate(batches):
    stale = {k: history[max(0, t - delays[DAG_STAGES[k]])][k] for k in params}
    loss, g = grad(stale, batch)
    updates, opt_state = tx.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
    losses.append(float(loss))
  return params, opt_state, losses


@pytest.mark.parametrize("schedule", sorted(DELAYS))
def test_async_schedule_matches_delayed_update_reference(schedule):
  from gpp_jax.passes.weight_versions import weight_delays

  tx = OPTIMIZERS["adamw"]()
  params = dag_params()
  batches = [make_batch(20 + t, 8, 5, 2) for t in range(STEPS)]
  pp = gpp_jax.graph_pipeline(
    mse_step(dag_model, tx),
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(DAG_STAGES),
    schedule=schedule,
  )
  p, o, losses = params, tx.init(params), []
  with jax.transfer_guard("disallow"):
    for batch in batches:
      p, o, metrics = pp(p, o, batch)
      losses.append(float(metrics["loss"]))
  assert pp.schedule.name == schedule
  assert weight_delays(pp.schedule) == DELAYS[schedule]
  rp, ro, rlosses = reference_loop(params, tx, batches, DELAYS[schedule])
  assert max_diff(rp, p) <= TOL
  assert max_diff(ro, o) <= TOL
  assert np.max(np.abs(np.array(losses) - np.array(rlosses))) <= TOL
  # The stale weights matter: the synchronous loop ends elsewhere.
  sp, _, _ = reference_loop(params, tx, batches, (0, 0, 0, 0))
  assert max_diff(sp, p) > 1e-3


def test_simulator_counts_stashed_weight_versions():
  from gpp_jax.cost.cluster import make_cluster
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.experiments.model_graphs import model_graph
  from gpp_jax.passes.partition import get_planner
  from gpp_jax.passes.simulation import simulate

  g = model_graph("mmt")
  cluster = make_cluster("v100", 8)
  plan = get_planner("pipedream")(g, cluster, 32, num_microbatches=8)
  assert plan.num_stages >= 2
  pc = plan_costs(plan, g, cluster)
  sync = simulate(plan, g, cluster)
  for name, delays in (("2bw", [1] * plan.num_stages), ("pipedream-async", None)):
    res = simulate(plan.replace(schedule=name), g, cluster)
    assert res.iteration_time == pytest.approx(sync.iteration_time)  # 1F1B lanes per step
    d = delays or [plan.num_stages - 1 - s for s in range(plan.num_stages)]  # a chain
    for s in range(plan.num_stages):
      assert res.stage_memory[s] == pytest.approx(sync.stage_memory[s] + d[s] * pc.param_bytes[s])
