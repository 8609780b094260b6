"""Property test: random DAG models trained pipelined equal the undecorated step.

A model is drawn as a DAG of small dense layers (fan-out, fan-in joined by sum, concat or
multiply, skip edges, a layer that reuses another's parameters), written as a Flax Linen or an
NNX module; the step (adam, with or without global-norm clipping) runs 2 steps under a planner
or a manual plan of contiguous stages (often concurrent ones), a schedule and a micro-batch
count drawn at random, and is compared with the same step run plainly on one device.

The default run draws a few examples; ``pytest -m fuzz`` runs 200 more. A failing example prints
its seed and model (hypothesis prints the drawn ``Case``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import max_diff
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import gpp_jax
from gpp_jax.errors import PlanError, ScheduleError

WIDTH, BATCH, DEVICES, TOL = 4, 8, 4, 2e-5
PLANNERS = ("balanced", "graphpipe", "pipedream", "piper", "bapipe", "luo", "manual")
SCHEDULES = (None, "1f1b", "gpipe", "graph-1f1b", "zero-bubble")


@dataclasses.dataclass(frozen=True)
class Case:
  """One drawn example: the model's DAG and how it is run."""

  inputs: tuple[tuple[int, ...], ...]  # per layer: earlier layers it reads (() = the input x)
  joins: tuple[str, ...]  # per layer: how several inputs combine (sum, concat, multiply)
  shares: tuple[int, ...]  # per layer: the layer whose parameters it uses (itself if own)
  flax: str  # "linen" or "nnx"
  clip: bool
  planner: str
  cuts: tuple[int, ...]  # manual plans: the first layer of each stage after stage 0
  schedule: str | None
  num_microbatches: int
  seed: int

  @property
  def num_layers(self) -> int:
    return len(self.inputs)

  def width_in(self, i: int) -> int:
    k = max(1, len(self.inputs[i]))
    return WIDTH * k if self.joins[i] == "concat" else WIDTH


@st.composite
def cases(draw) -> Case:
  n = draw(st.integers(3, 12))
  inputs, joins, shares = [], [], []
  for i in range(n):
    if i == 0:
      ins: tuple[int, ...] = ()
    else:
      k = draw(st.integers(1, min(3, i)))
      # The previous layer usually, plus skip edges from further back.
      ins = tuple(sorted({i - 1} | set(draw(st.lists(st.integers(0, i - 1), max_size=k - 1)))))
      if draw(st.booleans()) and i >= 2:  # fan-out: read an earlier layer instead
        ins = tuple(sorted({draw(st.integers(0, i - 2))} | set(ins[1:])))
    inputs.append(ins)
    joins.append(draw(st.sampled_from(("sum", "concat", "multiply"))))
  for i in range(n):
    same = [j for j in range(i) if joins[j] != "concat" and joins[i] != "concat"]
    shares.append(draw(st.sampled_from(same)) if same and draw(st.integers(0, 5)) == 0 else i)
  planner = draw(st.sampled_from(PLANNERS))
  stages = draw(st.integers(1, min(DEVICES, n)))
  k = stages - 1
  cuts = tuple(sorted(draw(st.sets(st.integers(1, n - 1), min_size=k, max_size=k))))
  return Case(
    tuple(inputs),
    tuple(joins),
    tuple(shares),
    draw(st.sampled_from(("linen", "nnx"))),
    draw(st.booleans()),
    planner,
    cuts,
    draw(st.sampled_from(SCHEDULES)),
    draw(st.sampled_from((1, 2, 4))),
    draw(st.integers(0, 2**16)),
  )


def _join(case: Case, i: int, values: list) -> jax.Array:
  xs = [values[j] for j in case.inputs[i]] if case.inputs[i] else [values[-1]]
  if case.joins[i] == "concat":
    return jnp.concatenate(xs, axis=-1)
  out = xs[0]
  for x in xs[1:]:
    out = out + x if case.joins[i] == "sum" else out * x
  return out


def _forward(case: Case, layers, x):
  """The model: layer i applies ``layers[shares[i]]`` to the join of its inputs; the output is
  the sum of the layers nobody reads (every sink)."""
  values: list = [x]
  read = {j for ins in case.inputs for j in ins}
  outs = []
  for i in range(case.num_layers):
    h = jnp.tanh(layers[case.shares[i]](_join(case, i, values[1:] if i else values)))
    values.append(h)
    if i not in read:
      outs.append(h)
  return sum(outs[1:], outs[0])


