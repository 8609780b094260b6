"""A GPT trained through graph_pipeline on the GPU(s), against the plain jitted step.

  python benchmarks/gpu.py                     # on a GPU: bf16, batch sized to a 20-100 ms step
  python benchmarks/gpu.py --platform=cpu --hidden=64 --num_layers=4 --seq_len=32 \\
      --vocab_size=512 --batch_size=16 --repeats=3        # a smoke run anywhere

Prints, measured side by side in one run:
  * the plain jitted step (the undecorated zoo step as one ``jax.jit``, state donated unless
    --nodonate): step time and model FLOP utilisation (MFU);
  * what ``graph_pipeline`` chooses on the platform's devices (GraphPipe with measured layers
    and host: on one device, the fused step or gradient accumulation), then for 1 and 4
    stages of consecutive blocks, one device each (skipped beyond the devices there are),
    x 4 and 8 micro-batches: the pipelined step time,
    its ratio to the plain step (targets <= 1.05 for 1 stage, <= 1.15 for 4), MFU, and the
    host time per action (median dispatch of one action, and the whole step's host time over
    its actions).

Model FLOPs per step are counted in closed form: 6 x tokens x (matmul parameters: blocks and
the output head) plus the attention scores and values, 12 x layers x seq x hidden per token
(the causal mask's zeros counted, as in the PaLM MFU convention). MFU divides them by the step
time and by the device's peak for the dtype (``gpp_jax.cluster.H100_PEAK_FLOPS`` on an H100 or
H200).
"""

import functools
import json
import statistics
import time

import jax
from absl import app, flags
from flax import nnx

import gpp_jax
from gpp_jax.cost.cluster import H100_PEAK_FLOPS
from gpp_jax.experiments import zoo

FLAGS = flags.FLAGS
flags.DEFINE_enum("platform", None, ["cpu", "gpu"], "device platform (default: JAX's default)")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "parameter and activation dtype")
flags.DEFINE_integer("hidden", 1024, "GPT width")
flags.DEFINE_integer("num_layers", 12, "transformer blocks")
flags.DEFINE_integer("num_heads", 16, "attention heads")
flags.DEFINE_integer("seq_len", 512, "tokens per sequence")
flags.DEFINE_integer("vocab_size", 32768, "vocabulary")
flags.DEFINE_integer(
  "batch_size",
  0,
  "sequences per step; 0: the first power of two from 16 "
  "whose plain step takes at least --target_ms (at most 256)",
)
flags.DEFINE_float("target_ms", 40.0, "plain step time the automatic batch size aims at")
flags.DEFINE_list("stages", ["1", "4"], "stage counts (a device each; skipped beyond the devices)")
flags.DEFINE_list("microbatches", ["4", "8"], "micro-batch counts")
flags.DEFINE_integer("repeats", 20, "timed steps per configuration (median reported)")
flags.DEFINE_integer("warmup", 4, "untimed steps per configuration (compilation, first steps)")
flags.DEFINE_string("json_out", None, "also write the results as JSON here")
flags.DEFINE_bool(
  "donate",
  True,
  "the plain step donates its state (jax.jit donate_argnums) and the pipelined steps their "
  "model and optimizer (graph_pipeline donate_argnums); --nodonate: neither, as nnx.jit",
)


