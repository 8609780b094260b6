"""The README's Python snippets and those of the docs pages it links to, run as written, and
the one-device warning they point to.

Each test reads its snippet from README.md or its docs page, defines the names the snippet
expects (``state``, ``batch``, ``model``, ``step`` ...), executes the snippet text unchanged and
checks the result against the same step run without the pipeline.
"""

import ast
import inspect
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import child_env, max_diff

import gpp_jax

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The pages the README's snippets moved to (each snippet is looked for on its own page).
MEMORY = REPO / "docs" / "memory.md"
SHARDING = REPO / "docs" / "sharding.md"
STATE = REPO / "docs" / "state.md"
PROCESSES = REPO / "docs" / "processes.md"
SCHEDULES = REPO / "docs" / "schedules.md"
PAGES = (MEMORY, SHARDING, STATE, PROCESSES, SCHEDULES)
TOL = 1e-5


def _snippets(page: pathlib.Path = README) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def _snippet(marker: str, page: pathlib.Path = README) -> str:
  found = [s for s in _snippets(page) if marker in s]
  assert len(found) == 1, f"expected one {page.name} python snippet containing {marker!r}"
  return found[0]


def _run(src: str, namespace: dict, page: pathlib.Path = README) -> dict:
  exec(compile(src, str(page), "exec"), namespace)
  return namespace


def _imports() -> dict:
  """The names the setup snippet imports (its import lines, executed unchanged)."""
  tree = ast.parse(_snippet("import gpp_jax"))
  lines: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
  assert lines, "the setup snippet imports nothing"
  return _run(ast.unparse(ast.Module(body=lines, type_ignores=[])), {})


def _batch(n=16, din=5, classes=None, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, din)).astype(np.float32)
  if classes is not None:
    return {"x": x, "y": rng.integers(0, classes, size=(n,)).astype(np.int32)}
  return {"x": x, "y": rng.normal(size=(n, 3)).astype(np.float32)}


def test_every_python_snippet_compiles():
  snippets = _snippets()
  assert len(snippets) >= 5
  for src in snippets:
    compile(src, str(README), "exec")
  for page in PAGES:
    snippets = _snippets(page)
    assert snippets, f"{page.name} has no python snippet"
    for src in snippets:
      compile(src, str(page), "exec")


def test_setup_snippet_gives_eight_cpu_devices():
  """Run in a fresh process without forced devices: the snippet alone must give 8."""
  env = child_env(JAX_PLATFORMS="cpu")
  src = _snippet("import gpp_jax") + "\nprint(len(jax.devices()), jax.devices()[0].platform)\n"
  out = subprocess.run(
    [sys.executable, "-c", src], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["8", "cpu"]


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = nn.tanh(nn.Dense(16, name=f"fc{i}")(x))
    return nn.Dense(3, name="head")(x)


def test_linen_snippet(capsys):
  model = MLP()
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), jnp.ones((1, 5))),
    tx=optax.adam(1e-2),
  )
  batch = _batch(classes=3)
  ns = _run(_snippet("a Linen TrainState step"), {**_imports(), "state": state, "batch": batch})

  @jax.jit
  def reference(state, batch):
    def loss_fn(params):
      logits = state.apply_fn(params, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  ref_state, ref_loss = reference(state, batch)
  loss = float(ns["metrics"]["loss"])
  assert np.isfinite(loss) and abs(loss - float(ref_loss)) <= TOL
  assert int(ns["state"].step) == 1
  assert max_diff(ns["state"].params, ref_state.params) <= TOL
  assert max_diff(ns["state"].params, state.params) > 1e-4  # the update really happened
  plan = ns["train_step"].plan
  assert plan.planner == "graphpipe" and plan.num_stages > 1
  assert f"stage {plan.num_stages - 1} on" in capsys.readouterr().out  # explain() printed


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.enc = nnx.Linear(5, 16, rngs=rngs)
    self.mid = nnx.Linear(16, 16, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.mid(jnp.tanh(self.enc(x)))))


