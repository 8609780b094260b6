"""The executor takes the batch where it is: a device array is split on its device."""

import jax
from harness import OPTIMIZERS, compare_steps, make_batch, max_diff, mse_step
from test_pipeline_numerics import CHAIN_PLAN, chain_model, chain_params

import gpp_jax.runtime.executor as executor

TOL = 1e-5


def test_device_batch_is_split_on_its_device_and_matches_the_reference(monkeypatch):
  host_reads = []
  real_get = jax.device_get

  def counting_get(x):
    host_reads.append(x)
    return real_get(x)

  monkeypatch.setattr(executor.jax, "device_get", counting_get)
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


def test_host_batch_is_put_once_per_step_and_cut_on_the_device(monkeypatch):
  # One host-to-device put per batch array per step, not one per micro-batch (each costs the
  # host a few hundred microseconds); the chunks are cut where the array landed.
  import numpy as np

  host_puts = []
  real_put = jax.device_put

  def counting_put(x, *a, **k):
    if isinstance(x, np.ndarray):
      host_puts.append(x.shape)
    return real_put(x, *a, **k)

  monkeypatch.setattr(executor.jax, "device_put", counting_put)
  tx = OPTIMIZERS["adamw"]()
  params = chain_params()
  r, p, _pp = compare_steps(
    mse_step(chain_model, tx),
    (params, tx.init(params)),
    make_batch(1, 16, 6, 3),
    steps=2,
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=CHAIN_PLAN,
  )
  assert max_diff(r[0], p[0]) <= TOL
  batch_puts = [s for s in host_puts if s[:1] == (16,)]
  assert sorted(batch_puts) == [(16, 3), (16, 3), (16, 6), (16, 6)]  # x and y, 2 steps
  assert not [s for s in host_puts if s[:1] == (4,)], "a micro-batch was put from the host"
