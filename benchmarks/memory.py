"""Memory, measured: peak bytes per device for what a user would run and for pipelines.

  python benchmarks/memory.py                      # (a) and (b), medium zoo models
  python benchmarks/memory.py --parts=peaks --models=mmt --devices=4

Each configuration runs one step of the zoo model at medium size, then one memory-measuring
step (``GraphPipeline.measure_memory``: every array alive on each device at every instruction
boundary, plus the running executable's temporaries), each in its own process so that nothing
another configuration left alive is counted.

(a) ``peaks``: measured peak per device (max and sum over devices) and the program's
    prediction, for plain jit on one device, jit data parallel over the devices, GPipe and 1F1B
    on GraphPipe's stages, the PipeDream plan and the GraphPipe plan; the stashed activations
    at the peak show whether GraphPipe's shallower DAG holds fewer for real.
(s) ``sharded`` (``--parts=sharded``): GPT and MMT with their Megatron-style partition specs
    on 8 devices, what a JAX user would run against pipelines, side by side in one run: plain
    jit, jit data parallel, jit fsdp, jit sharded (the model's specs over the mesh
    ``data:4,model:2``), GraphPipe's plan with replicated stages (8 devices) and with sharded
    stages (over the 4 rows of that mesh), the latter with every stage keeping the mesh's shape
    ("mesh shape", ``stage_shapes=False``) and with each stage's shape chosen by the planner
    (the stages column: rows, "xK" where a stage narrows "model" to K); per configuration
    the measured peak per device, the program's predicted peak, the measured step time
    (median of ``--timed_steps``) and the modelled one, and whether it fits
    ``--budget_fraction`` of plain jit's measured peak.
(b) ``fit``: a budget below what the plain step needs on one device (measured), the model
    trained pipelined under it on 4 devices with ``memory_limit``, every device's measured
    peak against the budget and the values against the one-device step; then the largest
    micro-batch each planner fits under one budget.
"""

import json
import os

from absl import app, flags
from child_runs import run_child

FLAGS = flags.FLAGS
flags.DEFINE_list(
  "parts", ["peaks", "fit", "microbatch"], "which parts to run: peaks, fit, microbatch"
)
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "zoo models (medium size)")
flags.DEFINE_list("devices", ["4", "8"], "device counts for part (a)")
flags.DEFINE_integer("batch_size", 64, "examples per step")
flags.DEFINE_integer("microbatches", 8, "micro-batches per step")
flags.DEFINE_string(
  "mb_budget", "2GiB", "part (c): the budget per device the largest micro-batch is found under"
)
flags.DEFINE_integer("mb_devices", 16, "part (c): V100s of the simulated cluster")
flags.DEFINE_string("child", None, "internal: run one configuration (JSON) and print its result")
flags.DEFINE_list("sharded_models", ["gpt", "mmt"], "part (s): models")
flags.DEFINE_float("budget_fraction", 0.6, "part (s): the budget, a fraction of plain jit's peak")
flags.DEFINE_integer("timed_steps", 10, "part (s): steps timed per configuration")

# Part (s): a GPT of the MMT medium's scale (the zoo has no medium GPT).
GPT_MEDIUM = dict(vocab_size=2048, seq_len=32, hidden=128, num_layers=4, num_heads=4, ffn=512)
SHARDED_CONFIGS = (
  "plain jit",
  "jit data parallel",
  "jit fsdp",
  "jit sharded",
  "graphpipe replicated",
  "graphpipe mesh shape",
  "graphpipe sharded",
)

CONFIGS = ("plain jit", "jit data parallel", "gpipe", "1f1b", "pipedream", "graphpipe")


