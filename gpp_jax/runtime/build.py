"""Building a captured, planned step (``runtime.compile``): stage (``runtime.stage``),
schedule, kernels (the jitted functions a program calls), loss seeds and the memory check,
into a ``CompiledStep``, which lowers its program (``passes.lowering``) and makes its executor
(``runtime.executor``) per number of steps; and ``time_step``, the timing a trial of the plan
choice takes of a built step."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import networkx as nx
import numpy as np
from absl import logging
from jax.extend import core as xc
from jax.sharding import NamedSharding, PartitionSpec

from gpp_jax.errors import PlanError, counted
from gpp_jax.ir.plan import Plan
from gpp_jax.ir.program import Program
from gpp_jax.ir.schedule import Schedule
from gpp_jax.ir.step import StepProgram
from gpp_jax.passes.lowering import KEY, Lowered, lower_fused, lower_step
from gpp_jax.passes.schedules import plan_schedule, stream_schedule
from gpp_jax.passes.staging import row_local_functions, stage_functions
from gpp_jax.passes.weight_versions import weight_delays
from gpp_jax.runtime.buffers import buffer_bytes, constant_bytes
from gpp_jax.runtime.captured import Captured
from gpp_jax.runtime.choice import Planned
from gpp_jax.runtime.executor import Executor, Kernels, StageKernels, leaf_homes
from gpp_jax.runtime.fused import fused_step
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.placement import pack_limit, place_input, transfer
from gpp_jax.runtime.planning import memory_limit
from gpp_jax.runtime.sharding import entry_axes, stage_param_specs
from gpp_jax.runtime.stage import Staged, row_batch_flags, stage_step


def fuses(opts: Options, plan: Plan, sched: Schedule, captured: Captured) -> bool:
  """Whether the step runs as one jitted function: one stage is gradient accumulation, not a
  pipeline (``runtime.fused``): plain jit on one device, jit data parallel on several (with
  several processes, a stage over devices of each is one SPMD program that each calls)."""
  return (
    opts.fuse
    and plan.num_stages == 1
    and weight_delays(sched) is None  # stale-weight schedules keep older versions
    and not captured.state  # state carried between micro-batches runs in the executor
  )


def _without(spec: Any, axis: str, ndim: int) -> tuple:
  """``spec``'s entries for an array of rank ``ndim``, without ``axis`` (taken by the rows)."""
  entries = list(tuple(spec or ())[:ndim]) + [None] * (ndim - len(tuple(spec or ())[:ndim]))
  out = []
  for e in entries:
    names = tuple(n for n in entry_axes(e) if n != axis)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return tuple(out)


def build_kernels(
  captured: Captured, planned: Planned, staged: Staged, opts: Options, sched: Schedule
) -> Kernels:
  """The jitted functions a program calls: per stage forward/backward, the pieces of the
  step around the pipeline, and (one fused stage, ``fuses``) the whole step; stages sum
  their gradients per row (``row_local``) unless ``sched`` splits the backward."""
  fused = fuses(opts, planned.plan, sched, captured)
  split_w = sched.splits_backward
  spec = staged.spec
  layers = [tuple(s.layers) for s in planned.plan.stages]
  stages = []
  param_specs = stage_param_specs(captured, staged.staged, staged.leaf_specs)
  for st, place, packed in zip(staged.staged.stages, staged.placements, spec.packed):
    avals = [v.aval for v in st.jaxpr.jaxpr.invars]
    shardings = [
      place.sharded(sp, avals[p].ndim) for sp, p in zip(param_specs[st.index], st.param_inputs)
    ]
    local = staged.row_local.get(st.index) if not split_w else None
    if local is not None:  # gradients summed per row, reduced once per step
      batch = row_batch_flags(st, captured.roles, place.microbatch_size)
      axis = place.axis_names[0]
      acc_shardings: list[jax.sharding.Sharding] = [
        NamedSharding(place.mesh, PartitionSpec(axis, *_without(sp, axis, a.ndim)))
        for sp, a in zip(param_specs[st.index], [avals[p] for p in st.param_inputs])
      ]
      fns = row_local_functions(local, place.mesh, batch, shardings, acc_shardings)
      shardings = acc_shardings
    else:
      fns = stage_functions(
        st,
        remat=opts.remat,
        pack_residuals=len(place.devices) == 1,
        pack_limit=pack_limit(place.devices[0]),
        param_shardings=None if len(place.devices) == 1 else shardings,
      )
    assert (fns.pack_params is not None) == packed
    nondiff = [r for r in st.inputs if not r.diff]
    keys = tuple(
      k for k, r in enumerate(nondiff) if r.kind == "data" and spec.roles[r.index] == KEY
    )
    zeros = jax.jit(
      fns.zeros_acc, out_shardings=place.replicated if len(place.devices) == 1 else shardings
    )
    stages.append(StageKernels(st, fns, place, zeros, keys, layers[st.index], local is not None))
  prog = staged.prog
  pieces = [jax.jit(xc.jaxpr_as_fun(p.jaxpr)) for p in prog.before + prog.after]
  fused_fn = None
  if fused:
    # The loss as captured (one stage needs no scan split): inputs are the marker's.
    stacked = len(staged.placements[0].devices) > 1
    fused_fn = fused_step(prog, captured, opts.num_microbatches, stacked)
  return Kernels(stages, pieces, fused_fn, staged.leaf_specs)


