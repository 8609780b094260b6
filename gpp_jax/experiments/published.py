"""Megatron-LM's published GPT runs against the simulator (``gpp_jax.experiments.published``).

For every row of Narayanan et al.'s Table 1 (SC'21: GPT 1.7B-1T on 32-3,072 A100s of Selene),
the paper's layout (tensor-parallel and pipeline-parallel sizes as published, data parallel
over the rest, micro-batches of one sequence, the interleaved schedule with the number of
stages per device that the simulator finds fastest among 1, 2 and 4) is simulated on the
``a100`` cluster preset, and the achieved teraFLOP/s per GPU (the paper's FLOPs per iteration
/ the predicted iteration time / GPUs) is printed beside the published one, with the error.
Every figure is modelled; the published ones were measured by the paper's authors. It writes
``docs/published.md`` (``--markdown``) and the records as JSON (``--json``).

  python -m gpp_jax.experiments.published
  python -m gpp_jax.experiments.published --rows=1.7,1008.0 --markdown= --json=/tmp/rows.json
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

from gpp_jax.errors import PlanError
from gpp_jax.experiments.megatron import (
  FITTED_ON,
  MEGATRON_COST_MODEL,
  SEQ_LEN,
  TABLE_1,
  VOCAB,
  Row,
  gpt_graph,
  paper_flops,
  paper_params,
  predict_layout,
  row_cluster,
)

FLAGS = flags.FLAGS


def graphpipe_own(row: Row, cluster: str = "a100") -> dict[str, Any]:
  """GraphPipe's own plan for ``row`` on the paper's tensor-parallel size (it chooses the
  stages, their rows and the micro-batches): teraFLOP/s per GPU and its search seconds, or
  the reason it found none."""
  from gpp_jax.cost.cluster import make_cluster
  from gpp_jax.passes.partition import PLANNERS

  rows = row_cluster(make_cluster(cluster, row.gpus), row.tp)
  graph = gpt_graph(row.batch, row.layers, row.hidden, row.heads, SEQ_LEN, VOCAB, row.tp)
  t0 = time.perf_counter()
  try:
    plan = PLANNERS["graphpipe"](
      graph, rows, row.batch, cost_model=MEGATRON_COST_MODEL, max_microbatches=4096
    )
  except PlanError as e:
    return {"graphpipe_error": str(e).split(";")[0], "graphpipe_seconds": time.perf_counter() - t0}
  T = plan.predicted["iteration_time"]
  flops = paper_flops(row.batch, SEQ_LEN, row.layers, row.hidden, VOCAB)
  return {
    "graphpipe_tflops": flops / T / row.gpus / 1e12,
    "graphpipe_stages": plan.num_stages,
    "graphpipe_microbatches": plan.num_microbatches,
    "graphpipe_seconds": time.perf_counter() - t0,
  }


def compare(
  rows: Sequence[Row] = TABLE_1, cluster: str = "a100", own: bool = True
) -> list[dict[str, Any]]:
  """One record per row: the published figure, the layout's prediction and its error, and
  (``own``) GraphPipe's own plan."""
  out = []
  for row in rows:
    t0 = time.perf_counter()
    rec = predict_layout(row, cluster)
    rec.pop("plan")
    rec.update(
      params_b=row.params_b,
      params_b_formula=round(paper_params(row.layers, row.hidden) / 1e9, 1),
      gpus=row.gpus,
      batch=row.batch,
      published_tflops=row.tflops,
      error=rec["tflops_per_device"] / row.tflops - 1,
      fitted_on=row.params_b in FITTED_ON,
      seconds=time.perf_counter() - t0,
    )
    if own:
      rec.update(graphpipe_own(row, cluster))
    out.append(rec)
  return out


# The paper's Table 2: ZeRO-3 without model parallelism against PTD-P (tp 8 and pp 12 for
# GPT-3 175B, pp 35 for 530B), global batch fixed as GPUs double: (params B, layers, hidden,
# heads, pp, [(GPUs, batch, ZeRO-3 micro-batch, ZeRO-3 TFLOP/s, PTD-P GPUs, PTD-P TFLOP/s)]).
TABLE_2 = (
  (174.6, 96, 12288, 96, 12, ((384, 1536, 4, 144, 384, 153), (768, 1536, 2, 88, 768, 149),
                              (1536, 1536, 1, 44, 1536, 141))),
  (529.6, 105, 20480, 128, 35, ((640, 2560, 4, 138, 560, 171), (1120, 2240, 2, 98, 1120, 167),
                                (2240, 2240, 1, 48, 2240, 159))),
)  # fmt: skip