def _run_sharded_child(cfg: dict) -> dict:
  """One configuration of part (s), run in its own process."""
  import statistics
  import time

  import jax

  import gpp_jax
  from gpp_jax.experiments import zoo

  sizes = GPT_MEDIUM if cfg["model"] == "gpt" else zoo.MEDIUM[cfg["model"]]
  run = zoo.setup(cfg["model"], "paper", **sizes)
  batch = run.batches(cfg["batch"], 1)[0]
  kind, n = cfg["config"], cfg["n"]
  kw: dict = dict(layer_depth=run.spec.layer_depth, memory_limit="64GiB", calibrate=False)
  mesh = f"data:{n // 2},model:2"
  probe = gpp_jax.graph_pipeline(run.train_step, num_microbatches=1, **kw)
  layers = tuple(probe.layer_graph_for(run.model, run.optimizer, batch).nodes)

  def one_stage(width: int, how: str) -> gpp_jax.Plan:
    return gpp_jax.Plan(
      (gpp_jax.Stage(0, layers, tuple(range(width))),), (), 1, planner=kind, param_sharding=how
    )

  M = cfg["m"]
  if kind == "plain jit":
    pp = gpp_jax.graph_pipeline(
      run.train_step,
      num_microbatches=1,
      devices=jax.devices()[:1],
      planner=one_stage(1, "model"),
      **kw,
    )
  elif kind in ("jit data parallel", "jit fsdp"):
    how = "replicated" if kind == "jit data parallel" else "fsdp"
    pp = gpp_jax.graph_pipeline(
      run.train_step, num_microbatches=1, devices=jax.devices()[:n], planner=one_stage(n, how), **kw
    )
  elif kind == "jit sharded":
    pp = gpp_jax.graph_pipeline(
      run.train_step, num_microbatches=1, mesh=mesh, planner=one_stage(n // 2, "model"), **kw
    )
  elif kind == "graphpipe replicated":
    pp = gpp_jax.graph_pipeline(
      run.train_step, num_microbatches=M, devices=jax.devices()[:n], planner="graphpipe",
      min_stages=2, **kw,
    )  # fmt: skip
  else:  # sharded stages; "mesh shape": every stage keeps the mesh's (stage_shapes=False)
    keep = {"stage_shapes": False} if kind == "graphpipe mesh shape" else {}
    pp = gpp_jax.graph_pipeline(
      run.train_step, num_microbatches=M, mesh=mesh, planner="graphpipe", min_stages=2,
      planner_options=keep, **kw,
    )  # fmt: skip
  first = float(pp(run.model, run.optimizer, batch))
  times = []
  for _ in range(cfg["timed"]):
    t = time.perf_counter()
    jax.block_until_ready(pp(run.model, run.optimizer, batch))
    times.append(time.perf_counter() - t)
  second = float(pp.measure_memory(run.model, run.optimizer, batch))
  rep = pp.memory
  return {
    "config": kind,
    "stages": pp.plan.num_stages,
    # Rows per stage, with "xK" where a stage narrows "model" to K (``Stage.inner``).
    "widths": [
      f"{len(s.devices)}" + ("" if s.inner is None else f"x{s.inner[0]}") for s in pp.plan.stages
    ],
    "max_measured": max(d.measured_peak_bytes for d in rep.devices),
    "max_predicted": max(d.predicted_peak_bytes for d in rep.devices),
    # The cost model's (what planners and the choice filter by), borrowing nothing measured.
    "max_modelled": pp.compiled.planned.memory.get("pipeline", 0.0),
    "measured_ms": statistics.median(times) * 1e3,
    "modelled_ms": (pp.compiled.planned.predicted_s or 0.0) * 1e3,
    "losses": [first, second],
  }


def sharded() -> None:
  n = 8
  print(
    f"\n(s) what a JAX user runs against pipelines, {n} forced CPU devices, batch "
    f"{FLAGS.batch_size}, {FLAGS.microbatches} micro-batches for the pipelines; memory measured "
    "(peak per device over a measuring step), the step's program's prediction (with the "
    "executables' measured temporaries) and the cost model's (no measurement); time measured "
    f"(median of {FLAGS.timed_steps} steps) and modelled (devices-only cost model, no "
    "calibration)"
  )
  print(
    f"{'model':6s} {'configuration':22s} {'stages':>16s} {'peak MiB':>9s} {'prog MiB':>9s} "
    f"{'model MiB':>9s} {'fits':>5s} {'step ms':>8s} {'model ms':>9s} {'vs plain':>8s}"
  )
  for model in FLAGS.sharded_models:
    rows = {}
    for kind in SHARDED_CONFIGS:
      cfg = dict(
        model=model, n=n, config=kind, batch=FLAGS.batch_size, m=FLAGS.microbatches,
        timed=FLAGS.timed_steps, sharded=True,
      )  # fmt: skip
      rows[kind] = child(cfg)
    plain = rows["plain jit"]
    budget = FLAGS.budget_fraction * plain.get("max_measured", 0)
    for kind, r in rows.items():
      if "error" in r:
        print(f"{model:6s} {kind:22s} failed: {r['error'][:90]}")
        continue
      fits = "yes" if r["max_measured"] <= budget else "no"
      ratio = plain["measured_ms"] / r["measured_ms"] if "measured_ms" in plain else float("nan")
      print(
        f"{model:6s} {kind:22s} {'/'.join(map(str, r['widths'])):>16s} "
        f"{mib(r['max_measured'])} {mib(r['max_predicted'])} {mib(r['max_modelled'])} "
        f"{fits:>5s} {r['measured_ms']:8.1f} {r['modelled_ms']:9.1f} "
        f"{ratio:7.2f}x",
        flush=True,
      )
    print(
      f"{model:6s} budget {budget / 2**20:.1f} MiB per device "
      f"({FLAGS.budget_fraction:.0%} of plain jit's peak)"
    )


def _run_child(cfg: dict) -> dict:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cfg['n']}"
  )
  if cfg.get("sharded"):
    return _run_sharded_child(cfg)
  import jax

  import gpp_jax
  from gpp_jax.experiments import zoo

  run = zoo.setup(cfg["model"], "paper", **zoo.MEDIUM[cfg["model"]])
  batch = run.batches(cfg["batch"], 1)[0]
  devices = jax.devices()[: cfg["n"]]
  layers = None
  kind = cfg["config"]
  kw: dict = dict(layer_depth=run.spec.layer_depth, memory_limit=cfg.get("limit") or "64GiB")
  if kind in ("plain jit", "jit data parallel"):
    graph = gpp_jax.graph_pipeline(run.train_step, num_microbatches=cfg["m"], **kw).layer_graph_for(
      run.model, run.optimizer, batch
    )
    layers = tuple(graph.nodes)
    width = 1 if kind == "plain jit" else cfg["n"]
    plan = gpp_jax.Plan((gpp_jax.Stage(0, layers, tuple(range(width))),), (), cfg["m"])
    pp = gpp_jax.graph_pipeline(
      run.train_step, num_microbatches=cfg["m"], devices=devices[:width], planner=plan, **kw
    )
  else:
    planner = "graphpipe" if kind in ("gpipe", "1f1b") else kind
    schedule = kind if kind in ("gpipe", "1f1b") else None
    pp = gpp_jax.graph_pipeline(
      run.train_step,
      num_microbatches=cfg["m"],
      devices=devices,
      planner=planner,
      schedule=schedule,
      **kw,
    )
  first = float(pp(run.model, run.optimizer, batch))
  second = float(pp.measure_memory(run.model, run.optimizer, batch))
  rep = pp.memory
  devs = [d for d in rep.devices if d.measured_peak_bytes >= 1 << 20] or list(rep.devices)

  def error(d) -> float:  # against what the step holds (arrays outside it are not its own)
    held = d.measured_peak_bytes - d.breakdown.get("outside the step", 0)
    return d.predicted_peak_bytes / max(held, 1) - 1

  worst = max(devs, key=lambda d: abs(error(d)))
  return {
    "config": kind,
    "stages": pp.plan.num_stages,
    "depth": pp.plan.depth(),
    "schedule": pp.schedule.name,
    "max_measured": max(d.measured_peak_bytes for d in rep.devices),
    "sum_measured": sum(d.measured_peak_bytes for d in rep.devices),
    "max_predicted": max(d.predicted_peak_bytes for d in rep.devices),
    "worst_error": error(worst),
    "outside_max": max(d.breakdown.get("outside the step", 0) for d in rep.devices),
    "stash_max": max(d.breakdown.get("stashed activations", 0) for d in rep.devices),
    "stash_sum": sum(d.breakdown.get("stashed activations", 0) for d in rep.devices),
    "devices": [d.to_dict() for d in rep.devices],
    "losses": [first, second],
  }