def loss_seeds(staged: Staged, counts: Sequence[int]) -> list[Any]:
  """Per stage, ``1 / M_s`` on the stage computing the loss (None elsewhere): the seed of its
  backward, d(mean loss) / d(chunk loss)."""
  st = staged.staged
  ls, lk = st.loss_outputs[0]
  dtype = st.stages[ls].jaxpr.jaxpr.outvars[lk].aval.dtype
  seeds: list[Any] = [None] * len(st.stages)
  seeds[ls] = transfer(np.asarray(1.0 / counts[ls], dtype=dtype), staged.placements[ls].replicated)
  return seeds


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """Everything built for one argument signature, phase by phase (``runtime.compile``).

  ``executor`` runs one step; ``executor_for`` gives the executor of K steps in one program
  (``run_steps``' stream) or of a stale-weight step with another history length.
  """

  opts: Options
  captured: Captured
  planned: Planned
  staged: Staged
  schedule: Schedule
  kernels: Kernels
  fused: bool
  seeds: tuple[Any, ...]
  delays: tuple[int, ...] | None
  history: list[list[Any]]  # parameter versions of earlier steps, newest first (stale weights)
  executors: dict[tuple[int, int], Executor]
  last: list[Executor]  # the executor of the last run

  @property
  def plan(self) -> Plan:
    return self.planned.plan

  @property
  def layer_graph(self) -> nx.DiGraph:
    return self.planned.layer_graph

  @property
  def batch_size(self) -> int:
    return self.captured.batch_size

  @property
  def out_tree(self) -> Any:
    return self.captured.out_tree

  @property
  def prog(self) -> StepProgram:
    return self.staged.prog

  @property
  def lowered(self) -> Lowered:
    return self.executor_for(1).lowered

  @property
  def program(self) -> Program:
    return self.lowered.program

  def executor_for(self, steps: int = 1, carry: dict[int, int] | None = None) -> Executor:
    """The executor of ``steps`` steps in one program (``carry``: flat input -> the flat
    output of the previous step feeding it)."""
    keep = max(self.delays) if self.delays else 0
    key = (steps, min(len(self.history), keep))
    ex = self.executors.get(key)
    if ex is None:
      if self.fused:
        assert steps == 1, "a fused step runs one step a call"
        lowered = lower_fused(self.staged.spec, self.opts.num_microbatches)
      else:
        sched = self.schedule if steps == 1 else stream_schedule(self.schedule, steps)
        split_w = sched.splits_backward
        lowered = lower_step(
          self.staged.spec,
          sched,
          carry=carry,
          delays=self.delays,
          history=key[1],
          sizes=buffer_bytes(self.kernels, self.staged.staged, split_w, self.opts.remat),
        )
      ex = Executor(
        lowered,
        self.kernels,
        seeds=self.seeds,
        timeout_s=self.opts.timeout_s,
        history=self.history,
      )
      self.executors[key] = ex
    return ex

  def input_kinds(self, lowered: Lowered) -> dict[int, str]:
    """Kinds of the program's step-argument buffers: parameters, the batch, other state."""
    J = self.captured.step.jaxpr
    index = {v: i for i, v in enumerate(J.invars)}
    params = {index[v] for v in self.captured.marker.invars[: self.captured.nparam] if v in index}
    batch = set(self.captured.batch_leaves)
    kinds = {}
    for b, binding in zip(lowered.program.inputs, lowered.bindings):
      if binding.kind == "leaf":
        i = binding.index
        kinds[b] = "param" if i in params else "batch" if i in batch else "input"
    return kinds

  def measure_memory(self, leaves: Sequence[Any]) -> tuple[list[Any], Any]:
    """One step, counting the live arrays per device at every instruction boundary; returns
    its flat outputs and the ``runtime.memory.MemoryReport`` (measured beside predicted)."""
    from gpp_jax.runtime import memory

    ex = self.executor_for(1)
    self.last[:] = [ex]
    kinds = self.input_kinds(ex.lowered)
    outs = ex.run([leaves], memory=kinds)[0]
    return outs, memory.report(ex.census, self.predicted_memory(ex.temps))

  def predicted_memory(self, temps: dict[int, int] | None = None) -> Any:
    """``cost.memory.program_memory`` of one step's program (``temps``: the executables'
    temporaries per instruction, when measured)."""
    from gpp_jax.cost.memory import program_memory

    ex = self.executor_for(1)
    lanes = [p.devices for p in self.staged.placements[: ex.program.num_stages]]
    return program_memory(
      ex.program,
      lanes + [()],
      temps,
      self.input_kinds(ex.lowered),
      constant_bytes(self.staged, self.fused, self.captured),
      self.memory_shares(ex),
    )

  def memory_shares(self, ex: Executor) -> dict[int, float]:
    """Buffer -> the fraction of it each device of its lane holds, for sharded buffers: the
    step's arguments with a partition spec and their copies, each stage's gradient sums, and
    the step's new values of such arguments (an NNX step's new state)."""
    if not any(self.staged.leaf_specs):
      return {}
    P, places = ex.program, self.staged.placements

    def share(lane: int, spec: Any, aval: Any) -> float:
      if lane >= len(places) or spec is None or not hasattr(aval, "ndim"):
        return 1.0
      s = places[lane].sharded(spec, aval.ndim)
      n = s.num_devices if hasattr(s, "num_devices") else len(s.device_set)
      shape = s.shard_shape(tuple(aval.shape)) if n > 1 else tuple(aval.shape)
      whole = max(1, int(np.prod(aval.shape, dtype=np.int64)))
      return int(np.prod(shape, dtype=np.int64)) / whole

    out = {b: share(P.buffers[b].lane, spec, ex.lowered.avals[b]) for b, spec in ex.specs.items()}
    # The new state of an NNX step comes back after the step's own outputs, leaf for leaf.
    out_def, state_def = self.out_tree.children()
    nout = out_def.num_leaves
    for ks in ex.lowered.step_outputs:
      for k in range(nout, min(len(ks), nout + state_def.num_leaves)):
        b = P.outputs[ks[k]]
        spec = self.staged.leaf_specs[k - nout] if k - nout < len(self.staged.leaf_specs) else None
        if spec is not None:
          out[b] = share(P.buffers[b].lane, spec, ex.lowered.avals[b])
    # Gradient sums: held like their parameters.
    param_specs = stage_param_specs(self.captured, self.staged.staged, self.staged.leaf_specs)
    for b, buf in enumerate(P.buffers):
      if buf.kind != "acc" or buf.lane >= len(places) or not places[buf.lane].devices[1:]:
        continue
      st = self.staged.staged.stages[buf.lane]
      avals = [st.jaxpr.jaxpr.invars[p].aval for p in st.param_inputs]
      sizes = [int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in avals]
      specs = param_specs[buf.lane]
      if self.kernels.stages[buf.lane].row_local:  # the rows' slices: the rows axis is theirs
        axis = places[buf.lane].axis_names[0]
        specs = [PartitionSpec(*_without(sp, axis, a.ndim)) for sp, a in zip(specs, avals)]
      held = sum(n * share(buf.lane, sp, a) for n, sp, a in zip(sizes, specs, avals))
      if sum(sizes):
        out[b] = held / sum(sizes)
    return out

  def run(
    self, steps_leaves: Sequence[Sequence[Any]], carry=None, measure: bool = False
  ) -> list[list[Any]]:
    """Runs ``len(steps_leaves)`` steps in one program; returns each step's flat outputs.
    ``measure``: one thread per lane waiting for each instruction (device times)."""
    ex = self.executor_for(len(steps_leaves), carry)
    self.last[:] = [ex]
    return ex.run(steps_leaves, measure=measure)


