"""Two processes, one device each, one core each: a 2-stage chain vs one process and one device.

  python benchmarks/multiprocess.py

Prints, measured side by side in one run:
  * step time of a 2-stage chain split over 2 processes (stage i on process i, pinned to core i)
    vs the same model as one stage in one process pinned to one core, 8 micro-batches; the
    speed-up (its limit is 2.0, the ideal 1F1B value 2M/(M+1));
  * cross-process transfer cost per MiB vs an in-process device_put between two devices;
  * with --simulate, the simulator's prediction for the 2-process run from the measured
    1-device stage times.
"""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)
M = 8
WIDTH, DEPTH, MB = 256, 16, 128


def build(num_stages):
  import jax
  import jax.numpy as jnp
  import optax

  import gpp_jax

  ks = jax.random.split(jax.random.key(0), DEPTH)
  params = {
    f"l{i:02d}": {
      "w": np.asarray(jax.random.normal(ks[i], (WIDTH, WIDTH))) / np.sqrt(WIDTH),
      "b": np.zeros(WIDTH, np.float32),
    }
    for i in range(DEPTH)
  }
  tx = optax.sgd(1e-3)

  def step(params, opt_state, batch):
    def loss_fn(p):
      x = batch["x"]
      for k in sorted(p):
        x = jnp.tanh(x @ p[k]["w"] + p[k]["b"])
      return jnp.mean((x - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  if num_stages == 1:
    rules, devices = {"": 0}, {0: 0}
  else:
    rules = {f"l{i:02d}": (0 if i < DEPTH // 2 else 1) for i in range(DEPTH)}
    devices = {0: 0, 1: 1}
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=M, timeout_s=600, planner=gpp_jax.manual_plan(rules, devices=devices)
  )
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.normal(size=(MB * M, WIDTH)).astype(np.float32),
    "y": rng.normal(size=(MB * M, WIDTH)).astype(np.float32),
  }
  return pp, params, tx.init(params), batch


def time_steps(pp, params, opt, batch, repeats=8):
  import jax

  from gpp_jax.runtime.executor import wait_for

  p, o, _ = pp(params, opt, batch)
  wait_for((p, o), 600)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    p, o, loss = pp(p, o, batch)
    wait_for((p, o, loss), 600)
    times.append(time.perf_counter() - t)
  del jax
  return statistics.median(times)


def worker_single():
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax

  pp, p, o, b = build(1)
  t = time_steps(pp, p, o, b)
  # Per-stage times on this core, for the simulator: forward and backward of half the model.
  fwd_bwd = t / M / 2
  d0, d1 = jax.devices()[:2]
  put = {}
  for mib in (1, 4, 16):
    x = jax.device_put(np.ones(mib * 2**18, np.float32), d0)
    jax.device_put(x, d1).block_until_ready()
    ts = []
    for _ in range(10):
      t0 = time.perf_counter()
      jax.device_put(x, d1).block_until_ready()
      ts.append(time.perf_counter() - t0)
    put[mib] = statistics.median(ts)
  print(json.dumps({"single_step": t, "stage_pair_time": fwd_bwd, "put": put}))


def worker_pair():
  from gpp_jax.runtime import processes as distributed

  distributed.initialize_from_env()
  import jax
  from jax.experimental import multihost_utils
  from jax.sharding import SingleDeviceSharding

  from gpp_jax.runtime.placement import transfer

  pp, p, o, b = build(2)
  t = time_steps(pp, p, o, b)
  d0, d1 = jax.devices()[0], jax.devices()[1]
  xfer = {}
  for mib in (1, 4, 16):
    n = mib * 2**18
    ts = []
    for _ in range(6):
      multihost_utils.sync_global_devices(f"x{mib}")
      if jax.process_index() == 0:
        x = jax.device_put(np.ones(n, np.float32), d0)
      else:
        x = jax.make_array_from_single_device_arrays(
          (n,), SingleDeviceSharding(d0), [], dtype=np.float32
        )
      t0 = time.perf_counter()
      y = transfer(x, SingleDeviceSharding(d1))
      if jax.process_index() == 1:
        y.block_until_ready()
      ts.append(time.perf_counter() - t0)
    xfer[mib] = statistics.median(ts[1:])
  multihost_utils.sync_global_devices("done")
  if jax.process_index() == 1:
    print("PAIR " + json.dumps({"pair_step": t, "xfer": xfer}))
  sys.stdout.flush()


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--single":
    return worker_single()
  if len(sys.argv) > 1 and sys.argv[1] == "--pair":
    return worker_pair()
  from gpp_jax.cli.launch import LaunchOptions, launch

  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  core = sorted(os.sched_getaffinity(0))[0]
  single = subprocess.run(
    [sys.executable, HERE, "--single"],
    env=env,
    capture_output=True,
    text=True,
    preexec_fn=lambda: os.sched_setaffinity(0, {core}),
  )
  s = json.loads(single.stdout.strip().splitlines()[-1])
  log = os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpp_mp_bench.log")
  with open(log, "w") as f:
    old = sys.stdout
    sys.stdout = f
    try:
      options = LaunchOptions(
        num_processes=2, devices_per_process=1, cpus_per_process=1, platform="cpu"
      )
      rc = launch([sys.executable, HERE, "--pair"], options, env=env)
    finally:
      sys.stdout = old
  with open(log) as f:
    text = f.read()
  assert rc == 0, text[-2000:]
  line = next(l for l in text.splitlines() if "PAIR " in l)
  pr = json.loads(line.split("PAIR ", 1)[1])
  t1, t2 = s["single_step"], pr["pair_step"]
  print(
    f"2 processes x 1 device (pinned): {t2 * 1e3:.1f} ms/step; 1 process x 1 device: "
    f"{t1 * 1e3:.1f} ms/step; speed-up {t1 / t2:.2f}x (limit 2.0, 1F1B ideal "
    f"{2 * M / (M + 1):.2f})"
  )
  for mib in ("1", "4", "16"):
    print(
      f"transfer {mib:>2s} MiB: cross-process {pr['xfer'][mib] * 1e3:.2f} ms "
      f"({pr['xfer'][mib] / int(mib) * 1e3:.2f} ms/MiB), in-process device_put "
      f"{s['put'][mib] * 1e3:.2f} ms ({s['put'][mib] / int(mib) * 1e3:.2f} ms/MiB)"
    )
  # The simulator's prediction: the 1F1B schedule of the two stages, each stage's F + B time
  # measured on one core (half the one-process model; B taken as twice F), and one activation
  # and one cotangent transfer per micro-batch at the measured cross-process cost.
  from gpp_jax.passes.schedules import one_f_one_b
  from gpp_jax.passes.simulation import StageTimes, simulate_times

  pair = s["stage_pair_time"]
  xfer = MB * WIDTH * 4 / 2**20 * pr["xfer"]["1"]
  pred = simulate_times(
    one_f_one_b(2, [(0, 1)], M),
    StageTimes([pair / 3] * 2, [2 * pair / 3] * 2, activation_transfer={(0, 1): xfer}),
  ).iteration_time
  print(
    f"simulator's prediction of the 2-process step: {pred * 1e3:.1f} ms vs measured "
    f"{t2 * 1e3:.1f} ms (error {abs(pred - t2) / t2 * 100:.0f}%)"
  )


if __name__ == "__main__":
  main()
