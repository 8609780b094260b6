"""GraphPipe on Megatron-LM's GPT rows at the layout's micro-batch count, with v = 1 and v = 2.

Modelled (the simulator on the ``a100`` preset, nothing runs). For each row of the paper's
Table 1 named by ``--rows``, GraphPipe's search on the paper's tensor-parallel size with the
number of micro-batches fixed to the layout's (M = batch / data-parallel replicas, one sequence
per replica), once with one stage per device and once with ``stages_per_device=2`` (its plan
cut in two and interleaved, its plan for 2M cut, or its search on a virtual cluster of twice
the rows, folded; whichever is predicted fastest), beside the layout's own prediction (the
interleaved schedule, the fastest v of 1, 2, 4). Printed per row and v: teraFLOP/s per GPU,
the ratio to the layout, the stages, how the v = 2 plan was made, and the search's seconds.

It diagnoses ``python -m gpp_jax.experiments.published``: where GraphPipe's own plan (its
micro-batch sweep, one stage per device) is below the layout, how much of that the
layout's M and interleaving account for, and what searching them costs.

  python benchmarks/published_interleaved.py --rows=145.6,310.1
  python benchmarks/published_interleaved.py --rows=1008.0     # the v = 2 search is long
"""

from absl import app, flags

from gpp_jax.experiments.megatron import TABLE_1, predict_layout
from gpp_jax.experiments.published import graphpipe_own

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["145.6", "310.1"], "rows of Table 1, by billions of parameters")
flags.DEFINE_list("stages_per_device", ["1", "2"], "the v GraphPipe searches with, one row each")


def main(argv):
  del argv
  print(
    "GraphPipe at the layout's micro-batch count, modelled (a100 preset); "
    "x: throughput over the paper's layout"
  )
  for want in FLAGS.rows:
    row = next((r for r in TABLE_1 if f"{r.params_b}" == want), None)
    if row is None:
      print(f"{want}: no such row; rows: {', '.join(str(r.params_b) for r in TABLE_1)}")
      continue
    layout = predict_layout(row, "a100")
    M = layout["num_microbatches"]
    print(
      f"{row.params_b}B on {row.gpus} GPUs: the layout (v={layout['stages_per_device']}, "
      f"M={M}) {layout['tflops_per_device']:.1f} TFLOP/s per GPU"
    )
    for v in (int(x) for x in FLAGS.stages_per_device):
      own = graphpipe_own(row, "a100", num_microbatches=M, stages_per_device=v)
      if "error" in own:
        print(f"  v={v}: no plan ({own['error']})")
        continue
      tflops = own["tflops"]
      print(
        f"  v={v}: {tflops:.1f} TFLOP/s ({tflops / layout['tflops_per_device']:.2f}x), "
        f"{own['stages']} stages, {own['shared_devices']}; search {own['seconds']:.1f} s",
        flush=True,
      )


if __name__ == "__main__":
  app.run(main)
