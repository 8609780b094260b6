"""The executor: runs a lowered program (``passes.lowering``) on real devices.

One object per lane owns that lane's buffers (``Lane.buffers``: a stage's parameters and
their packed form, its stashed residuals, its gradient sums, what it received; the host
lane's the arguments the caller passed). ``Executor`` turns each instruction into a call with
its operands resolved once, at build time, by a rule per op (``runtime.op_rules``), and
runs the calls in the program's order on one thread. JAX dispatches asynchronously, so nothing
here waits on a device: the devices overlap as the program lets them. Every value moves between
lanes by a SEND (``placement.transfer``: an explicit ``jax.device_put``), and each buffer is
dropped after its last reader.

Strategies of the same program:
  * ``run``: one thread, the program's order (every step, one-stage fused steps, K-step
    streams, multi-process runs alike);
  * ``run(measure=True)``: one thread per lane, each running its lane's instructions in order
    as their inputs arrive and waiting for each to finish on the device, which gives device
    times per instruction (single process).

Multi-process: every process runs the same program in the same order. A process computes only
the instructions of lanes on its own devices and stands in placeholders (arrays with no local
shards) for what the others compute; every SEND is issued by every process, which makes each
cross-process edge a matched send and receive (``placement.transfer``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from gpp_jax.errors import GppError, ScheduleError
from gpp_jax.ir.program import Instr, Op, Transfer, puts_together
from gpp_jax.passes.lowering import Lowered
from gpp_jax.runtime import liveness
from gpp_jax.runtime.op_rules import _RULES, send_sharding
from gpp_jax.runtime.placement import StagePlacement, new_send_epoch, transfer, transfer_all


@dataclasses.dataclass
class TimelineEvent:
  action: str
  stage: int
  microbatch: int
  start: float
  end: float


@dataclasses.dataclass
class Timeline:
  """Per-instruction times of one run (seconds from its start).

  ``measured`` is True when ``end`` is when the device finished the instruction (measure
  mode); otherwise start/end bracket only the host-side dispatch. ``action`` is the op (F, B,
  W, UPDATE, SEND, PIECE, ...); ``stage`` the stage it serves (its lane for ops serving none).
  """

  events: list[TimelineEvent]
  total: float
  measured: bool
  stage_devices: tuple[tuple[int, ...], ...] = ()  # the plan's device indices per stage

  def to_chrome_trace(
    self, memory: Mapping[str, Sequence[tuple[float, int]]] | None = None
  ) -> dict:
    """Chrome / Perfetto trace laid out like the simulator's (``cost.simulator.chrome_trace``):
    one track per stage, named with its devices; the track says whether its spans are device
    times (measured) or the host's dispatch of each action. ``memory``: device -> (seconds,
    bytes) of a memory-measuring step (``MemoryReport.counters``), a counter track per device."""
    ev: list[dict] = []
    stages = sorted({e.stage for e in self.events} | set(range(len(self.stage_devices))))
    what = "device (measured)" if self.measured else "host dispatch"
    for s in stages:
      devs = self.stage_devices[s] if s < len(self.stage_devices) else ()
      label = f"stage {s}" + (f" (devices {','.join(map(str, devs))})" if devs else "")
      if self.stage_devices and s == len(self.stage_devices):
        label = "host"
      ev.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": label}})
      ev.append({"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}})
      ev.append({"ph": "M", "name": "thread_name", "pid": s, "tid": 0, "args": {"name": what}})
    for e in self.events:
      ev.append(
        {
          "name": f"{e.action}{e.stage}.{e.microbatch}",
          "ph": "X",
          "cat": e.action,
          "pid": e.stage,
          "tid": 0,
          "ts": e.start * 1e6,
          "dur": max(e.end - e.start, 0) * 1e6,
          "args": {"microbatch": e.microbatch},
        }
      )
    if memory:
      pid = max(stages, default=-1) + 1
      name = "memory per device (the memory-measuring step)"
      ev.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
      for device, points in memory.items():
        for t, nbytes in points:
          ev.append(
            {
              "ph": "C",
              "name": f"{device} MiB",
              "pid": pid,
              "ts": t * 1e6,
              "args": {"MiB": nbytes / 2**20},
            }
          )
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


class StageFailure(GppError):
  """An instruction of the pipelined step raised; ``__cause__`` is the original exception."""


def placeholder(aval, sharding):
  """An array with no local data standing for a value computed on another process."""
  return jax.make_array_from_single_device_arrays(tuple(aval.shape), sharding, [], dtype=aval.dtype)


def is_local(placement: StagePlacement) -> bool:
  """Whether this process takes part in the stage: it holds one of the stage's devices (a
  stage spanning processes runs as one SPMD program that each of its processes calls)."""
  return any(d.process_index == jax.process_index() for d in placement.devices)


def wait_for(values, timeout_s: float) -> None:
  """Blocks until this process's shards of ``values`` are ready, or raises after a timeout.

  A peer process that died or stalls leaves a receive unfinished forever; this turns that hang
  into a clear error within ``timeout_s`` seconds.
  """
  arrays = [x for x in jax.tree.leaves(values) if isinstance(x, jax.Array)]
  done = threading.Event()
  failure = []

  def block():
    try:
      for x in arrays:
        for shard in x.addressable_shards:
          shard.data.block_until_ready()
    except BaseException as e:  # surfaced in the caller
      failure.append(e)
    done.set()

  threading.Thread(target=block, daemon=True, name="gpp-wait").start()
  with liveness.waiting("the pipelined step's results") as wait:
    while not done.wait(min(1.0, max(0.0, timeout_s - (time.monotonic() - wait.since)))):
      liveness.check(wait)
      if time.monotonic() - wait.since >= timeout_s:
        raise GppError(
          f"the pipelined step did not finish within {time.monotonic() - wait.since:.1f} s "
          f"(timeout_s={timeout_s:g}) on process {jax.process_index()} of "
          f"{jax.process_count()}: a peer process has died or stalls (its activations or "
          "gradients never arrived). Check the other processes' logs; raise timeout_s if "
          "steps are legitimately this slow."
        )
    if failure and jax.process_count() > 1:
      # A broken transfer: give the watch a moment to name the peer that went away.
      live = liveness.current()
      if live is not None:
        live.name_the_lost("a transfer with it broke")
      liveness.check(wait)
  if failure:
    where = f"process {jax.process_index()} of {jax.process_count()}"
    if jax.process_count() > 1:
      raise GppError(
        f"the pipelined step failed on {where}: a transfer with a peer process "
        f"broke, so the peer process has died or closed its connection. Check the "
        f"other processes' logs. Cause: {failure[0]}"
      ) from failure[0]
    raise GppError(f"the pipelined step failed on {where}: {failure[0]}") from failure[0]


@dataclasses.dataclass
class StageKernels:
  """A stage's executables and where they run (``passes.staging.stage_functions``)."""

  stage: Any  # ir.staged.StageProgram
  fns: Any  # passes.staging.StageFunctions
  placement: StagePlacement
  zeros: Callable[[], Any]
  key_positions: tuple[int, ...]  # among the forward's non-differentiable inputs
  layers: tuple[str, ...] = ()
  # Gradients summed per row of the stage's mesh and reduced once per step, in the UPDATE
  # (``passes.staging.row_local_functions``).
  row_local: bool = False


