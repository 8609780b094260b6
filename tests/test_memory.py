"""Memory: measured per device at every instruction, predicted from the step's program, and a
budget the user sets."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from harness import (
  DAG_STAGES,
  apply_dense,
  dag_model,
  dag_params,
  dense,
  make_batch,
  max_diff,
  mse_step,
)

import gpp_jax
from gpp_jax.runtime.memory import OUTSIDE, parse_bytes


def chain(p, x):
  return apply_dense(p["b"], jnp.tanh(apply_dense(p["a"], x)))


def chain_params():
  ks = jax.random.split(jax.random.key(0), 2)
  return {"a": dense(ks[0], 16, 32), "b": dense(ks[1], 32, 4)}


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_measured_parameters_and_gradients_are_the_bytes_known_by_hand():
  """SGD keeps no optimizer state: at the peak, a stage holds its parameters, their packed
  copy (one buffer per dtype), one gradient sum the size of its parameters; the program's
  prediction accounts for every array the step holds."""
  tx = optax.sgd(0.1)
  params = chain_params()
  pp = gpp_jax.graph_pipeline(
    mse_step(chain, tx),
    num_microbatches=4,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan({"a": 0, "b": 1}),
  )
  batch = make_batch(0, 64, 16, 4)
  params, opt, _ = pp(params, tx.init(params), batch)
  pp.measure_memory(params, opt, batch)
  report = pp.memory
  assert [d.device for d in report.devices] == ["cpu:0", "cpu:1"]
  for d, layer in zip(report.devices, ("a", "b")):
    own = _nbytes(params[layer])
    assert d.breakdown["parameters"] == 2 * own, d.breakdown
    assert d.breakdown["gradients"] == own, d.breakdown
    assert "optimizer state" not in d.breakdown
    held = d.measured_peak_bytes - d.breakdown.get(OUTSIDE, 0)
    assert abs(d.predicted_peak_bytes - held) <= 0.01 * held, (d, report)


@pytest.mark.parametrize(
  "schedule,remat",
  [("1f1b", False), ("gpipe", False), ("zero-bubble", False), ("2bw", False), ("1f1b", True)],
)
def test_the_measuring_step_gives_the_values_of_a_step_and_the_prediction_holds(schedule, remat):
  tx = optax.adam(1e-2)
  params = dag_params()
  batch = make_batch(1, 64, 5, 2)
  kw = dict(
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(DAG_STAGES),
    schedule=schedule,
    remat=remat,
  )
  plain = gpp_jax.graph_pipeline(mse_step(dag_model, tx), **kw)
  measured = gpp_jax.graph_pipeline(mse_step(dag_model, tx), **kw)
  a = plain(params, tx.init(params), batch)
  b = measured.measure_memory(params, tx.init(params), batch)
  assert max_diff(a, b) == 0.0
  for d in measured.memory.devices:
    held = d.measured_peak_bytes - d.breakdown.get(OUTSIDE, 0)
    assert abs(d.predicted_peak_bytes / held - 1) <= 0.10, measured.memory
  text = measured.explain()
  assert "peak memory per device (measured (measure_memory) / predicted" in text
  trace = measured.timeline.to_chrome_trace(measured.memory.counters)
  assert any(e["ph"] == "C" and e["name"] == "cpu:3 MiB" for e in trace["traceEvents"])


class Net(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(16, 32, rngs=rngs)
    self.b = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def nnx_step(model, optimizer, batch):
  loss, grads = gpp_jax.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
  optimizer.update(model, grads)
  return loss


def test_a_manual_plan_over_budget_is_refused_before_it_runs():
  model = Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  before = jax.tree.map(jnp.copy, nnx.state((model, optimizer)))
  plan = gpp_jax.manual_plan({"a": 0, "b": 1})
  kw = dict(num_microbatches=4, devices=jax.devices()[:2], planner=plan)
  batch = make_batch(2, 64, 16, 4)
  tight = gpp_jax.graph_pipeline(nnx_step, memory_limit="8KiB", **kw)
  with pytest.raises(gpp_jax.PlanError) as err:
    tight(model, optimizer, batch)
  msg = str(err.value)
  assert "memory_limit=8.0 KiB" in msg and "cpu:0:" in msg and "most: " in msg
  assert "raise memory_limit to at least" in msg and "remat=True" in msg
  assert max_diff(before, nnx.state((model, optimizer))) == 0.0  # untouched
  roomy = gpp_jax.graph_pipeline(nnx_step, memory_limit=1 << 20, **kw)
  ref_model = Net(nnx.Rngs(0))
  ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
  loss, ref = roomy(model, optimizer, batch), nnx.jit(nnx_step)(ref_model, ref_opt, batch)
  assert abs(float(loss) - float(ref)) <= 1e-5


def test_memory_sizes_read_as_bytes():
  assert parse_bytes("512MiB") == 512 << 20
  assert parse_bytes("12GiB") == 12 << 30
  assert parse_bytes("1.5 GB") == 1_500_000_000
  assert parse_bytes(4096) == 4096
  for bad in ("lots", "12 parsecs", "-1GiB", 0):
    with pytest.raises(ValueError, match="memory size"):
      parse_bytes(bad)
