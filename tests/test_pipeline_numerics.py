"""Pipelined steps equal the undecorated step on one device (3 steps, float32, 1e-5)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import OPTIMIZERS, apply_dense, compare_steps, dense, make_batch, max_diff, mse_step

import gpp_jax

TOL = 1e-5


def chain_model(p, x):
  for i in range(4):
    x = apply_dense(p[f"l{i}"], x)
    if i < 3:
      x = jnp.tanh(x)
  return x


def chain_params():
  ks = jax.random.split(jax.random.key(0), 4)
  sizes = [6, 16, 16, 16, 3]
  return {f"l{i}": dense(ks[i], sizes[i], sizes[i + 1]) for i in range(4)}


CHAIN_PLAN = gpp_jax.manual_plan({"l0": 0, "l1": 1, "l2": 2, "l3": 3})


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_chain_four_stages(schedule, remat, opt):
  tx = OPTIMIZERS[opt]()
  params = chain_params()
  r, p, pp = compare_steps(
    mse_step(chain_model, tx),
    (params, tx.init(params)),
    make_batch(0, 16, 6, 3),
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=CHAIN_PLAN,
    schedule=schedule,
    remat=remat,
  )
  assert pp.plan.num_stages == 4 and pp.plan.depth() == 4
  assert pp.schedule.name == schedule
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL
  assert max_diff(r[0], p[0]) <= TOL
  assert max_diff(r[1], p[1]) <= TOL
  # Parameters stay on their stage's device between steps.
  for i in range(4):
    assert p[0][f"l{i}"]["w"].devices() == {jax.devices()[i]}


def diamond_model(p, x):
  h = jnp.tanh(apply_dense(p["inp"], x))
  a = jnp.tanh(apply_dense(p["left"], h))
  b = jax.nn.relu(apply_dense(p["right"], h))
  return apply_dense(p["head"], jnp.concatenate([a, b], axis=-1))


def test_diamond_three_stages():
  ks = jax.random.split(jax.random.key(1), 4)
  params = {
    "inp": dense(ks[0], 5, 12),
    "left": dense(ks[1], 12, 8),
    "right": dense(ks[2], 12, 8),
    "head": dense(ks[3], 16, 2),
  }
  tx = OPTIMIZERS["adamw"]()
  plan = gpp_jax.manual_plan({"inp": 0, "left": 1, "right": 2, "head": 2})
  r, p, pp = compare_steps(
    mse_step(diamond_model, tx),
    (params, tx.init(params)),
    make_batch(1, 12, 5, 2),
    num_microbatches=3,
    devices=jax.devices()[:3],
    planner=plan,
  )
  assert sorted(pp.plan.edges) == [(0, 1), (0, 2), (1, 2)]
  assert max_diff(r[:2], p[:2]) <= TOL
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL


def branches_model(p, x):
  outs = [jnp.tanh(apply_dense(p[f"b{i}"], x[:, 3 * i : 3 * i + 3])) for i in range(4)]
  return apply_dense(p["head"], jnp.concatenate(outs, axis=-1))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_four_branches_run_as_concurrent_stages(schedule):
  ks = jax.random.split(jax.random.key(2), 5)
  params = {**{f"b{i}": dense(ks[i], 3, 8) for i in range(4)}, "head": dense(ks[4], 32, 2)}
  tx = OPTIMIZERS["clip_adam"]()
  plan = gpp_jax.manual_plan({"b0": 0, "b1": 1, "b2": 2, "b3": 3, "head": 4})
  r, p, pp = compare_steps(
    mse_step(branches_model, tx),
    (params, tx.init(params)),
    make_batch(2, 16, 12, 2),
    num_microbatches=4,
    devices=jax.devices()[:5],
    planner=plan,
    schedule=schedule,
  )
  g = pp.plan.stage_graph()
  # The four branch stages are mutually independent: a DAG of depth 2, not a chain of 5.
  assert pp.plan.depth() == 2
  assert all(g.has_edge(i, 4) for i in range(4)) and g.number_of_edges() == 4
  assert max_diff(r[:2], p[:2]) <= TOL


def skip_model(p, x):
  h0 = jnp.tanh(apply_dense(p["l0"], x))
  h1 = jnp.tanh(apply_dense(p["l1"], h0))
  h2 = jnp.tanh(apply_dense(p["l2"], h1))
  return apply_dense(p["l3"], h2 + h0)  # h0 skips stages 1 and 2


def test_skip_connection_to_non_adjacent_stage():
  ks = jax.random.split(jax.random.key(3), 4)
  params = {
    "l0": dense(ks[0], 4, 8),
    "l1": dense(ks[1], 8, 8),
    "l2": dense(ks[2], 8, 8),
    "l3": dense(ks[3], 8, 2),
  }
  tx = OPTIMIZERS["adamw"]()
  r, p, pp = compare_steps(
    mse_step(skip_model, tx),
    (params, tx.init(params)),
    make_batch(3, 8, 4, 2),
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner=CHAIN_PLAN,
    remat=True,
  )
  assert (0, 3) in pp.plan.edges
  assert max_diff(r[:2], p[:2]) <= TOL


def tied_model(p, tokens):
  h = p["embed"][tokens].mean(axis=1)  # stage 0 reads the embedding
  h = jnp.tanh(apply_dense(p["mid"], h))
  return h @ p["embed"].T  # the head reads it again, on another stage


def test_parameter_shared_by_two_stages():
  ks = jax.random.split(jax.random.key(4), 2)
  params = {"embed": jax.random.normal(ks[0], (11, 6)), "mid": dense(ks[1], 6, 6)}
  tx = OPTIMIZERS["adamw"]()

  def step(params, opt_state, batch):
    def loss_fn(p):
      logits = tied_model(p, batch["x"])
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    import optax

    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  rng = np.random.default_rng(4)
  batch = {
    "x": rng.integers(0, 11, (8, 3)).astype(np.int32),
    "y": rng.integers(0, 11, (8,)).astype(np.int32),
  }
  plan = gpp_jax.manual_plan({"embed": 0, "mid": 1, "embed#2": 2})
  r, p, pp = compare_steps(
    step,
    (params, tx.init(params)),
    batch,
    num_microbatches=4,
    devices=jax.devices()[:3],
    planner=plan,
  )
  staged = pp.compiled.staged.staged
  # The embedding lives on stage 0 and stage 2 reads a copy of it.
  embed_in = [i for i, o in enumerate(staged.param_owner) if o == 0]
  assert any(r_.kind == "param" and r_.index in embed_in for r_ in staged.stages[2].inputs)
  assert p[0]["embed"].devices() == {jax.devices()[0]}
  assert max_diff(r[:2], p[:2]) <= TOL
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL


def test_balanced_default_planner_and_metrics():
  tx = OPTIMIZERS["adamw"]()
  params = chain_params()
  r, p, pp = compare_steps(
    mse_step(chain_model, tx),
    (params, tx.init(params)),
    make_batch(5, 8, 6, 3),
    num_microbatches=2,
    devices=jax.devices()[:2],
  )
  assert pp.plan.planner == "balanced" and pp.plan.num_stages == 2
  assert max_diff(r, p) <= TOL
  text = pp.explain()
  assert "stage 0 -> stage 1" in text and "cut edges" in text
  tl = pp.timeline
  assert {(e.action, e.stage, e.microbatch) for e in tl.events} >= {("F", 0, 0), ("B", 1, 1)}


def test_global_norm_clipping_active_is_exact():
  # A tiny threshold makes clipping scale every update, so the cross-stage global norm
  # must be computed exactly for the parameters to match.
  import optax

  tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
  params = chain_params()
  r, p, pp = compare_steps(
    mse_step(chain_model, tx),
    (params, tx.init(params)),
    make_batch(9, 16, 6, 3),
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=CHAIN_PLAN,
  )
  moved = max_diff(params, r[0])
  assert 1e-4 < moved < 1e-2  # clipped: each step moves by at most 1e-3
  assert max_diff(r[0], p[0]) <= 1e-7
  # The norm pieces exchange scalars only: a piece another stage reads from computes just what
  # it sends, so no stage's update waits for another stage's update.
  c = pp.compiled
  after = list(c.prog.after)
  sent = [
    piece
    for piece in after
    if any(v in q.inputs for q in after if q.home != piece.home for v in piece.outputs)
  ]
  assert len({piece.home for piece in sent}) >= 3  # every stage sends its partial norm
  for piece in sent:
    assert all(v.aval.ndim == 0 for v in piece.outputs), [v.aval for v in piece.outputs]
  # The scalars a stage sends to the norm's stage go as one put (``_batched_sends``), and
  # the step is bit for bit what putting them one by one gives.
  from gpp_jax.runtime import executor

  ex = c.last[0]
  assert sum(call is executor._nothing for call, _ in ex.in_order) >= 2
  assert sum(call is executor._nothing for call, _ in ex.code) == 0
  one_by_one = gpp_jax.graph_pipeline(
    mse_step(chain_model, tx), num_microbatches=4, devices=jax.devices()[:4], planner=CHAIN_PLAN
  )
  args = (params, tx.init(params))
  batch = make_batch(9, 16, 6, 3)
  out = pp(*args, batch)
  one_by_one(*args, batch)  # compiles; then its executor calls each instruction alone
  ex1 = one_by_one.compiled.last[0]
  ex1.in_order = ex1.code
  assert max_diff(one_by_one(*args, batch)[0], out[0]) == 0.0
  assert one_by_one.compiled.last[0] is ex1  # the same executor ran, one put at a time
  # The simulator charges the puts the executor makes: the same groups (``puts_together``),
  # each a lone put plus ``send_extra`` of one per other array, at its first SEND.
  from gpp_jax.cost.cluster import cpu_cluster
  from gpp_jax.cost.host import HostCosts
  from gpp_jax.ir.program import Op, puts_together
  from gpp_jax.passes.simulation import simulate

  # The executor's calls skip the RECVs: its positions are the program's instructions.
  calls = ex.in_order
  together = {ex.positions[k] for k, (call, _) in enumerate(calls) if call is executor._nothing}
  instrs = ex.program.instrs

  def where(k):
    i = instrs[k]
    return (i.peer, None) if i.op is Op.SEND and i.lane != ex.program.host else None

  assert together == {k for g in puts_together(instrs, where) for k in g[1:]}
  send = 1e-3
  h = HostCosts(per_op={"F": 1e-5, "B": 1e-5, "SEND": send}, parallel=None)
  lg_, cl = c.layer_graph, cpu_cluster(4)

  def predicted(extra):
    host = dataclasses.replace(h, send_extra=extra)
    return simulate(c.plan, lg_, cl, program=ex.program, host=host).iteration_time

  alone = predicted(None)
  assert 0 < alone - predicted(0.0) <= len(together) * send * (1 + 1e-9)
  assert predicted(0.0) < predicted(0.5) < alone
  # The host lane's puts (the step's arguments) cost their own measured seconds.
  inputs = sum(i.op is Op.SEND and i.lane == ex.program.host for i in instrs)
  h = dataclasses.replace(h, input_send=0.0)
  assert 0 < alone - predicted(None) <= inputs * send * (1 + 1e-9)


def test_bfloat16_gpt_trains_pipelined_in_bfloat16():
  """bf16 parameters, activations and optimizer state, end to end: a pipelined step of the zoo
  GPT keeps every parameter in bf16 and matches the one-device step to bf16 rounding."""
  from flax import nnx

  from gpp_jax.experiments import zoo

  runs = [zoo.setup("gpt", dtype="bfloat16") for _ in range(2)]
  (batch,) = runs[0].batches(16, 1)
  before = [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(runs[0].model, nnx.Param))]
  pp = gpp_jax.graph_pipeline(
    runs[0].train_step, num_microbatches=2, devices=jax.devices()[:2], planner="balanced"
  )
  ref = nnx.jit(runs[1].train_step)
  with jax.transfer_guard("disallow"):
    lp = pp(runs[0].model, runs[0].optimizer, batch)
    lr = ref(runs[1].model, runs[1].optimizer, jax.device_put(batch, jax.devices()[0]))
  assert pp.plan.num_stages == 2
  assert lp.dtype == jnp.bfloat16 and lr.dtype == jnp.bfloat16
  assert abs(float(lp) - float(lr)) <= 1e-2 * abs(float(lr))
  for part in (nnx.state(runs[0].model, nnx.Param), nnx.state(runs[0].optimizer, nnx.OptState)):
    dtypes = {x.dtype for x in jax.tree.leaves(part) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}, dtypes
  after = [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(runs[0].model, nnx.Param))]
  ref_after = [
    np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(runs[1].model, nnx.Param))
  ]
  n = sum(a.size for a in after)
  moved = sum(int(np.sum(a != b)) for a, b in zip(after, before)) / n
  same = sum(int(np.sum(a == r)) for a, r in zip(after, ref_after)) / n
  assert moved >= 0.9  # AdamW's first step moves nearly every weight by ~lr,
  assert same >= 0.95  # and the pipelined and the one-device step agree to the bit
  assert max_diff(after, ref_after) <= 4e-3  # on nearly all of them, within a bf16 ulp elsewhere


def test_residual_packing_round_trips_and_keeps_inputs_apart():
  from gpp_jax.passes.staging import _pack, _unpack

  xs = [
    jnp.arange(6.0).reshape(2, 3),
    jnp.ones(4, jnp.bfloat16),
    jnp.array(3, jnp.int32),
    jax.random.key(1),
    jnp.zeros((0, 2)),
    jnp.full((3,), 2.0),
  ]
  (bufs, apart), layout = _pack(xs, keep={id(xs[1])})
  assert {k: v.shape for k, v in bufs.items()} == {"float32": (9,), "int32": (1,)}
  assert len(apart) == 2 and apart[0] is xs[1]  # the kept input and the key stay whole
  back = _unpack((bufs, apart), layout)
  for a, b in zip(xs, back):
    assert a.dtype == b.dtype and a.shape == b.shape
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_optimizer_work_that_does_not_feed_the_loss_runs_after_the_pipeline():
  # Adam's ``b1 * mu`` and ``b2 * nu`` read only the optimizer state, not the gradients. Run
  # before the pipeline they would be written out and read back after it (a pass over the
  # optimizer state per step); after it they fuse with the rest of the update. What the loss
  # reads (here the parameters scaled outside the loss) still runs before.
  tx = OPTIMIZERS["adamw"]()

  def step(params, opt_state, batch):
    def loss_fn(p):
      return jnp.mean((chain_model(p, batch["x"]) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(jax.tree.map(lambda w: 0.5 * w, params))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  params = chain_params()
  r, p, pp = compare_steps(
    step,
    (params, tx.init(params)),
    make_batch(3, 16, 6, 3),
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner=CHAIN_PLAN,
  )
  assert max_diff(r[0], p[0]) <= TOL and max_diff(r[1], p[1]) <= TOL
  c = pp.compiled
  before = [e for piece in c.prog.before for e in piece.jaxpr.jaxpr.eqns]
  after = [e for piece in c.prog.after for e in piece.jaxpr.jaxpr.eqns]
  opt_leaves = {id(v) for v in c.prog.jaxpr.jaxpr.invars[8:]}  # params are the first 8 leaves
  assert not any(id(v) in opt_leaves for e in before for v in e.invars), "optimizer work before"
  assert any(e.primitive.name == "mul" for e in before)
  assert any(id(v) in opt_leaves for e in after for v in e.invars)


def test_optimizer_update_is_not_cut_at_the_global_norm():
  # Under clip-by-global-norm + Adam, the moment updates wait for the norm, but ``b1 * mu``
  # and ``b2 * nu`` do not: they must sit in the piece that finishes the update (where XLA fuses
  # them), not in one below the norm's level that writes them out. Pieces hand each other only
  # the norm's scalars; everything else they output is the step's new state.
  tx = OPTIMIZERS["clip_adam"]()
  params = chain_params()
  r, p, pp = compare_steps(
    mse_step(chain_model, tx),
    (params, tx.init(params)),
    make_batch(5, 16, 6, 3),
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner=CHAIN_PLAN,
  )
  assert max_diff(r[0], p[0]) <= TOL and max_diff(r[1], p[1]) <= TOL
  c = pp.compiled
  outs = set(c.prog.jaxpr.jaxpr.outvars)
  handed = [v for piece in c.prog.after for v in piece.outputs if v not in outs]
  assert handed and all(v.aval.ndim == 0 for v in handed), [v.aval for v in handed]