def zero3(cluster: str = "a100") -> list[dict[str, Any]]:
  """The paper's ZeRO-3 comparison (Table 2, Figure 10) with the ``jit fsdp`` candidate's
  pricing as ZeRO-3 (one stage over every GPU, parameters, gradients and optimizer state
  sharded over all of them, the parameters gathered for every micro-batch's forward and
  backward): per configuration the modelled and published teraFLOP/s of both."""
  from gpp_jax.cost.cluster import make_cluster
  from gpp_jax.ir.plan import Plan, Stage
  from gpp_jax.passes.simulation import simulate

  out = []
  for params_b, layers, hidden, heads, pp, runs in TABLE_2:
    for gpus, batch, mb, zero_pub, ptd_gpus, ptd_pub in runs:
      graph = gpt_graph(batch, layers, hidden, heads, SEQ_LEN, VOCAB, 1)
      stage = Stage(0, tuple(graph.nodes), tuple(range(gpus)), mb * gpus)
      plan = Plan(
        (stage,), (), batch // (mb * gpus), planner="jit fsdp", batch_size=batch,
        param_sharding="fsdp",
      )  # fmt: skip
      res = simulate(plan, graph, make_cluster(cluster, gpus), cost_model=MEGATRON_COST_MODEL)
      flops = paper_flops(batch, SEQ_LEN, layers, hidden, VOCAB)
      zero = flops / res.iteration_time / gpus / 1e12
      row = Row(params_b, heads, hidden, layers, 8, pp, ptd_gpus, runs[-1][1], 0)
      ptd = predict_layout(row, cluster)["tflops_per_device"]
      out.append(
        dict(
          params_b=params_b, gpus=gpus, microbatch=mb, zero3=zero, zero3_published=zero_pub,
          ptd=ptd, ptd_published=ptd_pub, ratio=ptd / zero, ratio_published=ptd_pub / zero_pub,
        )
      )  # fmt: skip
  return out


def zero3_markdown(records: Sequence[dict[str, Any]]) -> str:
  lines = [
    "## PTD-P against ZeRO-3 (the paper's Table 2 and Figure 10)",
    "",
    "ZeRO-3 priced as the `jit fsdp` candidate (one stage over every GPU, everything sharded, "
    "the parameters gathered for each micro-batch's forward and backward); PTD-P as the "
    "layouts above (tp 8; pp 12 for 175B, 35 for 530B). TFLOP/s per GPU, modelled against "
    "published.",
    "",
    "| model | GPUs | ZeRO-3 mb | ZeRO-3 modelled | published | PTD-P modelled | published | "
    "PTD-P / ZeRO-3 modelled | published |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    lines.append(
      f"| {r['params_b']}B | {r['gpus']} | {r['microbatch']} | {r['zero3']:.1f} | "
      f"{r['zero3_published']} | {r['ptd']:.1f} | {r['ptd_published']} | {r['ratio']:.2f} | "
      f"{r['ratio_published']:.2f} |"
    )
  return "\n".join(lines) + "\n"


def _own(r: dict[str, Any]) -> str:
  if "graphpipe_tflops" in r:
    return (
      f"{r['graphpipe_tflops']:.1f} TFLOP/s ({r['graphpipe_tflops'] / r['tflops_per_device']:.2f}x "
      f"the layout; {r['graphpipe_stages']} stages, M {r['graphpipe_microbatches']}; "
      f"{r['graphpipe_seconds']:.1f} s)"
    )
  if "graphpipe_error" in r:
    return f"none: {r['graphpipe_error']}"
  return "-"


def markdown(records: Sequence[dict[str, Any]]) -> str:
  lines = [
    "# Megatron-LM's GPT runs (Narayanan et al., SC'21, Table 1), predicted",
    "",
    "`python -m gpp_jax.experiments.published` (modelled: the simulator on the `a100` "
    "preset; published: measured on Selene by the paper's authors). The layout is the "
    "paper's (TP, PP as published, DP the rest, micro-batches of one sequence); v is the "
    "number of stages per device of the interleaved schedule, the fastest of 1, 2, 4. Rows "
    "marked * are the four the GPU efficiency model's level was set on. GraphPipe's own plan: "
    "its search on the paper's tensor-parallel size (stages, their rows and the micro-batches "
    "its own), modelled the same way.",
    "",
    "| params | GPUs | batch | layout | v | M | iteration s | published TFLOP/s | "
    "predicted TFLOP/s | error | plan s | GraphPipe's own plan |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    star = "*" if r["fitted_on"] else ""
    lines.append(
      f"| {r['params_b']}B{star} | {r['gpus']} | {r['batch']} | {r['layout']} | "
      f"{r['stages_per_device']} | {r['num_microbatches']} | {r['iteration_ms'] / 1e3:.2f} | "
      f"{r['published_tflops']:.0f} | {r['tflops_per_device']:.1f} | {r['error'] * 100:+.1f}% | "
      f"{r['seconds']:.1f} | {_own(r)} |"
    )
  worst = max(abs(r["error"]) for r in records)
  lines += ["", f"Largest error: {worst * 100:.1f}% over {len(records)} rows."]
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> None:
  del argv
  rows: tuple[Row, ...] = TABLE_1
  if FLAGS.rows:
    want = {float(x) for x in FLAGS.rows}
    rows = tuple(r for r in TABLE_1 if r.params_b in want)
    if not rows:
      raise app.UsageError(f"--rows: none of {sorted(want)} is a row of Table 1")
  records = compare(rows, FLAGS.cluster)
  text = markdown(records)
  if not FLAGS.rows:
    text += "\n" + zero3_markdown(zero3(FLAGS.cluster))
  print(text)
  if FLAGS.markdown:
    with open(FLAGS.markdown, "w") as f:
      f.write(text)
    print(f"wrote {FLAGS.markdown}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(records, f, indent=1)
    print(f"wrote {FLAGS.json}")


if __name__ == "__main__":
  flags.DEFINE_list("rows", [], "rows of Table 1 by billions of parameters (default: all)")
  flags.DEFINE_string("cluster", "a100", "cluster preset")
  flags.DEFINE_string("markdown", "docs/published.md", "write the table here ('' for none)")
  flags.DEFINE_string("json", None, "write the records here")
  app.run(main)
