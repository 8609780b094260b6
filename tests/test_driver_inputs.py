"""The driver takes the batch where it is: a device array is split on its device."""

import jax
from harness import OPTIMIZERS, compare_steps, make_batch, max_diff, mse_step
from test_pipeline_numerics import CHAIN_PLAN, chain_model, chain_params

import gpp_jax.runtime.driver as driver

TOL = 1e-5


def test_device_batch_is_split_on_its_device_and_matches_the_reference(monkeypatch):
  host_reads = []
  real_get = jax.device_get

  def counting_get(x):
    host_reads.append(x)
    return real_get(x)

  monkeypatch.setattr(driver.jax, "device_get", counting_get)
  tx = OPTIMIZERS["adamw"]()
  params = chain_params()
  batch = jax.device_put(make_batch(0, 16, 6, 3), jax.devices()[5])
  r, p, pp = compare_steps(
    mse_step(chain_model, tx),
    (params, tx.init(params)),
    batch,
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=CHAIN_PLAN,
  )
  assert pp.plan.num_stages == 4
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL
  assert max_diff(r[0], p[0]) <= TOL
  # No batch array went through the host.
  assert not [x for x in host_reads if any(x is b for b in batch.values())]
