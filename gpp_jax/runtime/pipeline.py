"""The user-facing decorator: ``@gpp_jax.graph_pipeline``.

``GraphPipeline`` is the decorated step's face: calling it, ``run_steps``, ``cached_partial``,
``explain`` and read-only views of what was built. Building is the compile chain
(``runtime.compile``), running is the executor (``runtime.executor``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from gpp_jax.cost.memory import format_bytes
from gpp_jax.errors import BatchError, GppError
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan
from gpp_jax.ir.program import Program
from gpp_jax.passes.calibrate import Calibration
from gpp_jax.passes.weight_versions import weight_delays
from gpp_jax.runtime.build import CompiledStep
from gpp_jax.runtime.cached import CachedStep, median_seconds, writable_directly, write_values
from gpp_jax.runtime.capture_step import functionalize, with_keywords
from gpp_jax.runtime.captured import canonical_dtype, capture
from gpp_jax.runtime.compile import compile_step
from gpp_jax.runtime.executor import Timeline
from gpp_jax.runtime.input_checks import (
  argument_signature,
  changed_arguments_error,
  differences,
)
from gpp_jax.runtime.memory import MemoryReport
from gpp_jax.runtime.options import Options, PipelineKeywords
from gpp_jax.runtime.steps import carry_map, stream_reason


class GraphPipeline:
  """A train step run as a graph pipeline. Call it like the original step.

  Attributes (after the first call): ``plan``, ``layer_graph``, ``schedule``, ``program``,
  ``timeline`` (the last step's), ``compiled`` (everything built), and ``explain()``.
  """

  def __init__(self, fn: Callable, opts: Options):
    """``fn`` run with the settings ``opts`` (``graph_pipeline`` resolves its keywords into
    them: ``PipelineKeywords.options``)."""
    self.fn = fn
    self.opts = opts
    self._compiled: dict[Any, CompiledStep] = {}
    self._signatures: list[dict[str, Any]] = []  # of the calls compiled for, to name changes
    self._last: CompiledStep | None = None
    self._memory: MemoryReport | None = None
    functools.update_wrapper(self, fn)
    if len(self.devices) == 1 and self.num_microbatches > 1:
      warnings.warn(_one_device_message(self.devices[0]), UserWarning, stacklevel=_caller_level())

  # ------------------------------------------------------------------ settings
  @property
  def num_microbatches(self) -> int:
    return self.opts.num_microbatches

  @property
  def devices(self) -> list[Any]:
    return list(self.opts.devices)

  @property
  def measure(self) -> bool:
    """Whether steps record device-side times (one thread per stage, blocking per action)."""
    return self.opts.measure

  @measure.setter
  def measure(self, value: bool) -> None:
    self.opts = dataclasses.replace(self.opts, measure=bool(value))

  # ------------------------------------------------------------------ public views
  @property
  def compiled(self) -> CompiledStep:
    """Everything built for the last call's argument signature (``runtime.compile``)."""
    if self._last is None:
      raise RuntimeError("the pipeline is built on the first call; call the step once first")
    return self._last

  @property
  def plan(self) -> Plan:
    return self.compiled.plan

  @property
  def layer_graph(self):
    return self.compiled.layer_graph

  @property
  def schedule(self):
    return self.compiled.schedule

  @property
  def program(self) -> Program:
    """The lowered program of one step: what the executor runs and the simulator times."""
    return self.compiled.program

  @property
  def batch_size(self) -> int:
    """Examples per step of the last call."""
    return self.compiled.batch_size

  @property
  def calibration(self) -> Calibration | None:
    """The measured layer times the plan was made with (``calibrate=True``), else None."""
    return self.compiled.planned.calibration

  @property
  def timeline(self) -> Timeline | None:
    """The last run's per-instruction ``Timeline`` (device times when ``measure`` was on)."""
    c = self.compiled
    tl = c.last[0].last_timeline if c.last else None
    if tl is None:
      return None
    return dataclasses.replace(tl, stage_devices=tuple(s.devices for s in c.plan.stages))

  def explain(self) -> str:
    """Stages, devices, layers and the bytes cut between stages, as text. A layer named by
    the name stack (Linen) shows where its parameters sit in the parameter tree beside it."""
    c = self.compiled
    g = c.layer_graph
    where = c.plan.stage_of_layer()
    lines = [str(c.plan), ""]
    if c.planned.note:
      lines += [c.planned.note, ""]
    if c.planned.predicted_s is not None:
      how = "with the host's measured costs" if c.planned.host else "devices only"
      labels = c.planned.how
      alts = ", ".join(
        f"{k} {v * 1e3:.2f} ms {labels.get(k, 'modelled')}"
        for k, v in c.planned.alternatives.items()
      )
      lines.append(
        f"predicted step time {c.planned.predicted_s * 1e3:.2f} ms ({how}; candidates: {alts})"
      )
      if c.planned.measured:
        timed = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in c.planned.measured.items())
        lines.append(f"compiled and timed while choosing: {timed}")
      if len(c.planned.memory) > 1:
        lines += _candidate_lines(c.planned)
      own = c.planned.plans.get("pipeline")
      if own is not None and own.predicted.get("host_aware"):
        lines.append(
          f"{own.planner} searched with the host's measured costs: every plan it compared "
          "was predicted for this machine"
        )
      widths = sorted(lg.widths_measured(g, g.nodes))
      if widths:
        lines.append(
          "layers also timed as a stage over "
          + " and ".join(map(str, widths))
          + " devices runs them, for the candidates' stages that wide"
        )
      lines.append("")
    if c.fused:
      lines += [
        "runs as one jitted step: one stage is gradient accumulation, not a pipeline, so the "
        "micro-batch loop runs inside one XLA program (fuse=False runs it action by action)",
        "",
      ]
    lines.append("cut edges (bytes per micro-batch):")
    cut: dict[tuple[int, int], float] = {}
    for u, v, d in g.edges(data=True):
      if where[u] != where[v]:
        cut[(where[u], where[v])] = cut.get((where[u], where[v]), 0.0) + d["bytes"]
    for (a, b), by in sorted(cut.items()):
      lines.append(f"  stage {a} -> stage {b}: {by:,.0f} B")
    lines.append("")
    for s in c.plan.stages:
      flops = sum(g.nodes[l]["flops"] for l in s.layers)
      pbytes = sum(g.nodes[l]["param_bytes"] for l in s.layers)
      place = c.staged.placements[s.index]
      devs = ", ".join(str(d) for d in place.devices)
      if self.opts.layout is not None:  # rows of the user's mesh: name its axes and sizes
        sizes = ",".join(f"{a}:{n}" for a, n in place.mesh.shape.items())
        kinds = {"model": "the model's specs", "fsdp": "FSDP", "replicated": "replicated"}
        devs += f" (mesh {sizes}, parameters by {kinds.get(c.plan.param_sharding, '?')})"
      elif c.plan.param_sharding == "fsdp" and len(place.devices) > 1:
        devs += " (parameters sharded FSDP-style)"
      lines.append(
        f"stage {s.index} on {devs}: {len(s.layers)} layers, {flops / 1e6:.3f} MFLOP "
        f"forward per micro-batch, {pbytes / 2**20:.3f} MiB parameters"
      )
      for l in s.layers:
        tree = g.nodes[l].get("param_path")
        lines.append(f"  {l}" + (f"  (params/{tree})" if tree else ""))
    lines.append("")
    lines += self._memory_lines(c)
    lines.append("")
    lines.append(str(c.schedule))
    return "\n".join(lines)

  def _memory_lines(self, c: CompiledStep) -> list[str]:
    """Peak memory per device: the program's prediction, and the last measuring step's. The
    prediction counts the executables' temporaries once a measuring step has read them
    (``measure_memory``), and says so where it does not."""
    temps = c.executor_for(1).temps
    predicted = c.predicted_memory(temps)
    measured = {d.device: d for d in self._memory.devices} if self._memory else {}
    how = "measured (measure_memory) / " if measured else ""
    what = "" if temps else ", without the executables' temporaries (measure_memory reads them)"
    lines = [f"peak memory per device ({how}predicted from the step's program{what}):"]
    for d in sorted(predicted.peak, key=lambda d: getattr(d, "id", 0)):
      m = measured.get(str(d))
      got = f"{format_bytes(m.measured_peak_bytes)} / " if m else ""
      lines.append(f"  {d}: {got}{format_bytes(predicted.peak[d])}")
    return lines

  def layer_graph_for(self, *args):
    """Traces the step for these arguments and returns its LayerGraph, without planning."""
    pure, leaves = functionalize(self.fn, args)
    return capture(pure, args, leaves, self.opts).layering.graph

  # ------------------------------------------------------------------ running
  def compiled_for(self, args, pure, leaves, outside: Callable | None = None) -> CompiledStep:
    """The compiled step for these step arguments (built on first use of their shapes).
    ``outside``: what measures the host's seconds per call outside the program on the path
    the call came by, None where that path is not taken (the decorated call's,
    ``seconds_outside``, then and by default); the choice measures it where it uses the
    host's costs (``choice.plan_step``)."""
    key = (
      pure.in_tree,
      tuple(_leaf_key(x) for x in leaves),
      pure.graph_positions,
      pure.num_positional,
      pure.keywords,
    )
    c = self._compiled.get(key)
    if c is None:
      signature = argument_signature(args, pure.graph_positions)

      def path_outside() -> float:
        got = outside() if outside is not None else None
        # The decorated call's path (also a CachedStep's that cannot cache).
        return got if got is not None else self.seconds_outside(args, pure, leaves)

      try:
        c = compile_step(pure, args, leaves, self.opts, outside=path_outside)
      except GppError:
        raise
      except Exception as e:
        # A step that traced for an earlier call: say what changed since.
        diff = differences(self._signatures[-1], signature) if self._signatures else []
        if diff:
          raise changed_arguments_error(diff, e) from e
        raise
      self._compiled[key] = c
      self._signatures.append(signature)
    self._last = c
    return c

  def seconds_outside(self, args, pure, leaves) -> float:
    """Host seconds per call of the decorated call outside the program, on these step
    arguments: the arguments split and flattened (``functionalize``) and keyed for the
    compiled step, and the new state written back (the values read, so nothing changes) or a
    functional step's outputs unflattened, with the program left out. Less than the call
    costs in all (the executor's own bookkeeping outside its instructions is the trial's)."""
    state_leaves = jax.tree.leaves(pure.state) if pure.graph_positions else []
    fake = _OutTree(jax.tree.structure(((), pure.state)))

    def call():
      p, flat = functionalize(self.fn, args)
      tuple(_leaf_key(x) for x in flat)
      if p.graph_positions:
        _write_back(fake, p, args, state_leaves)
      else:
        jax.tree.unflatten(p.in_tree, flat)

    return median_seconds(call)

  def run_compiled(self, c: CompiledStep, leaves) -> list:
    """Runs one step of ``c`` on the flat step arguments; returns the flat outputs."""
    self._last = c
    return c.run([leaves], measure=self.measure)[0]

  def __call__(self, *args, **kwargs):
    return self._call(args, kwargs)

  def measure_memory(self, *args, **kwargs):
    """One step, as a call of the step, that also measures memory: at every instruction
    boundary the bytes of every array alive on each device (``jax.live_arrays``) plus the
    running executable's temporaries. Returns the step's output (the same values as a call);
    ``.memory`` is then the ``MemoryReport``: per device the measured and predicted peak and
    what held the bytes."""
    return self._call(args, kwargs, measure_memory=True)

  @property
  def memory(self):
    """The last ``measure_memory`` step's ``MemoryReport`` (None before one)."""
    return self._memory

  def _call(self, args, kwargs, measure_memory: bool = False):
    fn, args = with_keywords(self.fn, args, kwargs)
    pure, leaves = functionalize(fn, args)
    c = self.compiled_for(args, pure, leaves)
    if measure_memory:
      outs, self._memory = c.measure_memory(leaves)
    else:
      outs = self.run_compiled(c, leaves)
    if pure.graph_positions:
      return _write_back(c, pure, args, outs)
    return jax.tree.unflatten(c.out_tree, outs)[0]

  def run_steps(self, *args, stream: bool | None = None):
    """K training steps in one call: ``step(*args_t)`` for t = 0..K-1, where each batch
    argument (the last one, or ``batch_argnums``) is given as a list of K batches.

    The state carries from step to step as it would over K calls: NNX objects among ``args``
    are updated in place; a functional step returns its new non-batch arguments first, in
    order (``(params, opt_state, batch) -> (params, opt_state, metrics)``), and step t + 1
    gets them. Returns the list of the K outputs for an NNX step; for a functional step what
    ``jax.lax.scan`` would: ``(*final non-batch arguments, [rest of the output per step])``.

    Under the stale-weight schedules (``pipedream-async``, ``pipedream-async-vsync``, ``2bw``)
    the steps can be issued as one stream without a flush between them (``runtime.steps``), as
    PipeDream runs. ``stream=None`` (default) streams on accelerators and runs K calls on CPU
    devices, where the client blocks the issuing thread once a device has a few dozen
    computations queued and the stream measured slower than K calls (docs/results/schedules.md);
    ``True`` streams wherever it can, ``False`` never. Other schedules, and runs the stream
    does not cover (one fused stage, several processes,
    ``measure=True``), run the K steps one after another. The values are those of K calls
    either way.
    """
    bpos = self.opts.batch_positions(len(args))
    K = None
    for i in bpos:
      b = args[i]
      if not isinstance(b, (list, tuple)) or not b:
        raise BatchError(
          f"run_steps takes each batch argument as a non-empty list of per-step batches; "
          f"argument {i} is a {type(b).__name__}"
        )
      if K is not None and len(b) != K:
        raise BatchError(
          f"run_steps got {K} batches for one batch argument and {len(b)} for argument {i}; "
          "give every batch argument one batch per step"
        )
      K = len(b)
    assert K is not None

    def step_args(t: int) -> tuple:
      return tuple(a[t] if i in bpos else a for i, a in enumerate(args))

    first = step_args(0)
    pure, leaves = functionalize(self.fn, first)
    c = self.compiled_for(first, pure, leaves)
    graph = set(pure.graph_positions)
    carried_args = [i for i in range(len(args)) if i not in bpos and i not in graph]
    carry = carry_map(c, first, graph, carried_args)
    others_at = [i for i in range(len(args)) if i not in graph]
    nstate = len(leaves) - len(jax.tree.leaves(tuple(first[i] for i in others_at)))

    def flat(t: int) -> list:
      a = step_args(t)
      return leaves[:nstate] + jax.tree.leaves(tuple(a[i] for i in others_at))

    def signature(t: int) -> tuple:
      bs = [args[i][t] for i in bpos]
      shapes = [(np.shape(x), canonical_dtype(x)) for x in jax.tree.leaves(bs)]
      return str(jax.tree.structure(bs)), shapes

    want = signature(0)
    for t in range(1, K):
      if signature(t) != want:
        raise BatchError(
          f"run_steps needs batches of one structure, shape and dtype; batch {t} differs "
          "from batch 0"
        )
    steps_leaves = [leaves] + [flat(t) for t in range(1, K)]
    stale = weight_delays(c.schedule) is not None
    reason = stream_reason(c, self.measure, jax.process_count() > 1, stream)
    self._last = c
    if reason is None and stale:
      outs = c.run(steps_leaves, carry, measure=self.measure)
    else:
      if reason is not None and stale:
        logging.info("run_steps: the %d steps run one after another: %s", K, reason)
      outs = []
      for t in range(K):
        step_leaves = steps_leaves[t]
        if t > 0:
          step_leaves = [outs[-1][carry[i]] if i in carry else x for i, x in enumerate(step_leaves)]
        outs.append(self.run_compiled(c, step_leaves))
    per_step = [jax.tree.unflatten(c.out_tree, o) for o in outs]
    if graph:
      nnx.update(tuple(args[i] for i in pure.graph_positions), per_step[-1][1])
    if not carried_args:
      return [out for out, _ in per_step]
    n = len(carried_args)
    rest = [out[n] if len(out) == n + 1 else tuple(out[n:]) for out, _ in per_step]
    return (*per_step[-1][0][:n], rest)

  def cached_partial(self, *cached_args) -> Callable:
    """The step with its leading arguments bound, the NNX graph traversal done once.

    ``fast = step.cached_partial(model, optimizer)``, then ``fast(batch)`` is
    ``step(model, optimizer, batch)`` without splitting and updating the NNX objects on every
    call (milliseconds of host time per step for a few hundred variables), as
    ``nnx.cached_partial`` does for ``nnx.jit``: each call reads and writes the objects'
    Variables directly. Like there, the objects' structure must stay as it is between calls
    (assigning new values to their Variables is fine); see ``runtime.cached.CachedStep``.
    """
    return CachedStep(self, cached_args)