def child(cfg: dict) -> dict:
  r = run_child(__file__, cfg)
  return {"config": cfg["config"], **r} if "error" in r else r


def mib(x: float) -> str:
  return f"{x / 2**20:9.1f}"


def peaks() -> None:
  print("(a) peak memory per device, measured (one memory-measuring step per configuration)")
  print(
    "    worst err: the program's prediction against what the step holds on the device "
    "(measured minus the arrays outside the step, last column), worst device of >= 1 MiB"
  )
  print(
    f"{'model':10s} {'n':>2s} {'configuration':18s} {'stages':>6s} {'depth':>5s} "
    f"{'max MiB':>9s} {'sum MiB':>9s} {'pred max':>9s} {'worst err':>9s} "
    f"{'stash max':>9s} {'stash sum':>9s} {'outside':>9s}"
  )
  for model in FLAGS.models:
    for n in map(int, FLAGS.devices):
      for kind in CONFIGS:
        r = child(dict(model=model, n=n, config=kind, batch=FLAGS.batch_size, m=FLAGS.microbatches))
        if "error" in r:
          print(f"{model:10s} {n:2d} {kind:18s} failed: {r['error'][:90]}")
          continue
        print(
          f"{model:10s} {n:2d} {kind:18s} {r['stages']:6d} {r['depth']:5d} "
          f"{mib(r['max_measured'])} {mib(r['sum_measured'])} {mib(r['max_predicted'])} "
          f"{r['worst_error']:+9.1%} {mib(r['stash_max'])} {mib(r['stash_sum'])} "
          f"{mib(r['outside_max'])}",
          flush=True,
        )