class EncoderDecoder(nnx.Module):
  def __init__(self, rngs):
    self.encoder = nnx.Linear(5, 16, rngs=rngs)
    self.decoder = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.decoder(jnp.tanh(self.encoder(x)))


def _nnx_fresh(cls):
  model = cls(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _nnx_step(value_and_grad):
  def step(model, optimizer, batch):
    def loss_fn(model):
      return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return step


_nnx_reference = nnx.jit(_nnx_step(nnx.value_and_grad))


def _check_nnx_step(train_step, cls, steps=2):
  model, optimizer = _nnx_fresh(cls)
  ref_model, ref_opt = _nnx_fresh(cls)
  for i in range(steps):
    batch = _batch(seed=i)
    loss = float(train_step(model, optimizer, batch))
    ref_loss = float(_nnx_reference(ref_model, ref_opt, batch))
    assert np.isfinite(loss) and abs(loss - ref_loss) <= TOL
  assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)) <= TOL
  assert int(optimizer.step[...]) == steps
  return model


def test_nnx_snippet():
  ns = _run(_snippet("def train_step(model, optimizer, batch)"), _imports())
  _check_nnx_step(ns["train_step"], NNXNet)
  assert ns["train_step"].plan.num_stages > 1


def test_nnx_cached_partial_snippet():
  ns = _run(_snippet("def train_step(model, optimizer, batch)"), _imports())
  model, optimizer = _nnx_fresh(NNXNet)
  ref_model, ref_opt = _nnx_fresh(NNXNet)
  batches = [_batch(seed=i) for i in range(3)]
  ns = _run(
    _snippet("cached_partial(model, optimizer)"),
    {**ns, "model": model, "optimizer": optimizer, "batches": batches},
  )
  for batch in batches:
    ref_loss = float(_nnx_reference(ref_model, ref_opt, batch))
  assert abs(float(ns["loss"]) - ref_loss) <= TOL
  assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)) <= TOL
  assert int(optimizer.step[...]) == 3


def test_memory_snippet():
  ns = _run(_snippet("def train_step(model, optimizer, batch)"), _imports())
  model, optimizer = _nnx_fresh(NNXNet)
  ref_model, ref_opt = _nnx_fresh(NNXNet)
  batch = _batch()
  ns = _run(
    _snippet("train_step.measure_memory(", MEMORY),
    {**ns, "model": model, "optimizer": optimizer, "batch": batch},
    MEMORY,
  )
  assert abs(float(ns["loss"]) - float(_nnx_reference(ref_model, ref_opt, batch))) <= TOL
  report = ns["train_step"].memory
  assert report is not None and all(d.measured_peak_bytes > 0 for d in report.devices)


def test_manual_plan_snippet():
  ns = _run(
    _snippet("devices={0: [0, 1]", SHARDING),
    {**_imports(), "step": _nnx_step(gpp_jax.value_and_grad)},
    SHARDING,
  )
  model = _check_nnx_step(ns["train_step"], EncoderDecoder)
  plan = ns["train_step"].plan
  assert [s.devices for s in plan.stages] == [(0, 1), (2, 3, 4, 5)]
  assert model.decoder.kernel[...].devices() == set(jax.devices()[2:6])


class ShardedEncoderDecoder(nnx.Module):
  """EncoderDecoder with Megatron-style specs over "model" (metadata only)."""

  def __init__(self, rngs):
    meta = lambda spec: {"out_sharding": spec, "eager_sharding": False}
    self.encoder = nnx.Linear(5, 16, kernel_metadata=meta((None, "model")), rngs=rngs)
    self.decoder = nnx.Linear(16, 3, kernel_metadata=meta(("model", None)), rngs=rngs)

  def __call__(self, x):
    return self.decoder(jnp.tanh(self.encoder(x)))