def consecutive_stages(S: int, num_layers: int):
  """S stages of consecutive transformer blocks (embedding first, norm and head last), stage
  s on device s."""
  rules = {"": 0, "norm": S - 1, "head": S - 1}
  rules.update({f"blocks/{i}": i * S // num_layers for i in range(num_layers)})
  return gpp_jax.manual_plan(rules, devices={s: s for s in range(S)})


def model_flops(cfg, batch_size: int) -> float:
  tokens = batch_size * cfg.seq_len
  h, L = cfg.hidden, cfg.num_layers
  block = 4 * h * h + 2 * h * cfg.ffn  # qkv, attention out, FFN up and down
  matmul_params = L * block + h * cfg.vocab_size  # plus the output head
  attention = 12 * L * cfg.seq_len * h
  return tokens * (6 * matmul_params + attention)


def peak_flops(device, dtype: str) -> float | None:
  if "H100" in device.device_kind or "H200" in device.device_kind:  # the same Hopper die
    return H100_PEAK_FLOPS[dtype]
  return None


def new_run(seed=0):
  return zoo.setup(
    "gpt",
    "tiny",
    seed=seed,
    dtype=FLAGS.dtype,
    optimizer=zoo.OptimizerConfig(learning_rate=1e-4),
    vocab_size=FLAGS.vocab_size,
    seq_len=FLAGS.seq_len,
    hidden=FLAGS.hidden,
    num_layers=FLAGS.num_layers,
    num_heads=FLAGS.num_heads,
    ffn=4 * FLAGS.hidden,
  )


def plain_step(run, device):
  """The undecorated step as one jitted function over the split NNX state (donated unless
  --nodonate)."""
  graphdef, state = nnx.split((run.model, run.optimizer))
  state = jax.device_put(state, device)

  @functools.partial(jax.jit, donate_argnums=0 if FLAGS.donate else ())
  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss = run.train_step(model, optimizer, batch)
    return nnx.state((model, optimizer)), loss

  box = [state]

  def call(batch):
    box[0], loss = step(box[0], batch)
    return loss, box[0]

  return call


def time_steps(call, batches, repeats, warmup):
  """Median wall time per step and median host time per step (until the call returns)."""
  for i in range(warmup):
    jax.block_until_ready(call(batches[i % len(batches)]))
  wall, host = [], []
  for i in range(repeats):
    t0 = time.perf_counter()
    out = call(batches[i % len(batches)])
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    wall.append(time.perf_counter() - t0)
    host.append(t1 - t0)
  return statistics.median(wall), statistics.median(host)


def main(_):
  device = jax.devices(FLAGS.platform)[0] if FLAGS.platform else jax.devices()[0]
  print(
    f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, dtype {FLAGS.dtype}"
    f", state {'donated' if FLAGS.donate else 'not donated'}"
  )
  ref_run = new_run()
  cfg = ref_run.config
  peak = peak_flops(device, FLAGS.dtype)

  def batches_of(run, b):
    return [jax.device_put(x, device) for x in run.batches(b, 2)]

  # The plain step, sizing the batch when asked.
  b = FLAGS.batch_size or 16
  while True:
    run = new_run()
    plain = plain_step(run, device)
    t_plain, _ = time_steps(plain, batches_of(run, b), FLAGS.repeats, FLAGS.warmup)
    if FLAGS.batch_size or t_plain * 1e3 >= FLAGS.target_ms or b >= 256:
      break
    print(f"  batch {b}: plain step {t_plain * 1e3:.1f} ms, below {FLAGS.target_ms} ms")
    b *= 2
  flops = model_flops(cfg, b)
  nparams = sum(x.size for x in jax.tree.leaves(nnx.state(run.model, nnx.Param)))

  def mfu(t):
    return f"{flops / t / peak:.3f}" if peak else "n/a"

  print(
    f"GPT {cfg.num_layers} x {cfg.hidden} (heads {cfg.num_heads}, ffn {cfg.ffn}), vocab "
    f"{cfg.vocab_size}, seq {cfg.seq_len}, {nparams / 1e6:.0f}M parameters; batch {b} = "
    f"{b * cfg.seq_len} tokens; {flops / 1e12:.2f} TFLOP per step"
  )
  print(f"plain jit: {t_plain * 1e3:.2f} ms/step, MFU {mfu(t_plain)}")
  results = {
    "device": device.device_kind,
    "jax": jax.__version__,
    "dtype": FLAGS.dtype,
    "donate": FLAGS.donate,
    "config": {
      k: getattr(cfg, k)
      for k in ("hidden", "num_layers", "num_heads", "ffn", "seq_len", "vocab_size")
    },
    "batch_size": b,
    "flops_per_step": flops,
    "plain_ms": t_plain * 1e3,
    "plain_mfu": flops / t_plain / peak if peak else None,
    "pipelined": [],
  }

  devices = jax.devices(device.platform)
  configs: list[tuple[str, int, int]] = [("chosen", 0, int(FLAGS.microbatches[0]))]
  for S in map(int, FLAGS.stages):
    if len(devices) < S:
      print(f"{S} stages: skipped, {len(devices)} {device.platform} device(s) (one per stage)")
      continue
    configs += [("stages", S, M) for M in map(int, FLAGS.microbatches)]
  for kind, S, M in configs:
    run = new_run()
    pp = gpp_jax.graph_pipeline(
      run.train_step,
      num_microbatches=M,
      # "chosen": what graph_pipeline picks for the devices, measured layers and host.
      devices=devices if kind == "chosen" else devices[:S],
      planner="graphpipe" if kind == "chosen" else consecutive_stages(S, cfg.num_layers),
      calibrate=kind == "chosen",
      layer_depth=run.spec.layer_depth,
      donate_argnums=(0, 1) if FLAGS.donate else (),
    )
    data = batches_of(run, b)  # the same placed batches as the plain step's
    # As a training loop calls it: the NNX objects' traversal cached (``cached_partial``).
    step = pp.cached_partial(run.model, run.optimizer)
    _, state = nnx.split((run.model, run.optimizer))
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    # Waits for the new state as well as the loss (a pipeline's updates may finish last).
    call = lambda batch, step=step, vs=variables: (step(batch), [v.get_raw_value() for v in vs])
    t, t_host = time_steps(call, data, FLAGS.repeats, FLAGS.warmup)
    # Ratios side by side: the plain step again, right after, against drift.
    t_plain2, _ = time_steps(plain, batches_of(ref_run, b), max(FLAGS.repeats // 2, 3), 1)
    t_ref = min(t_plain, t_plain2)
    S = pp.plan.num_stages
    n_actions = sum(len(lane) for lane in pp.schedule.lanes)
    disp = statistics.median(e.end - e.start for e in pp.timeline.events)
    note = pp.compiled.planned.note or "the planner's plan"
    label = f"chosen ({note})" if kind == "chosen" else f"{S} stage(s), {M} micro-batches"
    target = 1.05 if S == 1 else 1.15
    print(
      f"{label}: {t * 1e3:.2f} ms/step, ratio to plain {t / t_ref:.3f} (target <= {target}), "
      f"MFU {mfu(t)}; {n_actions} actions, host dispatch {disp * 1e6:.0f} us per action "
      f"(median), step host time {t_host * 1e3:.2f} ms = {t_host / n_actions * 1e6:.0f} us "
      "per action"
    )
    results["pipelined"].append(
      {
        "config": kind,
        "stages": S,
        "microbatches": pp.plan.num_microbatches,
        "ms": t * 1e3,
        "plain_ms": t_ref * 1e3,
        "ratio": t / t_ref,
        "mfu": flops / t / peak if peak else None,
        "actions": n_actions,
        "dispatch_us_median": disp * 1e6,
        "host_us_per_action": t_host / n_actions * 1e6,
        "layers_per_stage": [len(s.layers) for s in pp.plan.stages],
        "note": pp.compiled.planned.note,
      }
    )
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
