"""Calibration pass: LayerGraph -> LayerGraph with measured ``time_f`` / ``time_b`` per layer.

Each layer is cut out of the loss with the staging pass (one stage per layer), jitted on the
given device like a real stage, and timed (forward, and backward with its vjp, less the call
that zeroes the gradient sum it consumes, which a stage makes once per step) on inputs of the
right shapes. The times are for the traced micro-batch size, the LayerGraph's ``batch_size``.

Measured times move with the machine's load, and a planner fed different numbers may choose a
different plan. Three things keep the numbers, and so the plans, stable from run to run:

* robust timing: samples are taken in rounds until a low quantile of all samples moves by
  less than ``rel_tol`` between rounds (at most ``max_rounds``); the low quantile ignores the
  slow outliers that other work on the machine causes;
* identical layers share one measurement: layers whose stage programs are the same (the
  blocks of a transformer, the towers of CANDLE-Uno) are timed once, so noise cannot break
  their symmetry and make a planner prefer one of them;
* times are snapped to a geometric grid of relative step ``resolution``, so small changes
  of a measurement usually give the same number.

``Calibration`` records the per-layer times and how they were obtained; the training entry
point writes it to the run folder.

Layers can also be timed as a stage over k devices runs them (``placement``: the micro-batch
split over the devices, parameters replicated, the gradients all-reduced in the backward):
on devices that share a host's cores, what that costs depends on the model's ops more than any
small probe says (``runtime.compile.calibrate_widths``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from jax.extend import core as xc

from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.layering import Layering
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.passes.staging import stage_functions, stage_program

Timer = Callable[[str, str, Callable[[], Any]], float]
"""``timer(layer, role, fn)``: seconds of one call of ``fn`` (role ``"fwd"``, ``"bwd"``, or
``"zeros"``: the zeroed gradient sum that each timed backward consumes, timed apart to be taken
out of the backward's time; ``"allreduce"``: over several devices, a tiny gradient all-reduce,
likewise)."""


def time_once(layer: str, role: str, fn: Callable[[], Any]) -> float:
  """The default timer: wall-clock seconds of one call of ``fn``, waiting for its results."""
  del layer, role
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


def robust_time(
  sample: Callable[[], float],
  *,
  repeats: int = 5,
  max_rounds: int = 6,
  quantile: float = 0.2,
  rel_tol: float = 0.02,
) -> tuple[float, int]:
  """A low quantile of ``sample()`` over rounds of ``repeats`` samples, taken until the
  estimate moves by less than ``rel_tol`` between rounds. Returns (seconds, samples taken)."""
  samples: list[float] = []
  est = math.inf
  for _ in range(max(max_rounds, 1)):
    samples += [sample() for _ in range(max(repeats, 1))]
    new = float(np.quantile(samples, quantile))
    if abs(new - est) <= rel_tol * new:
      return new, len(samples)
    est = new
  return est, len(samples)


def snap(seconds: float, resolution: float) -> float:
  """``seconds`` rounded to the nearest point of the grid ``(1 + resolution) ** k``."""
  if resolution <= 0 or seconds <= 0:
    return seconds
  base = math.log1p(resolution)
  return math.exp(round(math.log(seconds) / base) * base)


@dataclasses.dataclass(frozen=True)
class LayerTiming:
  """How layers are timed (``measure_layers``; the step's update takes the robust timing,
  ``measure_update``).

  Attributes:
    repeats, max_rounds, quantile, rel_tol: the robust timing (``robust_time``).
    resolution: the relative step of the grid times are snapped to (``snap``; 0: none).
    share_identical: whether layers with the same stage program share one measurement.
    timer: times one call (``Timer``; the default measures wall-clock time).
  """

  repeats: int = 5
  max_rounds: int = 6
  quantile: float = 0.2
  rel_tol: float = 0.02
  resolution: float = 0.05
  share_identical: bool = True
  timer: Timer = time_once

  def robust(self, sample: Callable[[], float]) -> tuple[float, int]:
    """``robust_time(sample)`` with these settings: (seconds, samples taken)."""
    return robust_time(
      sample,
      repeats=self.repeats,
      max_rounds=self.max_rounds,
      quantile=self.quantile,
      rel_tol=self.rel_tol,
    )


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Measured per-layer times and how they were obtained."""

  time_f: dict[str, float]
  time_b: dict[str, float]
  groups: dict[str, str]  # layer -> the layer whose measurement it shares
  samples: int  # timed calls in all
  device: str
  settings: dict[str, float]

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, s: str) -> Calibration:
    return cls(**json.loads(s))

  def apply(self, graph: nx.DiGraph, width: int = 1) -> nx.DiGraph:
    """A copy of ``graph`` with these ``time_f`` / ``time_b``, less the cost of calling a
    jitted function (``settings["call_overhead"]``, measured with the layers): each layer was
    timed as a call of its own, while a stage runs its layers in one call (and the host's issue
    of that call is priced by ``cost.host``). A layer keeps at least a quarter of its time.

    The step's own update, where measured (``settings["update_per_byte"]``, seconds per
    parameter byte, ``measure_update``), goes to ``graph.graph["update_per_byte"]``, and the
    zeroing of the gradient sums that the backward times leave out (``settings
    ["zero_per_byte"]``), which a stage pays once per step, to ``graph.graph
    ["zero_per_byte"]``.

    ``width`` > 1: the layers were timed as a stage over that many devices runs them
    (``measure_layers(placement=)``); the times go to the layers' ``time_f_at`` /
    ``time_b_at`` under ``str(width)`` (``ir.layer_graph.at_width``), beside the one-device
    times, and the gradients' all-reduce they leave out (``settings["allreduce_call"]``,
    seconds) to ``graph.graph["allreduce_call_at"][str(width)]``, which a stage's backward
    pays once."""
    over = self.settings.get("call_overhead", 0.0)
    out = graph.copy()
    if width == 1 and "update_per_byte" in self.settings:
      out.graph["update_per_byte"] = self.settings["update_per_byte"]
    if width == 1 and "zero_per_byte" in self.settings:
      out.graph["zero_per_byte"] = self.settings["zero_per_byte"]
    if width > 1:
      at = {**out.graph.get("allreduce_call_at", {})}
      at[str(width)] = self.settings.get("allreduce_call", 0.0)
      out.graph["allreduce_call_at"] = at
    for n in out:
      tf, tb = self.time_f[n], self.time_b[n]
      tf, tb = max(tf - over, 0.25 * tf), max(tb - over, 0.25 * tb)
      d = out.nodes[n]
      if width == 1:
        d["time_f"], d["time_b"] = tf, tb
      else:  # new dicts: the copy shares the old ones with ``graph``
        d["time_f_at"] = {**d.get("time_f_at", {}), str(width): tf}
        d["time_b_at"] = {**d.get("time_b_at", {}), str(width): tb}
    return out


