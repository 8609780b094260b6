"""Checkpoints: saved under one plan, resumed under another plan, device count or none; bad
checkpoints refused with the state left as it was; the train program resumes by itself."""

import json
import os
import shutil
import subprocess
import sys

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
from gpp_jax import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batches(n=16):
  rng = np.random.default_rng(0)
  return [
    {
      "x": rng.normal(size=(n, 5)).astype(np.float32),
      "y": rng.normal(size=(n, 3)).astype(np.float32),
    }
    for _ in range(6)
  ]


BATCHES = _batches()


def _equal(a, b) -> bool:
  """Bit-identical pytrees (same structure, same values)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    np.array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))
    for x, y in zip(la, lb)
  )


# ---------------------------------------------------------------------------- Linen TrainState
class Net(nn.Module):
  width: int = 16

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(self.width, name="fc1")(x))
    h = nn.tanh(nn.Dense(self.width, name="fc2")(h))
    return nn.Dense(3, name="head")(h)


def _linen_state(width=16, seed=0, dtype=jnp.float32):
  model = Net(width)
  params = model.init(jax.random.key(seed), jnp.ones((1, 5), dtype))
  params = jax.tree.map(lambda p: p.astype(dtype), params)
  return train_state.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
  )


def linen_step(state, batch):
  def loss_fn(params):
    return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def plain_linen_step(state, batch):
  """The reference: jax.grad and optax on one device, the whole batch at once."""
  grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(
    state.params
  )
  return state.apply_gradients(grads=grads)


@pytest.fixture(scope="module")
def linen_pipelines():
  """Plan A: three stages on devices 0-3, the first over two devices (its state replicated on
  both). Plan B: two stages on devices 4-5."""
  a = gpp_jax.graph_pipeline(
    linen_step,
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(
      {"Net/fc1": 0, "Net/fc2": 1, "Net/head": 2}, devices={0: [0, 1], 1: [2], 2: [3]}
    ),
  )
  b = gpp_jax.graph_pipeline(
    linen_step,
    num_microbatches=4,
    devices=jax.devices()[4:6],
    planner=gpp_jax.manual_plan({"Net/fc1": 0, "Net/fc2": 0, "Net/head": 1}),
  )
  return a, b


def _run(step, state, batches):
  with jax.transfer_guard("disallow"):
    for batch in batches:
      state, loss = step(state, batch)
  return state, loss


def test_linen_saved_under_one_plan_resumes_under_another(tmp_path, linen_pipelines):
  plan_a, plan_b = linen_pipelines
  state, _ = _run(plan_a, _linen_state(), BATCHES[:3])
  assert {d for leaf in jax.tree.leaves(state) for d in leaf.devices()} == set(jax.devices()[:4])
  assert state.params["params"]["fc1"]["kernel"].devices() == set(jax.devices()[:2])
  checkpoint.save(str(tmp_path), state, step=3)
  uninterrupted, loss_u = _run(plan_b, state, BATCHES[3:])

  # Resume into a freshly initialised state (other values, on the default device).
  fresh = _linen_state(seed=1)
  fresh_values = jax.tree.map(np.asarray, fresh)
  restored = checkpoint.restore(str(tmp_path), fresh)
  assert _equal(restored, state) and int(restored.step) == 3
  assert _equal(fresh, fresh_values)  # the state passed in is not changed
  resumed, loss_r = _run(plan_b, restored, BATCHES[3:])
  # Restored into a pipelined run's state, each leaf lands where that state holds it (here
  # fc1's on both devices of plan A's first stage).
  again = checkpoint.restore(str(tmp_path), state)
  assert _equal(again, state)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
    assert a.sharding == b.sharding
  # Saved and restored values are bit-identical, so the resumed run is the uninterrupted one.
  assert _equal(resumed, uninterrupted) and float(loss_r) == float(loss_u)

  # Against plain jax.grad + optax on one device, six steps.
  ref = _linen_state()
  plain = jax.jit(plain_linen_step)
  for batch in BATCHES:
    ref = plain(ref, batch)
  assert max_diff(ref.params, resumed.params) <= 1e-6
  assert max_diff(ref.opt_state, resumed.opt_state) <= 1e-6


# ---------------------------------------------------------------------------- NNX
class NNXNet(nnx.Module):
  def __init__(self, rngs, width=16):
    self.enc = nnx.Linear(5, width, rngs=rngs)
    self.mid = nnx.Linear(width, width, rngs=rngs)
    self.head = nnx.Linear(width, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.mid(jnp.tanh(self.enc(x)))))


def _nnx_state(seed=0, width=16):
  model = NNXNet(nnx.Rngs(seed), width)
  return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def nnx_step(model, optimizer, batch):
  def loss_fn(model):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _snapshot(model, optimizer):
  return jax.tree.map(
    np.asarray, (nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(optimizer)))
  )


def _commit(device, *objs):
  """Commits NNX objects' state to ``device``, where a jitted step leaves it: the step's second
  call then has the placement of its first and is not compiled again."""
  for obj in objs:
    nnx.update(obj, jax.device_put(nnx.state(obj), device))


def test_nnx_plain_one_device_checkpoint_restores_into_a_pipeline(tmp_path):
  model, optimizer = _nnx_state()
  plain = nnx.jit(nnx_step)
  dev0 = jax.devices()[0]
  _commit(dev0, model, optimizer)
  for batch in BATCHES[:3]:
    plain(model, optimizer, jax.device_put(batch, dev0))
  checkpoint.save(str(tmp_path), {"model": model, "optimizer": optimizer}, step=3)
  at_3 = _snapshot(model, optimizer)
  for batch in BATCHES[3:]:
    loss_plain = plain(model, optimizer, jax.device_put(batch, dev0))

  pp = gpp_jax.graph_pipeline(
    nnx_step,
    num_microbatches=4,
    devices=jax.devices()[:3],
    planner=gpp_jax.manual_plan({"enc": 0, "mid": 1, "head": 2}),
  )
  m2, o2 = _nnx_state(seed=1)
  out = checkpoint.restore(str(tmp_path), {"model": m2, "optimizer": o2})
  assert out["model"] is m2 and out["optimizer"] is o2  # updated in place
  assert _equal(_snapshot(m2, o2), at_3) and int(o2.step[...]) == 3
  with jax.transfer_guard("disallow"):
    for batch in BATCHES[3:]:
      loss_pp = pp(m2, o2, batch)
  assert m2.head.kernel[...].devices() == {jax.devices()[2]}
  assert int(o2.step[...]) == 6
  # Six steps: three on one device, three pipelined, against six on one device.
  assert abs(float(loss_pp) - float(loss_plain)) <= 1e-6
  assert max_diff(nnx.state(model), nnx.state(m2)) <= 1e-6
  assert max_diff(nnx.state(optimizer), nnx.state(o2)) <= 1e-6


# ---------------------------------------------------------------------------- bad input
def test_checkpoint_of_another_model_is_refused_naming_the_leaves(tmp_path):
  checkpoint.save(str(tmp_path), _linen_state(width=16), step=0)
  other = _linen_state(width=8, seed=1)
  before = jax.tree.map(np.asarray, other)
  with pytest.raises(gpp_jax.CheckpointError) as e:
    checkpoint.restore(str(tmp_path), other)
  msg = str(e.value)
  assert "different shape or dtype" in msg
  assert "params/params/fc1/kernel: checkpoint float32[5,16], state float32[5,8]" in msg
  assert "Restore into a state built like the saved one" in msg
  assert _equal(other, before)  # untouched, and its arrays still usable
  bf16 = _linen_state(dtype=jnp.bfloat16)
  with pytest.raises(
    gpp_jax.CheckpointError, match=r"checkpoint float32\[16\], state bfloat16\[16\]"
  ):
    checkpoint.restore(str(tmp_path), bf16)

  # NNX: another structure (an optimizer without clipping state is fine; a model with
  # other layers is not), and the objects passed in keep their values.
  checkpoint.save(str(tmp_path / "nnx"), {"model": _nnx_state()[0]}, step=0)
  model, optimizer = _nnx_state(seed=2, width=8)
  before = _snapshot(model, optimizer)
  with pytest.raises(gpp_jax.CheckpointError) as e:
    checkpoint.restore(str(tmp_path / "nnx"), {"model": model, "optimizer": optimizer})
  msg = str(e.value)
  assert "not in the checkpoint: optimizer/opt_state/0/count" in msg
  assert "model/enc/kernel: checkpoint float32[5,16], state float32[5,8]" in msg
  assert _equal(_snapshot(model, optimizer), before)


def test_missing_checkpoint_and_bad_save_arguments(tmp_path):
  with pytest.raises(gpp_jax.CheckpointError, match="holds no checkpoint"):
    checkpoint.restore(str(tmp_path), {"w": jnp.zeros(2)})
  assert checkpoint.latest_step(str(tmp_path / "nothing")) is None
  checkpoint.save(str(tmp_path), {"w": jnp.zeros(2)}, step=1)
  with pytest.raises(gpp_jax.CheckpointError, match="has no checkpoint of step 2; it has steps"):
    checkpoint.restore(str(tmp_path), {"w": jnp.zeros(2)}, step=2)
  with pytest.raises(gpp_jax.CheckpointError, match="already holds a checkpoint of step 1"):
    checkpoint.save(str(tmp_path), {"w": jnp.ones(2)}, step=1)
  with pytest.raises(gpp_jax.CheckpointError, match="leaf 'name' of the state is a str"):
    checkpoint.save(str(tmp_path), {"w": jnp.ones(2), "name": "x"}, step=2)
  with pytest.raises(gpp_jax.CheckpointError, match="leaf names clash"):
    checkpoint.save(str(tmp_path), {"a": jnp.ones(2), "a/b": jnp.ones(2)}, step=2)
  with pytest.raises(gpp_jax.CheckpointError, match="extra must hold JSON values"):
    checkpoint.save(str(tmp_path), {"w": jnp.ones(2)}, step=2, extra={"f": object()})
  assert checkpoint.all_steps(str(tmp_path)) == [1]
  # Another program's orbax checkpoint.
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(str(tmp_path / "other"), options=options) as m:
    m.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": jnp.ones(2)})))
  with pytest.raises(gpp_jax.CheckpointError, match="is not a gpp_jax checkpoint"):
    checkpoint.restore(str(tmp_path / "other"), {"w": jnp.zeros(2)})


def test_a_failed_save_leaves_the_earlier_checkpoints(tmp_path):
  good = {"w": jnp.arange(4.0), "b": jnp.ones(3)}
  checkpoint.save(str(tmp_path), good, step=1)
  broken = {"w": jnp.arange(4.0) + 1, "b": jnp.ones(3)}
  broken["b"].delete()  # fails while orbax writes the step
  with pytest.raises(Exception):  # noqa: B017 (orbax's own error)
    checkpoint.save(str(tmp_path), broken, step=2)
  assert checkpoint.latest_step(str(tmp_path)) == 1
  assert _equal(checkpoint.restore(str(tmp_path), {"w": jnp.zeros(4), "b": jnp.zeros(3)}), good)
  assert not broken["w"].is_deleted()
  checkpoint.save(str(tmp_path), {"w": broken["w"], "b": jnp.zeros(3)}, step=2)
  assert checkpoint.all_steps(str(tmp_path)) == [1, 2]


def test_keys_numbers_and_numpy_round_trip_where_the_target_lives(tmp_path):
  dev = jax.devices()[5]
  state = {
    "key": jax.random.key(7),
    "legacy_key": jax.random.PRNGKey(3),
    "count": 5,
    "host": np.arange(3, dtype=np.int64),
    "w": jax.device_put(jnp.ones((2, 2), jnp.bfloat16), jax.devices()[1]),
  }
  checkpoint.save(str(tmp_path), state, step=0, extra={"data_position": 12})
  target = {
    "key": jax.random.key(0),
    "legacy_key": jax.random.PRNGKey(0),
    "count": 0,
    "host": np.zeros(3, np.int64),
    "w": jax.device_put(jnp.zeros((2, 2), jnp.bfloat16), dev),
  }
  out = checkpoint.restore(str(tmp_path), target)
  assert jax.random.key_impl(out["key"]) == jax.random.key_impl(state["key"])
  assert np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(state["key"]))
  assert np.array_equal(out["legacy_key"], state["legacy_key"])
  assert int(out["count"]) == 5 and out["count"].dtype == jnp.int32
  assert isinstance(out["host"], np.ndarray) and out["host"].tolist() == [0, 1, 2]
  assert out["w"].devices() == {dev} and out["w"].dtype == jnp.bfloat16
  assert checkpoint.extra(str(tmp_path)) == {"data_position": 12}
  # Abstract targets (jax.eval_shape) need no initialised state.
  abstract = jax.eval_shape(lambda: {k: v for k, v in target.items() if k != "host"})
  out = checkpoint.restore(str(tmp_path), {**abstract, "host": target["host"]})
  assert out["w"].devices() == {jax.devices()[0]}
  assert float(out["w"][0, 0]) == 1.0


# ---------------------------------------------------------------------------- the train program
def _train(tmp_path, name, *flags):
  env = child_env()
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.train",
      "--model=dlrm",
      "--preset=tiny",
      "--planner=balanced",
      "--nocalibrate",
      "--batch_size=8",
      "--num_microbatches=2",
      "--log_every=1",
      f"--run_dir={tmp_path / name}",
      *flags,
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=env,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / name / "metrics.jsonl") as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}, proc.stderr


@pytest.mark.slow  # three runs of the program: about 40 s of CPU
def test_train_program_resumes_from_its_checkpoint(tmp_path):
  # An uninterrupted run of four steps that saves every two.
  saved = str(tmp_path / "saved")
  whole, _ = _train(
    tmp_path,
    "whole",
    "--steps=4",
    "--num_devices=4",
    f"--checkpoint_dir={saved}",
    "--checkpoint_every=2",
  )
  assert checkpoint.all_steps(saved) == [2, 4]
  assert checkpoint.extra(saved, 2)["data_position"] == 2
  # A folder holding step 2 only, as if the run had stopped after it.
  ckpt = tmp_path / "ckpt"
  shutil.copytree(os.path.join(saved, "2"), ckpt / "2")
  # It continues from step 2 on another device count (so under another plan).
  resumed, err = _train(
    tmp_path,
    "resumed",
    "--steps=4",
    "--num_devices=2",
    f"--checkpoint_dir={ckpt}",
    "--checkpoint_every=2",
  )
  assert "resumed from" in err and "at step 2" in err
  assert sorted(resumed) == [4]  # step 3 compiled, step 4 logged
  assert checkpoint.all_steps(str(ckpt)) == [2, 4]
  assert abs(resumed[4] - whole[4]) <= 1e-6, (resumed, whole)
  # Resuming with flags that change the model or the data is refused, naming them.
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.train",
      "--model=dlrm",
      "--seed=1",
      "--steps=6",
      f"--checkpoint_dir={ckpt}",
      f"--run_dir={tmp_path / 'bad'}",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
  )
  assert proc.returncode != 0
  assert "--seed=0 (now 1)" in proc.stderr and "resume with the same flags" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_readme_checkpoint_snippet(tmp_path, monkeypatch):
  import re

  with open(os.path.join(REPO, "README.md")) as f:
    (snippet,) = [
      s
      for s in re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
      if "checkpoint.save(" in s
    ]
  monkeypatch.chdir(tmp_path)
  linen, (model, optimizer) = _linen_state(), _nnx_state()
  ns = {"state": linen, "model": model, "optimizer": optimizer}
  exec(snippet, ns)
  assert _equal(ns["state"], linen) and ns["state"] is not linen
  assert ns["nnx_state"]["model"] is model
  assert checkpoint.all_steps("ckpt") == checkpoint.all_steps("nnx_ckpt") == [100]
  assert checkpoint.extra("nnx_ckpt") == {"data_position": 100}


def test_several_processes_are_refused_with_a_message(tmp_path, monkeypatch):
  checkpoint.save(str(tmp_path), {"w": jnp.zeros(2)}, step=1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(gpp_jax.CheckpointError, match="multi-process run it is not supported yet"):
    checkpoint.save(str(tmp_path), {"w": jnp.ones(2)}, step=2)
  with pytest.raises(gpp_jax.CheckpointError, match="multi-process run it is not supported yet"):
    checkpoint.restore(str(tmp_path), {"w": jnp.ones(2)})
  monkeypatch.undo()
  assert checkpoint.all_steps(str(tmp_path)) == [1]


class WithRngs(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(2, 2, rngs=rngs)
    self.rngs = rngs


def test_nnx_rngs_counters_and_keys_are_restored_in_place(tmp_path):
  model = WithRngs(nnx.Rngs(params=0, dropout=1))
  for _ in range(3):
    model.rngs.dropout()  # advances the dropout stream's counter
  checkpoint.save(str(tmp_path), model, step=3)
  fresh = WithRngs(nnx.Rngs(params=5, dropout=6))
  assert checkpoint.restore(str(tmp_path), fresh) is fresh
  assert int(fresh.rngs.dropout.count[...]) == 3
  # The next draw is the one the saved model makes.
  assert np.array_equal(
    jax.random.key_data(fresh.rngs.dropout()), jax.random.key_data(model.rngs.dropout())
  )
  assert np.array_equal(fresh.fc.kernel[...], model.fc.kernel[...])


def test_restores_in_a_process_with_one_device(tmp_path):
  # Saved here (8 devices): one leaf on device 5, one replicated and one sharded over 4-7.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.array(jax.devices()[4:8]), ("data",))
  state = {
    "a": jax.device_put(jnp.arange(8.0), jax.devices()[5]),
    "b": jax.device_put(jnp.arange(8.0) * 2, NamedSharding(mesh, PartitionSpec())),
    "c": jax.device_put(jnp.arange(8.0) * 3, NamedSharding(mesh, PartitionSpec("data"))),
  }
  checkpoint.save(str(tmp_path), state, step=1)
  script = (
    "import json, jax, jax.numpy as jnp\n"
    "from gpp_jax import checkpoint\n"
    f"out = checkpoint.restore({str(tmp_path)!r}, {{k: jnp.zeros(8) for k in 'abc'}})\n"
    "print(json.dumps([jax.device_count(), {k: v.tolist() for k, v in out.items()}]))\n"
  )
  env = child_env()
  proc = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  count, values = json.loads(proc.stdout.strip().splitlines()[-1])
  assert count == 1
  assert values == {k: np.asarray(v).tolist() for k, v in state.items()}