class LinenDag(nn.Module):
  case: Case

  @nn.compact
  def __call__(self, x):
    c = self.case
    layers = {i: nn.Dense(WIDTH, name=f"l{i}") for i in range(c.num_layers) if c.shares[i] == i}
    return _forward(c, layers, x)


class NnxDag(nnx.Module):
  def __init__(self, case: Case, rngs: nnx.Rngs):
    self.case = case
    for i in range(case.num_layers):
      if case.shares[i] == i:
        din = case.width_in(i) if i else case.width_in(0)
        setattr(self, f"l{i}", nnx.Linear(din, WIDTH, rngs=rngs))

  def __call__(self, x):
    c = self.case
    layers = {i: getattr(self, f"l{i}") for i in range(c.num_layers) if c.shares[i] == i}
    return _forward(c, layers, x)


def _tx(case: Case):
  adam = optax.adam(1e-2)
  return optax.chain(optax.clip_by_global_norm(0.5), adam) if case.clip else adam


def _batch(case: Case):
  rng = np.random.default_rng(case.seed)
  din = case.width_in(0)
  return {
    "x": rng.normal(size=(BATCH, din)).astype(np.float32),
    "y": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
  }


def _linen_step(state, batch):
  def loss_fn(params):
    return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def _nnx_step(model, optimizer, batch):
  def loss_fn(model):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _manual(case: Case):
  bounds = (0, *case.cuts, case.num_layers)
  prefix = "LinenDag/" if case.flax == "linen" else ""
  rules = {}
  for s in range(len(bounds) - 1):
    for i in range(bounds[s], bounds[s + 1]):
      if case.shares[i] == i:
        rules[f"{prefix}l{i}"] = s
  used = sorted(set(rules.values()))
  renumber = {s: k for k, s in enumerate(used)}  # stages holding only shared layers vanish
  return gpp_jax.manual_plan({p: renumber[s] for p, s in rules.items()})


def check(case: Case) -> None:
  """Trains ``case`` 2 steps pipelined and plainly; asserts equal losses and parameters."""
  note(repr(case))
  batch = _batch(case)
  planner = _manual(case) if case.planner == "manual" else case.planner
  kw = dict(
    num_microbatches=case.num_microbatches,
    devices=jax.devices()[:DEVICES],
    planner=planner,
    schedule=case.schedule,
  )
  if case.flax == "linen":
    model = LinenDag(case)
    params = model.init(jax.random.key(case.seed), batch["x"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_tx(case))
    pp, ref = gpp_jax.graph_pipeline(_linen_step, **kw), jax.jit(_linen_step)
    # The reference's state where its own steps leave it: one compile for both steps.
    ps, rs = state, jax.device_put(state, jax.devices()[0])
    for _ in range(2):
      ps, pl = pp(ps, batch)
      rs, rl = ref(rs, batch)
    got, want = (ps.params, pl), (rs.params, rl)
  else:
    models = [NnxDag(case, nnx.Rngs(case.seed)) for _ in range(2)]
    opts = [nnx.Optimizer(m, _tx(case), wrt=nnx.Param) for m in models]
    pp = gpp_jax.graph_pipeline(_nnx_step, **kw)
    ref = nnx.jit(_nnx_step)  # type: ignore[assignment]
    for obj in (models[1], opts[1]):  # committed, as its own steps leave it: one compile
      nnx.update(obj, jax.device_put(nnx.state(obj), jax.devices()[0]))
    for _ in range(2):
      pl = pp(models[0], opts[0], batch)
      rl = ref(models[1], opts[1], batch)
    got, want = (nnx.state(models[0], nnx.Param), pl), (nnx.state(models[1], nnx.Param), rl)
  note(f"plan:\n{pp.plan}")
  err = max_diff(got, want)
  assert err <= TOL, f"{case}: pipelined differs from the plain step by {err:.2e}"


def _run(case: Case) -> None:
  event(f"planner {case.planner}, schedule {case.schedule}, {case.flax}")
  try:
    check(case)
  except (PlanError, ScheduleError) as e:  # a planner or schedule refusing the model is no error
    note(f"refused: {e}")
    event("refused")


settings.register_profile(
  "random_dags", deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
COMMON = settings.get_profile("random_dags")


@settings(COMMON, max_examples=6)
@given(cases())
def test_random_dag_models_match_the_plain_step(case):
  _run(case)


@pytest.mark.fuzz
@settings(COMMON, max_examples=200)
@given(cases())
def test_random_dag_models_fuzz(case):
  _run(case)
