"""Property test: random DAG models trained pipelined equal the undecorated step.

A model is drawn as a DAG of small dense layers (fan-out, fan-in joined by sum, concat or
multiply, skip edges, a layer that reuses another's parameters), written as a Flax Linen or an
NNX module; the step (adam, with or without global-norm clipping) runs 2 steps under a planner
or a manual plan of contiguous stages (often concurrent ones), a schedule, a micro-batch count
and a number of stages per device (v: a manual plan deals its stages round robin over
ceil(stages / v) devices, a planner gets ``stages_per_device=v``), and is compared with the
same step run plainly on one device (jax.grad and optax).

Nothing passes without running. An example either trains and matches the plain step, or
gpp_jax refuses it for a reason listed in ``EXPECTED_REFUSALS`` (exception type, a substring
of its message, the planners it may come from); any other exception fails the example, and a
``ProgramError`` (the lowered program's validator) always does. The default run is
``EXAMPLES``: 24 examples cycling through ``PLANNERS``, ``SCHEDULES``, the micro-batch counts
1, 2, 4 and v in 1, 2, 4 (every planner and schedule several times, each schedule for stages
that share devices too), models drawn from fixed seeds, three examples to a model (they share
its reference step). ``test_examples_trained`` then checks
that enough of them trained and compared, and ran pipelines of several stages: it counts only
what its own process ran, running itself any example that process has not (deselected, or run
by another pytest-xdist worker, should the examples' ``xdist_group`` not keep them together;
the persistent compilation cache makes a rerun cheap).
``pytest -m fuzz`` draws 200 more examples with hypothesis, which prints a failing example's
``Case``; ``check(case)`` reruns one.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import max_diff
from hypothesis import HealthCheck, currently_in_test_context, event, given, note, settings
from hypothesis import strategies as st

import gpp_jax
from gpp_jax.errors import PlanError
from gpp_jax.ir.program import ProgramError

WIDTH, BATCH, DEVICES, TOL = 4, 8, 4, 2e-5
PLANNERS = ("balanced", "graphpipe", "pipedream", "piper", "bapipe", "luo", "manual")
SCHEDULES = (
  None,
  "1f1b",
  "gpipe",
  "graph-1f1b",
  "zero-bubble",
  "interleaved-1f1b",
  "looped-bfs",
  "zb-v",
)
MICROBATCHES = (1, 2, 4)
PER_DEVICE = (1, 2, 4)  # stages per device
NUM_EXAMPLES = 24
JOINS = ("sum", "concat", "multiply")

# What gpp_jax may legitimately refuse: (exception type, a substring of its message, the
# planners whose examples may raise it, why). Anything else fails the example.
EXPECTED_REFUSALS: tuple[tuple[type[Exception], str, tuple[str, ...], str], ...] = (
  (
    PlanError,
    "is not convex: a path leaves it and re-enters it",
    ("manual",),
    "the manual plan cuts the layers in the model's order, but gpp_jax's layering puts "
    "parameter-free joins (the sum of the sinks) into one of the layers they read, which can "
    "then read a later stage: such contiguous stages are not convex",
  ),
  (
    PlanError,
    "no plan with stages_per_device=",
    ("balanced", "graphpipe", "pipedream", "piper", "bapipe", "luo"),
    "a planner whose stages cannot be cut and dealt v to a device (too few layers or devices)",
  ),
  (
    PlanError,
    "downsets (successor-closed layer sets)",
    ("piper",),
    "Piper's dynamic programme refuses graphs with too many parallel branches",
  ),
  (
    PlanError,
    "downset pairs (",
    ("piper",),
    "Piper's dynamic programme refuses graphs with too many parallel branches",
  ),
)


@dataclasses.dataclass(frozen=True)
class Case:
  """One example: the model's DAG and how it is run."""

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
  stages_per_device: int = 1

  @property
  def num_layers(self) -> int:
    return len(self.inputs)

  @property
  def model(self) -> tuple:
    """What the plain step's result depends on."""
    return (self.inputs, self.joins, self.shares, self.flax, self.clip, self.seed)

  def width_in(self, i: int) -> int:
    k = max(1, len(self.inputs[i]))
    return WIDTH * k if self.joins[i] == "concat" else WIDTH


