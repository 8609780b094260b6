"""Lowering pass: Schedule (+ the staged train step) -> Program (``ir.program``).

Two front ends share one builder:

* ``lower_step`` lowers a schedule together with the staged step it runs: every value the
  runtime handles becomes a buffer and every move a SEND/RECV pair: step inputs onto their
  homes, parameters to the stages that read them, the batch onto each stage and into its
  micro-batches, activations and cotangents between stages (split or joined where stages cut
  the batch differently), gradients back to the parameters' owners, and the pieces of the
  step around the pipeline (``passes.step_split``). The executor runs the result.
* ``lower_schedule`` lowers a schedule alone, one value per stage edge and micro-batch, for
  the planners' simulations of candidate plans (no staged step exists yet).

The dispatch order. Each lane has a queue of anchored instructions in program order: a
stage's set-up for a step (its parameter copies, its batch chunks, zeroed gradient sums) sits
right before its first action of that step, receives right before the action that reads them,
sends right after the action that computes them. Everything else (the pieces of the step, the
gradient sums on the owners, the loss outputs) floats: it is issued as soon as what it reads
exists. The order walks the lanes round-robin, each advancing while its next instruction's
inputs exist, as ``ir.schedule.dispatch_order`` does for a schedule's actions, issuing floating
instructions as they become ready. It is a pure function of the schedule and the step, so every
process of a multi-process run issues the same instructions (and transfers) in the same order.
Then every buffer is freed by its last reader.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Hashable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as xc

from gpp_jax.errors import BatchError, CaptureError, ScheduleError
from gpp_jax.ir.program import Buffer, Instr, Op, Program, format_indices, validate_program
from gpp_jax.ir.schedule import (
  Action,
  Schedule,
  chunk_range,
  device_lanes_with_updates,
  dispatch_order,
  lanes_with_updates,
)
from gpp_jax.passes.costs import aval_bytes

# Roles of the loss's non-parameter inputs (``GraphPipeline``'s capture decides them).
BATCH, KEY, BROADCAST = "batch", "key", "broadcast"
STATE = "state"  # state the loss updates: carried from one micro-batch to the next


@dataclasses.dataclass(frozen=True)
class Binding:
  """What the executor binds to one program input.

  kind "leaf": the flat step argument ``index`` of step ``step``; "const": ``value``; "seed":
  the loss seed ``1 / M_s`` of stage ``index``; "version": split parameter ``index`` as the
  caller gave it ``step`` steps before the program's first step (stale-weight schedules).
  """

  kind: str
  index: int = 0
  step: int = 0
  value: Any = None


@dataclasses.dataclass(frozen=True)
class Lowered:
  """A program and what the executor needs to run it.

  Attributes:
    program: the lowered program.
    avals: each buffer's abstract value (None for a pytree such as a stage's residuals).
    bindings: one per program input, in order.
    step_outputs: per step, the positions (in ``program.outputs``) of the step's flat outputs.
    versions: per step, the positions of the split parameters the step computed with (kept
      for later steps under stale-weight schedules; empty otherwise).
    delays: per stage, how many updates its weights lag (stale-weight schedules), or None.
    counts: per stage, micro-batches per step (micro-batch m of a program over several steps
      is micro-batch ``m % counts[s]`` of its step).
  """

  program: Program
  avals: tuple[Any, ...]
  bindings: tuple[Binding, ...]
  step_outputs: tuple[tuple[int, ...], ...]
  versions: tuple[tuple[int, ...], ...] = ()
  delays: tuple[int, ...] | None = None
  counts: tuple[int, ...] = ()


# ---------------------------------------------------------------------------- builder


@dataclasses.dataclass
class _Pending:
  instr: Instr
  seq: int
  missing: int = 0


class _Builder:
  """Buffers and instructions, queued per lane or floating; ``finish`` orders them."""

  def __init__(self, num_stages: int, name: str, steps: int):
    self.S = num_stages
    self.host = num_stages
    self.name = name
    self.steps = steps
    self.buffers: list[Buffer] = []
    self.avals: list[Any] = []
    self.keyed: dict[Hashable, int] = {}
    # Anchored instructions by group (a stage's action, or its set-up for a step); the lanes'
    # queues are their groups in lane order (``finish``).
    self.groups: dict[Hashable, list[_Pending]] = {}
    self.floating: list[_Pending] = []
    self.copies: dict[tuple[int, int], int] = {}
    self.inputs: list[int] = []
    self.bindings: list[Binding] = []
    self._seq = 0
    # lane -> (devices, micro-batch size) for lanes over several devices
    self.split: dict[int, tuple[int, int]] = {}
    self.places: tuple[int, ...] | None = None  # Program.places, where stages share devices

  def new(
    self,
    lane: int,
    name: str,
    aval: Any = None,
    nbytes: int | None = None,
    kind: str | None = None,
  ) -> int:
    shape: tuple[int, ...] = ()
    dtype = ""
    if aval is not None and hasattr(aval, "shape"):
      shape, dtype = tuple(int(d) for d in aval.shape), str(aval.dtype)
      if nbytes is None:
        nbytes = int(aval_bytes(aval))
        width, mb = self.split.get(lane, (1, 0))
        if width > 1 and shape and shape[0] == mb:  # split over the lane's devices
          nbytes //= width
    kind = kind or _kind_of(name)
    self.buffers.append(Buffer(lane, name, shape, dtype, -1 if nbytes is None else nbytes, kind))
    self.avals.append(aval)
    return len(self.buffers) - 1

  def keyed_buffer(self, key: Hashable, lane: int, name: str, aval: Any = None) -> int:
    """The buffer named by ``key``, made on first use (both ends of a transfer meet there)."""
    b = self.keyed.get(key)
    if b is None:
      b = self.keyed[key] = self.new(lane, name, aval)
    return b

  def bind(self, binding: Binding, lane: int, name: str, aval: Any) -> int:
    b = self.new(lane, name, aval)
    self.inputs.append(b)
    self.bindings.append(binding)
    return b

  def emit(self, instr: Instr, group: Hashable | None = None) -> Instr:
    """Queues ``instr`` in ``group`` (anchored), or floating when None."""
    p = _Pending(instr, self._seq)
    self._seq += 1
    (self.floating if group is None else self.groups.setdefault(group, [])).append(p)
    return instr

  def on(self, b: int, lane: int, kind: str, queue: Hashable | None = None, mb: int = -1) -> int:
    """Buffer ``b`` on ``lane``: itself, or a copy sent there (made once per buffer and lane).

    The SEND and RECV are queued in group ``queue`` (a stage's set-up) or float."""
    src = self.buffers[b].lane
    if src == lane:
      return b
    c = self.copies.get((b, lane))
    if c is None:
      src_buf = self.buffers[b]
      copy_kind = kind if kind in ("param", "batch", "grad") else src_buf.kind
      c = self.copies[(b, lane)] = self.new(
        lane, f"{src_buf.name}@{lane}", self.avals[b], src_buf.nbytes, copy_kind
      )
      self.emit(Instr(Op.SEND, src, mb=mb, reads=(b,), writes=(c,), peer=lane, arg=kind), queue)
      self.emit(Instr(Op.RECV, lane, mb=mb, reads=(c,), peer=src, arg=kind), queue)
    return c

  def send(self, b: int, dst: int, lane: int, kind: str, queue: Hashable, stage=-1, mb=-1) -> None:
    """A SEND of ``b`` into the (keyed) buffer ``dst`` on ``lane``; its RECV is queued apart."""
    src = self.buffers[b].lane
    self.emit(Instr(Op.SEND, src, stage, mb, reads=(b,), writes=(dst,), peer=lane, arg=kind), queue)

  def recv(self, dst: int, src_lane: int, kind: str, queue: Hashable, stage=-1, mb=-1) -> None:
    lane = self.buffers[dst].lane
    self.emit(Instr(Op.RECV, lane, stage, mb, reads=(dst,), peer=src_lane, arg=kind), queue)

  # ------------------------------------------------------------------ ordering
  def finish(
    self, outputs: Sequence[int], lane_groups: Sequence[Sequence[Hashable]], grid: str = ""
  ) -> Program:
    """Orders the instructions (see the module docstring), adds the frees, validates.

    ``lane_groups[l]``: the groups of lane l's queue, in lane order."""
    self.queues = [[p for g in groups for p in self.groups.get(g, ())] for groups in lane_groups]
    placed = sum(map(len, self.queues))
    assert placed == sum(map(len, self.groups.values())), "an instruction group is in no lane"
    nbuf = len(self.buffers)
    state = [0] * nbuf  # 0 absent, 1 sent (a RECV may take it), 2 there
    for b in self.inputs:
      state[b] = 2
    waiters: list[list[_Pending]] = [[] for _ in range(nbuf)]
    ready: list[tuple[int, int, _Pending]] = []

    def need(p: _Pending, b: int) -> int:
      return 1 if p.instr.op is Op.RECV else 2

    for p in self.floating:
      for b in p.instr.reads:
        if state[b] < need(p, b):
          p.missing += 1
          waiters[b].append(p)
      if p.missing == 0:
        heapq.heappush(ready, (p.seq, id(p), p))

    order: list[Instr] = []

    def mark(b: int, level: int) -> None:
      state[b] = level
      still = []
      for p in waiters[b]:
        if need(p, b) <= level:
          p.missing -= 1
          if p.missing == 0:
            heapq.heappush(ready, (p.seq, id(p), p))
        else:
          still.append(p)
      waiters[b] = still

    def issue(i: Instr) -> None:
      order.append(i)
      if i.op is Op.RECV:
        mark(i.reads[0], 2)
      for b in i.writes:
        mark(b, 1 if i.op is Op.SEND else 2)

    def drain() -> None:
      while ready:
        issue(heapq.heappop(ready)[2].instr)

    def is_ready(i: Instr) -> bool:
      lvl = 1 if i.op is Op.RECV else 2
      return all(state[b] >= lvl for b in i.reads)

    pos = [0] * len(self.queues)
    total = sum(map(len, self.queues)) + len(self.floating)
    drain()
    while len(order) < total:
      progressed = False
      for q, queue in enumerate(self.queues):
        while pos[q] < len(queue) and is_ready(queue[pos[q]].instr):
          issue(queue[pos[q]].instr)
          pos[q] += 1
          progressed = True
          drain()
      if not progressed and len(order) < total:
        heads = [queue[pos[q]].instr for q, queue in enumerate(self.queues) if pos[q] < len(queue)]
        waits = "; ".join(
          f"{i.label()} on lane {i.lane} waits for "
          + ", ".join(self.buffers[b].name for b in i.reads if state[b] < 2)
          for i in heads[:6]
        )
        stuck = [p.instr.label() for p in self.floating if p.missing][:6]
        raise ScheduleError(
          f"the lowered schedule deadlocks: {waits or 'no lane can go on'}"
          + (f"; unissued: {stuck}" if stuck else "")
          + (f"\n{grid}" if grid else "")
        )
    return self._with_frees(order, outputs)

  def _with_frees(self, order: list[Instr], outputs: Sequence[int]) -> Program:
    keep = set(outputs)
    last: dict[int, int] = {}
    for k, i in enumerate(order):
      for b in i.reads:
        last[b] = k
    for k, i in enumerate(order):
      for b in i.writes:
        last.setdefault(b, k)  # written and never read: freed by its writer
    unread = [b for b in self.inputs if b not in last and b not in keep]
    assert not unread, f"program inputs {unread} are never read"
    frees: list[list[int]] = [[] for _ in order]
    for b, k in last.items():
      if b not in keep:
        frees[k].append(b)
    instrs = tuple(i._replace(frees=tuple(sorted(f))) if f else i for i, f in zip(order, frees))
    program = Program(
      self.name,
      self.S + 1,
      tuple(self.buffers),
      instrs,
      tuple(self.inputs),
      tuple(outputs),
      self.steps,
      self.places,
    )
    validate_program(program)
    return program


def _group(sched: Schedule, a: Action) -> tuple:
  if a.kind == "UPDATE":
    return ("UPDATE", a.stage, sched.step_of(a))
  return (a.kind, a.stage, a.microbatch)


def _lane_groups(sched: Schedule, lanes: Sequence[Sequence[Action]]) -> list[list[Hashable]]:
  """Each lane's groups in order: a stage's set-up for a step before its first action of that
  step, then the actions; the host lane has none (what runs there floats or is set-up). Where
  stages share devices, one queue per place in its order (``Schedule.device_lanes``)."""
  if sched.shares_devices:
    lanes = device_lanes_with_updates(sched)
  out: list[list[Hashable]] = []
  for lane in lanes:
    groups: list[Hashable] = []
    started: set[tuple[int, int]] = set()
    for a in lane:
      t = sched.step_of(a)
      if (a.stage, t) not in started:
        started.add((a.stage, t))
        groups.append(("setup", a.stage, t))
      groups.append(_group(sched, a))
    out.append(groups)
  out.append([])
  return out


def program_places(sched: Schedule) -> tuple[int, ...] | None:
  """``Program.places`` for a schedule's lanes and the host (a place of its own), or None
  where every stage has devices of its own."""
  if not sched.shares_devices:
    return None
  return (*(sched.places or ()), sched.num_places)


# ---------------------------------------------------------------------------- abstract


def lower_schedule(sched: Schedule) -> Program:
  """A schedule alone -> its program, one value per stage edge and producer micro-batch.

  F(s, m) receives one activation from each predecessor's overlapping chunk and sends one to
  each successor; B(s, m) one cotangent from each successor's overlapping chunk and to each
  predecessor. What the planners simulate for a candidate plan (``cost.simulator``), so it is
  built in one pass over the schedule's dispatch order (``ir.schedule.dispatch_order``: the
  order ``_Builder.finish`` gives these instructions) with each buffer freed by its last
  reader as it goes; the tests check it against the rules ``validate_program`` states."""
  S = sched.num_stages
  counts = sched.stage_counts
  g = sched.stage_graph()
  preds = [sorted(g.predecessors(s)) for s in range(S)]
  succs = [sorted(g.successors(s)) for s in range(S)]
  lanes = lanes_with_updates(sched)
  if any(len(a) != len(b) for a, b in zip(lanes, sched.lanes)):
    orders = sched.orders and tuple(map(tuple, device_lanes_with_updates(sched)))
    sched = dataclasses.replace(sched, lanes=tuple(map(tuple, lanes)), orders=orders)
  order = dispatch_order(sched)
  one_step = sched.steps == 1
  split_w = [any(a.kind == "W" for a in lane) for lane in lanes]
  anon = [Buffer(l, "v") for l in range(S + 1)]
  buffers: list[Buffer] = []
  keyed: dict[tuple, int] = {}
  readers: dict[int, int] = {}  # received buffer -> reads still to come
  instrs: list[Instr] = []

  def new(lane: int) -> int:
    buffers.append(anon[lane])
    return len(buffers) - 1

  def arrive(key: tuple, s: int, src: int, kind: str, m: int, uses: int) -> int:
    """The buffer ``key`` sent to s: received (before its first reader), freed by its last."""
    b = keyed.get(key)
    if b is None:
      b = keyed[key] = new(s)
    if b not in readers:
      readers[b] = uses
      instrs.append(Instr(Op.RECV, s, s, m, (b,), peer=src, arg=kind))
    return b

  def last_read(bufs: list[int]) -> tuple[int, ...]:
    done = []
    for b in bufs:
      readers[b] -= 1
      if readers[b] == 0:
        done.append(b)
    return tuple(done)

  def uses(s: int, other: int) -> int:
    """Chunks of s reading one chunk of ``other``."""
    return max(counts[s] // counts[other], 1)

  for a in order:
    s, m = a.stage, a.microbatch
    if a.kind == "F":
      reads = [
        arrive(("a", p, s, k), s, p, "act", m, uses(s, p))
        for p in preds[s]
        for k in chunk_range(counts, s, m, p)
      ]
      res = keyed[("res", s, m)] = new(s)
      out = new(s)
      frees = last_read(reads)
      if not succs[s]:
        frees += (out,)
      instrs.append(Instr(Op.F, s, s, m, tuple(reads), (res, out), frees))
      for i, c in enumerate(succs[s]):
        dst = keyed.setdefault(("a", s, c, m), len(buffers))
        if dst == len(buffers):
          new(c)
        last = (out,) if i == len(succs[s]) - 1 else ()
        instrs.append(Instr(Op.SEND, s, s, m, (out,), (dst,), last, c, "act"))
    elif a.kind == "B":
      res = keyed[("res", s, m)]
      cts = [
        arrive(("c", c, s, k), s, c, "ct", m, uses(s, c))
        for c in succs[s]
        for k in chunk_range(counts, s, m, c)
      ]
      ict = new(s)
      frees = last_read(cts)
      if split_w[s]:
        bw = keyed[("bw", s, m)] = new(s)
        writes: tuple[int, ...] = (ict, bw)
      else:
        writes, frees = (ict,), (res, *frees)
      if not preds[s]:
        frees += (ict,)
      instrs.append(Instr(Op.B, s, s, m, (res, *cts), writes, frees))
      for i, p in enumerate(preds[s]):
        dst = keyed.setdefault(("c", s, p, m), len(buffers))
        if dst == len(buffers):
          new(p)
        last = (ict,) if i == len(preds[s]) - 1 else ()
        instrs.append(Instr(Op.SEND, s, s, m, (ict,), (dst,), last, p, "ct"))
    elif a.kind == "W":
      both = (keyed[("res", s, m)], keyed[("bw", s, m)])
      instrs.append(Instr(Op.W, s, s, m, both, (), both))
    else:
      instrs.append(Instr(Op.UPDATE, s, s, 0 if one_step else a.microbatch))
  return Program(
    sched.name,
    S + 1,
    tuple(buffers),
    tuple(instrs),
    steps=sched.steps,
    places=program_places(sched),
  )


# ---------------------------------------------------------------------------- the step


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """The staged train step, as the lowering reads it.

  Attributes:
    staged: the staged loss (``passes.staging.StagedProgram``).
    prog: the step around the pipeline (``passes.step_split.StepProgram``).
    roles: per input of the (scan-split) loss: None for a parameter, else BATCH, KEY,
      BROADCAST or STATE.
    scan_split: how the captured loss's inputs and outputs map to the split loss's.
    state: the split loss's state pairs (``runtime.loss_state.StatePair``).
    batch_size: examples per step.
    batch_leaves: the flat step arguments that are batch arrays (traced at micro-batch size).
    packed: per stage, whether its parameters are packed (``PACK``; single-device stages).
    multi_device: per stage, whether it spans several devices (its batch chunks are cut on the
      host and put batch-sharded; a single device cuts them where the batch lands).
    carries: (stage, loss input, stage output position) of each state a stage carries from
      one micro-batch to the next (``runtime.loss_state.state_carries``).
    reduce: per loss output, how it combines over micro-batches ("mean", "sum", "concat",
      "last"; None or missing: the default rule, see ``reduction``).
    widths: devices per stage; a value of a stage over k devices whose leading axis is the
      stage's micro-batch is split over them (``runtime.placement.StagePlacement.for_array``),
      so each device holds 1/k of it.
    donated: the flat step arguments (``donate_argnums``) whose arrays the fused step consumes
      (``lower_fused``; a pipeline's program does not donate them).
  """

  staged: Any
  prog: Any
  roles: tuple[str | None, ...]
  scan_split: Any
  state: tuple[Any, ...]
  batch_size: int
  batch_leaves: tuple[int, ...]
  packed: tuple[bool, ...]
  multi_device: tuple[bool, ...]
  carries: tuple[tuple[int, int, int], ...] = ()
  reduce: tuple[str | None, ...] = ()
  widths: tuple[int, ...] = ()  # devices per stage (a batch-carrying value is split over them)
  donated: tuple[int, ...] = ()  # flat step arguments the fused step consumes (donate_argnums)


def lower_fused(spec: StepSpec, num_microbatches: int = 1) -> Lowered:
  """The step as one executable on stage 0's devices: every argument put there, one STEP
  (arg ``donate=<reads>``: the reads it consumes, as ``format_indices`` writes them).

  On several devices (jit data parallel) each batch array is first cut into its micro-batches
  stacked along a new leading axis (``CHUNK`` with arg ``M:stacked`` on the host lane) and put
  with every micro-batch split over the devices (SEND arg ``stacked``)."""
  J = spec.prog.jaxpr.jaxpr
  bld = _Builder(1, "fused", 1)
  reads = []
  M = num_microbatches
  stacked = spec.multi_device[0]
  for i, v in enumerate(J.invars):
    batch = i in spec.batch_leaves
    aval = _whole_batch(v.aval, spec.batch_size) if batch else v.aval
    b = bld.bind(Binding("leaf", i), bld.host, f"in{i}", aval)
    if batch and stacked:
      chunked = aval.update(shape=(M, aval.shape[0] // M, *aval.shape[1:]))
      c = bld.new(bld.host, f"b{i}.t0@host", chunked)
      bld.emit(Instr(Op.CHUNK, bld.host, 0, 0, (b,), (c,), arg=f"{M}:stacked"), "step")
      dst = bld.new(0, f"b{i}.t0", chunked, nbytes=int(aval_bytes(chunked)) // spec.widths[0])
      bld.send(c, dst, 0, "stacked", "step")
      bld.recv(dst, bld.host, "stacked", "step")
      reads.append(dst)
      continue
    reads.append(bld.on(b, 0, "input", queue="step"))
  outs = tuple(bld.new(0, f"out{k}", getattr(v, "aval", None)) for k, v in enumerate(J.outvars))
  arg = f"donate={format_indices(spec.donated)}" if spec.donated else ""
  bld.emit(Instr(Op.STEP, 0, 0, 0, tuple(reads), outs, arg=arg), "step")
  program = bld.finish(outs, [["step"], []])
  return Lowered(
    program, tuple(bld.avals), tuple(bld.bindings), (tuple(range(len(outs))),), counts=(1,)
  )


def lower_step(
  spec: StepSpec,
  sched: Schedule,
  *,
  carry: dict[int, int] | None = None,
  delays: Sequence[int] | None = None,
  history: int = 0,
  sizes: Sequence[dict[str, int]] | None = None,
) -> Lowered:
  """The staged step under ``sched`` -> its program.

  A schedule over K > 1 steps (``passes.schedules.stream_schedule``) lowers to one program of
  K steps; ``carry`` maps a flat step input to the flat output of the previous step that feeds
  it. ``delays[s]``: how many updates stage s's weights lag (stale-weight schedules): stage s
  computes step t with the parameters of step t - d(s), and with those the caller gave t - d(s)
  steps before (``Binding("version")``) while t < d(s); ``history`` is how many such earlier
  versions exist (the oldest stands in for older ones, the current parameters for none).
  ``sizes[s]``: bytes per device of stage s's buffers whose size only its traced functions
  know (``res`` residuals, ``pp`` packed parameters, ``acc`` gradient sums, ``kept`` what B
  leaves W), for memory accounting.
  """
  return _StepLowering(spec, sched, carry or {}, delays, history, sizes).run()


class _StepLowering:
  """``lower_step``'s state: the builder and where each step's values are."""

  def __init__(
    self, spec: StepSpec, sched: Schedule, carry: dict[int, int], delays, history, sizes
  ):
    self.spec, self.sched, self.carry = spec, sched, carry
    self.K = sched.steps
    st = self.st = spec.staged
    self.S = len(st.stages)
    self.counts = sched.stage_counts
    self.mb = [spec.batch_size // c for c in self.counts]
    self.delays = tuple(delays) if delays is not None else None
    self.history = history
    self.sizes = list(sizes) if sizes is not None else [{} for _ in range(self.S)]
    self.bld = _Builder(self.S, sched.name, self.K)
    for s, w in enumerate(spec.widths):
      if w > 1:
        self.bld.split[s] = (w, self.mb[s])
    self.J = spec.prog.jaxpr.jaxpr
    self.marker = spec.prog.marker
    self.split = spec.scan_split
    self.nparam = self.split.num_params  # parameters of the captured loss
    self.nloss = len(self.split.out_parts)
    self.split_w = sched.splits_backward
    self.out_pos = {o.vid: (s.index, k) for s in st.stages for k, o in enumerate(s.outputs)}
    # (stage, loss input) -> the stage output that carries it to the next micro-batch.
    self.carries = {(s, j): k for s, j, k in spec.carries}
    self.state_outputs = {p.output for p in spec.state}
    self.piece_index = {id(p): k for k, p in enumerate(spec.prog.before + spec.prog.after)}
    J = self.J
    self.invar_index = {v: i for i, v in enumerate(J.invars)}
    self.data_read = {r.index for s in st.stages for r in s.inputs if r.kind == "data"}
    # Per step: buffer of each step variable; the split loss's inputs.
    self.vals: list[dict[Any, int]] = [{} for _ in range(self.K)]
    self.loss_in: list[list[int]] = [[] for _ in range(self.K)]
    self.versions: dict[tuple[int, int], int] = {}
    self.fixed: dict[tuple[int, int], dict[int, int]] = {}  # (stage, step) -> input j -> buf
    self.chunks: dict[tuple[int, int, int], tuple[int, ...]] = {}  # (stage, step, input j)
    self.packed_buf: dict[tuple[int, int], int] = {}
    self.acc: dict[tuple[int, int], int] = {}
    self.res: dict[tuple[int, int], int] = {}
    self.outs: dict[tuple[int, int], tuple[int, ...]] = {}
    self.cts: dict[tuple[int, int], tuple[tuple[int, ...], str]] = {}
    self.kept: dict[tuple[int, int], int] = {}
    self.seeds: dict[int, int] = {}
    self.grad_parts: dict[tuple[int, int], list[int]] = {}

  def size(self, s: int, what: str) -> int | None:
    return self.sizes[s].get(what)

  # ------------------------------------------------------------------ step values
  def const(self, value: Any, name: str) -> int:
    return self.bld.bind(Binding("const", value=value), self.bld.host, name, _aval_of(value))

  def read(self, t: int, v) -> int:
    """The buffer of step variable ``v`` at step t (wherever it lives); a step argument is
    bound (on the host lane) when first read."""
    if isinstance(v, xc.Literal):
      return self.const(v.val, "literal")
    b = self.vals[t].get(v)
    if b is None:
      i = self.invar_index[v]
      aval = v.aval
      if i in self.spec.batch_leaves:  # traced at micro-batch size
        aval = _whole_batch(aval, self.spec.batch_size)
      b = self.vals[t][v] = self.bld.bind(Binding("leaf", i, t), self.bld.host, f"in{i}.t{t}", aval)
    return b

  def bind_inputs(self, t: int) -> None:
    """Step t > 0 reads the state step t - 1 returned where ``carry`` says so."""
    J = self.J
    if t > 0:
      for i, o in self.carry.items():
        self.vals[t][J.invars[i]] = self.read(t - 1, J.outvars[o])

  def pieces(self, t: int, pieces) -> None:
    bld = self.bld
    for p in pieces:
      reads = tuple(bld.on(self.read(t, v), p.home, "data") for v in p.inputs)
      writes = []
      for o in p.outputs:
        self.vals[t][o] = b = bld.new(p.home, f"v.t{t}", o.aval)
        writes.append(b)
      index = str(self.piece_index[id(p)])
      bld.emit(Instr(Op.PIECE, p.home, -1, t, reads, tuple(writes), arg=index))

  def step_outputs(self, t: int) -> list[int]:
    """Step t's flat outputs (an argument returned as it is comes back on its home)."""
    out = []
    for v in self.J.outvars:
      b = self.read(t, v)
      i = self.invar_index.get(v)
      if i is not None and self.spec.prog.invar_home[i] >= 0:
        b = self.bld.on(b, self.spec.prog.invar_home[i], "input")
      out.append(b)
    return out

  # ------------------------------------------------------------------ the marker's inputs
  def loss_aval(self, k: int):
    """The abstract value of input k of the split loss (a slice of a stacked input)."""
    for i, ks in enumerate(self.split.parts):
      if k in ks:
        aval = self.marker.invars[i].aval
        return aval if len(ks) == 1 else aval.update(shape=aval.shape[1:])
    raise AssertionError(f"split loss input {k} belongs to no captured input")

  def marker_inputs(self, t: int) -> None:
    """The split loss's inputs at step t: parameters on their owners, data where it is."""
    bld, split, owner = self.bld, self.split, self.st.param_owner
    ins: list[int] = [-1] * sum(len(ks) for ks in split.parts)
    for i, (a, ks) in enumerate(zip(self.marker.invars, split.parts)):
      if i >= self.nparam and not any(k in self.data_read for k in ks):
        continue  # state the loss overwrites without reading it
      b = self.read(t, a)
      if i < self.nparam:
        if owner[ks[0]] < 0:
          raise CaptureError(f"parameter {i} of the loss belongs to no stage")
        b = bld.on(b, owner[ks[0]], "param")
      if len(ks) == 1:
        ins[ks[0]] = b
        continue
      lane = bld.buffers[b].lane
      slices = tuple(bld.new(lane, f"slice{k}.t{t}", self.loss_aval(k)) for k in ks)
      bld.emit(Instr(Op.UNSTACK, lane, -1, t, (b,), slices))
      for k, sl in zip(ks, slices):
        ins[k] = bld.on(sl, owner[k], "param") if i < self.nparam else sl
    self.loss_in[t] = ins

  def param(self, t: int, s: int, k: int) -> int:
    """Split parameter k as stage s reads it at step t (its stale version under delays)."""
    u = t - (self.delays[s] if self.delays is not None else 0)
    if u >= 0:
      return self.loss_in[u][k]
    back = min(-u, self.history)
    if back == 0:  # no earlier version: the first step's own
      return self.loss_in[0][k]
    if (back, k) not in self.versions:
      aval = self.loss_aval(k)
      b = self.bld.bind(Binding("version", k, back), self.bld.host, f"p{k}-{back}", aval)
      self.versions[(back, k)] = self.bld.on(b, self.st.param_owner[k], "input")
    return self.versions[(back, k)]

  # ------------------------------------------------------------------ a stage's set-up
  def setup(self, s: int, t: int) -> None:
    """Stage s's inputs for step t that its micro-batches share, queued right before its
    first action of the step: parameters (packed), data and keys, batch chunks, zeroed sums."""
    bld, st = self.bld, self.st.stages[s]
    grp = ("setup", s, t)
    fixed = self.fixed[(s, t)] = {}
    for j, r in enumerate(st.inputs):
      if r.kind == "param":
        fixed[j] = bld.on(self.param(t, s, r.index), s, "param", queue=grp, mb=t)
    if self.spec.packed[s]:
      params = tuple(fixed[j] for j, r in enumerate(st.inputs) if r.kind == "param")
      self.packed_buf[(s, t)] = pp = bld.new(s, f"pp{s}.t{t}", nbytes=self.size(s, "pp"))
      bld.emit(Instr(Op.PACK, s, s, t, params, (pp,)), grp)
    for j, r in enumerate(st.inputs):
      if r.kind != "data":
        continue
      src = self.loss_in[t][r.index]
      if self.spec.roles[r.index] == BATCH:
        self.batch_setup(s, t, j, r.index, src, grp)
      else:
        fixed[j] = bld.on(src, s, "data", queue=grp, mb=t)
    self.acc[(s, t)] = acc = bld.new(s, f"acc{s}.t{t}", nbytes=self.size(s, "acc"))
    bld.emit(Instr(Op.ZERO, s, s, t, (), (acc,)), grp)

  def batch_setup(self, s: int, t: int, j: int, k: int, src: int, grp) -> None:
    """Batch input k cut into stage s's micro-batches: on the stage's device (one put, then
    cut there), or on the host for a stage over several devices (each chunk then put
    batch-sharded before its forward)."""
    bld = self.bld
    M = self.counts[s]
    aval = bld.avals[src]
    shape = tuple(getattr(aval, "shape", ()))
    if not shape or shape[0] % M:
      raise BatchError(
        f"batch input of shape {shape} does not split into {M} micro-batches (stage {s})"
      )
    chunk = aval.update(shape=(shape[0] // M, *shape[1:]))
    if self.spec.multi_device[s]:
      if bld.buffers[src].lane != bld.host:
        raise CaptureError(f"batch input {k} is computed on a stage; pass it to the step")
      lane, here = bld.host, src
    else:
      lane, here = s, bld.on(src, s, "batch", queue=grp, mb=t)
    chunks = tuple(bld.new(lane, f"b{k}.{m}.t{t}", chunk) for m in range(M))
    bld.emit(Instr(Op.CHUNK, lane, s, t, (here,), chunks, arg=str(M)), grp)
    self.chunks[(s, t, j)] = chunks

  # ------------------------------------------------------------------ actions
  def forward(self, s: int, m: int, grp) -> None:
    bld, st, spec = self.bld, self.st.stages[s], self.spec
    t, lm = divmod(m, self.counts[s])
    fixed = self.fixed[(s, t)]
    reads: list[int] = [self.packed_buf[(s, t)]] if spec.packed[s] else []
    for j, r in enumerate(st.inputs):
      if r.kind == "param":
        if not spec.packed[s]:
          reads.append(fixed[j])
      elif r.kind == "act":
        aval = st.jaxpr.jaxpr.invars[j].aval
        reads.append(self.activation_in(s, r.src, r.index, m, aval, grp))
      elif spec.roles[r.index] == BATCH:
        c = self.chunks[(s, t, j)][lm]
        if spec.multi_device[s]:
          b = bld.new(s, f"{bld.buffers[c].name}@{s}", bld.avals[c])
          bld.send(c, b, s, "batch", grp, s, m)
          bld.recv(b, bld.host, "batch", grp, s, m)
          c = b
        reads.append(c)
      elif spec.roles[r.index] == STATE and lm > 0 and (s, r.index) in self.carries:
        reads.append(self.outs[(s, m - 1)][self.carries[(s, r.index)]])
      else:
        reads.append(fixed[j])
    self.res[(s, m)] = res = bld.new(s, f"res{s}.{m}", nbytes=self.size(s, "res"))
    outs = tuple(
      bld.new(s, f"x{o.vid}.{m}", v.aval) for o, v in zip(st.outputs, st.jaxpr.jaxpr.outvars)
    )
    self.outs[(s, m)] = outs
    bld.emit(Instr(Op.F, s, s, m, tuple(reads), (res, *outs)), grp)
    for k, o in enumerate(st.outputs):
      for c in o.consumers:
        self.activation_out(s, c, o.vid, m, outs[k], grp)

  def activation_out(self, s: int, c: int, vid: int, m: int, x: int, grp) -> None:
    """Chunk m of stage s's value ``vid`` on its way to consumer c, in c's chunks."""
    bld = self.bld
    Ms, Mc = self.counts[s], self.counts[c]
    if Ms == Mc:
      dst = bld.keyed_buffer(("x", c, vid, m), c, f"x{vid}.{m}@{c}", bld.avals[x])
      bld.send(x, dst, c, "act", grp, s, m)
    elif Mc > Ms:  # c's chunks are smaller: split here, send each piece
      r = Mc // Ms
      aval = _rows(bld.avals[x], r)
      pieces = tuple(bld.new(s, f"x{vid}.{m}/{i}", aval) for i in range(r))
      bld.emit(Instr(Op.SPLIT, s, s, m, (x,), pieces, arg=str(r)), grp)
      for i, p in enumerate(pieces):
        g = m * r + i
        dst = bld.keyed_buffer(("x", c, vid, g), c, f"x{vid}.{g}@{c}", aval)
        bld.send(p, dst, c, "act", grp, s, m)
    else:  # c's chunk covers r of ours: send ours, c joins them
      dst = bld.keyed_buffer(("xpart", c, vid, m), c, f"x{vid}.{m}@{c}", bld.avals[x])
      bld.send(x, dst, c, "act", grp, s, m)

  def activation_in(self, c: int, s: int, vid: int, m: int, aval, grp) -> int:
    """Value ``vid`` of producer s as consumer c's chunk m: received (and joined) on c."""
    bld = self.bld
    Ms, Mc = self.counts[s], self.counts[c]
    src_aval = self.st.stages[s].jaxpr.jaxpr.outvars[self.out_pos[vid][1]].aval
    if Mc >= Ms:
      piece = src_aval if Mc == Ms else _rows(src_aval, Mc // Ms)
      b = bld.keyed_buffer(("x", c, vid, m), c, f"x{vid}.{m}@{c}", piece)
      bld.recv(b, s, "act", grp, c, m)
      return b
    r = Ms // Mc
    parts = []
    for g in range(m * r, m * r + r):
      p = bld.keyed_buffer(("xpart", c, vid, g), c, f"x{vid}.{g}@{c}", src_aval)
      bld.recv(p, s, "act", grp, c, m)
      parts.append(p)
    whole = bld.new(c, f"x{vid}.{m}@{c}", aval)
    bld.emit(Instr(Op.CONCAT, c, c, m, tuple(parts), (whole,), arg="act"), grp)
    return whole

  def backward(self, s: int, m: int, grp) -> None:
    bld, st = self.bld, self.st.stages[s]
    t = m // self.counts[s]
    loss_at = self.st.loss_outputs[0]
    groups, contribs = [], []
    for k, o in enumerate(st.outputs):
      got = []
      if o.diff:
        got = [
          self.cotangent_in(s, k, c, m, grp) for c in o.consumers if self.consumer_diff(c, o.vid)
        ]
        if (s, k) == loss_at:
          got.append(self.seed(s))
      groups.append(len(got))
      contribs.extend(got)
    arg = ".".join(map(str, groups))
    self.cts[(s, m)] = (tuple(contribs), arg)
    pre = [self.res[(s, m)]] + ([self.packed_buf[(s, t)]] if self.spec.packed[s] else [])
    acts = [(j, r) for j, r in enumerate(st.inputs) if r.diff and r.kind == "act"]
    ict = tuple(bld.new(s, f"ct{r.index}.{m}@{s}", st.jaxpr.jaxpr.invars[j].aval) for j, r in acts)
    if self.split_w:
      self.kept[(s, m)] = kept = bld.new(s, f"kept{s}.{m}", nbytes=self.size(s, "kept"))
      bld.emit(Instr(Op.B, s, s, m, (*pre, *contribs), (kept, *ict), arg=arg), grp)
    else:
      acc = self.acc[(s, t)]
      self.acc[(s, t)] = new = bld.new(s, f"acc{s}.{m}", nbytes=self.size(s, "acc"))
      bld.emit(Instr(Op.B, s, s, m, (*pre, acc, *contribs), (new, *ict), arg=arg), grp)
    for (_, r), b in zip(acts, ict):
      p, k = self.out_pos[r.index]
      self.cotangent_out(s, p, k, m, b, grp)

  def weight(self, s: int, m: int, grp) -> None:
    bld = self.bld
    t = m // self.counts[s]
    contribs, arg = self.cts.pop((s, m))
    pre = [self.res[(s, m)]] + ([self.packed_buf[(s, t)]] if self.spec.packed[s] else [])
    acc = self.acc[(s, t)]
    self.acc[(s, t)] = new = bld.new(s, f"acc{s}.{m}", nbytes=self.size(s, "acc"))
    reads = (*pre, self.kept[(s, m)], acc, *contribs)
    bld.emit(Instr(Op.W, s, s, m, reads, (new,), arg=arg), grp)

  def consumer_diff(self, c: int, vid: int) -> bool:
    return any(r.kind == "act" and r.index == vid and r.diff for r in self.st.stages[c].inputs)

  def seed(self, s: int) -> int:
    """d(mean loss) / d(chunk loss) = 1 / M_s, bound on the loss stage."""
    if s not in self.seeds:
      ls, lk = self.st.loss_outputs[0]
      aval = self.st.stages[ls].jaxpr.jaxpr.outvars[lk].aval
      self.seeds[s] = self.bld.bind(Binding("seed", s), s, f"seed{s}", aval)
    return self.seeds[s]

  def cotangent_out(self, s: int, p: int, k: int, m: int, ct: int, grp) -> None:
    """Consumer s's cotangent (its chunk m) for output k of producer p -> p's chunks."""
    bld = self.bld
    Ms, Mp = self.counts[s], self.counts[p]
    if Ms == Mp:
      dst = bld.keyed_buffer(("ct", p, k, m, s), p, f"ct{p}.{k}.{m}<{s}", bld.avals[ct])
      bld.send(ct, dst, p, "ct", grp, s, m)
    elif Mp > Ms:
      r = Mp // Ms
      aval = _rows(bld.avals[ct], r)
      pieces = tuple(bld.new(s, f"ct{p}.{k}.{m}<{s}/{i}", aval) for i in range(r))
      bld.emit(Instr(Op.SPLIT, s, s, m, (ct,), pieces, arg=str(r)), grp)
      for i, piece in enumerate(pieces):
        g = m * r + i
        dst = bld.keyed_buffer(("ct", p, k, g, s), p, f"ct{p}.{k}.{g}<{s}", aval)
        bld.send(piece, dst, p, "ct", grp, s, m)
    else:
      dst = bld.keyed_buffer(("ctpart", p, k, m, s), p, f"ct{p}.{k}.{m}<{s}", bld.avals[ct])
      bld.send(ct, dst, p, "ct", grp, s, m)

  def cotangent_in(self, p: int, k: int, s: int, m: int, grp) -> int:
    """Consumer s's cotangent for output k of p, as p's chunk m, received on p."""
    bld = self.bld
    Ms, Mp = self.counts[s], self.counts[p]
    aval = self.st.stages[p].jaxpr.jaxpr.outvars[k].aval
    if Mp >= Ms:
      piece = aval
      b = bld.keyed_buffer(("ct", p, k, m, s), p, f"ct{p}.{k}.{m}<{s}", piece)
      bld.recv(b, s, "ct", grp, p, m)
      return b
    r = Ms // Mp
    parts = []
    for g in range(m * r, m * r + r):
      b = bld.keyed_buffer(("ctpart", p, k, g, s), p, f"ct{p}.{k}.{g}<{s}", _rows(aval, r))
      bld.recv(b, s, "ct", grp, p, m)
      parts.append(b)
    whole = bld.new(p, f"ct{p}.{k}.{m}<{s}", aval)
    bld.emit(Instr(Op.CONCAT, p, p, m, tuple(parts), (whole,), arg="ct"), grp)
    return whole

  def update(self, s: int, t: int, grp) -> None:
    """Stage s's gradient sums of step t, one buffer per parameter it reads."""
    bld, st = self.bld, self.st.stages[s]
    ins = [(r, v) for r, v in zip(st.inputs, st.jaxpr.jaxpr.invars) if r.kind == "param"]
    grads = tuple(bld.new(s, f"g{r.index}.t{t}@{s}", v.aval) for r, v in ins)
    bld.emit(Instr(Op.UPDATE, s, s, t, (self.acc[(s, t)],), grads), grp)
    for (r, _), g in zip(ins, grads):
      self.grad_parts.setdefault((t, r.index), []).append(g)

  # ------------------------------------------------------------------ the marker's outputs
  def marker_outputs(self, t: int) -> None:
    """Loss outputs reduced over micro-batches; gradients summed on their owners (stacked
    again on their home for split scans), as the step's values after the marker."""
    bld, split, marker = self.bld, self.split, self.marker
    owner = self.st.param_owner
    for li, parts in enumerate(split.out_parts):
      o = marker.outvars[li]
      if isinstance(o, xc.DropVar):
        continue
      reduced = [self.reduce(t, q) for q in parts]
      lanes = [self.st.loss_outputs[q][0] for q in parts]
      self.vals[t][o] = self.stacked(reduced, lanes, o.aval, t)
    for i, ks in enumerate(split.parts[: self.nparam]):
      o = marker.outvars[self.nloss + i]
      if isinstance(o, xc.DropVar):
        continue
      grads = []
      for k in ks:
        own = owner[k]
        parts = [bld.on(g, own, "grad") for g in self.grad_parts.get((t, k), [])]
        if len(parts) == 1:
          grads.append(parts[0])
          continue
        g = bld.new(own, f"g{k}.t{t}", self.loss_aval(k))
        bld.emit(Instr(Op.ADD if parts else Op.ZEROS, own, -1, t, tuple(parts), (g,)))
        grads.append(g)
      self.vals[t][o] = self.stacked(grads, [owner[k] for k in ks], o.aval, t)

  def reduce(self, t: int, q: int) -> int:
    """Split loss output q of step t over its stage's micro-batches: per-example values
    concatenated, other floating values averaged, carried state as the last left it."""
    bld = self.bld
    ls, lk = self.st.loss_outputs[q]
    M = self.counts[ls]
    vals = [self.outs[(ls, t * M + m)][lk] for m in range(M)]
    aval = bld.avals[vals[0]]
    asked = self.spec.reduce[q] if q < len(self.spec.reduce) else None
    mode = reduction(q, aval, self.mb[ls], q in self.state_outputs, asked)
    out_aval = aval
    if mode == "concat":
      out_aval = aval.update(shape=(aval.shape[0] * M, *aval.shape[1:]))
    elif mode == "last":
      vals = vals[-1:]
    out = bld.new(ls, f"loss{q}.t{t}", out_aval)
    bld.emit(Instr(Op.REDUCE, ls, ls, t, tuple(vals), (out,), arg=mode))
    return out

  def stacked(self, bufs: Sequence[int], lanes: Sequence[int], aval, t: int) -> int:
    """One value as it is, or slices stacked again on the lane of the first."""
    if len(bufs) == 1:
      return bufs[0]
    bld = self.bld
    parts = tuple(bld.on(b, lanes[0], "grad") for b in bufs)
    out = bld.new(lanes[0], f"stack.t{t}", aval)
    bld.emit(Instr(Op.STACK, lanes[0], -1, t, parts, (out,)))
    return out

  # ------------------------------------------------------------------ the whole
  def run(self) -> Lowered:
    bld, sched, prog = self.bld, self.sched, self.spec.prog
    lanes = lanes_with_updates(sched)
    for t in range(self.K):
      self.bind_inputs(t)
      self.pieces(t, prog.before)
      self.marker_inputs(t)
      for s, lane in enumerate(lanes):
        first = True
        for a in lane:
          if sched.step_of(a) != t:
            continue
          if first:
            self.setup(s, t)
            first = False
          grp = _group(sched, a)
          if a.kind == "F":
            self.forward(s, a.microbatch, grp)
          elif a.kind == "B":
            self.backward(s, a.microbatch, grp)
          elif a.kind == "W":
            self.weight(s, a.microbatch, grp)
          else:
            self.update(s, t, grp)
      self.marker_outputs(t)
      self.pieces(t, prog.after)
    outputs: list[int] = []
    step_outputs, versions = [], []
    for t in range(self.K):
      outs = self.step_outputs(t)
      step_outputs.append(tuple(range(len(outputs), len(outputs) + len(outs))))
      outputs.extend(outs)
    if self.delays is not None:
      for t in range(self.K):
        versions.append(tuple(range(len(outputs), len(outputs) + len(self.loss_in[t]))))
        outputs.extend(self.loss_in[t])
    bld.places = program_places(sched)
    program = bld.finish(outputs, _lane_groups(sched, lanes), sched.grid())
    return Lowered(
      program,
      tuple(bld.avals),
      tuple(bld.bindings),
      tuple(step_outputs),
      tuple(versions),
      self.delays,
      tuple(self.counts),
    )


def reduction(index: int, aval, microbatch: int, state: bool, asked: str | None) -> str:
  """How loss output ``index`` combines over micro-batches: the loss (index 0) is averaged;
  state the loss carries takes the last micro-batch's value; an aux leaf what ``aux_reduce``
  asked, else per-example values (leading axis = the micro-batch) are concatenated, other
  floating values averaged, the rest (integers) the last."""
  if index == 0:
    return "mean"
  if state:
    return "last"
  per_example = len(aval.shape) >= 1 and aval.shape[0] == microbatch
  if asked is not None:
    if asked == "concat" and not len(aval.shape):
      raise CaptureError(f"aux_reduce asks to concatenate aux leaf {index - 1}, a scalar")
    return asked
  if per_example:
    return "concat"
  return "mean" if jnp.issubdtype(aval.dtype, jnp.inexact) else "last"


# Buffer names the lowering gives -> what the buffer holds (``ir.program.KINDS``).
_NAME_KINDS = tuple(
  (re.compile(pattern), kind)
  for pattern, kind in (
    (r"in\d|literal|out-literal|p\d+-\d", "input"),
    (r"seed", "data"),
    (r"slice|pp\d", "param"),
    (r"acc", "acc"),
    (r"b\d", "batch"),
    (r"res|kept", "res"),
    (r"x\d", "act"),
    (r"ct\d", "ct"),
    (r"g\d|stack", "grad"),
    (r"loss", "loss"),
    (r"v\.|out\d", "piece"),
  )
)


def _kind_of(name: str) -> str:
  return next((kind for pattern, kind in _NAME_KINDS if pattern.match(name)), "other")


def _rows(aval, r: int):
  """The abstract value of one of r equal pieces of ``aval`` along its leading axis."""
  shape = tuple(getattr(aval, "shape", ()))
  if not shape or shape[0] % r:
    raise CaptureError(
      f"a value of shape {shape} cannot be cut into {r} chunks along its leading (batch) "
      "axis; give the stages on both sides the same micro-batch size"
    )
  return aval.update(shape=(shape[0] // r, *shape[1:]))


def _whole_batch(aval, batch_size: int):
  return aval.update(shape=(batch_size, *aval.shape[1:]))


def _aval_of(value: Any):
  import jax

  try:
    return jax.typeof(value)
  except TypeError:
    return jax.typeof(np.asarray(value))