def build_step(
  captured: Captured,
  planned: Planned,
  opts: Options,
  recapture: Callable[[int], Captured],
  planned_by_user: bool,
) -> CompiledStep:
  """Stage, schedule, kernels and memory check of a captured, planned step."""
  staged = stage_step(captured, planned, opts, recapture)
  sched = plan_schedule(planned.plan, captured.batch_size)
  fused = fuses(opts, planned.plan, sched, captured)
  kernels = build_kernels(captured, planned, staged, opts, sched)
  counts = sched.stage_counts
  seeds = loss_seeds(staged, counts)
  logging.info(
    "graph_pipeline: %s (depth %d), micro-batches per stage %s of %s, %s",
    counted(planned.plan.num_stages, "stage"),
    planned.plan.depth(),
    list(counts),
    list(staged.microbatch_sizes),
    counted(len(kernels.pieces), "step piece"),
  )
  compiled = CompiledStep(
    opts=opts,
    captured=captured,
    planned=planned,
    staged=staged,
    schedule=sched,
    kernels=kernels,
    fused=fused,
    seeds=tuple(seeds),
    delays=weight_delays(sched),
    history=[],
    executors={},
    last=[],
  )
  check_memory(compiled, opts, planned_by_user)
  return compiled


def check_memory(c: CompiledStep, opts: Options, planned_by_user: bool) -> None:
  """Before anything runs: the step's program, its buffers sized, against the budget. A plan
  that does not fit is refused with each device's numbers (a planner's too: its cost model
  was optimistic where the program finds it over budget)."""
  limit = memory_limit(opts)
  trace = c.predicted_memory()
  over = {d: n for d, n in trace.peak.items() if n > limit}
  if not over:
    return
  from gpp_jax.cost.memory import format_bytes as fmt

  lines = []
  for d, n in sorted(over.items(), key=lambda kv: -kv[1]):
    cat, size = max(trace.breakdown[d].items(), key=lambda kv: kv[1])
    lines.append(f"{d}: {fmt(n)} (most: {cat}, {fmt(size)})")
  msg = (
    f"the plan needs more memory than memory_limit={fmt(limit)} per device (before "
    f"temporaries): {'; '.join(lines)}. Give the stages fewer layers (more stages), keep fewer "
    "micro-batches in flight (schedule='1f1b' instead of 'gpipe'), use smaller micro-batches "
    "(more num_microbatches), recompute activations (remat=True), or raise memory_limit to at "
    f"least {fmt(max(over.values()))}"
  )
  if not planned_by_user:
    msg = f"{c.plan.planner}'s plan: {msg}"
  raise PlanError(msg)