def _dag(ints: Callable[[int, int], int]):
  """(inputs, joins, shares) of a random DAG; ``ints(lo, hi)`` draws an int in [lo, hi]."""
  n = ints(3, 12)
  inputs: list[tuple[int, ...]] = []
  joins: list[str] = []
  for i in range(n):
    ins: set[int] = set()
    if i:
      # The previous layer usually, or fan-out from an earlier one; skip edges from further back.
      ins.add(i - 1 if i < 2 or ints(0, 1) else ints(0, i - 2))
      for _ in range(ints(0, min(2, i - 1))):
        ins.add(ints(0, i - 1))
    inputs.append(tuple(sorted(ins)))
    joins.append(JOINS[ints(0, len(JOINS) - 1)])
  shares: list[int] = []
  for i in range(n):  # a layer may reuse an earlier layer's parameters (inputs of one width)
    same = [j for j in range(i) if shares[j] == j and "concat" not in (joins[j], joins[i])]
    shares.append(same[ints(0, len(same) - 1)] if same and ints(0, 5) == 0 else i)
  return tuple(inputs), tuple(joins), tuple(shares)


def _cuts(ints: Callable[[int, int], int], n: int) -> tuple[int, ...]:
  """The first layer of each stage after stage 0 of a manual plan of 1 to 4 stages."""
  cuts: set[int] = set()
  for _ in range(ints(1, min(DEVICES, n)) - 1):
    cuts.add(ints(1, n - 1))
  return tuple(sorted(cuts))


@st.composite
def cases(draw) -> Case:
  def ints(lo: int, hi: int) -> int:
    return draw(st.integers(lo, hi))

  inputs, joins, shares = _dag(ints)
  return Case(
    inputs,
    joins,
    shares,
    draw(st.sampled_from(("linen", "nnx"))),
    draw(st.booleans()),
    draw(st.sampled_from(PLANNERS)),
    _cuts(ints, len(inputs)),
    draw(st.sampled_from(SCHEDULES)),
    draw(st.sampled_from(MICROBATCHES)),
    draw(st.integers(0, 2**16)),
    draw(st.sampled_from(PER_DEVICE)),
  )