def _example(aval, place, rng):
  """An array of ``aval``'s shape put where ``place(array)`` says."""
  if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
    x = jax.random.key(0)
  elif jnp.issubdtype(aval.dtype, jnp.floating):
    x = rng.standard_normal(aval.shape).astype(aval.dtype)
  else:
    x = np.zeros(aval.shape, aval.dtype)
  return jax.device_put(x, place(x))


def measure_layers(
  closed,
  layering: Layering,
  device,
  timing: LayerTiming = LayerTiming(),
  placement: Any = None,
) -> Calibration:
  """Times every layer of ``layering``'s graph, cut out of the loss ``closed`` by its equations'
  and parameters' layers, on ``device`` (see the module docstring).

  ``timing`` sets the robust timing, the grid times are snapped to, whether layers with the
  same stage program share one measurement, and the timer of one call (``LayerTiming``).
  ``placement`` (a ``runtime.placement.StagePlacement``): each layer runs as a stage over its
  devices does, micro-batch arrays split over them and the rest replicated (default: all on
  ``device``).
  """
  if placement is None:
    one = jax.sharding.SingleDeviceSharding(device)
    place: Callable[[Any], Any] = lambda x: one
    replicated = one
  else:
    place, replicated = placement.for_array, placement.replicated
  graph, timer = layering.graph, timing.timer
  layers = topo_layers(graph)
  index = {l: i for i, l in enumerate(layers)}
  stages = tuple(Stage(i, (l,), (0,)) for i, l in enumerate(layers))
  edges = tuple(sorted({(index[u], index[v]) for u, v in graph.edges}))
  plan = Plan(stages, edges, 1)
  staged = stage_program(closed, layering.eqn_layer, layering.param_layer, plan)
  rng = np.random.default_rng(0)
  time_f: dict[str, float] = {}
  time_b: dict[str, float] = {}
  groups: dict[str, str] = {}
  first_of: dict[str, str] = {}  # stage program text -> first layer with it
  total = 0
  rt = timing.robust
  overhead = allreduce = 0.0
  zeroed = [0.0, 0]  # seconds of zeroing the timed layers' gradient sums, their bytes
  if timer is time_once:  # a trivial jitted call, timed like the layers
    tiny = jax.device_put(np.zeros((), np.float32), replicated)
    bump = jax.jit(lambda x: x + 1)
    jax.block_until_ready(bump(tiny))
    overhead, _ = rt(functools.partial(timer, "", "fwd", lambda: bump(tiny)))
  if placement is not None and len(placement.devices) > 1:
    # The gradients' all-reduce over the devices, of a tiny array, less the call: a layer's
    # backward timed alone pays one, while XLA combines a stage's into one for all its layers.
    # Taken out of each layer's backward here, it is paid once per stage
    # (``cost.simulator.measured_width_times``).
    rows = np.ones((placement.microbatch_size, 1), np.float32)
    rows = jax.device_put(rows, place(rows))
    reduce = jax.jit(lambda r: jnp.sum(r, axis=0), out_shardings=replicated)
    jax.block_until_ready(reduce(rows))
    t_ar, _ = rt(functools.partial(timer, "", "allreduce", lambda: reduce(rows)))
    allreduce = max(t_ar - overhead, 0.0)
  for st in staged.stages:
    layer = layers[st.index]
    key = str(st.jaxpr) + repr([(r.diff, r.kind) for r in st.inputs])
    if timing.share_identical and key in first_of:
      src = first_of[key]
      groups[layer] = src
      time_f[layer], time_b[layer] = time_f[src], time_b[src]
      continue
    first_of.setdefault(key, layer)
    groups[layer] = layer
    fns = stage_functions(st)
    avals = [v.aval for v in st.jaxpr.jaxpr.invars]
    args = [_example(a, place, rng) for a in avals]
    diff = [a for a, r in zip(args, st.inputs) if r.diff]
    nondiff = [a for a, r in zip(args, st.inputs) if not r.diff]
    outs, res = fns.fwd(diff, nondiff)
    cts = [
      (jax.device_put(jnp.ones_like(o), place(o)),) if r.diff else ()
      for o, r in zip(outs, st.outputs)
    ]
    zeros = jax.jit(fns.zeros_acc, out_shardings=replicated)
    fwd = functools.partial(fns.fwd, diff, nondiff)
    jax.block_until_ready(fwd())

    def bwd(fns=fns, res=res, cts=cts, zeros=zeros):
      return fns.bwd(res, cts, zeros())  # it consumes its gradient sum: a fresh one each

    jax.block_until_ready(bwd())
    t_f, n_f = rt(functools.partial(timer, layer, "fwd", fwd))
    t_b, n_b = rt(functools.partial(timer, layer, "bwd", bwd))
    total += n_f + n_b
    # Each timed backward consumes a fresh gradient sum, made by a call of its own, which a
    # stage makes once per step (the program's ZERO), not once per backward: timed alike, it
    # is taken out (over 4 forced CPU devices, a fifth of tiny DLRM's layers' backward).
    t_z, n_z = rt(functools.partial(timer, layer, "zeros", zeros))
    nbytes = graph.nodes[layer].get("param_bytes", 0)
    less = t_z + (allreduce if nbytes else 0.0)
    t_b, total = max(t_b - less, 0.25 * t_b), total + n_z
    zeroed[0] += max(t_z - overhead, 0.0) if nbytes else 0.0
    zeroed[1] += nbytes
    time_f[layer], time_b[layer] = snap(t_f, timing.resolution), snap(t_b, timing.resolution)
  settings = {
    "call_overhead": overhead,
    "allreduce_call": allreduce,
    "zero_per_byte": zeroed[0] / zeroed[1] if zeroed[1] else 0.0,
    "repeats": float(timing.repeats),
    "max_rounds": float(timing.max_rounds),
    "quantile": timing.quantile,
    "rel_tol": timing.rel_tol,
    "resolution": timing.resolution,
    "share_identical": float(timing.share_identical),
  }
  return Calibration(time_f, time_b, groups, total, str(device), settings)