def test_mesh_snippet():
  ns = _run(
    _snippet("mesh=mesh", SHARDING),
    {**_imports(), "step": _nnx_step(gpp_jax.value_and_grad)},
    SHARDING,
  )
  model = _check_nnx_step(ns["train_step"], ShardedEncoderDecoder)
  assert [s.devices for s in ns["train_step"].plan.stages] == [(0,), (1, 2)]
  rows = np.asarray(ns["mesh"].devices)
  kernel = model.decoder.kernel[...]
  assert kernel.devices() == set(rows[1:3].flat)
  assert kernel.sharding.shard_shape(kernel.shape) == (8, 3)  # 16 rows split over "model"


def test_stage_inner_shape_snippet():
  """The mesh page's narrowed stage: the decoder's 2 rows run as 4 of "model" size 1, so its
  kernel (split over "model" on the mesh) is whole on each of the stage's devices."""
  ns = _run(
    _snippet("mesh=mesh", SHARDING),
    {**_imports(), "step": _nnx_step(gpp_jax.value_and_grad)},
    SHARDING,
  )
  ns = _run(_snippet("inner={1: (1,)}", SHARDING), ns, SHARDING)
  step = gpp_jax.graph_pipeline(ns["step"], num_microbatches=4, mesh=ns["mesh"], planner=ns["plan"])
  model = _check_nnx_step(step, ShardedEncoderDecoder)
  assert [s.inner for s in step.plan.stages] == [None, (1,)]
  kernel = model.decoder.kernel[...]
  assert kernel.devices() == set(np.asarray(ns["mesh"].devices)[1:3].flat)
  assert kernel.sharding.shard_shape(kernel.shape) == (16, 3)


def test_per_stage_microbatch_snippet():
  ns = _run(
    _snippet("microbatch_sizes=", STATE),
    {**_imports(), "step": _nnx_step(gpp_jax.value_and_grad)},
    STATE,
  )
  _check_nnx_step(ns["train_step"], EncoderDecoder)
  assert ns["train_step"].schedule.stage_counts == (4, 2)


def test_distributed_snippet_names_real_api():
  src = _snippet("gpp_jax.distributed.initialize(", PROCESSES)
  compile(src, str(PROCESSES), "exec")  # needs a cluster to run
  import gpp_jax.distributed

  assert "transfer_address" in inspect.signature(gpp_jax.distributed.initialize).parameters


def test_distributed_after_plain_import():
  """docs/processes.md calls gpp_jax.distributed.initialize(...) after a plain `import gpp_jax`."""
  src = "import gpp_jax\ngpp_jax.distributed.initialize, gpp_jax.distributed.initialize_from_env\n"
  out = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr


def _tiny_step(params, batch):
  return gpp_jax.value_and_grad(lambda p: jnp.mean(batch["x"] @ p))(params)


def test_one_device_warns_once_and_still_runs():
  with pytest.warns(UserWarning, match="runs on one device") as record:
    pp = gpp_jax.graph_pipeline(_tiny_step, num_microbatches=4, devices=jax.devices()[:1])
  assert len(record) == 1 and record[0].filename == __file__
  batch = _batch()
  params = jnp.ones((5, 2))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(2):  # once per pipeline: calling it warns no more
      loss, grads = pp(params, batch)
  ref_loss, ref_grads = jax.value_and_grad(lambda p: jnp.mean(batch["x"] @ p))(params)
  assert abs(float(loss) - float(ref_loss)) <= TOL and max_diff(grads, ref_grads) <= TOL
  assert pp.plan.num_stages == 1


def test_one_device_warning_says_how_to_get_more(monkeypatch):
  monkeypatch.setattr(jax, "device_count", lambda *a, **k: 1)
  with pytest.warns(UserWarning, match="jax_num_cpu_devices"):
    gpp_jax.graph_pipeline(num_microbatches=2, devices=jax.devices()[:1])(_tiny_step)


def test_no_warning_with_several_devices_or_one_microbatch():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    gpp_jax.graph_pipeline(_tiny_step, num_microbatches=4, devices=jax.devices()[:2])
    gpp_jax.graph_pipeline(_tiny_step, num_microbatches=1, devices=jax.devices()[:1])