def _leaf_key(x: Any) -> tuple:
  """A step argument's (shape, dtype) for the compiled-step cache: a JAX array's own (already
  canonical), else its canonical dtype (a NumPy array and a JAX array of one shape and dtype
  key alike). Dtype objects, not their names: naming one costs microseconds, hundreds of times
  a call."""
  aval = getattr(x, "aval", None)  # a JAX array's; cheaper than isinstance(x, jax.Array)
  if aval is not None:
    return aval.shape, aval.dtype
  return tuple(np.shape(x)), canonical_dtype(x)


@dataclasses.dataclass(frozen=True)
class _OutTree:
  """A compiled step's output tree alone (what ``_write_back`` reads of it)."""

  out_tree: Any


def _write_back(c: Any, pure: Any, args: tuple, outs: list) -> Any:
  """The step's output, the NNX objects given updated with the new state ``outs`` ends with.

  The new values go straight into the objects' Variables (those ``functionalize``'s split
  found, in the same order), as ``runtime.cached`` writes them: unflattening the new state
  into Variables and ``nnx.update`` cost more host time than the step for a few hundred
  Variables. Where the new state's structure is not the split state's, ``nnx.update``."""
  out_def, state_def = c.out_tree.children()
  nout = out_def.num_leaves
  new = outs[nout:]
  variables = jax.tree.leaves(pure.state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  if (
    state_def == pure.in_tree.children()[0]
    and len(variables) == len(new)
    and all(isinstance(v, nnx.Variable) for v in variables)
  ):
    write_values(variables, new, all(writable_directly(v) for v in variables))
    return out_def.unflatten(outs[:nout])
  out, new_state = jax.tree.unflatten(c.out_tree, outs)
  nnx.update(tuple(args[i] for i in pure.graph_positions), new_state)
  return out


def _candidate_lines(planned: Any) -> list[str]:
  """Each candidate's modelled peak memory per device and its predicted time (or why it was
  left out: over the memory budget)."""
  limit = planned.memory_limit
  budget = f", budget {format_bytes(limit)} per device" if limit else ""
  lines = [f"candidates (modelled peak per device{budget}; predicted step time):"]
  for name, cand in planned.candidates.items():
    t = cand.predicted_s
    when = f"{t * 1e3:.2f} ms {cand.how}" if t is not None else "left out: over the memory budget"
    if cand.measured_s is not None:
      when += f" (timed {cand.measured_s * 1e3:.2f} ms)"
    lines.append(f"  {name:28s} {format_bytes(cand.peak_bytes):>12s}  {when}")
  return lines


def _probe_host(devices) -> Any:
  """The host's costs of driving ``devices`` (``runtime.host.measure_host``, with this module's
  decorator for its small pipeline)."""
  from gpp_jax.runtime import host

  return host.measure_host(devices, graph_pipeline)


def _one_device_message(device) -> str:
  """The warning for a pipeline given a single device: every stage shares it."""
  msg = (
    f"graph_pipeline runs on one device ({device}): every stage shares it, so the step is "
    "gradient accumulation over micro-batches, not a pipeline. "
  )
  available = jax.device_count()
  if available > 1:
    return msg + f"JAX has {available} devices; pass several in devices=."
  if device.platform == "cpu":
    return msg + (
      "JAX has one CPU device unless asked for more before it is first used: call "
      'jax.config.update("jax_num_cpu_devices", 8) right after `import jax` (or set '
      "XLA_FLAGS=--xla_force_host_platform_device_count=8), then pass devices=jax.devices()."
    )
  return msg + (
    f"JAX has one device per accelerator and sees a single {device.platform.upper()} here; run "
    "on a machine with several."
  )


def _caller_level() -> int:
  """The ``stacklevel`` of the first frame outside this module (the decorator's caller)."""
  frame: FrameType | None = sys._getframe(1)
  level = 1
  while frame is not None and frame.f_code.co_filename == __file__:
    frame, level = frame.f_back, level + 1
  return level


def graph_pipeline(fn: Callable | None = None, **kwargs) -> Any:
  """Decorates a train step to run as a graph pipeline.

  Usage::

    @gpp_jax.graph_pipeline(num_microbatches=8, devices=jax.devices()[:4])
    def train_step(state, batch):
      def loss_fn(params):
        return loss(state.apply_fn(params, batch["x"]), batch["y"])
      loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

  Args:
    num_microbatches: micro-batches per step; the batch size must divide by it.
    mesh: the user's ``jax.sharding.Mesh`` (or ``"data:4,model:2"``), instead of ``devices``.
      Stages take whole rows of its first axis (a plan's device indices are then row
      indices); every other axis stays whole inside each stage. The model's partition specs
      (``nnx.with_partitioning``, Linen ``nn.with_partitioning`` and
      ``nn.with_logical_partitioning`` under ``nn.logical_axis_rules``, or arrays already
      sharded over a mesh of these axis names) hold over each stage's sub-mesh: a spec naming
      "model" is tensor parallel, one naming the first axis shards over the stage's rows
      (FSDP). Parameters, their optimizer state and gradient sums stay sharded where their
      stage holds them (``runtime.sharding``).
    devices: devices to run on (default: ``jax.devices()``); plan device indices refer to it.
      A single device with several micro-batches warns (every stage would share it); on CPU,
      ``jax.config.update("jax_num_cpu_devices", n)`` before JAX is first used gives n devices.
    planner: a planner name (``"balanced"``, and the cost-model planners), a ``Plan``, a
      ``gpp_jax.manual_plan(...)``, or a callable ``(layer_graph, cluster, batch_size,
      num_microbatches=) -> Plan``. Stages with different ``microbatch_size``s each run at
      their own size (``manual_plan(..., microbatch_sizes=)``, ``"graphpipe-stage-mb"``).
    schedule: ``"1f1b"``, ``"gpipe"``, ``"graph-1f1b"`` or ``"zero-bubble"`` (backward split
      into input and weight gradients, the latter deferred into bubbles); None (default) keeps
      the plan's (planners choose; a manual plan uses 1F1B).
    batch_argnums: positions of the batch arguments (default: the last argument).
    remat: recompute each stage's forward in its backward instead of keeping residuals.
    layer_depth: truncate layer paths to this many components (coarser layers).
    cluster: the Cluster description planners use (default: the device count).
    measure: run each stage in its own thread, blocking per action, to record a measured
      timeline (slower; single process only).
    calibrate: time every layer's forward and backward on this process's first device of the
      pipeline before planning (``passes.calibrate``: robust, identical layers timed once), so
      cost-model planners see measured layer times instead of the roofline estimate; with
      several processes all take process 0's times. The result is ``.calibration``.
    fuse: a plan of one stage on one device (in one process) runs as one jitted step, the
      micro-batch loop inside it (``runtime.fused``), so it costs what the plain jitted step
      costs; False runs it action by action like any other plan (to inspect its timeline).
    timeout_s: in a multi-process run, the set-up (sharing layer times and checking that all
      processes have one plan) or a step that has not finished after this many seconds
      (a peer process died or stalls) raises ``GppError`` instead of hanging.
    memory_limit: bytes a plan may use per device (an int, or a string such as ``"512MiB"``,
      ``"12GiB"``); default: the device's ``bytes_limit`` where JAX reports one (GPU, TPU),
      else the cluster preset's. Planners choose among the plans whose predicted peak fits;
      a plan given by hand (a ``Plan`` or ``manual_plan``) that does not fit is refused before
      anything runs, with each device's numbers.
    min_stages: the plain jitted step on one device and jit data parallel over the devices are
      candidates of every planner, taken when predicted faster than its pipeline (the choice
      and the predictions are logged and in ``explain()``); k > 1 keeps the planner's
      pipeline and has the planner search only plans of at least k stages (its best such
      plan runs; no other planner stands in, and a planner that cannot is a ``PlanError``
      naming it).
    donate_argnums: positions of arguments whose arrays the step may consume, as
      ``jax.jit``'s: every array of a pytree there, and of an NNX object its Variables' values
      (the Variables then hold the step's new values). Where the step runs as one executable
      (plain jit, jit data parallel, a fused one-stage plan) XLA writes the new state into
      the donated buffers: no second copy of the state, and on a GPU no time spent allocating
      one (see docs/results/gpus.md). The caller must not read
      a donated array afterwards (JAX raises: deleted); a pipeline of several stages does not
      consume them.
  """
  if fn is None:
    return lambda f: _decorated(f, kwargs)
  return _decorated(fn, kwargs)


def _decorated(fn: Callable, keywords: dict[str, Any]) -> GraphPipeline:
  """``fn`` as a ``GraphPipeline`` with ``graph_pipeline``'s ``keywords``; a ``TypeError``
  naming the keyword where one is unknown (with the nearest known one) or missing."""
  known = [f.name for f in dataclasses.fields(PipelineKeywords)]
  for k in keywords:
    if k not in known:
      near = difflib.get_close_matches(k, known, n=1)
      raise TypeError(
        f"graph_pipeline got an unexpected keyword {k!r}"
        + (f"; did you mean {near[0]!r}?" if near else f"; it takes {', '.join(known)}")
      )
  if "num_microbatches" not in keywords:
    raise TypeError(
      "graph_pipeline needs num_microbatches= (how many micro-batches each batch is split "
      "into; 1 runs the step whole)"
    )
  opts = PipelineKeywords(**keywords).options(getattr(fn, "__name__", "step"), _probe_host)
  return GraphPipeline(fn, opts)
