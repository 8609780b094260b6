"""One stage on one device runs as one jitted step, with the driver's per-micro-batch semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from harness import dense, max_diff

import gpp_jax

M = 4


def _params():
  ks = jax.random.split(jax.random.key(0), 3)
  return {"a": dense(ks[0], 5, 16), "b": dense(ks[1], 16, 16), "c": dense(ks[2], 16, 3)}


def _batch(seed=0, n=16):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(n, 5)).astype(np.float32),
    "y": rng.normal(size=(n, 3)).astype(np.float32),
  }


tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))


def _loss_and_aux(p, x, y, key):
  h = jnp.tanh(x @ p["a"]["w"] + p["a"]["b"])
  keep = jax.random.bernoulli(key, 0.7, h.shape)  # dropout from the key the step passes in
  h = jnp.where(keep, h / 0.7, 0.0)
  h = jnp.tanh(h @ p["b"]["w"] + p["b"]["b"])
  out = h @ p["c"]["w"] + p["c"]["b"]
  per_example = jnp.mean((out - y) ** 2, axis=1)
  # Aux: a per-example array (concatenated over micro-batches), a float scalar (averaged), an
  # integer (the last micro-batch's).
  count = jnp.sum(out > 0).astype(jnp.int32)
  aux = {"per_example": per_example, "mean_out": jnp.mean(out), "count": count}
  return jnp.mean(per_example), aux


def step(params, opt_state, key, batch):
  (loss, aux), grads = gpp_jax.value_and_grad(
    lambda p: _loss_and_aux(p, batch["x"], batch["y"], key), has_aux=True
  )(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, aux


@jax.jit
def reference(params, opt_state, key, batch):
  """Gradient accumulation over micro-batches with fold_in(key, m), as documented."""
  xs, ys = batch["x"].reshape(M, -1, 5), batch["y"].reshape(M, -1, 3)
  grads = jax.tree.map(jnp.zeros_like, params)
  losses, auxes = [], []
  for m in range(M):
    (l, aux), g = jax.value_and_grad(_loss_and_aux, has_aux=True)(
      params, xs[m], ys[m], jax.random.fold_in(key, m)
    )
    grads = jax.tree.map(lambda a, b: a + b / M, grads, g)
    losses.append(l)
    auxes.append(aux)
  aux = {
    "per_example": jnp.concatenate([a["per_example"] for a in auxes]),
    "mean_out": sum(a["mean_out"] for a in auxes) / M,
    "count": auxes[-1]["count"],
  }
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, sum(losses) / M, aux


@pytest.fixture(scope="module")
def runs():
  """Three steps of the reference, the fused step and the action-by-action driver."""
  dev = jax.devices()[0]
  params = _params()
  kw = dict(num_microbatches=M, devices=[dev], batch_argnums=3)
  with pytest.warns(UserWarning, match="one device"):
    fused = gpp_jax.graph_pipeline(step, **kw)
    driven = gpp_jax.graph_pipeline(step, fuse=False, **kw)
  state = {
    "ref": jax.device_put((params, tx.init(params)), dev),
    "fused": (params, tx.init(params)),
    "driven": (params, tx.init(params)),
  }
  out = {}
  keys = [jax.random.key(10 + i) for i in range(3)]
  with jax.transfer_guard("disallow"):
    for i in range(3):
      key, batch = keys[i], _batch(i)
      for name, fn in (("ref", reference), ("fused", fused), ("driven", driven)):
        if name == "ref":
          key_i, batch_i = jax.device_put((key, batch), dev)
        else:
          key_i, batch_i = key, batch
        p, o, loss, aux = fn(*state[name], key_i, batch_i)
        state[name] = (p, o)
        out[name] = (p, o, loss, aux)
  return out, fused, driven


def test_fused_step_matches_the_accumulation_reference(runs):
  out, fused, _ = runs
  assert fused.plan.num_stages == 1
  assert "one jitted step" in fused.explain()
  assert max_diff(out["ref"][:2], out["fused"][:2]) <= 1e-6
  assert abs(float(out["ref"][2]) - float(out["fused"][2])) <= 1e-6
  assert out["fused"][3]["per_example"].shape == (16,)
  assert max_diff(out["ref"][3], out["fused"][3]) <= 1e-6
  # One computation per step: the whole step (after its arguments are put on its device).
  assert [e.action for e in fused.timeline.events if e.action != "SEND"] == ["STEP"]


def test_fused_and_action_by_action_runs_agree(runs):
  out, _, driven = runs
  assert "one jitted step" not in driven.explain()
  assert {e.action for e in driven.timeline.events} >= {"F", "B"}
  assert max_diff(out["driven"], out["fused"]) <= 1e-6


def test_fused_nnx_step_updates_the_module_in_place():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = nnx.Linear(5, 8, rngs=rngs)
      self.fc2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.fc2(jnp.tanh(self.fc1(x)))

  def nnx_step(model, optimizer, batch):
    def loss_fn(model):
      return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  ref_model = Net(nnx.Rngs(0))
  ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
  model = Net(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  pp = gpp_jax.graph_pipeline(nnx_step, num_microbatches=1, devices=jax.devices()[:1])
  ref = nnx.jit(nnx_step)
  for i in range(3):
    batch = _batch(i)
    rl = ref(ref_model, ref_opt, batch)
    pl = pp(model, opt, batch)
  assert pp.compiled.fused
  assert abs(float(rl) - float(pl)) <= 1e-6
  assert max_diff(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= 1e-6
  assert int(opt.step[...]) == 3


def test_updated_state_comes_back_where_the_next_step_reads_it():
  """Each state leaf a step returns lives on the stage that reads it in the next step, so no
  value moves between steps (across processes such a move would be a send and a receive)."""
  from gpp_jax.experiments import zoo
  from gpp_jax.runtime.capture_step import functionalize

  run = zoo.setup("dlrm", "tiny")
  batch = run.batches(8, 1)[0]
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner="balanced",
    layer_depth=run.spec.layer_depth,
  )
  pp(run.model, run.optimizer, batch)
  c = pp.compiled
  assert c.plan.num_stages == 4
  _, leaves = functionalize(pp.fn, (run.model, run.optimizer, batch))
  moved = [
    (i, x.shape, x.devices(), h)
    for i, (x, h) in enumerate(zip(leaves, c.prog.invar_home))
    if isinstance(x, jax.Array) and h >= 0 and x.devices() != {c.staged.placements[h].devices[0]}
  ]
  assert not moved


def test_stale_weight_schedules_are_not_fused():
  """2BW reads weights one update old even on one stage: it runs action by action."""
  params = _params()
  kw = dict(num_microbatches=M, devices=jax.devices()[:1], batch_argnums=3)
  keys = jax.random.key(1)
  with pytest.warns(UserWarning, match="one device"):
    sync = gpp_jax.graph_pipeline(step, **kw)
    stale = gpp_jax.graph_pipeline(step, schedule="2bw", **kw)
  sync(params, tx.init(params), keys, _batch())
  stale(params, tx.init(params), keys, _batch())
  assert sync.compiled.fused
  assert not stale.compiled.fused


def test_fused_step_runs_a_scan_over_stacked_layers_whole():
  """One stage needs no scan split: the fused step runs the captured loss, scan and all."""
  ks = jax.random.split(jax.random.key(3), 4)
  stacked = {"w": jax.random.normal(ks[0], (4, 5, 5)) / np.sqrt(5.0), "b": jnp.zeros((4, 5))}
  params = {"blocks": stacked, "head": dense(ks[1], 5, 3)}

  def loss_fn(p, batch):
    def block(h, w):
      return jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = jax.lax.scan(block, batch["x"], p["blocks"])
    return jnp.mean((h @ p["head"]["w"] + p["head"]["b"] - batch["y"]) ** 2)

  def scan_step(params, opt_state, batch):
    loss, grads = gpp_jax.value_and_grad(lambda p: loss_fn(p, batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  pp = gpp_jax.graph_pipeline(scan_step, num_microbatches=1, devices=jax.devices()[:1])
  ref = jax.jit(scan_step)
  p, o, rp, ro = params, tx.init(params), params, tx.init(params)
  for i in range(3):
    p, o, loss = pp(p, o, _batch(i))
    rp, ro, rloss = ref(rp, ro, _batch(i))
  assert pp.compiled.fused
  assert abs(float(loss) - float(rloss)) <= 1e-6
  assert max_diff((p, o), (rp, ro)) <= 1e-6


@pytest.mark.parametrize("M", [1, 4])
def test_one_stage_over_several_devices_runs_as_jit_data_parallel(M):
  """One stage over four devices: one jitted step with the parameters replicated and every
  micro-batch split over the devices, equal to the plain step."""
  from harness import dag_model, dag_params, make_batch, mse_step

  tx = optax.adam(1e-2)
  params, batch = dag_params(), make_batch(0, 32, 5, 2)
  layers = ("inp", "left", "right", "head")
  plan = gpp_jax.Plan((gpp_jax.Stage(0, layers, (0, 1, 2, 3)),), (), M)
  pp = gpp_jax.graph_pipeline(
    mse_step(dag_model, tx), num_microbatches=M, devices=jax.devices()[:4], planner=plan
  )
  out = pp(params, tx.init(params), batch)
  ref = jax.jit(mse_step(dag_model, tx))(params, tx.init(params), batch)
  assert pp.compiled.fused
  assert [e.action for e in pp.timeline.events if e.action not in ("SEND", "CHUNK")] == ["STEP"]
  assert max_diff(ref, out) <= 1e-6
  w = out[0]["inp"]["w"]
  assert len(w.sharding.device_set) == 4 and w.sharding.is_fully_replicated


def test_donated_state_is_consumed_and_the_values_hold():
  """``donate_argnums`` on a fused step: the model's and optimizer's old arrays are consumed
  (XLA writes the new state into them), values equal the non-donating step's bit for bit and
  ``nnx.jit``'s within 1e-6, the memory prediction counts the donation and holds, and the
  timing runs of planning never consume the caller's arrays."""
  from gpp_jax.ir.program import Op, step_donates
  from gpp_jax.runtime.compile import time_step
  from gpp_jax.runtime.memory import OUTSIDE

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = nnx.Linear(5, 64, rngs=rngs)
      self.fc2 = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x):
      return self.fc2(jnp.tanh(self.fc1(x)))

  def nnx_step(model, optimizer, batch):
    loss, grads = gpp_jax.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(
      model
    )
    optimizer.update(model, grads)
    return loss

  def fresh():
    m = Net(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

  dev = jax.devices()[:1]
  (rm, ro), (km, ko), (dm, do) = fresh(), fresh(), fresh()
  ref = nnx.jit(nnx_step)
  kept = gpp_jax.graph_pipeline(nnx_step, num_microbatches=1, devices=dev)
  donating = gpp_jax.graph_pipeline(
    nnx_step, num_microbatches=1, devices=dev, donate_argnums=(0, 1)
  )
  fast = donating.cached_partial(dm, do)
  for i in range(3):
    batch = _batch(i)
    old = dm.fc1.kernel.get_value()
    rl, kl, dl = ref(rm, ro, batch), kept(km, ko, batch), fast(batch)
    assert float(kl) == float(dl)
    assert abs(float(rl) - float(dl)) <= 1e-6
    if i:  # placed where the step keeps it from the second step on: consumed there
      assert old.is_deleted()
    assert not dm.fc1.kernel.get_value().is_deleted()
  assert donating.compiled.fused
  assert max_diff(nnx.state((km, ko)), nnx.state((dm, do))) == 0.0
  assert max_diff(nnx.state((rm, ro)), nnx.state((dm, do))) <= 1e-6

  # The program says what the step consumes: every Variable of the model and optimizer.
  (step_ins,) = [i for i in donating.program.instrs if i.op is Op.STEP]
  assert len(step_donates(step_ins)) == len(jax.tree.leaves(nnx.state((dm, do))))
  (kept_step,) = [i for i in kept.program.instrs if i.op is Op.STEP]
  assert step_donates(kept_step) == ()

  # Memory: measured as predicted, and the donated state is not held twice.
  kept.measure_memory(km, ko, _batch(5))
  donating.measure_memory(dm, do, _batch(5))
  peaks = []
  for pp in (kept, donating):
    (d,) = pp.memory.devices
    held = d.measured_peak_bytes - d.breakdown.get(OUTSIDE, 0)
    assert abs(d.predicted_peak_bytes - held) <= 0.01 * held, pp.memory
    peaks.append(d.predicted_peak_bytes)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state((dm, do))))
  assert peaks[0] - peaks[1] >= 0.75 * state_bytes, peaks  # (temporaries differ a little)

  # Timing runs (the planner's trials) copy what the step consumes.
  leaves = jax.tree.leaves(nnx.state((dm, do))) + jax.tree.leaves(_batch(6))
  time_step(donating.compiled, leaves, repeats=1)
  assert not any(x.is_deleted() for x in leaves if isinstance(x, jax.Array))

  with pytest.raises(ValueError, match="donate_argnums"):
    gpp_jax.graph_pipeline(nnx_step, num_microbatches=1, devices=dev, donate_argnums=5)(
      dm, do, _batch(7)
    )
