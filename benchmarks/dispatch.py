"""Host dispatch time per action of a pipelined GPT step, by action kind (forced CPU devices).

  python benchmarks/dispatch.py [STAGES]      # default 1; all stages on one device

A bf16 GPT with 12 blocks of width 64 (many parameters and residual arrays, little compute),
4 micro-batches of 4; prints the median over 15 steps of the time the driver spends issuing
one forward (F) and one backward (B). What it measures is the runtime's per-call cost, which
grows with the number of arrays a call takes and returns.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import statistics

import jax

import gpp_jax
from gpp_jax.experiments import zoo


def main():
  S = int(sys.argv[1]) if len(sys.argv) > 1 else 1
  run = zoo.setup(
    "gpt",
    "tiny",
    dtype="bfloat16",
    vocab_size=512,
    seq_len=32,
    hidden=64,
    num_layers=12,
    num_heads=4,
    ffn=256,
  )
  plan = gpp_jax.manual_plan({"": 0}) if S == 1 else "balanced"
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=4,
    devices=[jax.devices()[0]] * S,
    planner=plan,
    layer_depth=run.spec.layer_depth,
    fuse=False,  # one stage would otherwise run as one jitted step, with no actions to time
  )
  data = run.batches(16, 2)
  for i in range(4):
    jax.block_until_ready(pp(run.model, run.optimizer, data[i % 2]))
  times = {}
  for i in range(15):
    jax.block_until_ready(pp(run.model, run.optimizer, data[i % 2]))
    for e in pp.timeline.events:
      times.setdefault(e.action, []).append(e.end - e.start)
  print(
    f"{S} stage(s): host dispatch per action (median) "
    + ", ".join(
      f"{k} {statistics.median(v) * 1e6:.0f} us" for k, v in times.items() if k in ("F", "B")
    )
  )


if __name__ == "__main__":
  main()
