"""Planning from the command line: several planners' plans for one model and cluster, side by side.

  python -m gpp_jax.plan --model=dlrm --preset=paper --cluster=v100 --num_devices=32 \\
      --planner=graphpipe,pipedream-published,pipedream,piper-published,piper,bapipe,luo

``pipedream-published`` and ``piper-published`` are PipeDream and Piper as published (their own
objective, the smallest bottleneck, with no simulation ranking and no polish); ``pipedream``
and ``piper`` are the polished baselines (simulation-ranked, then ``refine.polish``).

Prints each planner's Plan table, then one summary row per planner: stages, depth, micro-batch,
predicted iteration time, throughput, peak memory per device and search time. Nothing is run:
the numbers are the cost model's and simulator's predictions for the cluster preset. A planner
that cannot plan (Piper's state limit, no plan fitting memory) gets its error message in its
row. ``--json=PATH`` also writes the rows and plans as JSON.

Models are the synthetic LayerGraphs of ``gpp_jax.experiments.model_graphs``
(``--preset=paper``: the GraphPipe paper's shapes; ``--preset=tiny``: the same topologies at
small widths);
``--shape=branches=16`` overrides a shape argument. The mini-batch defaults to
``planner_runs.PER_DEVICE_BATCH[model]`` samples per device.

A GPT of any size (``--model=gpt`` with ``--gpt_layers``, ``--gpt_hidden``, ``--gpt_heads``,
``--seq_len``, ``--vocab_size``, ``--batch_size``) is priced as Megatron-LM runs it
(``experiments.megatron``): ``--layout=tp:8,pp:8`` simulates that layout; otherwise the
planners choose its stages over ``--mesh=data:R,model:t`` (by default rows of a node's GPUs).

Progress (which planner runs, how far, elapsed seconds) goes to stderr; the report to stdout.
A bad flag value (unknown model or planner, a malformed ``--shape``, a ``--num_microbatches``
that does not divide the mini-batch, an unwritable ``--json``) stops before planning with a
message naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx
from absl import app, flags
from absl.flags import FlagValues

from gpp_jax.cost.cluster import Cluster, make_cluster
from gpp_jax.cost.memory import format_bytes
from gpp_jax.errors import counted
from gpp_jax.experiments import model_graphs
from gpp_jax.experiments.planner_runs import (
  MODEL_LABELS,
  PLANNER_VARIANTS,
  build_graph,
  default_batch_size,
  resolve_planner,
  run_planner,
  short_error,
)
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition import PLANNERS
from gpp_jax.passes.partition.shared import default_stages_per_device
from gpp_jax.runtime.memory import parse_bytes

if TYPE_CHECKING:
  from gpp_jax.experiments.megatron import GPTShape

FLAGS = flags.FLAGS
DEFAULT_PLANNERS = (
  "graphpipe",
  "pipedream-published",
  "pipedream",
  "piper-published",
  "piper",
  "bapipe",
  "luo",
)


def define_flags() -> None:
  """Defines the CLI's flags (called by ``run``; other entry points define flags of the same
  names, so importing this module defines none)."""
  flags.DEFINE_string("model", "dlrm", "model graph: mmt, dlrm, candle_uno, gpt or chain")
  flags.DEFINE_enum("preset", "paper", ["paper", "tiny"], "model shapes: the paper's or tiny")
  flags.DEFINE_list("shape", [], "shape overrides as key=value (e.g. branches=16,layers=2)")
  flags.DEFINE_enum(
    "cluster",
    "v100",
    ["v100", "cuda", "cpu", "a100", "h100"],
    "cluster preset (a100: Selene's DGX A100s as Megatron-LM's SC'21 paper describes them; "
    "h100: DGX H100s)",
  )
  flags.DEFINE_integer("num_devices", 8, "devices in the cluster")
  flags.DEFINE_list(
    "planner",
    list(DEFAULT_PLANNERS),
    "planners to run, in this order (any of "
    f"{', '.join(sorted(PLANNERS) + sorted(PLANNER_VARIANTS))})",
  )
  flags.DEFINE_integer(
    "batch_size", None, "mini-batch size (default: per-model samples per device x num_devices)"
  )
  flags.DEFINE_integer(
    "num_microbatches",
    None,
    "fix the number of micro-batches (default: each planner sweeps micro-batch sizes)",
  )
  flags.DEFINE_string(
    "memory_limit",
    None,
    "bytes a plan may use per device, e.g. 512MiB or 12GiB (default: the cluster preset's)",
  )
  flags.DEFINE_string(
    "stages_per_device",
    None,
    "stages each device may run: 1, a larger number (Megatron-style interleaving on the stage "
    "DAG, schedule interleaved-1f1b), or auto (each planner chooses 1, 2 or 4 by prediction); "
    "default: auto on accelerator clusters, 1 on the cpu preset",
  )
  flags.DEFINE_string("json", None, "also write the results to this JSON file")
  flags.DEFINE_string(
    "layout",
    None,
    "--model=gpt only: plan exactly this layout, e.g. tp:8,pp:8 (tensor parallel inside a "
    "node, pp equal pipeline stages, data parallel over the rest; Megatron-LM's)",
  )
  flags.DEFINE_string(
    "mesh",
    None,
    "--model=gpt only: the devices as a mesh, e.g. data:192,model:8: the planners choose the "
    "stages over the rows of the first axis (pipeline and data parallel), each stage tensor "
    "parallel over the other (the model's Megatron-style specs), priced as --layout prices it; "
    "with the GPT's shape flags and neither --mesh nor --layout, rows of a node's GPUs",
  )
  flags.DEFINE_integer("gpt_layers", None, "--model=gpt: Transformer layers")
  flags.DEFINE_integer("gpt_hidden", None, "--model=gpt: hidden size")
  flags.DEFINE_integer("gpt_heads", None, "--model=gpt: attention heads")
  flags.DEFINE_integer("seq_len", None, "--model=gpt: sequence length")
  flags.DEFINE_integer("vocab_size", None, "--model=gpt: vocabulary size")
  flags.DEFINE_integer("microbatch_size", 1, "--layout: sequences per micro-batch")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
  """The CLI's settings, one field per flag (``from_flags``), as ``prepare``, ``compare``,
  ``plan_layout`` and ``plan_mesh`` read them.

  Attributes:
    model: model graph (``model_graphs.PRESETS``). preset: "paper" or "tiny".
    shape: shape overrides of the model graph (``--shape``, ``parse_shape``).
    cluster: cluster preset; num_devices: devices in it.
    planners: planners to run, in this order (``--planner``).
    batch_size: the mini-batch (None: ``default_batch_size``).
    num_microbatches: fixed number of micro-batches (None: each planner sweeps).
    memory_limit: bytes a plan may use per device, a number or "512MiB" (None: the preset's).
    stages_per_device: 1, a larger number or "auto", as the flag gives it; None (the flag's
      default): ``shared.default_stages_per_device`` of the cluster, "auto" on accelerators.
    json: also write the results to this file.
    layout, mesh: ``--model=gpt`` only: plan exactly this layout, or over this mesh.
    gpt_layers, gpt_hidden, gpt_heads, seq_len, vocab_size: the GPT's shape (``gpt_shape``).
    microbatch_size: ``--layout``'s sequences per micro-batch.
  """

  model: str
  preset: str = "paper"
  shape: Mapping[str, int] = dataclasses.field(default_factory=dict)
  cluster: str = "v100"
  num_devices: int = 8
  planners: Sequence[str] = DEFAULT_PLANNERS
  batch_size: int | None = None
  num_microbatches: int | None = None
  memory_limit: int | str | None = None
  stages_per_device: int | str | None = None
  json: str | None = None
  layout: str | None = None
  mesh: str | None = None
  gpt_layers: int | None = None
  gpt_hidden: int | None = None
  gpt_heads: int | None = None
  seq_len: int | None = None
  vocab_size: int | None = None
  microbatch_size: int = 1

  @classmethod
  def from_flags(cls, values: FlagValues) -> PlanOptions:
    """The options the flags give, all but ``--shape`` (``parse_shape`` reads it, rejecting a
    malformed one, where the model graph is planned)."""
    return cls(
      model=values.model,
      preset=values.preset,
      cluster=values.cluster,
      num_devices=values.num_devices,
      planners=tuple(values.planner),
      batch_size=values.batch_size,
      num_microbatches=values.num_microbatches,
      memory_limit=values.memory_limit,
      stages_per_device=values.stages_per_device,
      json=values.json,
      layout=values.layout,
      mesh=values.mesh,
      gpt_layers=values.gpt_layers,
      gpt_hidden=values.gpt_hidden,
      gpt_heads=values.gpt_heads,
      seq_len=values.seq_len,
      vocab_size=values.vocab_size,
      microbatch_size=values.microbatch_size,
    )


def parse_shape(items: Sequence[str]) -> dict[str, int]:
  """``["branches=16", "layers=2"]`` -> ``{"branches": 16, "layers": 2}``."""
  shape = {}
  for item in items:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
      raise ValueError(f"--shape entries are key=value (e.g. --shape=branches=16), got {item!r}")
    if key == "batch_size":
      raise ValueError("--shape batch_size: set the mini-batch with --batch_size")
    if not value.strip().isdigit() or int(value) < 1:
      raise ValueError(f"--shape {key}: expected a positive integer, got {value!r}")
    shape[key] = int(value)
  return shape


def prepare(options: PlanOptions) -> tuple[nx.DiGraph, Cluster, int]:
  """Checks the options before anything is planned and returns the model graph, the cluster
  and the mini-batch; a bad option raises ValueError naming it and what to pass instead."""
  model, planners, num_devices = options.model, options.planners, options.num_devices
  batch_size, num_microbatches = options.batch_size, options.num_microbatches
  if model not in model_graphs.PRESETS:
    raise ValueError(f"unknown model {model!r}; choose one of {sorted(model_graphs.PRESETS)}")
  if not planners:
    raise ValueError(f"no planner given; name one or more of {sorted(PLANNERS)}")
  for name in planners:
    resolve_planner(name)  # an unknown name fails before anything runs
  if num_devices < 1:
    raise ValueError(f"--num_devices must be at least 1, got {num_devices}")
  parse_stages_per_device(options.stages_per_device)
  if batch_size is not None and batch_size < 1:
    raise ValueError(
      f"--batch_size must be at least 1, got {batch_size} (leave it out for the default "
      f"{default_batch_size(model, num_devices)} samples)"
    )
  batch = default_batch_size(model, num_devices) if batch_size is None else batch_size
  if num_microbatches is not None and (num_microbatches < 1 or batch % num_microbatches):
    raise ValueError(
      f"--num_microbatches={num_microbatches} does not divide the mini-batch of {batch} "
      "samples; pick a divisor, change --batch_size, or leave it out to let the planners "
      "choose"
    )
  graph = build_graph(model, options.preset, batch, **dict(options.shape))
  cl = make_cluster(options.cluster, num_devices)
  if options.memory_limit is not None:
    cl = cl.replace(memory_per_device=float(parse_bytes(options.memory_limit)))
  return graph, cl, batch


def parse_stages_per_device(value: int | str | None) -> int | str | None:
  """``--stages_per_device``: a positive integer or ``auto`` (None where not given);
  ValueError naming both else."""
  if value is None or value == "auto":
    return value
  try:
    v = int(value)
  except (TypeError, ValueError):
    v = 0
  if v < 1:
    raise ValueError(f"--stages_per_device must be a positive integer or auto, got {value!r}")
  return v


def stages_per_device_option(value: str | None) -> dict:
  """``--stages_per_device`` as ``graph_pipeline``'s planner option (none where not given:
  the planner's default, ``shared.default_stages_per_device``); a bad value is a usage error
  naming the flag."""
  try:
    v = parse_stages_per_device(value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  return {} if v is None else {"stages_per_device": v}


def stages_per_device_for(options: PlanOptions, cluster: Cluster) -> int | str:
  """What the planners are asked for on ``cluster``: ``--stages_per_device``, else the
  default (``shared.default_stages_per_device``: "auto" on accelerators, 1 on CPU devices)."""
  v = parse_stages_per_device(options.stages_per_device)
  return default_stages_per_device(cluster) if v is None else v


def compare(options: PlanOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Runs ``options.planners`` on one model and cluster; returns the configuration and one row
  per planner (``planner_runs.run_planner`` rows, each with its ``plan`` when it planned). Bad
  options raise ValueError before anything runs (``prepare``). ``progress`` gets a line
  before and after each planner: ``"[2/5] pipedream ..."`` and its result with the elapsed
  seconds."""
  graph, cl, batch = prepare(options)
  planners, num_microbatches = options.planners, options.num_microbatches
  per_device = stages_per_device_for(options, cl)
  planner_options = {} if per_device == 1 else {"stages_per_device": per_device}
  rows = []
  t0 = time.perf_counter()
  for i, name in enumerate(planners, 1):
    if progress is not None:
      progress(f"[{i}/{len(planners)}] {name} ... ({time.perf_counter() - t0:.1f} s elapsed)")
    rows.append(
      run_planner(
        name,
        graph,
        cl,
        batch,
        num_microbatches=num_microbatches,
        keep_plan=True,
        **planner_options,
      )
    )
    if progress is not None:
      r = rows[-1]
      result = f"failed: {short_error(r)}" if "error" in r else f"{r['throughput']:.1f} samples/s"
      progress(
        f"[{i}/{len(planners)}] {name} {result} (search {r['seconds']:.2f} s, "
        f"{time.perf_counter() - t0:.1f} s elapsed)"
      )
  return {
    "model": options.model,
    "graph": graph.graph.get("name", options.model),
    "layers": len(graph),
    "preset": options.preset,
    "cluster": cl.name,
    "num_devices": options.num_devices,
    "memory_per_device": cl.memory_per_device,
    "batch_size": batch,
    "num_microbatches": num_microbatches,
    "shape": dict(options.shape),
    "stages_per_device": per_device,
    "results": rows,
  }


def format_report(report: Mapping[str, Any]) -> str:
  """The plans one after another, then the side-by-side summary table."""
  rows = report["results"]
  lines = [
    f"Planning {MODEL_LABELS.get(report['model'], report['model'])} "
    f"({report['graph']}, {report['layers']} layers, {report['preset']} preset) on "
    f"{report['cluster']}, mini-batch {report['batch_size']}"
    + (f", {report['num_microbatches']} micro-batches" if report["num_microbatches"] else "")
    + ". Nothing is run: times are simulated predictions.",
    "",
  ]
  for r in rows:
    lines.append(f"== {r['planner']} (search {r['seconds']:.2f} s) ==")
    lines.append(str(r["plan"]) if "plan" in r else f"no plan: {r['error']}")
    lines.append("")
  best = max((r["throughput"] for r in rows if r.get("throughput")), default=None)
  header = (
    f"{'planner':19s} {'stages':>6s} {'v':>2s} {'depth':>5s} {'mb':>5s} {'M':>4s} "
    f"{'iter ms':>10s} {'samples/s':>11s} {'peak GiB':>8s} {'fits':>4s} "
    f"{'search s':>8s} {'vs best':>7s}"
  )
  lines += [
    f"Summary ({report['cluster']}, {format_bytes(report['memory_per_device'])} per device)",
    header,
    "-" * len(header),
  ]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['planner']:19s} FAILED after {r['seconds']:.2f} s: {short_error(r)}")
      continue
    lines.append(
      f"{r['planner']:19s} {r['stages']:6d} {r.get('stages_per_device', 1):2d} {r['depth']:5d} "
      f"{r['microbatch'] or 0:5d} "
      f"{r['num_microbatches']:4d} {r['iteration_time'] * 1e3:10.3f} {r['throughput']:11.1f} "
      f"{r['max_memory'] / 2**30:8.2f} {'yes' if r['memory_ok'] else 'NO':>4s} "
      f"{r['seconds']:8.2f} {r['throughput'] / best:7.3f}"
    )
  return "\n".join(lines)


