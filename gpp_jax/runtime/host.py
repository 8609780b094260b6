"""Measuring the host's costs on this machine (``cost.host.HostCosts``)."""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpp_jax.cost.host import HostCosts, host_costs_from_timeline


def _chain(devices: Sequence[Any], size: int) -> tuple[Callable[[Sequence[Any]], float], list]:
  """A matrix chain compiled and placed on each of ``devices``: (seconds of one run of it on
  each of the given inputs at once, the inputs)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  f = jax.jit(lambda x: jax.lax.fori_loop(0, 24, lambda i, h: jnp.tanh(h @ x), x))
  xs = [jax.device_put(np.ones((size, size), np.float32) / size, d) for d in devices]
  jax.block_until_ready([f(x) for x in xs])

  def once(args: Sequence[Any]) -> float:
    t = time.perf_counter()
    jax.block_until_ready([f(x) for x in args])
    return time.perf_counter() - t

  return once, xs


def measure_parallel(devices: Sequence[Any], size: int = 192, reps: int = 5) -> float:
  """How many of ``devices`` compute at full speed at once: a matrix chain's time on one
  device, times the number of devices, over its time on all of them together (1: they take
  turns; len(devices): independent)."""
  if len(devices) < 2:
    return 1.0
  once, xs = _chain(devices, size)
  one = min(once(xs[:1]) for _ in range(reps))
  together = min(once(xs) for _ in range(reps))
  return float(min(max(len(xs) * one / together, 1.0), len(xs)))


def measure_parallel_across(
  devices: Sequence[Any], timeout_s: float, size: int = 192, reps: int = 5
) -> float:
  """``measure_parallel`` over several processes (each process calls it, at the same point):
  each runs the chain on its own devices among ``devices`` (up to 4 of them), first process
  0 on one device alone while the others wait, then every process on all of its at once
  (processes on one machine share its cores). Process 0's time alone, times the devices that
  ran, over the slowest process's median time together; the same number on every process."""
  import jax

  from gpp_jax.runtime.processes import exchange

  here = jax.process_index()
  mine = [d for d in devices if d.process_index == here][:4]
  once, xs = _chain(mine, size)
  exchange("parallel", "compiled", timeout_s)
  one = min(once(xs[:1]) for _ in range(reps)) if here == 0 else 0.0
  exchange("parallel", "alone", timeout_s)
  together = statistics.median(once(xs) for _ in range(reps))
  runs = [v.split() for v in exchange("parallel", f"{together} {len(xs)} {one}", timeout_s)]
  n = sum(int(k) for _, k, _ in runs)
  slowest = max(float(t) for t, _, _ in runs)
  alone = float(runs[0][2])  # process 0's
  return float(min(max(n * alone / slowest, 1.0), n))