def fit() -> None:
  print("\n(b) fitting under a budget")
  model = FLAGS.models[0]
  plain = child(
    dict(model=model, n=1, config="plain jit", batch=FLAGS.batch_size, m=FLAGS.microbatches)
  )
  if "error" in plain:
    print(f"plain jit failed: {plain['error']}")
    return
  budget = int(0.7 * plain["max_measured"])
  print(
    f"{model}: the plain step on one device peaks at {plain['max_measured'] / 2**20:.1f} MiB; "
    f"budget {budget / 2**20:.1f} MiB per device"
  )
  for planner in ("graphpipe", "pipedream", "balanced"):
    r = child(
      dict(
        model=model, n=4, config=planner, batch=FLAGS.batch_size, m=FLAGS.microbatches,
        limit=budget,
      )
    )  # fmt: skip
    if "error" in r:
      print(f"  {planner:10s} under the budget: {r['error'][:100]}")
      continue
    over = [d for d in r["devices"] if d["measured_peak_bytes"] > budget]
    diff = max(abs(a - b) for a, b in zip(r["losses"], plain["losses"]))
    print(
      f"  {planner:10s} {r['stages']} stages, peak {r['max_measured'] / 2**20:.1f} MiB measured "
      f"({'every device under the budget' if not over else f'{len(over)} devices over'}); "
      f"losses of two steps vs the one-device step: max difference {diff:.1e}"
    )


def largest_microbatch() -> None:
  """(c) The paper's models on a simulated V100 cluster: for each planner, the largest
  micro-batch (fewest micro-batches of the mini-batch) whose plan fits ``--mb_budget``."""
  from gpp_jax.cli.plan import PlanOptions, compare, default_batch_size
  from gpp_jax.cost.memory import format_bytes
  from gpp_jax.runtime.memory import parse_bytes

  budget = parse_bytes(FLAGS.mb_budget)
  n = FLAGS.mb_devices
  print(
    f"\n(c) largest micro-batch that fits {format_bytes(budget)} per device, paper models on "
    f"{n} simulated V100s (planner predictions, nothing run)"
  )
  planners = ["graphpipe", "pipedream", "piper", "bapipe", "luo"]
  print(f"{'model':12s} {'batch':>6s} " + " ".join(f"{p:>10s}" for p in planners))
  for model in FLAGS.models:
    B = default_batch_size(model, n)
    best: dict[str, int | None] = {}
    for p in planners:
      best[p] = None
      for M in sorted({B // b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if B % b == 0}):
        if M < 1 or B % M:
          continue
        r = compare(PlanOptions(
          model, cluster="v100", num_devices=n, planners=[p], num_microbatches=M,
          memory_limit=budget,
        ))["results"][0]  # fmt: skip
        if "error" not in r:
          best[p] = B // M
          break
    print(
      f"{model:12s} {B:6d} " + " ".join(f"{best[p] if best[p] else '-':>10}" for p in planners),
      flush=True,
    )


def main(argv):
  del argv
  if FLAGS.child:
    print("RESULT " + json.dumps(_run_child(json.loads(FLAGS.child))), flush=True)
    return
  if "peaks" in FLAGS.parts:
    peaks()
  if "sharded" in FLAGS.parts:
    sharded()
  if "fit" in FLAGS.parts:
    fit()
  if "microbatch" in FLAGS.parts:
    largest_microbatch()


if __name__ == "__main__":
  app.run(main)
