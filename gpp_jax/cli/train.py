"""Trains a model-zoo model with a graph pipeline on synthetic data.

  python -m gpp_jax.train --model=mmt --planner=graphpipe --num_devices=8 \\
      --num_microbatches=8 --memory_limit=310KiB --steps=200

Logs loss, throughput and progress while it runs and writes a run folder (``--run_dir``):
  plan.json, plan.txt        the plan (rerun it exactly with --plan=plan.json), and a
                             readable table with explain()
  calibration.json           the measured layer times the plan was made from (--calibrate)
  layer_graph.json           the LayerGraph the planner saw
  stage_graph.dot (.svg)     the stage DAG (SVG when Graphviz's ``dot`` is installed)
  timeline_measured.json     Chrome/Perfetto trace of the last step, measured per action
  timeline_predicted.json    the simulator's prediction of the same schedule
  schedule_<name>.png        the plan simulated under every schedule, one PNG each, and
  schedule_measured.png      the measured last step (with matplotlib, the ``plots`` extra)
  metrics.jsonl              one JSON object per logged step
  summary.json               measured step time beside the time the plan was chosen by
                             (``measured_ms``, ``predicted_ms``, ``prediction``: measured
                             or modelled), every candidate's time (``candidates_ms``) and
                             where it comes from (``candidates_how``), and memory

With ``--checkpoint_dir`` the model and optimizer state are saved every ``--checkpoint_every``
steps and at the end (``gpp_jax.checkpoint``), and a run started with a folder that holds
checkpoints resumes from the latest: the same step count, the same data position, values equal
to an uninterrupted run's, under any plan and device count.

Multi-process: started by ``python -m gpp_jax.launch`` (GPP_* variables), or with
``--distributed`` on a cluster where ``jax.distributed.initialize()`` finds its environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mmt", "model: mmt, dlrm, candle_uno or gpt")
flags.DEFINE_string("preset", "tiny", "model size preset: tiny or paper")
flags.DEFINE_string(
  "planner",
  "graphpipe",
  "planner name (graphpipe, pipedream, piper, bapipe, luo, balanced, exhaustive)",
)
flags.DEFINE_string(
  "plan", None, "run this saved plan (a run folder's plan.json) instead of planning"
)
flags.DEFINE_string(
  "schedule",
  None,
  "micro-batch schedule: 1f1b, gpipe, graph-1f1b, zero-bubble, pipedream-async, "
  "pipedream-async-vsync or 2bw (default: the planner's choice)",
)
flags.DEFINE_integer(
  "num_devices",
  None,
  "devices to use, the first N of the platform's "
  "(default: all accelerators, or 8 forced CPU devices on CPU)",
)
flags.DEFINE_string(
  "mesh",
  None,
  "the device mesh, e.g. data:4,model:2 (over the first 8 devices): stages take whole rows of "
  "its first axis, the model's partition specs (tensor parallel over 'model', FSDP over the "
  "first axis) hold inside each stage (default: --num_devices as one axis)",
)
flags.DEFINE_enum(
  "platform",
  None,
  ["cpu", "gpu", "tpu"],
  "device platform (default: the accelerator when there is one, else CPU)",
)
flags.DEFINE_enum(
  "dtype", "float32", ["float32", "bfloat16"], "parameter, activation and optimizer-state dtype"
)
flags.DEFINE_integer("num_microbatches", 8, "micro-batches per step")
flags.DEFINE_integer("batch_size", 64, "examples per step")
flags.DEFINE_integer(
  "min_stages",
  1,
  "the fewest stages the plan may have: the planner's own search keeps to plans of at least "
  "this many and runs its best such plan (never another planner's); 1 lets plain jit and jit "
  "data parallel compete with the planner's pipeline and win where faster on this machine",
)
flags.DEFINE_string(
  "stages_per_device",
  None,
  "stages each device may run: 1, a larger number (the planner's stages interleaved over the "
  "devices, schedule interleaved-1f1b unless --schedule names another), or auto (the planner "
  "chooses 1, 2 or 4 by prediction); default: auto on GPUs (or a GPU --cluster preset), 1 on "
  "CPU devices",
)
flags.DEFINE_integer("steps", 200, "training steps")
flags.DEFINE_float("learning_rate", 1e-3, "AdamW learning rate")
flags.DEFINE_float("clip_norm", 1.0, "global-norm gradient clipping (0 disables)")
flags.DEFINE_bool("remat", False, "recompute stage forwards in the backward")
flags.DEFINE_integer("seed", 0, "parameter and data seed")
flags.DEFINE_integer("log_every", 10, "log every N steps")
flags.DEFINE_integer("num_batches", 4, "distinct synthetic batches, cycled")
flags.DEFINE_string("run_dir", None, "output folder (default runs/<model>-<planner>-<time>)")
flags.DEFINE_enum(
  "cluster",
  None,
  ["cpu", "cuda", "v100"],
  "cluster preset the planner and simulator use (default: cuda on GPUs, else cpu)",
)
flags.DEFINE_bool(
  "calibrate",
  True,
  "time each layer on the device before planning (not with the simulated v100 cluster)",
)
flags.DEFINE_bool(
  "distributed", False, "call jax.distributed.initialize() from the cluster environment"
)
flags.DEFINE_string(
  "transfer_address", None, "host:port for cross-process transfers (with --distributed)"
)
flags.DEFINE_float("timeout_s", 300.0, "multi-process: fail a step that stalls this long")
flags.DEFINE_string(
  "memory_limit",
  None,
  "bytes a plan may use per device, e.g. 512MiB or 12GiB (default: the device's limit where "
  "JAX reports one, else the cluster preset's)",
)
flags.DEFINE_bool(
  "measure_memory",
  True,
  "measure the memory of one step (the second; live arrays per device at every instruction) "
  "and write it to summary.json and the measured trace",
)
flags.DEFINE_bool(
  "donate",
  True,
  "the step consumes the model's and optimizer's old arrays (graph_pipeline donate_argnums): "
  "where it runs as one executable, XLA writes the new state in place of the old",
)
flags.DEFINE_string(
  "checkpoint_dir",
  None,
  "save checkpoints here and resume from the latest one it holds (gpp_jax.checkpoint)",
)
flags.DEFINE_integer(
  "checkpoint_every",
  100,
  "with --checkpoint_dir: save every N steps (and after the last); the newest 3 are kept",
)

# Flags a resumed run must share with the run that saved the checkpoint: they fix the model,
# the optimizer and the data sequence.
RESUME_FLAGS = (
  "model",
  "preset",
  "dtype",
  "seed",
  "batch_size",
  "num_batches",
  "learning_rate",
  "clip_norm",
)


def _check_flags() -> None:
  """Bad flag values stop the program with a one-line message (absl's UsageError)."""
  from gpp_jax.models.registry import MODELS
  from gpp_jax.passes.partition import PLANNERS
  from gpp_jax.passes.schedules import GENERATORS

  def choose(flag: str, value, known) -> None:
    if value not in known:
      raise app.UsageError(f"--{flag}={value!r} is not one of {sorted(known)}")

  choose("model", FLAGS.model, MODELS)
  choose("preset", FLAGS.preset, ("tiny", "paper"))
  if FLAGS.plan is None and FLAGS.planner == "manual":
    raise app.UsageError(
      "--planner=manual: a plan you write is given as --plan=PATH (a plan.json, as a run "
      "folder's; Plan.to_dict)"
    )
  if FLAGS.plan is None:
    choose("planner", FLAGS.planner, PLANNERS)
  elif not os.path.isfile(FLAGS.plan):
    raise app.UsageError(f"--plan={FLAGS.plan!r}: no such file (a run folder's plan.json)")
  if FLAGS.schedule is not None:
    choose("schedule", FLAGS.schedule, GENERATORS)
  for flag in (
    "num_devices",
    "num_microbatches",
    "batch_size",
    "steps",
    "log_every",
    "checkpoint_every",
  ):
    if getattr(FLAGS, flag) is not None and getattr(FLAGS, flag) < 1:
      raise app.UsageError(f"--{flag} must be at least 1, got {getattr(FLAGS, flag)}")
  if FLAGS.batch_size % FLAGS.num_microbatches:
    raise app.UsageError(
      f"--batch_size={FLAGS.batch_size} does not split into --num_microbatches="
      f"{FLAGS.num_microbatches} equal micro-batches; choose a divisor"
    )


_MULTIPROCESS = False  # set once jax.distributed is initialised


def _setup_devices():
  """Multi-process set-up, or enough forced CPU devices for a single-process CPU run."""
  import jax

  from gpp_jax.runtime import processes as distributed

  global _MULTIPROCESS
  if distributed.initialize_from_env():
    _MULTIPROCESS = True
    return
  if FLAGS.distributed:
    distributed.initialize(transfer_address=FLAGS.transfer_address)
    _MULTIPROCESS = True
    return
  # Only affects the CPU backend (and only before it starts): accelerators are unaffected.
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", FLAGS.num_devices or 8)


def pick_devices(platform, num_devices):
  """The first ``num_devices`` devices of ``platform`` (None: JAX's default backend, which is
  the accelerator when there is one; all of its devices, or 8 on CPU)."""
  import jax

  try:
    devices = jax.devices(platform) if platform else jax.devices()
  except RuntimeError as e:
    raise app.UsageError(f"--platform={platform}: no such devices here ({e})") from None
  if num_devices is None:
    num_devices = len(devices) if devices[0].platform != "cpu" else min(8, len(devices))
  if num_devices > len(devices):
    hint = (
      "; set XLA_FLAGS=--xla_force_host_platform_device_count=N for CPU"
      if devices[0].platform == "cpu"
      else ""
    )
    raise app.UsageError(
      f"--num_devices={num_devices} but only {len(devices)} {devices[0].platform} devices{hint}"
    )
  return devices[:num_devices]


def write_stage_graph(plan, layer_graph, path_dot):
  lines = ["digraph stages {", "  rankdir=LR; node [shape=box, fontname=Helvetica];"]
  for s in plan.stages:
    flops = sum(layer_graph.nodes[l]["flops"] for l in s.layers)
    first = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
    lines.append(
      f'  s{s.index} [label="stage {s.index}\\n{first}\\n{len(s.layers)} layers, '
      f'{flops / 1e6:.1f} MFLOP\\ndevices {list(s.devices)}"];'
    )
  for a, b in plan.edges:
    lines.append(f"  s{a} -> s{b};")
  lines.append("}")
  with open(path_dot, "w") as f:
    f.write("\n".join(lines) + "\n")
  if shutil.which("dot"):
    for fmt in ("svg", "png"):
      subprocess.run(["dot", f"-T{fmt}", path_dot, "-o", path_dot[:-3] + fmt], check=False)


@contextlib.contextmanager
def _orbax_quiet():
  """Orbax logs some 50 INFO lines per save through absl; the program logs its own line."""
  level = logging.get_verbosity()
  logging.set_verbosity(min(level, logging.WARNING))  # absl: lower is quieter
  try:
    yield
  finally:
    logging.set_verbosity(level)


def resume(directory: str, state: dict) -> int:
  """Restores the latest checkpoint of ``directory`` into ``state`` (in place) and returns its
  step, or 0 when there is none yet."""
  from gpp_jax import checkpoint

  with _orbax_quiet():
    step = checkpoint.latest_step(directory)
    saved = checkpoint.extra(directory, step).get("flags", {}) if step is not None else {}
  if step is None:
    return 0
  differ = [
    f"--{k}={saved[k]!r} (now {getattr(FLAGS, k)!r})"
    for k in RESUME_FLAGS
    if k in saved and saved[k] != getattr(FLAGS, k)
  ]
  if differ:
    raise app.UsageError(
      f"--checkpoint_dir={directory} holds step {step} of a run with "
      + ", ".join(differ)
      + "; resume with the same flags, or use a new --checkpoint_dir"
    )
  with _orbax_quiet():
    checkpoint.restore(directory, state, step=step)
  return step


def save_checkpoint(directory: str, state: dict, step: int, num_batches: int) -> None:
  from gpp_jax import checkpoint

  with _orbax_quiet():
    path = checkpoint.save(
      directory,
      state,
      step=step,
      keep=3,
      extra={
        "flags": {k: getattr(FLAGS, k) for k in RESUME_FLAGS},
        "data_position": step % num_batches,  # the next step trains on data[step % num_batches]
      },
    )
  logging.info("saved checkpoint %s", path)


def main(argv: list[str]) -> None:
  from gpp_jax.errors import GppError

  try:
    _main(argv)
  except GppError as e:  # the user's input: its message names the fix, a traceback does not
    print(f"gpp_jax.train: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if _MULTIPROCESS:
      sys.stdout.flush()
      os._exit(1)  # as below: do not wait for the other processes
    sys.exit(1)
  except Exception:
    if _MULTIPROCESS:
      # A process that fails must exit now: JAX's shutdown at interpreter exit waits for the
      # other processes, which wait (up to --timeout_s) for this one's transfers.
      logging.exception("this process failed; exiting without waiting for the others")
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(1)
    raise


def _pipeline_from_flags() -> tuple[Any, Any, Any]:
  """(the zoo run, its ``graph_pipeline``, the cluster preset) as the flags ask: the devices,
  the model and optimizer, the mesh, and every option of the pipeline."""
  import gpp_jax
  from gpp_jax.cli.plan import stages_per_device_option
  from gpp_jax.cost.cluster import make_cluster, process_cluster
  from gpp_jax.experiments import zoo

  devices = pick_devices(FLAGS.platform, FLAGS.num_devices)
  cluster_name = FLAGS.cluster or ("cuda" if devices[0].platform == "gpu" else "cpu")
  logging.info(
    "%d %s devices (%s), cluster preset %s, %s",
    len(devices),
    devices[0].platform,
    devices[0].device_kind,
    cluster_name,
    FLAGS.dtype,
  )
  run = zoo.setup(
    FLAGS.model,
    FLAGS.preset,
    seed=FLAGS.seed,
    optimizer=zoo.OptimizerConfig(FLAGS.learning_rate, FLAGS.clip_norm),
    dtype=None if FLAGS.dtype == "float32" else FLAGS.dtype,
  )
  mesh = None
  if FLAGS.mesh:
    from gpp_jax.runtime.sharding import MeshLayout, parse_mesh

    try:
      mesh = parse_mesh(FLAGS.mesh, devices)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    devices = list(MeshLayout.of(mesh).representatives)  # the planners count rows
    logging.info("mesh %s: stages take rows of %r", FLAGS.mesh, mesh.axis_names[0])
  # The cpu preset follows the devices: one node per process in a multi-process run.
  if cluster_name == "cpu":
    cluster = process_cluster(devices)
  else:
    cluster = make_cluster(cluster_name, len(devices), dtype=FLAGS.dtype)
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=FLAGS.num_microbatches,
    devices=None if mesh is not None else devices,
    mesh=mesh,
    planner=gpp_jax.Plan.load(FLAGS.plan) if FLAGS.plan else FLAGS.planner,
    schedule=FLAGS.schedule,
    remat=FLAGS.remat,
    cluster=cluster,
    timeout_s=FLAGS.timeout_s,
    # A given plan is run as it is; with measured layers it gets the same prediction for this
    # machine as the planners' plans.
    calibrate=FLAGS.calibrate and cluster_name != "v100",
    min_stages=FLAGS.min_stages,
    planner_options=stages_per_device_option(FLAGS.stages_per_device),
    layer_depth=run.spec.layer_depth,
    memory_limit=FLAGS.memory_limit,
    donate_argnums=(0, 1) if FLAGS.donate else (),
  )
  return run, pp, cluster


def _write_plan_files(pp: Any, run_dir: str) -> None:
  """The run folder's plan.json, plan.txt, layer_graph.json, calibration.json (where the
  layers were timed) and stage_graph.dot."""
  from gpp_jax.ir import layer_graph as lg

  with open(os.path.join(run_dir, "plan.json"), "w") as f:
    f.write(pp.plan.to_json())
  with open(os.path.join(run_dir, "plan.txt"), "w") as f:
    f.write(pp.explain() + "\n")
  with open(os.path.join(run_dir, "layer_graph.json"), "w") as f:
    f.write(lg.to_json(pp.layer_graph))
  if pp.calibration is not None:
    with open(os.path.join(run_dir, "calibration.json"), "w") as f:
      f.write(pp.calibration.to_json() + "\n")
  write_stage_graph(pp.plan, pp.layer_graph, os.path.join(run_dir, "stage_graph.dot"))


def _main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
  _check_flags()
  _setup_devices()
  import jax

  import gpp_jax
  from gpp_jax.cli import reporting

  run, pp, cluster = _pipeline_from_flags()
  model, optimizer = run.model, run.optimizer
  data = run.batches(FLAGS.batch_size, FLAGS.num_batches)
  label = "plan" if FLAGS.plan else FLAGS.planner
  run_dir = FLAGS.run_dir or os.path.join(
    "runs", f"{FLAGS.model}-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
  )
  main_process = jax.process_index() == 0
  if main_process:
    os.makedirs(run_dir, exist_ok=True)
  ckpt_state = {"model": model, "optimizer": optimizer}
  start = 1  # the first step to run; data[(step - 1) % len(data)] is step's batch
  if FLAGS.checkpoint_dir:
    try:
      start = resume(FLAGS.checkpoint_dir, ckpt_state) + 1
    except gpp_jax.CheckpointError as e:
      raise app.UsageError(f"--checkpoint_dir={FLAGS.checkpoint_dir}: {e}") from None
    if start > 1:
      logging.info("resumed from %s at step %d", FLAGS.checkpoint_dir, start - 1)
    if start > FLAGS.steps:
      logging.info(
        "the checkpoint is at step %d, --steps=%d: nothing to do", start - 1, FLAGS.steps
      )
      return

  def after_step(step: int) -> None:
    if FLAGS.checkpoint_dir and (step % FLAGS.checkpoint_every == 0 or step == FLAGS.steps):
      save_checkpoint(FLAGS.checkpoint_dir, ckpt_state, step, len(data))

  # The model and optimizer are the same objects every step: traverse them once.
  train = pp.cached_partial(model, optimizer)
  t_start = time.perf_counter()
  loss = train(data[(start - 1) % len(data)])
  jax.block_until_ready(loss)
  logging.info("compiled and ran the first step in %.1f s", time.perf_counter() - t_start)
  if main_process:
    print(pp.explain())
    _write_plan_files(pp, run_dir)
  after_step(start)
  # Open for the whole run (closed after the last step); lines are flushed as they are written.
  metrics = open(os.path.join(run_dir, "metrics.jsonl"), "w") if main_process else None  # noqa: SIM115
  t_log, samples, measuring = time.perf_counter(), 0, False
  step_ms: list[float] = []
  for step in range(start + 1, FLAGS.steps + 1):  # step ``start`` (compilation) ran above
    last = step == FLAGS.steps
    if last and step > start + 1 and jax.process_count() == 1:
      pp.measure = True  # the last step records a measured per-action timeline
    batch = data[(step - 1) % len(data)]
    if step == start + 1 and FLAGS.measure_memory and not last:
      # In the first logged interval, which the step time leaves out (warm-up).
      loss = pp.measure_memory(model, optimizer, batch)
      measuring = True
    else:
      loss = train(batch)
      measuring = measuring or pp.measure
    samples += FLAGS.batch_size
    if step % FLAGS.log_every == 0 or last:
      value = reporting.fetch(loss)
      dt = time.perf_counter() - t_log
      rec = {
        "step": step,
        "loss": value,
        "samples_per_s": samples / dt,
        "step_ms": dt / max(samples // FLAGS.batch_size, 1) * 1e3,
      }
      if not measuring:  # a measuring step blocks per action or walks the arrays: slower
        step_ms.append(rec["step_ms"])
      logging.info(
        "step %d/%d loss %s  %.1f samples/s  %.1f ms/step",
        step,
        FLAGS.steps,
        f"{value:.5f}" if value is not None else "(remote)",
        rec["samples_per_s"],
        rec["step_ms"],
      )
      if metrics:
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
      t_log, samples, measuring = time.perf_counter(), 0, False
    after_step(step)
  if main_process:
    assert metrics is not None
    metrics.close()
    tl = pp.timeline
    memory = pp.memory
    with open(os.path.join(run_dir, "timeline_measured.json"), "w") as f:
      json.dump(tl.to_chrome_trace(memory.counters if memory else None), f)
    predicted = reporting.write_predicted_timeline(
      pp, cluster, os.path.join(run_dir, "timeline_predicted.json")
    )
    reporting.write_schedule_pngs(pp, cluster, run_dir)
    summary = reporting.step_time_summary(pp, cluster, step_ms, predicted)
    planned = reporting.planned_peaks(pp, cluster)
    summary["memory"] = (
      [{**d.to_dict(), "planned_peak_bytes": planned.get(d.device)} for d in memory.devices]
      if memory
      else None
    )
    if memory:
      print(f"peak memory per device (measured step vs the program's prediction):\n{memory}")
      print(
        "the planner's memory model (what plans are chosen and refused by), per device: "
        + ", ".join(f"{d} {b / 2**20:.3f} MiB" for d, b in planned.items())
      )
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    print(reporting.format_summary(summary))
    logging.info("run folder: %s", os.path.abspath(run_dir))
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