def report_to_json(report: Mapping[str, Any]) -> dict[str, Any]:
  """The report with each Plan as its dict (``Plan.from_dict`` reads it back)."""
  out = dict(report)
  out["results"] = [
    {k: (v.to_dict() if isinstance(v, Plan) else v) for k, v in r.items()}
    for r in report["results"]
  ]
  return out


def stderr_progress(msg: str) -> None:
  """Progress lines on stderr (stdout carries the report)."""
  print(msg, file=sys.stderr, flush=True)


def check_json_path(path: str | None) -> None:
  """ValueError when ``--json`` cannot be written (checked before planning, which may be long)."""
  if path is None:
    return
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise ValueError(f"--json={path} is a folder; give a file name such as {path}/plans.json")
  if not os.path.isdir(folder):
    raise ValueError(f"--json={path}: folder {folder} does not exist; create it or pick another")


def parse_layout(text: str) -> dict[str, int]:
  """``tp:8,pp:8`` -> ``{"tp": 8, "pp": 8}``; ValueError naming what is wrong."""
  out: dict[str, int] = {}
  for part in text.split(","):
    key, sep, value = part.strip().partition(":")
    if key not in ("tp", "pp") or not sep or not value.isdigit() or int(value) < 1:
      raise ValueError(f"--layout={text}: expected tp:<int>,pp:<int> (e.g. tp:8,pp:8)")
    out[key] = int(value)
  return {"tp": out.get("tp", 1), "pp": out.get("pp", 1)}