def time_step(
  c: CompiledStep, leaves: Sequence[Any], repeats: int = 5, outside: float = 0.0
) -> float:
  """Seconds per step of ``c`` in the steady state of a training loop whose host spends
  ``outside`` seconds a step outside the program, less those seconds: after two runs to warm
  up, at least ``repeats`` rounds (quick steps: more, until ``TIME_STEP_SECONDS`` of rounds or
  100 runs) of runs issued back to back, as a loop issues its steps, the clock read when the
  host has issued the last one (``issued``) and when its outputs are ready (``wall``). The
  loop's host issues a step and does its work outside the program while the devices run the
  steps before, so a round of n runs takes max(wall, issued + n * outside) in the loop; the
  median round's time per run, less ``outside`` (which the prediction adds back). A step timed
  one run at a time, each waited for, pays the host's issue of a run and the devices' work
  one after the other: on tiny steps that was most of the step (a trial up to 1.9x the loop's
  time). A round is ``ROUND_CALLS`` runs (at least ``MIN_ROUND_CALLS``, fewer where a run
  takes long: ``ROUND_SECONDS`` a round), since a round pays once the first run's issue and
  the last run's work, which a loop overlaps: in rounds of 4, tiny MMT's trial measured up
  to 1.6x the loop's step (docs/results/trials.md). Arrays among ``leaves`` are placed
  where the step keeps them first: on the first call a model's arrays are not yet where a
  training loop's later steps find them (the step's own outputs), and moving them every run
  would be timed as the step: a stage over several devices keeps them replicated over its
  mesh (the batch arrives as a training loop's data does, on the stage's first device), and
  a pipeline's parameters and optimizer state go where its program puts them. A
  step that consumes arguments (``donate_argnums``) gets fresh copies of them for every run,
  made before the clock starts: the caller's arrays survive.

  With several processes every process runs the same number of runs (a stage over devices of
  several processes is one SPMD program that each calls), ``repeats`` rounds of one run each,
  the batch stays on the host, and each process's own clock is returned: the caller takes one
  process's."""
  multi = jax.process_count() > 1
  if c.staged.placements:
    place, batch = c.staged.placements[0], set(c.staged.spec.batch_leaves)
    # A pipeline's parameters and optimizer state go to their stages (where its program puts
    # them); its batch stays where it was given.
    homes = leaf_homes(c.executor_for(1)) if not c.fused or any(c.staged.leaf_specs) else None

    def home(i: int, x: Any) -> Any:
      if homes is not None:
        there = homes.get(i) if i not in batch else None
        if there is None:
          return x
        return place_input(x, there) if multi else jax.device_put(x, there)
      if multi:
        return x if i in batch else place_input(x, place.replicated)
      return jax.device_put(x, place.devices[0] if i in batch else place.replicated)

    given = list(leaves)
    leaves = [
      home(i, x) if isinstance(x, jax.Array) and x.is_fully_addressable else x
      for i, x in enumerate(leaves)
    ]
  donated = set(c.staged.spec.donated) if c.fused else set()

  def fresh(i: int, x: Any) -> Any:  # a copy the step may consume
    if multi and c.staged.placements:
      mine = given[i]
      if isinstance(mine, jax.Array) and mine.is_fully_addressable:  # not yet global
        return home(i, jax.device_put(mine, may_alias=False))
    return jax.device_put(x, may_alias=False)

  def arguments() -> list[Any]:
    return [
      fresh(i, x) if i in donated and isinstance(x, jax.Array) else x for i, x in enumerate(leaves)
    ]

  warm = 0.0
  for _ in range(2):  # to warm up, each waited for
    run = arguments()
    jax.block_until_ready(run)
    t = time.perf_counter()
    jax.block_until_ready(c.run([run]))
    warm = time.perf_counter() - t
  # A round's consumed arguments are copied before its clock starts: at most ROUND_BYTES of
  # copies a round.
  consumed = sum(
    int(x.nbytes) for i, x in enumerate(leaves) if i in donated and isinstance(x, jax.Array)
  )
  calls = max(MIN_ROUND_CALLS, min(ROUND_CALLS, int(ROUND_SECONDS / max(warm, 1e-9))))
  if consumed:
    calls = max(1, min(calls, ROUND_BYTES // consumed))
  if multi:  # processes keep in step run by run, as before: one run a round
    calls = 1
  per_run: list[float] = []
  spent = 0.0
  # At least ``repeats`` rounds, more while they add up to under TIME_STEP_SECONDS: a step of
  # a few milliseconds on a shared machine needs dozens of runs for a median that holds.
  while len(per_run) < repeats or (
    not multi and spent < TIME_STEP_SECONDS and len(per_run) * calls < 100
  ):
    runs = [arguments() for _ in range(calls)]
    jax.block_until_ready(runs)
    t = time.perf_counter()
    for run in runs:  # only the last run's outputs are kept: each run's are freed as it ends
      out = c.run([run])
    issued = time.perf_counter() - t
    jax.block_until_ready(out)
    dt = time.perf_counter() - t
    spent += dt
    per_run.append(max(dt, issued + calls * outside) / calls - outside)
  return statistics.median(per_run)


TIME_STEP_SECONDS = 0.3  # the timed rounds of a trial add up to at least this (or 100 runs)
ROUND_CALLS = 16  # runs a round issues back to back, at most
MIN_ROUND_CALLS = 4  # at least (long runs: a round's first issue and last work are small)
ROUND_SECONDS = 0.05  # a round's runs add up to about this, between the two
ROUND_BYTES = 256 << 20  # consumed arguments copied for a round at most