def measure_update(step, marker_index: int, device, timing: LayerTiming = LayerTiming()) -> float:
  """Seconds of the step's work after its loss and gradients (the optimizer update, and
  whatever else the step computes from them) on ``device``: the step's ClosedJaxpr ``step``
  split around its pipeline marker (``passes.step_split``) with every value on one stage,
  each piece after the marker jitted and timed on inputs of the right shapes (as
  ``measure_layers`` times layers: wall-clock time, ``timing``'s robust timing), the pieces'
  times summed. A cost model's update is a
  guess of the optimizer's memory traffic at a preset bandwidth (on forced CPU devices 1.7x
  this measurement for Adam on medium CANDLE-Uno); this is the step's own."""
  from gpp_jax.passes.step_split import split_step

  marker = step.jaxpr.eqns[marker_index]
  prog = split_step(step, marker_index, [0] * len(marker.invars), [0] * len(marker.outvars))
  one = jax.sharding.SingleDeviceSharding(device)
  rng = np.random.default_rng(0)
  total = 0.0
  for piece in prog.after:
    closed = piece.jaxpr
    if closed.effects:  # a print or callback of the user's: not run on made-up values
      continue
    args = [_example(v.aval, lambda x: one, rng) for v in closed.jaxpr.invars]
    f = jax.jit(xc.jaxpr_as_fun(closed))
    jax.block_until_ready(f(*args))
    t, _ = timing.robust(functools.partial(time_once, "update", "fwd", functools.partial(f, *args)))
    total += t
  return total


def calibrate_layers(
  closed, layering: Layering, device, timing: LayerTiming = LayerTiming()
) -> nx.DiGraph:
  """Returns a copy of ``layering``'s graph with ``time_f`` and ``time_b`` (seconds) for every
  layer (``measure_layers``)."""
  return measure_layers(closed, layering, device, timing).apply(layering.graph)
