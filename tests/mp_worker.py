"""One process of a 2-process pipelined run (started by tests/test_multiprocess.py).

Stages alternate between the processes (l0 on process 0, l1 on 1, l2 on 0, l3 on 1, plus a skip
l0 -> l3), so activations cross the process boundary in both directions. Each process checks
the values it holds against a one-device reference it computes itself.

  mode "check": 3 steps, prints RESULT and exits 0 iff everything is within 1e-5.
  mode "kill":  steps until killed from outside; exits 3 with the error message when a step
                fails (the peer died).
  mode "calibrate": as "check", but planned by GraphPipe from calibrated layer times (each
                process measures; all take process 0's numbers).
  mode "differ": the processes are given different plans; exits 4 with the error message
                when the first step refuses to run them.
  mode "span": as "check", but stage l1 runs on devices of both processes (one SPMD program
                over a sub-mesh spanning them); values of that stage are checked shard by shard.
  mode "stream": 4 steps of pipedream-async as one run_steps call vs 4 calls.
  mode "absent": process 1 never builds the pipeline (it sleeps, then exits); process 0
                exits 3 with the error message when its set-up times out.
  mode "widths": as "check", with every placement a stage can have: one device of process 0,
                two devices of process 1 fed from it, two devices spanning both processes,
                two devices of process 0 (so each kind of transfer crosses the processes).
  mode "jitdp": as "check", one stage over devices of both processes (0, 1, 4, 5): jit data
                parallel, run as one jitted step that both processes call.
  mode "jit0": as "check", one stage on device 0 (plain jit on process 0; process 1 idles).
  mode "timed": as "calibrate", by the balanced planner, with a host that issues for free and
                a link that costs nothing, so that its pipeline (stages on both processes) is
                predicted faster than plain jit and jit data parallel and is compiled and timed
                over both processes before it is taken.
  mode "accumulate": as "timed", by a user's planner that returns one stage over those 4
                devices with 4 micro-batches: timed beside jit data parallel over both.
  mode "die":  the process GPP_TEST_DIE_PROCESS exits (os._exit(7)) at the point
                GPP_TEST_DIE_AT: "setup" (before building the pipeline), "compile" (in the
                first call, after the plan check, before compiling), "first" (when the first
                step starts running) or "mid" (after step 2); the others step until a step
                fails and exit 3 printing the error and the seconds since their call began.
  mode "four-<planner>": for 4 processes (tests/test_multiprocess.py starts them), planned by
                that planner over every device of the 4 processes; 2 steps checked against
                jax.value_and_grad and optax on one device.
  mode "planned-<planner>": as "check", planned by that planner over the 8 devices given
                alternately from each process (so the planner's device groups cross them).

Modes that print RESULT can be joined by commas ("check,span,widths"): they run in turn in the
same processes, one RESULT line each (ending mode=<mode>); the exit code is 1 if any differs.
"""

import os
import sys
import time
from typing import Any

from gpp_jax.runtime import processes as distributed

distributed.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import gpp_jax  # noqa: E402


def dense(key, a, b):
  return {"w": jax.random.normal(key, (a, b)) / np.sqrt(a), "b": 0.1 * jnp.ones(b)}


def model(p, x):
  h0 = jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"])
  h1 = jnp.tanh(h0 @ p["l1"]["w"] + p["l1"]["b"])
  h2 = jnp.tanh(h1 @ p["l2"]["w"] + p["l2"]["b"])
  return (h2 + h0) @ p["l3"]["w"] + p["l3"]["b"]


tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def step(params, opt_state, batch):
  def loss_fn(p):
    return jnp.mean((model(p, batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def plain_step(params, opt_state, batch):
  def loss_fn(p):
    return jnp.mean((model(p, batch["x"]) - batch["y"]) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def die(point):
  print(f"DYING at {point} {time.time():.3f}", flush=True)
  os._exit(7)


def arm_death(point):
  """Makes this process exit at ``point`` of the first call (see the "die" mode)."""
  from gpp_jax.runtime import build as build_mod
  from gpp_jax.runtime import executor as executor_mod

  if point == "setup":
    die(point)
  if point == "compile":
    build_mod.build_kernels = lambda *a, **k: die(point)  # read by ``build.build_step``
  if point == "first":
    executor_mod.Executor.run = lambda *a, **k: die(point)


def main(mode):
  timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
  dying = mode == "die" and str(jax.process_index()) == os.environ["GPP_TEST_DIE_PROCESS"]
  if dying:
    arm_death(os.environ["GPP_TEST_DIE_AT"])
  ks = jax.random.split(jax.random.key(0), 4)
  with jax.default_device(jax.local_devices()[0]):
    params = {
      "l0": dense(ks[0], 6, 8),
      "l1": dense(ks[1], 8, 8),
      "l2": dense(ks[2], 8, 8),
      "l3": dense(ks[3], 8, 3),
    }
    params = jax.tree.map(np.asarray, params)
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.normal(size=(16, 6)).astype(np.float32),
    "y": rng.normal(size=(16, 3)).astype(np.float32),
  }
  plan = gpp_jax.manual_plan({"l0": 0, "l1": 1, "l2": 2, "l3": 3}, devices={0: 0, 1: 4, 2: 1, 3: 5})
  if mode == "span":  # l1 on the last device of process 0 and the first of process 1
    plan = gpp_jax.manual_plan(
      {"l0": 0, "l1": 1, "l2": 2, "l3": 3}, devices={0: 0, 1: (3, 4), 2: 5, 3: 1}
    )
  if mode == "widths":
    plan = gpp_jax.manual_plan(
      {"l0": 0, "l1": 1, "l2": 2, "l3": 3}, devices={0: 0, 1: (4, 5), 2: (3, 6), 3: (1, 2)}
    )
  if mode == "jitdp":
    plan = gpp_jax.manual_plan(dict.fromkeys(params, 0), devices={0: (0, 1, 4, 5)})
  if mode == "jit0":
    plan = gpp_jax.manual_plan(dict.fromkeys(params, 0), devices={0: 0})
  if mode == "differ" and jax.process_index() == 1:
    plan = gpp_jax.manual_plan({"l0": 0, "l1": 1, "l2": 1, "l3": 1}, devices={0: 0, 1: 4})
  options = {}
  if mode == "calibrate":
    options = dict(planner="graphpipe", calibrate=True)
  elif mode in ("timed", "accumulate"):
    from gpp_jax.cost.host import HostCosts
    from gpp_jax.runtime import host as host_mod

    ops = ("F", "B", "W", "UPDATE", "SEND", "RECV", "STEP")
    free = HostCosts(per_op=dict.fromkeys(ops, 0.0), parallel=None, cores=2, device="cpu:0")
    host_mod.measure_host = lambda devices, *_: free
    host_mod.measure_link_across = lambda devices, timeout_s: (1e-6, 1e12)  # type: ignore[misc]
    devs = jax.devices()  # two of each process's, in blocks: stages on both processes
    planner: Any = "balanced"
    if mode == "accumulate":  # one stage over the 4 devices of both processes, 4 micro-batches
      from harness import accumulating_planner

      planner = accumulating_planner(4)
    options = dict(planner=planner, calibrate=True, devices=devs[:2] + devs[4:6])
  elif mode.startswith("four-"):
    options = dict(planner=mode.split("-", 1)[1], devices=jax.devices(), min_stages=4)
  elif mode.startswith("planned-"):
    devs = jax.devices()
    alternate = [d for pair in zip(devs[:4], devs[4:]) for d in pair]
    options = dict(planner=mode.split("-", 1)[1], devices=alternate)
  else:
    options = dict(planner=plan)
  pp = gpp_jax.graph_pipeline(step, num_microbatches=4, timeout_s=timeout, **options)
  p, o = params, tx.init(params)
  if mode == "absent":
    if jax.process_index() == 1:
      time.sleep(3 * timeout)
      os._exit(0)
    try:
      pp(p, o, batch)
    except gpp_jax.GppError as e:
      print(f"FAILED: {e}", flush=True)
      os._exit(3)
    os._exit(0)
  if mode == "differ":
    try:
      pp(p, o, batch)
    except gpp_jax.PlanError as e:
      print(f"PLANERROR process={jax.process_index()}: {e}", flush=True)
      if jax.process_index() == 0:
        # Process 0 runs the coordination service, whose end aborts the others at once: it
        # outlives their reports (each raises on its own; the test checks both said so).
        time.sleep(3)
      os._exit(4)
    os._exit(0)
  if mode in ("kill", "die"):
    i = 0
    try:
      while True:
        t = time.monotonic()
        if dying and i == 2:
          die("mid")
        p, o, loss = pp(p, o, batch)
        print(f"STEP {i}", flush=True)
        i += 1
    except gpp_jax.GppError as e:
      print(f"FAILED after {time.monotonic() - t:.1f} s in the call: {e}", flush=True)
      os._exit(3)
  t = time.monotonic()
  if mode == "stream":  # run_steps under pipedream-async vs one call per step
    batches = [jax.tree.map(lambda a, k=k: a * (1 + 0.1 * k), batch) for k in range(4)]
    one = gpp_jax.graph_pipeline(
      step, num_microbatches=4, timeout_s=timeout, schedule="pipedream-async", **options
    )
    rp, ro = p, o
    for b in batches:
      rp, ro, rloss = one(rp, ro, b)
    many = gpp_jax.graph_pipeline(
      step, num_microbatches=4, timeout_s=timeout, schedule="pipedream-async", **options
    )
    p, o, losses = many.run_steps(p, o, batches)
    loss = losses[-1]
    pp = many
  else:
    dev0 = jax.local_devices()[0]
    ref = jax.jit(plain_step if mode.startswith("four-") else step)
    rp, ro = jax.device_put((params, tx.init(params)), dev0)
    rb = jax.device_put(batch, dev0)
    for _ in range(2 if mode.startswith("four-") else 3):
      p, o, loss = pp(p, o, batch)
      rp, ro, rloss = ref(rp, ro, rb)
  diffs, checked = [], 0
  for a, b in zip(jax.tree.leaves((p, o, loss)), jax.tree.leaves((rp, ro, rloss))):
    if a.is_fully_addressable and (b.is_fully_addressable or mode != "stream"):
      diffs.append(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
      checked += 1
    elif a.addressable_shards:  # spans processes: compare this process's shards
      whole = np.asarray(b)
      for shard in a.addressable_shards:
        diffs.append(float(np.max(np.abs(np.asarray(shard.data) - whole[shard.index]))))
      checked += 1
  # A planner may leave a process without stages; the manual plan gives each some.
  ok = max(diffs, default=0.0) <= 1e-5 and (
    checked > 0
    or mode in ("calibrate", "jit0", "timed", "accumulate")
    or mode.startswith(("planned-", "four-"))
  )
  if mode == "timed":  # the planner's own pipeline, which was timed, and why it ran or not
    from gpp_jax.runtime.compile import make_plan

    c = pp.compiled
    own = make_plan(c.planned.layer_graph, c.batch_size, c.opts)
    on = sorted({pp.devices[d].process_index for st in own.stages for d in st.devices})
    print(
      f"PIPELINE process={jax.process_index()} stages={own.num_stages} on_processes={on} "
      f"note={c.planned.note}",
      flush=True,
    )
  print(
    f"RESULT process={jax.process_index()} checked={checked} maxdiff={max(diffs, default=0.0):.3g} "
    f"edges={sorted(pp.plan.edges)} plan={pp.plan.fingerprint()[:12]} fused={pp.compiled.fused} "
    f"host_processes={getattr(pp.compiled.planned.host, 'processes', None)} "
    f"host_parallel={getattr(pp.compiled.planned.host, 'parallel', None)} "
    f"host_link={','.join(map(repr, getattr(pp.compiled.planned.host, 'cross_link', None) or ()))} "
    f"devices={[tuple(pp.devices[d].id for d in st.devices) for st in pp.plan.stages]} "
    f"seconds={time.monotonic() - t:.1f} "
    f"timed={'+'.join(k.replace(' ', '_') for k in pp.compiled.planned.measured) or '-'} "
    f"mode={mode}",
    flush=True,
  )
  return ok


if __name__ == "__main__":
  # Modes joined by commas run in turn in the same processes (one start-up for several);
  # each runs whatever an earlier one found (the processes must make the same calls).
  oks = [main(m) for m in sys.argv[1].split(",")]
  ok = all(oks)
  sys.stdout.flush()
  # Let every process finish its receives before any exits (os._exit skips JAX's shutdown).
  multihost_utils.sync_global_devices("gpp-worker-done")
  os._exit(0 if ok else 1)