def plan_layout(options: PlanOptions) -> list[dict[str, Any]]:
  """The records of the GPT's ``options.layout`` (``experiments.megatron.predict_layout``):
  one per plan, with ``planner`` ("layout"), ``iteration_ms``, ``samples_per_s`` and
  ``tflops_per_device`` (the paper's FLOPs per iteration / time / devices), the best of 1, 2
  and 4 stages per device where ``options.stages_per_device`` is "auto" or not given.
  ValueError naming a flag that is malformed or missing."""
  from gpp_jax.experiments.megatron import Row, predict_layout

  layout = parse_layout(options.layout or "")
  spd = parse_stages_per_device(options.stages_per_device)
  shape = gpt_shape(options, "--layout")
  assert options.batch_size is not None  # gpt_shape checked it
  row = Row(
    0.0,
    shape.heads,
    shape.hidden,
    shape.layers,
    layout["tp"],
    layout["pp"],
    options.num_devices,
    options.batch_size,
    0,
    seq=shape.seq,
    vocab=shape.vocab,
  )
  vs = (1, 2, 4) if spd is None or spd == "auto" else (int(spd),)
  rec = predict_layout(row, options.cluster, options.microbatch_size, vs)
  plan = rec.pop("plan")
  return [{**rec, "plan": plan}]


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; everything is given as --flags")
  options = PlanOptions.from_flags(FLAGS)
  if options.layout:
    layout_main(options)
    return
  if options.model == "gpt" and not options.mesh and gives_gpt_shape(options):
    # A GPT of the given shape: the planners search its stages, tensor parallelism inside a
    # node and data parallelism, over rows of a node's GPUs.
    try:
      gpt_shape(options, "--model=gpt")
      options = dataclasses.replace(options, mesh=default_gpt_mesh(options))
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    print(
      f"--mesh not given: the GPT is planned over --mesh={options.mesh} (tensor parallel "
      "inside a node, at most its GPUs; pass --mesh or --layout to choose)\n"
    )
  if options.mesh:
    mesh_main(options)
    return
  try:  # bad flag values: the message alone, no traceback
    check_json_path(options.json)
    options = dataclasses.replace(options, shape=parse_shape(FLAGS.shape))
    prepare(options)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  report = compare(options, progress=stderr_progress)
  print(format_report(report))
  if options.json:
    with open(options.json, "w") as f:
      json.dump(report_to_json(report), f, indent=1)
    print(f"\nwrote {options.json}")