def _example(k: int) -> Case:
  """Example k of the default run: planner k mod 7, schedule k mod 8, micro-batch count k mod
  3, stages per device (k // 2) mod 3 (so each schedule meets several of each); the model,
  its Flax API and its optimiser are drawn from the seed k // 3 (three examples to a model)."""
  p, s = k % len(PLANNERS), k % len(SCHEDULES)
  model = k // 3
  rng = np.random.default_rng(model)

  def ints(lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))

  inputs, joins, shares = _dag(ints)
  flax, clip = ("linen", "nnx")[model % 2], bool(model // 2 % 2)
  rng = np.random.default_rng(1000 + k)  # the cuts, apart for each example of the model
  cuts = _cuts(ints, len(inputs))
  return Case(
    inputs,
    joins,
    shares,
    flax,
    clip,
    PLANNERS[p],
    cuts,
    SCHEDULES[s],
    MICROBATCHES[k % len(MICROBATCHES)],
    model,
    PER_DEVICE[k // 2 % len(PER_DEVICE)],
  )


EXAMPLES = tuple(_example(k) for k in range(NUM_EXAMPLES))
KNOWN_BUGS: dict[int, str] = {}  # example index -> the library bug it shows (strict xfail)


def _note(text: str) -> None:
  if currently_in_test_context():  # a hypothesis example: printed with the failing Case
    note(text)


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
        setattr(self, f"l{i}", nnx.Linear(case.width_in(i), WIDTH, rngs=rngs))

  def __call__(self, x):
    c = self.case
    layers = {i: getattr(self, f"l{i}") for i in range(c.num_layers) if c.shares[i] == i}
    return _forward(c, layers, x)


def _tx(case: Case):
  adam = optax.adam(1e-2)
  return optax.chain(optax.clip_by_global_norm(0.5), adam) if case.clip else adam


def _batch(case: Case):
  rng = np.random.default_rng(case.seed)
  return {
    "x": rng.normal(size=(BATCH, case.width_in(0))).astype(np.float32),
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


def _linen_state(case: Case, batch):
  model = LinenDag(case)
  params = model.init(jax.random.key(case.seed), batch["x"])
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_tx(case))


def _nnx_objects(case: Case):
  model = NnxDag(case, nnx.Rngs(case.seed))
  return model, nnx.Optimizer(model, _tx(case), wrt=nnx.Param)


_REFERENCES: dict[tuple, tuple] = {}  # Case.model -> the plain step's (params, loss) after 2 steps


def _reference(case: Case, batch):
  """The plain step, 2 steps jitted on one device (gpp_jax.value_and_grad outside a pipeline
  is jax.value_and_grad or nnx.value_and_grad; optax), as host arrays; one per model, shared
  by its examples."""
  if case.model not in _REFERENCES:
    dev = jax.devices()[0]
    if case.flax == "linen":
      ref, rs = jax.jit(_linen_step), jax.device_put(_linen_state(case, batch), dev)
      for _ in range(2):  # committed, as its own steps leave it: one compile for both steps
        rs, rl = ref(rs, batch)
      got = (rs.params, rl)
    else:
      model, opt = _nnx_objects(case)
      for obj in (model, opt):  # committed, as its own steps leave it: one compile
        nnx.update(obj, jax.device_put(nnx.state(obj), dev))
      nref = nnx.jit(_nnx_step)
      for _ in range(2):
        rl = nref(model, opt, batch)
      got = (nnx.state(model, nnx.Param), rl)
    _REFERENCES[case.model] = jax.device_get(got)
  return _REFERENCES[case.model]


def check(case: Case) -> tuple[int, int]:
  """Trains ``case`` 2 steps pipelined and compares it with the plain step: asserts equal
  losses and parameters. Returns the number of stages the pipeline ran and the most of them
  on one device."""
  _note(repr(case))
  batch = _batch(case)
  planner = _manual(case) if case.planner == "manual" else case.planner
  kw = dict(
    num_microbatches=case.num_microbatches,
    devices=jax.devices()[:DEVICES],
    planner=planner,
    schedule=case.schedule,
  )
  if case.planner != "manual" and case.stages_per_device > 1:
    kw["planner_options"] = {"stages_per_device": case.stages_per_device}
  if case.flax == "linen":
    pp, ps = gpp_jax.graph_pipeline(_linen_step, **kw), _linen_state(case, batch)
    for _ in range(2):
      ps, pl = pp(ps, batch)
    got = (ps.params, pl)
  else:
    model, opt = _nnx_objects(case)
    pp = gpp_jax.graph_pipeline(_nnx_step, **kw)
    for _ in range(2):
      pl = pp(model, opt, batch)
    got = (nnx.state(model, nnx.Param), pl)
  _note(f"plan:\n{pp.plan}")
  err = max_diff(got, _reference(case, batch))
  assert err <= TOL, f"{case}: pipelined differs from the plain step by {err:.2e}\n{pp.plan}"
  return pp.plan.num_stages, pp.plan.stages_per_device


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
  places = -(-len(used) // case.stages_per_device)  # v stages to a device, round robin
  return gpp_jax.manual_plan(
    {p: renumber[s] for p, s in rules.items()},
    devices={k: [k % places] for k in range(len(used))},
  )


def expected_refusal(case: Case, e: BaseException) -> str | None:
  """Why ``e`` is a refusal of ``case`` that ``EXPECTED_REFUSALS`` lists; None if it is not."""
  if isinstance(e, ProgramError):  # a lowered program that is wrong is never a refusal
    return None
  for kind, text, planners, why in EXPECTED_REFUSALS:
    if isinstance(e, kind) and text in str(e) and case.planner in planners:
      return why
  return None


@dataclasses.dataclass(frozen=True)
class Outcome:
  stages: int  # stages of the pipeline that trained; 0 if refused
  refusal: str = ""  # the refusal and why it is expected
  per_device: int = 0  # the most stages on one device


def outcome(case: Case) -> Outcome:
  """Runs ``case``: trained and compared, or refused for a listed reason; raises otherwise."""
  try:
    stages, per_device = check(case)
  except Exception as e:
    why = expected_refusal(case, e)
    if why is None:
      raise
    _note(f"refused: {e}")
    return Outcome(0, f"{type(e).__name__}: {e} ({why})")
  return Outcome(stages, per_device=per_device)


_OUTCOMES: dict[Case, Outcome | BaseException] = {}  # the examples this process has run


def _example_outcome(case: Case) -> Outcome:
  """``outcome(case)``, once per process (a failure is raised again, not rerun)."""
  if case not in _OUTCOMES:
    try:
      _OUTCOMES[case] = outcome(case)
    except Exception as e:
      _OUTCOMES[case] = e
  got = _OUTCOMES[case]
  if isinstance(got, BaseException):
    raise got
  return got


def _param(k: int):
  c = EXAMPLES[k]
  marks = [pytest.mark.xdist_group("random_dags")]
  if k in KNOWN_BUGS:
    marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[k]))
  name = (
    f"{k:02d}-{c.planner}-{c.schedule or 'default'}-M{c.num_microbatches}"
    f"-v{c.stages_per_device}-{c.flax}"
  )
  return pytest.param(k, marks=marks, id=name)


@pytest.mark.parametrize("k", [_param(k) for k in range(len(EXAMPLES))])
def test_random_dag_models_match_the_plain_step(k):
  got = _example_outcome(EXAMPLES[k])
  if got.refusal:
    print(f"refused as expected: {got.refusal}")


@pytest.mark.xdist_group("random_dags")
def test_examples_trained():
  """Most examples trained and compared, pipelines of several stages among them, and every
  planner, schedule and micro-batch count among those that trained."""
  runs = {k: _example_outcome(c) for k, c in enumerate(EXAMPLES) if k not in KNOWN_BUGS}
  trained = [EXAMPLES[k] for k, o in runs.items() if not o.refusal]
  piped = [k for k, o in runs.items() if o.stages >= 2]
  refused = {k: o.refusal for k, o in runs.items() if o.refusal}
  print(f"{len(trained)} of {len(runs)} trained, {len(piped)} in 2+ stages; refused: {refused}")
  assert len(EXAMPLES) >= 24
  assert len(trained) >= 21, f"only {len(trained)} examples trained; refused: {refused}"
  assert len(piped) >= 16, f"only {len(piped)} examples ran a pipeline of 2+ stages: {piped}"
  assert {c.planner for c in trained} == set(PLANNERS)
  assert {c.schedule for c in trained} == set(SCHEDULES)
  assert {c.num_microbatches for c in trained} == set(MICROBATCHES)
  shared = {EXAMPLES[k].schedule for k, o in runs.items() if o.per_device > 1}
  # Stages sharing devices trained under each schedule made for them, and under others.
  assert {"interleaved-1f1b", "looped-bfs", "zb-v"} <= shared, shared
  assert len(shared) >= 5, shared


def test_a_refusal_must_be_listed():
  """A listed refusal, raised by gpp_jax: layers 1, 2, 4 are the sinks, and the layering puts
  their sum into layer 2 (stage 1), which then reads layer 4 (stage 2). The list matches the
  type, the message and the planner; a ProgramError never matches."""
  case = Case(
    inputs=((), (0,), (0,), (0,), (3,)),
    joins=("sum",) * 5,
    shares=(0, 1, 2, 3, 4),
    flax="linen",
    clip=False,
    planner="manual",
    cuts=(2, 4),
    schedule=None,
    num_microbatches=2,
    seed=0,
  )
  assert "is not convex" in outcome(case).refusal
  convex = PlanError("stage 0 is not convex: a path leaves it and re-enters it (stage cycle")
  assert expected_refusal(case, convex)
  assert expected_refusal(dataclasses.replace(case, planner="piper"), convex) is None
  assert expected_refusal(case, PlanError("stage 1 computes nothing")) is None
  assert expected_refusal(case, ProgramError(str(convex))) is None


settings.register_profile(
  "random_dags", deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
COMMON = settings.get_profile("random_dags")


@pytest.mark.fuzz
def test_random_dag_models_fuzz():
  """200 drawn examples; most of them must train (not be refused)."""
  seen: collections.Counter[str] = collections.Counter()

  @settings(COMMON, max_examples=200)
  @given(cases())
  def one(case):
    event(
      f"planner {case.planner}, schedule {case.schedule}, v {case.stages_per_device}, {case.flax}"
    )
    got = outcome(case)
    seen["refused" if got.refusal else "trained"] += 1
    event("refused" if got.refusal else f"{got.stages} stage(s)")

  one()
  print(dict(seen))
  assert seen["trained"] >= 0.8 * sum(seen.values()), seen