@dataclasses.dataclass
class Kernels:
  """Everything a program of one compiled step calls: per stage, the step's pieces, the
  fused step, the loss seeds."""

  stages: list[StageKernels]
  pieces: Sequence[Callable[..., Any]]
  fused: Callable[..., Any] | None
  # Per flat step argument, its partition spec (``runtime.sharding``; None or missing:
  # replicated over the stage that holds it).
  leaf_specs: Sequence[Any] = ()


class Lane:
  """One lane's buffers: a stage's devices, or the host."""

  def __init__(self, index: int, size: int, placement: StagePlacement | None, local: bool):
    self.index = index
    self.placement = placement
    self.local = local
    self.buffers: list[Any] = [None] * size

  def live_bytes(self) -> int:
    """Bytes this lane's live buffers hold on its devices (this process's shards)."""
    total = 0
    for x in jax.tree.leaves(self.buffers):
      if isinstance(x, jax.Array):
        total += sum(s.data.nbytes for s in x.addressable_shards)
    return total


class Executor:
  """Runs one lowered program with one compiled step's kernels."""

  def __init__(
    self,
    lowered: Lowered,
    kernels: Kernels,
    *,
    seeds: Sequence[Any] = (),
    timeout_s: float = 300.0,
    history: list[list[Any]] | None = None,
  ):
    """``seeds``: the loss seed per stage (``Binding("seed")``); ``history``: the parameter
    versions of earlier steps, newest first, shared by the executors of one compiled step
    (``Binding("version")`` reads it; stale-weight programs extend it)."""
    self.lowered = lowered
    self.program = P = lowered.program
    self.kernels = kernels
    self.timeout_s = timeout_s
    self.multiprocess = jax.process_count() > 1
    S = P.num_stages
    places = [k.placement for k in kernels.stages[:S]]
    self.lanes = [
      Lane(l, 0, places[l] if l < S else None, is_local(places[l]) if l < S else True)
      for l in range(P.num_lanes)
    ]
    # Global buffer id -> (its lane's list, index there).
    self.where: list[tuple[list[Any], int]] = []
    sizes = [0] * P.num_lanes
    for b in P.buffers:
      self.where.append((self.lanes[b.lane].buffers, sizes[b.lane]))
      sizes[b.lane] += 1
    for lane, n in zip(self.lanes, sizes):
      lane.buffers.extend([None] * n)
    self.seeds = list(seeds)
    self.specs = buffer_specs(lowered, kernels.leaf_specs)
    self.split_lanes = {i.lane for i in P.instrs if i.op is Op.W}
    self._fold_m: dict[tuple[int, int], Any] = {}
    self.code: list[tuple[Callable[[], None], tuple[tuple[list[Any], int], ...]]] = []
    self.instrs: list[Instr] = []
    self.positions: list[int] = []  # each call's instruction in the program
    for k, ins in enumerate(P.instrs):
      if ins.op is Op.RECV:
        continue  # arrival is the SEND's result being there; nothing to call
      self.instrs.append(ins)
      self.positions.append(k)
      self.code.append((_RULES[ins.op](self, ins), tuple(self.where[b] for b in ins.frees)))
    # What a plain run calls: runs of transfers between stages batched (the measuring runs
    # call each instruction on its own, ``code``).
    self.in_order = _batched_sends(self.code, self.instrs)
    self._timeline: Timeline | Callable[[], Timeline] | None = None
    self.history = history if history is not None else []
    self.census: Any = None  # the last memory-measuring run's (``runtime.memory.Census``)
    self.temps: dict[int, int] = {}  # instruction -> its executable's temporaries (measured)
    self._temp_cache: dict = {}

  @property
  def last_timeline(self) -> Timeline | None:
    """The last run's per-instruction times (built when first asked for: a step of a few
    hundred instructions should not pay for objects nobody reads)."""
    if callable(self._timeline):
      self._timeline = self._timeline()
    return self._timeline

  # ------------------------------------------------------------------ helpers for the rules
  def _slot(self, b: int) -> tuple[list[Any], int]:
    return self.where[b]

  def _getter(self, reads: Sequence[int]) -> Callable[[], list[Any]]:
    slots = [self.where[b] for b in reads]
    return lambda: [lst[i] for lst, i in slots]

  def _setter(self, writes: Sequence[int]) -> Callable[[Sequence[Any]], None]:
    slots = [self.where[b] for b in writes]

    def put(values: Sequence[Any]) -> None:
      for (lst, i), v in zip(slots, values):
        lst[i] = v

    return put

  def _remote(self, ins: Instr) -> Callable[[], None] | None:
    """The call for an instruction of a lane this process does not compute, else None: it
    stands in new placeholders (a transfer's state hangs off its arrays, so each run makes
    its own) for what the lane writes (None where no shape is known)."""
    if self.lanes[ins.lane].local:
      return None
    place = self.lanes[ins.lane].placement
    assert place is not None
    shapes = []
    for b in ins.writes:
      aval = self.lowered.avals[b]
      known = aval is not None and hasattr(aval, "shape")
      shapes.append((aval, place.for_array(aval)) if known else None)
    put = self._setter(ins.writes)

    def stand_in():
      put([None if x is None else placeholder(*x) for x in shapes])

    return stand_in

  def fold_index(self, lane: int, m: int) -> Any:
    """Micro-batch index m on a lane's devices (folded into the loss's keys)."""
    key = (lane, m)
    x = self._fold_m.get(key)
    if x is None:
      place = self.lanes[lane].placement
      assert place is not None, "the host lane folds no keys"
      x = self._fold_m[key] = transfer(np.uint32(m), place.replicated)
    return x

  def describe(self, ins: Instr) -> str:
    """Where an instruction runs, in words, for error messages."""
    P = self.program
    if ins.lane == P.host:
      where = "the host"
    else:
      k = self.kernels.stages[ins.lane]
      layers = ", ".join(k.layers[:6]) + (", ..." if len(k.layers) > 6 else "")
      where = f"stage {ins.lane} ({layers}) on {k.placement}"
    mb = f", micro-batch {ins.mb}" if ins.op in (Op.F, Op.B, Op.W) else ""
    step = f", step {ins.mb}" if ins.op is Op.UPDATE else ""
    peer = ""
    if ins.op is Op.SEND and 0 <= ins.peer < len(self.kernels.stages):
      place = self.kernels.stages[ins.peer].placement
      peer = f" to stage {ins.peer} on {place}"
      if self.multiprocess:  # which processes the transfer joins (one of them may be gone)
        ends = [self.kernels.stages[ins.peer].placement.devices]
        if ins.lane != P.host:
          ends.insert(0, self.kernels.stages[ins.lane].placement.devices)
        procs = sorted({d.process_index for devs in ends for d in devs})
        peer += f", between processes {', '.join(map(str, procs))}"
    return f"{ins.label()} ({ins.op.name}{mb}{step}) on {where}{peer}"

  # ------------------------------------------------------------------ running
  def bind(self, steps_leaves: Sequence[Sequence[Any]]) -> None:
    P, lw = self.program, self.lowered
    for b, binding in zip(P.inputs, lw.bindings):
      lst, i = self.where[b]
      kind = binding.kind
      if kind == "leaf":
        lst[i] = steps_leaves[binding.step][binding.index]
      elif kind == "seed":
        lst[i] = self.seeds[binding.index]
      elif kind == "const":
        lst[i] = binding.value
      elif kind == "version":
        lst[i] = self.history[binding.step - 1][binding.index]
      else:
        raise ScheduleError(f"unknown input binding {binding}")

  def run(
    self,
    steps_leaves: Sequence[Sequence[Any]],
    measure: bool = False,
    memory: Mapping[int, str] | None = None,
  ) -> list[list[Any]]:
    """Runs the program on the flat arguments of each of its steps; returns each step's flat
    outputs. ``measure``: device times per instruction (one thread per lane). ``memory``: count
    the live arrays per device at every instruction boundary (``runtime.memory``; the mapping
    gives buffers a kind other than their own, e.g. which step arguments are parameters);
    the result is ``self.census``."""
    if measure and self.multiprocess:
      raise GppError(
        "measure=True records device-side times with one thread per stage and "
        "runs in a single process only; leave it off for multi-process runs"
      )
    if self.multiprocess:
      new_send_epoch()
    t0 = time.perf_counter()
    try:
      self.bind(steps_leaves)
      events: list[TimelineEvent] | Callable[[], list[TimelineEvent]]
      if measure:
        events = self._run_threaded(t0)
      elif memory is not None:
        events = self._run_counting_memory(t0, memory)
      else:
        events = self._run_in_order(t0)
      P = self.program
      values = [self.where[b] for b in P.outputs]
      outs = [lst[i] for lst, i in values]
    finally:
      for lane in self.lanes:  # nothing of this run outlives it but its outputs
        lane.buffers[:] = [None] * len(lane.buffers)
    if self.multiprocess:
      wait_for(outs, self.timeout_s)
    total = time.perf_counter() - t0
    if callable(events):
      self._timeline = lambda: Timeline(events(), total, measure)
    else:
      self._timeline = Timeline(events, total, measure)
    lw = self.lowered
    if lw.versions:
      keep = max(lw.delays or (0,))
      kept = [[outs[k] for k in ks] for ks in reversed(lw.versions)]
      self.history[:] = (kept + self.history)[:keep]
    return [[outs[k] for k in ks] for ks in lw.step_outputs]

  def _run_in_order(self, t0: float) -> Callable[[], list[TimelineEvent]]:
    code = self.in_order
    stamps = [0.0] * (len(code) + 1)
    perf = time.perf_counter
    k = 0
    try:
      stamps[0] = perf()
      for k, (call, frees) in enumerate(code):
        call()
        for lst, i in frees:
          lst[i] = None
        stamps[k + 1] = perf()
    except Exception as e:
      ins = self.instrs[k]
      raise StageFailure(
        f"the pipelined step failed at instruction {k} of {len(code)}, {self.describe(ins)}: "
        f"{type(e).__name__}: {e}"
      ) from e
    instrs = self.instrs
    return lambda: [
      TimelineEvent(
        ins.op.value,
        ins.stage if ins.stage >= 0 else ins.lane,
        ins.mb,
        stamps[k] - t0,
        stamps[k + 1] - t0,
      )
      for k, ins in enumerate(instrs)
    ]

  def _run_counting_memory(self, t0: float, kinds: Mapping[int, str]) -> list[TimelineEvent]:
    """In order, waiting for each instruction, counting the live arrays after it ran."""
    from gpp_jax.runtime.memory import Census, executable_temps

    census = Census(self, kinds)
    census.count(0.0, {})
    events = []
    for k, (call, frees) in enumerate(self.code):
      ins = self.instrs[k]
      start = time.perf_counter()
      try:
        call()
        jax.block_until_ready([self.where[b][0][self.where[b][1]] for b in ins.writes])
      except Exception as e:
        raise StageFailure(
          f"the pipelined step failed at {self.describe(ins)}: {type(e).__name__}: {e}"
        ) from e
      end = time.perf_counter()
      temp = executable_temps(call, self._temp_cache)
      place = self.lanes[ins.lane].placement
      devices = place.devices if place is not None else ()
      if temp:
        self.temps[self.positions[k]] = temp
      census.count(end - t0, dict.fromkeys(devices, temp) if temp else {})
      for lst, i in frees:
        lst[i] = None
      stage = ins.stage if ins.stage >= 0 else ins.lane
      events.append(TimelineEvent(ins.op.value, stage, ins.mb, start - t0, end - t0))
    self.census = census
    return events

  def _run_threaded(self, t0: float) -> list[TimelineEvent]:
    """One thread per lane; each waits for its instruction's inputs, runs it and blocks until
    the device has finished (device times)."""
    P = self.program
    present = [False] * len(P.buffers)
    for b in P.inputs:
      present[b] = True
    cond = threading.Condition()
    errors: list[BaseException] = []
    events: list[TimelineEvent] = []
    per_lane: list[list[int]] = [[] for _ in range(P.num_lanes)]
    for k, ins in enumerate(self.instrs):
      per_lane[ins.lane].append(k)

    def worker(lane: int) -> None:
      try:
        for k in per_lane[lane]:
          ins = self.instrs[k]
          call, frees = self.code[k]
          with cond:
            while not errors and not all(present[b] for b in ins.reads):
              if not cond.wait(timeout=self.timeout_s):
                raise ScheduleError(
                  f"lane {lane} waited {self.timeout_s:.0f} s for the inputs of {ins.label()}"
                )
            if errors:
              return
          start = time.perf_counter()
          try:
            call()
          except Exception as e:
            raise StageFailure(
              f"the pipelined step failed at {self.describe(ins)}: {type(e).__name__}: {e}"
            ) from e
          jax.block_until_ready([self.where[b][0][self.where[b][1]] for b in ins.writes])
          end = time.perf_counter()
          with cond:
            for lst, i in frees:
              lst[i] = None
            for b in ins.writes:
              present[b] = True
            stage = ins.stage if ins.stage >= 0 else ins.lane
            events.append(TimelineEvent(ins.op.value, stage, ins.mb, start - t0, end - t0))
            cond.notify_all()
      except BaseException as e:  # surfaced in the caller
        with cond:
          errors.append(e)
          cond.notify_all()

    threads = [threading.Thread(target=worker, args=(l,), daemon=True) for l in range(P.num_lanes)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    if errors:
      raise errors[0]
    events.sort(key=lambda e: e.start)
    return events


def buffer_specs(lowered: Lowered, leaf_specs: Sequence[Any]) -> dict[int, Any]:
  """Buffer -> the partition spec of the step argument it holds (a bound argument leaf, or a
  copy of one sent elsewhere whole: not by a ``Transfer.batched``), for the arguments that
  have one."""
  if not any(leaf_specs):
    return {}
  P = lowered.program
  out: dict[int, Any] = {}
  for b, binding in zip(P.inputs, lowered.bindings):
    if binding.kind == "leaf" and binding.index < len(leaf_specs):
      spec = leaf_specs[binding.index]
      if spec is not None:
        out[b] = spec
  for ins in P.instrs:
    batched = isinstance(ins.arg, Transfer) and ins.arg.batched
    if ins.op is Op.SEND and not batched and ins.reads[0] in out:
      out[ins.writes[0]] = out[ins.reads[0]]
  return out


def leaf_homes(ex: Executor) -> dict[int, Any]:
  """Argument leaf index -> the sharding the program puts it on, for the leaves of the first
  step that go to one place only (a stage's parameters and optimizer state)."""
  P = ex.program
  leaf_of = {
    b: binding.index
    for b, binding in zip(P.inputs, ex.lowered.bindings)
    if binding.kind == "leaf" and binding.step == 0
  }
  homes: dict[int, list[Any]] = {}
  for ins in P.instrs:
    if ins.op is Op.SEND and ins.lane == P.host and ins.reads[0] in leaf_of:
      homes.setdefault(leaf_of[ins.reads[0]], []).append(send_sharding(ex, ins))
  return {i: s[0] for i, s in homes.items() if all(x == s[0] for x in s)}


def _nothing() -> None:
  pass


def _batched_sends(
  code: Sequence[tuple[Callable[[], None], Any]], instrs: Sequence[Instr]
) -> list[tuple[Callable[[], None], Any]]:
  """``code`` with each group of ``ir.program.puts_together`` (consecutive transfers between
  stages in one process, by destination sharding) issued as one ``transfer_all`` at its
  first member; the others do nothing. The lowering emits such runs where a stage sends
  several arrays at once: an edge carrying several arrays, and the step pieces' inputs (the
  optimizer's global norm reads a scalar per parameter array from every stage: tens per
  step). Each instruction keeps its frees: a buffer freed by a later member of a group was
  read by the put before it."""
  out = list(code)

  def key(i: int) -> Any:
    batch = getattr(code[i][0], "batch", None)
    return None if batch is None else batch[2]

  for members in puts_together(instrs, key):
    srcs = [code[i][0].batch[0] for i in members]  # type: ignore[attr-defined]
    dsts = [code[i][0].batch[1] for i in members]  # type: ignore[attr-defined]
    sharding = key(members[0])

    def put_all(srcs=srcs, dsts=dsts, sharding=sharding) -> None:
      moved = transfer_all([lst[i] for lst, i in srcs], sharding)
      for (lst, i), y in zip(dsts, moved):
        lst[i] = y

    out[members[0]] = (put_all, code[members[0]][1])
    for i in members[1:]:
      out[i] = (_nothing, code[i][1])
  return out