GPT_SHAPE_FLAGS = ("gpt_layers", "gpt_hidden", "gpt_heads", "seq_len", "vocab_size")


def gives_gpt_shape(options: PlanOptions) -> bool:
  """Whether any of the GPT's shape flags is given (``gpt_shape`` then needs them all)."""
  return any(getattr(options, k) is not None for k in GPT_SHAPE_FLAGS)


def default_gpt_mesh(options: PlanOptions) -> str:
  """The mesh a GPT of a given shape is planned over without ``--mesh`` or ``--layout``:
  rows of a node's GPUs (``data:N/g,model:g``, g the cluster's devices per node that divide
  the N devices; 1 on a one-level cluster)."""
  n = options.num_devices
  if n < 1:
    raise ValueError(f"--num_devices must be at least 1, got {n}")
  per_node = make_cluster(options.cluster, n).devices_per_node or 1
  g = math.gcd(per_node, n)
  return f"data:{n // g},model:{g}"


def gpt_shape(options: PlanOptions, flag: str) -> GPTShape:
  """The GPT's shape from ``options``, which also needs ``batch_size``: ValueError naming the
  missing flags, all required by ``flag``."""
  from gpp_jax.experiments.megatron import GPTShape

  if options.batch_size is None:
    raise ValueError(f"{flag} needs --batch_size (sequences per iteration)")
  need = {k: getattr(options, k) for k in GPT_SHAPE_FLAGS}
  missing = sorted(k for k, v in need.items() if v is None)
  if missing:
    pass_ = ", ".join("--" + m for m in missing)
    raise ValueError(f"{flag} needs the GPT's shape: pass {pass_}")
  return GPTShape(*need.values())