def measure_link_across(
  devices: Sequence[Any],
  timeout_s: float,
  sizes: tuple[int, int] = (1 << 12, 1 << 22),
  reps: int = 7,
) -> tuple[float, float]:
  """(alpha seconds, beta bytes per second) of a transfer between processes, ``alpha + bytes
  / beta``: process 0's first device among ``devices`` puts an array to process 1's first,
  which puts it back, the median of ``reps`` round trips at each of the two ``sizes`` (bytes)
  halved, and the line through the two. Every process calls it at the same point; the others
  only take process 0's numbers."""
  import jax
  import numpy as np
  from jax.sharding import SingleDeviceSharding

  from gpp_jax.runtime.placement import new_send_epoch, transfer
  from gpp_jax.runtime.processes import exchange

  here = jax.process_index()
  a = next(d for d in devices if d.process_index == 0)
  b = next(d for d in devices if d.process_index == 1)
  to_a, to_b = SingleDeviceSharding(a), SingleDeviceSharding(b)

  def absent(shape, sharding):  # what the other process holds
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=np.float32)

  halves = []
  for size in sizes:
    shape = (size // 4,)
    x = jax.device_put(np.ones(shape, np.float32), a) if here == 0 else None
    times = []
    for r in range(reps + 1 if here <= 1 else 0):  # the first warms the connection
      t = time.perf_counter()
      there = transfer(x if here == 0 else absent(shape, to_a), to_b)
      back = transfer(there if here == 1 else absent(shape, to_b), to_a)
      if here == 0:
        back.block_until_ready()
        if r:
          times.append((time.perf_counter() - t) / 2)
      else:  # one round behind process 0 at most: its transfers outlive two epochs
        there.block_until_ready()
      new_send_epoch()
    halves.append(statistics.median(times) if times else 0.0)
  mine = " ".join(map(repr, halves))
  t0, t1 = map(float, exchange("link", mine, timeout_s)[0].split())
  (n0, n1) = sizes
  beta = (n1 - n0) / max(t1 - t0, 1e-9)
  return max(t0 - n0 / beta, 0.0), beta


def _best_in_turns(
  num_devices: int,
  divides: int,
  points: Sequence[int],
  compiled: Callable[[int, int], Callable[[], Any]],
  reps: int,
) -> tuple[list[int], dict[tuple[int, int], float]]:
  """(the widths 1, 2, 4, ... up to ``num_devices`` that divide ``divides``, the best of
  ``reps`` seconds of ``compiled(width, point)()`` per width and point), every call taking
  its turn in each round, so that a busy spell of the host does not fall on one of them
  only."""
  widths = [1]
  while widths[-1] * 2 <= num_devices and divides % (widths[-1] * 2) == 0:
    widths.append(widths[-1] * 2)
  calls = {(k, x): compiled(k, x) for x in points for k in widths}
  best = dict.fromkeys(calls, float("inf"))
  for _ in range(reps):
    for key, call in calls.items():
      t = time.perf_counter()
      call()
      best[key] = min(best[key], time.perf_counter() - t)
  return widths, best


def measure_spmd(
  devices: Sequence[Any],
  batches: tuple[int, int] = (16, 256),
  width: int = 128,
  layers: int = 4,
  reps: int = 12,
) -> tuple[dict[int, float], dict[int, float]]:
  """Per number of devices k (the powers of two from 2 to ``len(devices)``), (the SPMD
  factor, the seconds per call): a computation sharded over k devices whose one-device time
  is t takes ``seconds + factor * t / k`` (``cost.host.HostCosts.spmd`` and ``spmd_call``).
  The step is an MLP's forward, backward and update, jitted with the batch split over a mesh
  of the k devices and the weights replicated, so XLA inserts the gradients' all-reduce; timed
  at the two ``batches`` (the best of ``reps`` calls of each, the widths and batches taking
  turns, so that a busy spell of the host does not fall on one of them only), the line
  through the two points is the fit: its slope times k the factor (at least 1), its value at
  t = 0 the seconds (at least 0). CPU devices only (forced CPU devices share the host's cores
  and meet at each collective); empty for accelerators or one device.

  A factor alone, measured at one batch, falls as each device's share of the work grows (over
  4 devices of a 2-core host: 8-12 at batch 64, about 5 at 128, 3-4 at 256): most of a small
  call's time over k devices is the fixed part (0.3-0.5 ms over 2 forced devices, about 2 ms
  over 4 on this machine, whatever the batch), which a pipeline stage over k devices pays for
  every action of its small micro-batches (BUILD_NOTES.md, "The simulator and the cost model")."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  if len(devices) < 2 or devices[0].platform != "cpu":
    return {}, {}
  rng = np.random.default_rng(0)
  ws = [rng.normal(size=(width, width)).astype(np.float32) / width**0.5 for _ in range(layers)]

  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.mean(x**2)

  def step(ws, x):
    grads = jax.grad(loss)(ws, x)
    return [w - 1e-3 * g for w, g in zip(ws, grads)]

  def compiled(k: int, batch: int) -> Callable[[], Any]:
    mesh = Mesh(np.asarray(devices[:k]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    f = jax.jit(step, out_shardings=replicated)
    x = rng.normal(size=(batch, width)).astype(np.float32)
    args = (
      jax.device_put(ws, replicated),
      jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))),
    )
    jax.block_until_ready(f(*args))
    return lambda: jax.block_until_ready(f(*args))

  widths, best = _best_in_turns(len(devices), min(batches), batches, compiled, reps)
  factors, seconds = {}, {}
  for k in widths[1:]:
    (x0, y0), (x1, y1) = [(best[1, b], best[k, b]) for b in batches]
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else y1 / x1
    factor = max(slope * k, 1.0)
    # The fixed part at the small batch, with the factor as fitted (or raised to 1).
    seconds[k] = max(y0 - factor * x0 / k, 0.0)
    factors[k] = factor
  return factors, seconds


def measure_allreduce(
  devices: Sequence[Any], sizes: tuple[int, int] = (2 << 20, 8 << 20), reps: int = 5
) -> dict[int, float]:
  """Per number of devices k (the powers of two from 2 to ``len(devices)``), seconds per byte
  of parameter gradients that a backward sharded over k devices pays beyond the same backward
  on one device (``cost.host.HostCosts.allreduce``). The backward is a stage's as the executor
  runs it: the gradient of replicated weights from a batch split over the k devices, added to
  a donated running sum, so XLA all-reduces it in the call. Timed at two weight sizes (the
  best of ``reps`` calls each, all taking turns), the slope over k devices less the slope on
  one device is the cost (at least 0). CPU devices only (forced CPU devices share the host's
  cores: each writes its whole partial gradient and the reduction reads them all); empty for
  accelerators or one device.

  The slope rises with the size as the gradient leaves the caches (over 2 forced CPU devices of
  a 2-core host 0.5 ms per MiB between 2 and 8 MiB, 1.5 between 4 and 16; over 8 devices 3.6
  and 7.4). A stage's gradients are many arrays of a few MiB each: medium CANDLE-Uno's stages
  over 2 devices, 5-20 MiB of parameters, paid 0.8-0.9 ms per MiB in their backward, measured
  one instruction at a time, so the default sizes are the small ones."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  if len(devices) < 2 or devices[0].platform != "cpu":
    return {}
  rows, cols = 16, 128

  def backward(w, x, acc):
    return acc + jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

  def compiled(k: int, nbytes: int) -> Callable[[], Any]:
    mesh = Mesh(np.asarray(devices[:k]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    n = max(nbytes // (4 * cols), 1)
    f = jax.jit(backward, donate_argnums=(2,), out_shardings=replicated)
    w = jax.device_put(np.full((n, cols), 0.01, np.float32), replicated)
    x = jax.device_put(
      np.full((rows, n), 0.01, np.float32), NamedSharding(mesh, PartitionSpec("data"))
    )
    acc = [jax.device_put(np.zeros((n, cols), np.float32), replicated)]

    def call():
      acc[0] = f(w, x, acc[0])
      return jax.block_until_ready(acc[0])

    call()
    return call

  widths, best = _best_in_turns(len(devices), rows, sizes, compiled, reps)
  small, large = sizes
  slope = {k: (best[k, large] - best[k, small]) / (large - small) for k in widths}
  return {k: max(slope[k] - slope[1], 0.0) for k in widths[1:]}


def measure_send_extra(devices: Sequence[Any], n: int = 4, reps: int = 40) -> float | None:
  """What each array beyond the first adds to a put of ``n`` arrays from one device to
  another in one ``jax.device_put`` (``runtime.placement.transfer_all``, as the executor puts
  a stage edge's arrays), as a share of a lone put: the best of ``reps`` puts of 1 and of
  ``n`` small arrays, taking turns. None for fewer than 2 devices, and with several
  processes, whose executors put each array on its own (``runtime.op_rules._send``)."""
  import jax
  import numpy as np

  from gpp_jax.runtime.placement import transfer_all

  if len(devices) < 2 or jax.process_count() > 1:
    return None
  to = jax.sharding.SingleDeviceSharding(devices[1])
  xs = [jax.device_put(np.full((16, 64), k, np.float32), devices[0]) for k in range(n)]
  jax.block_until_ready(transfer_all(xs, to))
  best = {1: float("inf"), n: float("inf")}
  for _ in range(reps):
    for k in best:
      t = time.perf_counter()
      jax.block_until_ready(transfer_all(xs[:k], to))
      best[k] = min(best[k], time.perf_counter() - t)
  return float(min(max((best[n] - best[1]) / ((n - 1) * best[1]), 0.0), 1.0))


@functools.lru_cache(maxsize=8)
def _measure(devices: tuple[Any, ...], repeats: int, graph_pipeline: Any) -> HostCosts:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from gpp_jax.passes.partition.manual import manual_plan
  from gpp_jax.runtime.capture_step import value_and_grad

  n = min(4, len(devices))
  widths = [6, 8, 8, 8, 3]

  def model(p, x):
    for k in range(4):
      x = jnp.tanh(x @ p[f"l{k}"]["w"] + p[f"l{k}"]["b"])
    return x

  rng = np.random.default_rng(0)
  params = {
    f"l{k}": {
      "w": rng.normal(size=(widths[k], widths[k + 1])).astype(np.float32),
      "b": np.zeros(widths[k + 1], np.float32),
    }
    for k in range(4)
  }
  tx = optax.adam(1e-3)

  def step(params, opt_state, batch):
    loss, grads = value_and_grad(lambda p: jnp.mean((model(p, batch[0]) - batch[1]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def timed(devs: Sequence[Any], stages: dict[str, int], placed: dict | None, B: int, reps: int):
    """Per-step HostCosts of the small pipeline of ``stages`` on ``devs``, batch ``B``; of
    the stages' own instructions where ``placed`` (the wide stages)."""
    pp = graph_pipeline(
      step,
      num_microbatches=4,
      devices=list(devs),
      planner=manual_plan(stages, placed),
      fuse=False,
    )
    batch = (
      rng.normal(size=(B, widths[0])).astype(np.float32),
      rng.normal(size=(B, widths[-1])).astype(np.float32),
    )
    p, o = params, tx.init(params)
    for _ in range(2):
      p, o, loss = pp(p, o, batch)
    jax.block_until_ready(loss)
    found = []
    for _ in range(reps):
      t = time.perf_counter()
      p, o, loss = pp(p, o, batch)
      call = time.perf_counter() - t
      jax.block_until_ready(loss)
      found.append(
        host_costs_from_timeline(pp.timeline, pp.plan.num_stages, call, placed is not None)
      )
    return found

  def medians(found):
    return {
      k: statistics.median(h.per_op[k] for h in found if k in h.per_op)
      for k in {k for h in found for k in h.per_op}
    }

  found = timed(devices[:n], {f"l{k}": k * n // 4 for k in range(4)}, None, 16, repeats)
  per_op = medians(found)
  # The same pipeline with stages over w = 2, 4, ... devices: two stages where the devices
  # hold them (transfers between wide stages too), else one.
  wide_ops, wide_per_stage = {}, {}
  w = 2
  while w <= len(devices):
    two = 2 * w <= len(devices)
    placed = {0: list(range(w)), 1: list(range(w, 2 * w))} if two else {0: list(range(w))}
    rules = {f"l{k}": k // 2 if two else 0 for k in range(4)}
    wide = timed(devices[: 2 * w if two else w], rules, placed, 4 * max(4, w), min(repeats, 5))
    wide_ops[w] = medians(wide)
    wide_per_stage[w] = statistics.median(h.per_stage for h in wide)
    w *= 2
  cpu = devices[0].platform == "cpu"
  spmd = measure_spmd(list(devices)) if cpu else ({}, {})
  allreduce = measure_allreduce(list(devices)) if cpu else {}
  return HostCosts(
    per_op=per_op,
    per_stage=statistics.median(h.per_stage for h in found),
    outside=statistics.median(h.outside for h in found),
    parallel=measure_parallel(list(devices[:n])) if cpu else None,
    cores=len(os.sched_getaffinity(0)) if cpu else None,
    device=str(devices[0]),
    spmd=spmd[0] or None,
    spmd_call=spmd[1] or None,
    allreduce=allreduce or None,
    wide_ops=wide_ops or None,
    wide_per_stage=wide_per_stage or None,
    send_extra=measure_send_extra(devices),
    input_send=statistics.median(h.input_send for h in found if h.input_send is not None)
    if any(h.input_send is not None for h in found)
    else None,
  )


def measure_host(devices: Sequence[Any], graph_pipeline: Any, repeats: int = 7) -> HostCosts:
  """``HostCosts`` of this process driving ``devices``: a small pipeline over up to four of
  them runs a few steps through the executor (its per-instruction dispatch timeline gives the
  per-op costs), then again with stages over 2, 4, ... of them (two stages where the devices
  hold them, else one: the per-op costs of wide stages, ``wide_ops``), and puts of several
  arrays at once (``measure_send_extra``); on CPU devices a
  matrix chain on each of them measures how many compute at once (``measure_parallel``) and a
  small data-parallel step over 2, 4, ... of them how much slower than perfect division it
  runs and what each of its calls costs whatever its size (``measure_spmd``), and what a
  backward over them pays per byte of gradients it all-reduces (``measure_allreduce``).
  Seconds in all;
  measured once per process and devices. ``graph_pipeline``: the decorator that builds the
  small pipeline (``runtime.pipeline``'s, passed in so that this module does not import the
  runtime that calls it)."""
  return _measure(tuple(devices), repeats, graph_pipeline)
