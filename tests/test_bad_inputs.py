"""What a user can get wrong, one row each: the input, the error it gets (type and the words
that name the input and the fix), and where it is caught.

Every row runs against the same model and optimizer state; afterwards the state must be
untouched and a good call of a step built before the row must still give the undecorated
step's result. Rows whose ``raises`` is None are legal inputs that must work.

Run-time failures (a stage whose computation raises) follow the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import OPTIMIZERS, make_batch, max_diff, mse_step
from test_pipeline_numerics import chain_model, chain_params

import gpp_jax
from gpp_jax.errors import BatchError, CaptureError, PlanError
from gpp_jax.runtime.executor import StageFailure

TX = OPTIMIZERS["adamw"]()
BATCH = make_batch(0, 8, 6, 3)
STAGES = {"l0": 0, "l1": 1, "l2": 2, "l3": 3}


class Env:
  """The shared state: parameters, optimizer state, a good pipelined step and its reference."""

  def __init__(self):
    self.params = chain_params()
    self.opt_state = TX.init(self.params)
    self.snapshot = jax.tree.map(np.asarray, (self.params, self.opt_state))
    self.good = self.pp()
    self.good(self.params, self.opt_state, BATCH)  # built once, before any row
    self.ref = jax.jit(mse_step(chain_model, TX))(self.params, self.opt_state, BATCH)

  def pp(self, step: Callable | None = None, **kw) -> Any:
    kw.setdefault("num_microbatches", 4)
    kw.setdefault("devices", jax.devices()[:4])
    kw.setdefault("planner", gpp_jax.manual_plan(STAGES))
    return gpp_jax.graph_pipeline(step or mse_step(chain_model, TX), **kw)

  def call(self, batch=BATCH, step: Callable | None = None, **kw):
    return self.pp(step, **kw)(self.params, self.opt_state, batch)


@pytest.fixture(scope="module")
def env() -> Env:
  return Env()


def _steps_with_loss(loss: Callable, **vg) -> Callable:
  """A step whose loss is ``loss(params, batch)``."""

  def step(params, opt_state, batch):
    out, grads = gpp_jax.value_and_grad(lambda p: loss(p, batch), **vg)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, out

  return step


def _mse(p, b):
  return jnp.mean((chain_model(p, b["x"]) - b["y"]) ** 2)


def _with_callback(p, b):
  h = chain_model(p, b["x"])
  h = jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
  return jnp.mean((h - b["y"]) ** 2)


def _with_print(p, b):
  loss = _mse(p, b)
  jax.debug.print("loss {}", loss)
  return loss


def _two_losses(params, opt_state, batch):
  gpp_jax.value_and_grad(lambda p: _mse(p, batch))(params)
  loss, _ = gpp_jax.value_and_grad(lambda p: _mse(p, batch))(params)
  return params, opt_state, loss


def _plain_grad(params, opt_state, batch):
  loss, _ = jax.value_and_grad(lambda p: _mse(p, batch))(params)
  return params, opt_state, loss


def _int_parameter(params, opt_state, batch):
  loss, _ = gpp_jax.value_and_grad(lambda p: _mse(p, batch) * p["n"])(params)
  return params, opt_state, loss


def _xy_step(params, opt_state, x, y):
  """A step given the inputs and the labels as two arguments."""
  return _steps_with_loss(lambda p, b: _mse(p, {"x": x, "y": b}))(params, opt_state, y)


def _xy_as_the_batch(e: Env) -> None:
  out = e.pp(_xy_step, batch_argnums=(2, 3))(e.params, e.opt_state, BATCH["x"], BATCH["y"])
  assert max_diff(out, e.ref) <= 1e-5


def _second_call(batch) -> Callable[[Env], Any]:
  """A row that calls the shared, already built step again with ``batch``."""
  return lambda e: e.good(e.params, e.opt_state, batch)


@dataclasses.dataclass(frozen=True)
class Row:
  what: str  # the input, in words
  run: Callable[[Env], Any]
  raises: type[Exception] | None  # None: legal, must work
  match: str = ""  # words of the message that name the input and the fix


CATALOGUE = [
  # -- the decorator's settings (refused when decorating) --------------------------------
  Row("num_microbatches=2.5", lambda e: e.pp(num_microbatches=2.5), ValueError,
      r"whole number .*got 2\.5"),
  Row("num_microbatches=0", lambda e: e.pp(num_microbatches=0), ValueError, ">= 1, got 0"),
  Row("num_microbatches=True", lambda e: e.pp(num_microbatches=True), ValueError,
      "whole number"),
  Row("num_microbatches as a NumPy integer", lambda e: e.call(num_microbatches=np.int64(4)),
      None),
  Row("devices given as indices", lambda e: e.pp(devices=[0, 1, 2, 3]), ValueError,
      r"takes JAX devices; entry 0 is 0 .*jax\.devices\(\)\[:4\]"),
  Row("a device named twice", lambda e: e.pp(devices=[jax.devices()[0]] * 2 + jax.devices()[1:3]),
      ValueError, r"names cpu:0 twice \(entries 0 and 1\).*each device once"),
  Row("devices=[]", lambda e: e.pp(devices=[]), ValueError, "empty"),
  Row("timeout_s=0", lambda e: e.pp(timeout_s=0), ValueError, "timeout_s must be a number > 0"),
  Row("layer_depth=0", lambda e: e.pp(layer_depth=0), ValueError, "layer_depth must be"),
  Row("memory_limit='lots'", lambda e: e.pp(memory_limit="lots"), ValueError,
      "cannot read the memory size 'lots'.*512MiB"),
  # -- plans and schedules (refused before compiling) ------------------------------------
  Row("an unknown planner", lambda e: e.call(planner="graphpip"), ValueError,
      "unknown planner 'graphpip'; choose one of"),
  Row("an unknown schedule", lambda e: e.call(schedule="1f1c"), ValueError,
      "unknown schedule '1f1c'; choose one of"),
  Row("microbatch_sizes={0: 0}", lambda e: gpp_jax.manual_plan(STAGES, microbatch_sizes={0: 0}),
      PlanError, "stage 0 0 samples per micro-batch; a size is an int >= 1"),
  Row("microbatch_sizes={0: 2.5}",
      lambda e: gpp_jax.manual_plan(STAGES, microbatch_sizes={0: 2.5}),  # type: ignore[dict-item]
      PlanError,
      "stage 0 2.5 samples"),
  Row("microbatch_sizes naming a stage the plan lacks",
      lambda e: e.call(planner=gpp_jax.manual_plan(STAGES, microbatch_sizes={7: 2})), PlanError,
      r"name stages \[7\], but the plan has stages 0..3"),
  Row("a stage at micro-batch size 1", lambda e: e.call(
      planner=gpp_jax.manual_plan(STAGES, microbatch_sizes={0: 1})), None),
  Row("a manual plan naming an unknown module", lambda e: e.call(
      planner=gpp_jax.manual_plan({**STAGES, "decoder": 3})), PlanError,
      r"rules \['decoder'\] match no layer"),
  Row("a manual plan leaving layers out", lambda e: e.call(
      planner=gpp_jax.manual_plan({"l0": 0, "l1": 1})), PlanError,
      r"layers \['l2', 'l3'\] match no rule.*default_stage"),
  Row("more stages than devices", lambda e: e.call(devices=jax.devices()[:2]), PlanError,
      "4 stages but only 2 devices"),
  Row("two stages sharing some devices", lambda e: e.call(
      planner=gpp_jax.manual_plan(STAGES, devices={0: [0, 1], 1: [1, 2], 2: 3, 3: 4})),
      PlanError, "either on disjoint devices or on the same ones"),
  # -- the batch ---------------------------------------------------------------------------
  Row("a batch that does not split into the micro-batches",
      lambda e: e.call(make_batch(0, 10, 6, 3)), BatchError,
      "batch of 10 examples does not split into 4"),
  Row("batch leaves of different lengths",
      lambda e: e.call({"x": BATCH["x"], "y": BATCH["y"][:4]}), BatchError, "share one leading"),
  Row("a batch without arrays", lambda e: e.call({}), BatchError, "hold no arrays"),
  Row("inputs and labels as two arguments, the batch left at the last", lambda e: e.pp(_xy_step)(
      e.params, e.opt_state, BATCH["x"], BATCH["y"]), BatchError,
      r"argument 2 has the batch's leading dimension \(8\).*batch_argnums=\(2, 3\)"),
  Row("inputs and labels as two arguments, both named the batch", _xy_as_the_batch, None),
  Row("batch_argnums out of range", lambda e: e.call(batch_argnums=5), ValueError,
      r"batch_argnums \(5,\) out of range for 3"),
  Row("run_steps given one batch, not a list", lambda e: e.good.run_steps(
      e.params, e.opt_state, BATCH), BatchError, "list of per-step batches"),
  Row("a later call with another batch structure", _second_call({"x": BATCH["x"], "z": BATCH["y"]}),
      BatchError, r"differ from an earlier call's \(argument 2\['z'\] is new; argument 2\['y'\] "
      r"is missing\).*KeyError: 'y'.*same structure"),
  Row("a later call with another feature width", _second_call(make_batch(0, 8, 7, 3)),
      BatchError, r"argument 2\['x'\] has shape \(8, 7\) float32, before \(8, 6\) float32"),
  Row("a later call with more examples", _second_call(make_batch(1, 16, 6, 3)), None),
  # -- the loss and the step ------------------------------------------------------------------
  Row("an integer loss", lambda e: e.call(step=_steps_with_loss(
      lambda p, b: jnp.sum(chain_model(p, b["x"]) > 0))), CaptureError,
      "dtype int32; gradients of an integer .* floating-point loss"),
  Row("a loss that is not a scalar", lambda e: e.call(step=_steps_with_loss(
      lambda p, b: (chain_model(p, b["x"]) - b["y"]) ** 2)), CaptureError, "scalar loss"),
  Row("a callback in the loss", lambda e: e.call(step=_steps_with_loss(_with_callback)),
      CaptureError, r"pure_callback in layer 'l3' of the loss \(at .*test_bad_inputs.py"),
  Row("a print in the loss", lambda e: e.call(step=_steps_with_loss(_with_print)), CaptureError,
      "debug_print in layer .* must be pure"),
  Row("has_aux=True with a loss that returns no aux", lambda e: e.call(step=_steps_with_loss(
      _mse, has_aux=True)), CaptureError, r"has_aux=True the loss function must return \(loss"),
  Row("an unknown aux_reduce", lambda e: gpp_jax.value_and_grad(_mse, aux_reduce="median"),
      CaptureError, "aux_reduce takes 'mean', 'sum', 'concat', 'last'"),
  Row("two losses in one step", lambda e: e.call(step=_two_losses), CaptureError,
      "called twice in one step"),
  Row("jax.value_and_grad instead of gpp_jax's", lambda e: e.call(step=_plain_grad), CaptureError,
      "never calls gpp_jax.value_and_grad; replace"),
  Row("an integer parameter differentiated", lambda e: e.pp(_int_parameter, planner="balanced")(
      {**e.params, "n": jnp.ones((), jnp.int32)}, e.opt_state, BATCH), CaptureError,
      "dtype int32; only floating-point parameters"),
]  # fmt: skip


@pytest.mark.parametrize("row", CATALOGUE, ids=[r.what for r in CATALOGUE])
def test_catalogue(env: Env, row: Row):
  if row.raises is None:
    row.run(env)
  else:
    with pytest.raises(row.raises, match=row.match):
      row.run(env)
  # The user's state is untouched, and the step built before still gives the right result.
  now = jax.tree.map(np.asarray, (env.params, env.opt_state))
  assert max_diff(now, env.snapshot) == 0.0
  out = env.good(env.params, env.opt_state, BATCH)
  assert max_diff(out, env.ref) <= 1e-5


def test_catalogue_rows_are_distinct():
  assert len({r.what for r in CATALOGUE}) == len(CATALOGUE) >= 30


# -- run-time failures --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "op,stage,mb,where",
  [
    ("F", 1, 2, r"F1\.2 \(F, micro-batch 2\) on stage 1 \(l1\) on (TFRT_)?cpu:?_?1"),
    ("B", 2, 0, r"B2\.0 \(B, micro-batch 0\) on stage 2 \(l2\) on (TFRT_)?cpu:?_?2"),
    ("SEND", 0, 3, r"\(SEND\) on stage 0 \(l0\) on (TFRT_)?cpu:?_?0"),
  ],
)
def test_a_stage_that_raises_names_where(env: Env, op, stage, mb, where):
  """An instruction that raises: StageFailure names the action, micro-batch, stage, its layers
  and device, keeps the exception as its cause; nothing of the step is applied, and the next
  call runs as before."""
  ex = env.good.compiled.executor_for(1)
  k = next(
    k
    for k, ins in enumerate(ex.instrs)
    if ins.op.name == op and ins.lane == stage and (op == "SEND" or ins.mb == mb)
  )
  call, frees = ex.in_order[k]  # what a plain run calls (transfers may go together)
  cause = RuntimeError("device lost")

  def fail():
    raise cause

  ex.in_order[k] = (fail, frees)
  try:
    with pytest.raises(StageFailure, match=where) as info:
      env.good(env.params, env.opt_state, BATCH)
  finally:
    ex.in_order[k] = (call, frees)
  assert info.value.__cause__ is cause
  assert "RuntimeError: device lost" in str(info.value)
  now = jax.tree.map(np.asarray, (env.params, env.opt_state))
  assert max_diff(now, env.snapshot) == 0.0
  assert max_diff(env.good(env.params, env.opt_state, BATCH), env.ref) <= 1e-5