def plan_mesh(options: PlanOptions) -> list[dict[str, Any]]:
  """Each planner's plan for the GPT over ``options.mesh`` (``data:R,model:t``, R x t = the
  devices): stages over the R rows, each tensor parallel over t GPUs of a node, priced as
  ``experiments.megatron`` prices a layout. One record per planner: ``planner``,
  ``iteration_ms``, ``samples_per_s``, ``tflops_per_device`` (the Megatron-LM paper's FLOP
  count) and the plan, or ``error``. ValueError naming a flag that is malformed or missing."""
  from gpp_jax.experiments.megatron import (
    MEGATRON_COST_MODEL,
    gpt_graph,
    paper_flops,
    row_cluster,
  )

  shape = gpt_shape(options, "--mesh")
  for name in options.planners:
    resolve_planner(name)
  mesh, num_devices, batch_size = options.mesh or "", options.num_devices, options.batch_size
  assert batch_size is not None  # gpt_shape checked it
  axes = [part.strip().partition(":") for part in mesh.split(",")]
  if len(axes) != 2 or any(not n or not sep or not v.isdigit() or int(v) < 1 for n, sep, v in axes):
    raise ValueError(
      f"--mesh={mesh}: give two axes as NAME:SIZE, the rows and the model (e.g. data:8,model:8)"
    )
  names = [n for n, _, _ in axes]
  rows, tp = (int(v) for _, _, v in axes)
  if rows * tp != num_devices:
    raise ValueError(f"--mesh={mesh} has {rows * tp} devices but --num_devices={num_devices}")
  rc = row_cluster(make_cluster(options.cluster, num_devices), tp)
  graph = gpt_graph(shape, batch_size, tp)
  flops = paper_flops(batch_size, shape.seq, shape.layers, shape.hidden, shape.vocab)
  per_device = stages_per_device_for(options, rc)
  planner_options = {} if per_device == 1 else {"stages_per_device": per_device}
  out: list[dict[str, Any]] = []
  for name in options.planners:
    t0 = time.perf_counter()
    row = run_planner(
      name,
      graph,
      rc,
      batch_size,
      keep_plan=True,
      cost_model=MEGATRON_COST_MODEL,
      max_microbatches=4096,
      **planner_options,
    )
    if "error" in row:
      where = f"{names[0]}:{rows},{names[1]}:{tp}"
      out.append({"planner": name, "mesh": where, "error": row["error"], "seconds": row["seconds"]})
      continue
    T = row["iteration_time"]
    out.append(
      {
        "planner": name,
        "mesh": f"{names[0]}:{rows},{names[1]}:{tp}",
        "stages_per_device": row.get("stages_per_device", 1),
        "iteration_ms": T * 1e3,
        "samples_per_s": batch_size / T,
        "tflops_per_device": flops / T / num_devices / 1e12,
        "seconds": time.perf_counter() - t0,
        "costs": graph.graph["costs"],
        "plan": row["plan"],
      }
    )
  return out


def mesh_main(options: PlanOptions) -> None:
  """``--mesh``: the planners' plans for a GPT over a (rows x model) mesh."""
  if options.model != "gpt":
    raise app.UsageError("--mesh plans a GPT over a (rows x model) mesh: pass --model=gpt")
  try:
    check_json_path(options.json)
    records = plan_mesh(options)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  for r in records:
    if "error" in r:
      width = r["mesh"].rpartition(":")[2]
      print(
        f"== {r['planner']}: no plan over --mesh={r['mesh']} (each device below is a row of "
        f"{width} GPUs): {r['error']}\n"
      )
      continue
    print(f"== {r['planner']} (search {r['seconds']:.2f} s) ==\n{r['plan']}")
    print(
      f"{r['iteration_ms'] / 1e3:.3f} s an iteration, {r['samples_per_s']:.1f} sequences/s, "
      f"{r['tflops_per_device']:.1f} TFLOP/s per GPU (modelled; the Megatron-LM paper's FLOP "
      f"count), {counted(r['stages_per_device'], 'stage')} per device; the GPT's FLOPs and "
      f"parameters {r['costs']}\n"
    )
  if options.json:
    out = [{k: (v.to_dict() if isinstance(v, Plan) else v) for k, v in r.items()} for r in records]
    with open(options.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {options.json}")


def layout_main(options: PlanOptions) -> None:
  """``--layout``: the given layout of a GPT, simulated; prints it and writes ``--json``."""
  if options.model != "gpt":
    raise app.UsageError("--layout plans a GPT's tensor x pipeline x data layout: pass --model=gpt")
  try:
    check_json_path(options.json)
    records = plan_layout(options)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  for r in records:
    print(r["plan"])
    print(
      f"\n{r['layout']} on {options.num_devices} {options.cluster} GPUs: iteration "
      f"{r['iteration_ms'] / 1e3:.3f} s, {r['samples_per_s']:.1f} sequences/s, "
      f"{r['tflops_per_device']:.1f} TFLOP/s per GPU (modelled; the paper's FLOP count), "
      f"{counted(r['stages_per_device'], 'stage')} per device, "
      f"{r['num_microbatches']} micro-batches; "
      f"the GPT's FLOPs and parameters {r['costs']}"
    )
    fits = "fits" if r["fits_memory"] else "DOES NOT FIT"
    print(
      f"peak memory {r['peak_memory_gib']:.1f} GiB per GPU (modelled): {fits} in a GPU's "
      f"{r['memory_per_gpu_gib']:.0f} GiB"
      + (
        ""
        if r["fits_memory"]
        else "; use more pipeline stages (pp), more GPUs or a smaller --microbatch_size"
      )
    )
  if options.json:
    out = [
      {k: v for k, v in r.items() if k != "plan"} | {"plan": r["plan"].to_dict()} for r in records
    ]
    with open(options.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"\nwrote {options.json}")


def run(argv: Sequence[str] | None = None) -> None:
  """Defines the flags and runs ``main`` under absl (``python -m gpp_jax.plan``)."""
  define_flags()
  app.run(main, argv=None if argv is None else list(argv))


if __name__ == "__main__":
  run()
