"""Lowering pass: Schedule (+ the staged train step) -> Program (``ir.program``).

Two front ends share one builder:

* ``lower_step`` lowers a schedule together with the staged step it runs: every value the
  runtime handles becomes a buffer, made with the kind it holds (``ir.program.BufferKind``),
  and every move a SEND/RECV pair (its ``Transfer`` says what it carries): step inputs onto their
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

This module holds the step's front ends (``lower_step``, ``lower_fused``); the builder and
what a lowering gives the executor (``Lowered``, ``Binding``) are in ``passes.program_builder``,
``lower_schedule`` in ``passes.schedule_lowering`` (both importable from here too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as xc

from gpp_jax.errors import BatchError, CaptureError
from gpp_jax.ir.program import (
  BufferKind,
  Cotangents,
  Count,
  Donate,
  Instr,
  Op,
  Piece,
  Reduce,
  Transfer,
)
from gpp_jax.ir.schedule import Schedule, lanes_with_updates
from gpp_jax.passes.costs import aval_bytes
from gpp_jax.passes.program_builder import (
  Anchor,
  Binding,
  Lowered,
  _Builder,
  _group,
  _lane_groups,
  program_places,
)
from gpp_jax.passes.schedule_lowering import lower_schedule  # noqa: F401

# Roles of the loss's non-parameter inputs (``GraphPipeline``'s capture decides them).
BATCH, KEY, BROADCAST = "batch", "key", "broadcast"
STATE = "state"  # state the loss updates: carried from one micro-batch to the next

_ACT, _CT, _BATCH = Transfer(BufferKind.ACT), Transfer(BufferKind.CT), Transfer(BufferKind.BATCH)
_STACKED = Transfer(BufferKind.BATCH, stacked=True)


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """The staged train step, as the lowering reads it.

  Attributes:
    staged: the staged loss (``ir.staged.StagedProgram``).
    prog: the step around the pipeline (``ir.step.StepProgram``).
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
  (arg ``Donate``: the reads it consumes, written ``donate=<reads>``).

  On several devices (jit data parallel) each batch array is first cut into its micro-batches
  stacked along a new leading axis (``CHUNK`` with arg ``Count(M, stacked=True)``, written
  ``M:stacked``, on the host lane) and put with every micro-batch split over the devices (SEND
  arg ``Transfer(batch, stacked=True)``, written ``stacked``)."""
  J = spec.prog.jaxpr.jaxpr
  bld = _Builder(1, "fused", 1)
  reads = []
  M = num_microbatches
  stacked = spec.multi_device[0]
  for i, v in enumerate(J.invars):
    batch = i in spec.batch_leaves
    aval = _whole_batch(v.aval, spec.batch_size) if batch else v.aval
    b = bld.bind(Binding("leaf", i), bld.host, f"in{i}", aval, kind=BufferKind.INPUT)
    if batch and stacked:
      chunked = aval.update(shape=(M, aval.shape[0] // M, *aval.shape[1:]))
      c = bld.new(bld.host, f"b{i}.t0@host", chunked, kind=BufferKind.BATCH)
      bld.emit(Instr(Op.CHUNK, bld.host, 0, 0, (b,), (c,), arg=Count(M, stacked=True)), "step")
      nbytes = int(aval_bytes(chunked)) // spec.widths[0]
      dst = bld.new(0, f"b{i}.t0", chunked, nbytes=nbytes, kind=BufferKind.BATCH)
      bld.send(c, dst, 0, _STACKED, Anchor("step"))
      bld.recv(dst, bld.host, _STACKED, Anchor("step"))
      reads.append(dst)
      continue
    reads.append(bld.on(b, 0, BufferKind.INPUT, queue="step"))
  outs = tuple(
    bld.new(0, f"out{k}", getattr(v, "aval", None), kind=BufferKind.PIECE)
    for k, v in enumerate(J.outvars)
  )
  arg = Donate(tuple(sorted(spec.donated))) if spec.donated else None
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
  versions = _Versions(tuple(delays) if delays is not None else None, history)
  return _StepLowering(spec, sched, carry or {}, versions, sizes).run()


@dataclasses.dataclass(frozen=True)
class _Versions:
  """The older weights a stale-weight schedule computes with (``lower_step``).

  Attributes:
    delays: per stage, how many updates its weights lag; None: none lag.
    history: how many earlier versions of the parameters the caller gives.
  """

  delays: tuple[int, ...] | None = None
  history: int = 0


class _StepLowering:
  """``lower_step``'s state: the builder and where each step's values are."""

  def __init__(
    self,
    spec: StepSpec,
    sched: Schedule,
    carry: dict[int, int],
    versions: _Versions,
    sizes: Sequence[dict[str, int]] | None,
  ):
    self.spec, self.sched, self.carry = spec, sched, carry
    self.K = sched.steps
    st = self.st = spec.staged
    self.S = len(st.stages)
    self.counts = sched.stage_counts
    self.mb = [spec.batch_size // c for c in self.counts]
    self.delays = versions.delays
    self.history = versions.history
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
    self.cts: dict[tuple[int, int], tuple[tuple[int, ...], Cotangents]] = {}
    self.kept: dict[tuple[int, int], int] = {}
    self.seeds: dict[int, int] = {}
    self.grad_parts: dict[tuple[int, int], list[int]] = {}

  def size(self, s: int, what: str) -> int | None:
    return self.sizes[s].get(what)

  # ------------------------------------------------------------------ step values
  def const(self, value: Any, name: str) -> int:
    binding = Binding("const", value=value)
    return self.bld.bind(binding, self.bld.host, name, _aval_of(value), kind=BufferKind.INPUT)

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
      b = self.vals[t][v] = self.bld.bind(
        Binding("leaf", i, t), self.bld.host, f"in{i}.t{t}", aval, kind=BufferKind.INPUT
      )
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
      reads = tuple(bld.on(self.read(t, v), p.home, BufferKind.DATA) for v in p.inputs)
      writes = []
      for o in p.outputs:
        self.vals[t][o] = b = bld.new(p.home, f"v.t{t}", o.aval, kind=BufferKind.PIECE)
        writes.append(b)
      arg = Piece(self.piece_index[id(p)])
      bld.emit(Instr(Op.PIECE, p.home, -1, t, reads, tuple(writes), arg=arg))

  def step_outputs(self, t: int) -> list[int]:
    """Step t's flat outputs (an argument returned as it is comes back on its home)."""
    out = []
    for v in self.J.outvars:
      b = self.read(t, v)
      i = self.invar_index.get(v)
      if i is not None and self.spec.prog.invar_home[i] >= 0:
        b = self.bld.on(b, self.spec.prog.invar_home[i], BufferKind.INPUT)
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
        b = bld.on(b, owner[ks[0]], BufferKind.PARAM)
      if len(ks) == 1:
        ins[ks[0]] = b
        continue
      lane = bld.buffers[b].lane
      slices = tuple(
        bld.new(lane, f"slice{k}.t{t}", self.loss_aval(k), kind=BufferKind.PARAM) for k in ks
      )
      bld.emit(Instr(Op.UNSTACK, lane, -1, t, (b,), slices))
      for k, sl in zip(ks, slices):
        ins[k] = bld.on(sl, owner[k], BufferKind.PARAM) if i < self.nparam else sl
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
      binding = Binding("version", k, back)
      b = self.bld.bind(binding, self.bld.host, f"p{k}-{back}", aval, kind=BufferKind.INPUT)
      self.versions[(back, k)] = self.bld.on(b, self.st.param_owner[k], BufferKind.INPUT)
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
        fixed[j] = bld.on(self.param(t, s, r.index), s, BufferKind.PARAM, queue=grp, mb=t)
    if self.spec.packed[s]:
      params = tuple(fixed[j] for j, r in enumerate(st.inputs) if r.kind == "param")
      self.packed_buf[(s, t)] = pp = bld.new(
        s, f"pp{s}.t{t}", nbytes=self.size(s, "pp"), kind=BufferKind.PARAM
      )
      bld.emit(Instr(Op.PACK, s, s, t, params, (pp,)), grp)
    for j, r in enumerate(st.inputs):
      if r.kind != "data":
        continue
      src = self.loss_in[t][r.index]
      if self.spec.roles[r.index] == BATCH:
        self.batch_setup(s, t, j, src, grp)
      else:
        fixed[j] = bld.on(src, s, BufferKind.DATA, queue=grp, mb=t)
    self.acc[(s, t)] = acc = bld.new(
      s, f"acc{s}.t{t}", nbytes=self.size(s, "acc"), kind=BufferKind.ACC
    )
    bld.emit(Instr(Op.ZERO, s, s, t, (), (acc,)), grp)

  def batch_setup(self, s: int, t: int, j: int, src: int, grp) -> None:
    """Stage s's input j, a batch input (``src``), cut into its micro-batches: on the stage's
    device (one put, then cut there), or on the host for a stage over several devices (each
    chunk then put batch-sharded before its forward)."""
    bld = self.bld
    k = self.st.stages[s].inputs[j].index
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
      lane, here = s, bld.on(src, s, BufferKind.BATCH, queue=grp, mb=t)
    chunks = tuple(bld.new(lane, f"b{k}.{m}.t{t}", chunk, kind=BufferKind.BATCH) for m in range(M))
    bld.emit(Instr(Op.CHUNK, lane, s, t, (here,), chunks, arg=Count(M)), grp)
    self.chunks[(s, t, j)] = chunks

  # ------------------------------------------------------------------ actions
  def forward(self, at: Anchor) -> None:
    s, m, grp = at.stage, at.mb, at.group
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
        reads.append(self.activation_in(at, r.src, r.index, aval))
      elif spec.roles[r.index] == BATCH:
        c = self.chunks[(s, t, j)][lm]
        if spec.multi_device[s]:
          b = bld.new(s, f"{bld.buffers[c].name}@{s}", bld.avals[c], kind=BufferKind.BATCH)
          bld.send(c, b, s, _BATCH, at)
          bld.recv(b, bld.host, _BATCH, at)
          c = b
        reads.append(c)
      elif spec.roles[r.index] == STATE and lm > 0 and (s, r.index) in self.carries:
        reads.append(self.outs[(s, m - 1)][self.carries[(s, r.index)]])
      else:
        reads.append(fixed[j])
    self.res[(s, m)] = res = bld.new(
      s, f"res{s}.{m}", nbytes=self.size(s, "res"), kind=BufferKind.RES
    )
    outs = tuple(
      bld.new(s, f"x{o.vid}.{m}", v.aval, kind=BufferKind.ACT)
      for o, v in zip(st.outputs, st.jaxpr.jaxpr.outvars)
    )
    self.outs[(s, m)] = outs
    bld.emit(Instr(Op.F, s, s, m, tuple(reads), (res, *outs)), grp)
    for k, o in enumerate(st.outputs):
      for c in o.consumers:
        self.activation_out(at, c, o.vid, outs[k])

  def activation_out(self, at: Anchor, c: int, vid: int, x: int) -> None:
    """Chunk m of stage s's value ``vid`` (buffer ``x``, computed by F(s, m) at ``at``) on its
    way to consumer c, in c's chunks."""
    s, m, grp = at.stage, at.mb, at.group
    bld = self.bld
    Ms, Mc = self.counts[s], self.counts[c]
    act = BufferKind.ACT
    if Ms == Mc:
      dst = bld.keyed_buffer(("x", c, vid, m), c, f"x{vid}.{m}@{c}", bld.avals[x], kind=act)
      bld.send(x, dst, c, _ACT, at)
    elif Mc > Ms:  # c's chunks are smaller: split here, send each piece
      r = Mc // Ms
      aval = _rows(bld.avals[x], r)
      pieces = tuple(bld.new(s, f"x{vid}.{m}/{i}", aval, kind=act) for i in range(r))
      bld.emit(Instr(Op.SPLIT, s, s, m, (x,), pieces, arg=Count(r)), grp)
      for i, p in enumerate(pieces):
        g = m * r + i
        dst = bld.keyed_buffer(("x", c, vid, g), c, f"x{vid}.{g}@{c}", aval, kind=act)
        bld.send(p, dst, c, _ACT, at)
    else:  # c's chunk covers r of ours: send ours, c joins them
      dst = bld.keyed_buffer(("xpart", c, vid, m), c, f"x{vid}.{m}@{c}", bld.avals[x], kind=act)
      bld.send(x, dst, c, _ACT, at)

  def activation_in(self, at: Anchor, s: int, vid: int, aval) -> int:
    """Value ``vid`` of producer s as consumer c's chunk m (F(c, m) at ``at``): received (and
    joined) on c."""
    c, m, grp = at.stage, at.mb, at.group
    bld = self.bld
    Ms, Mc = self.counts[s], self.counts[c]
    src_aval = self.st.stages[s].jaxpr.jaxpr.outvars[self.out_pos[vid][1]].aval
    act = BufferKind.ACT
    if Mc >= Ms:
      piece = src_aval if Mc == Ms else _rows(src_aval, Mc // Ms)
      b = bld.keyed_buffer(("x", c, vid, m), c, f"x{vid}.{m}@{c}", piece, kind=act)
      bld.recv(b, s, _ACT, at)
      return b
    r = Ms // Mc
    parts = []
    for g in range(m * r, m * r + r):
      p = bld.keyed_buffer(("xpart", c, vid, g), c, f"x{vid}.{g}@{c}", src_aval, kind=act)
      bld.recv(p, s, _ACT, at)
      parts.append(p)
    whole = bld.new(c, f"x{vid}.{m}@{c}", aval, kind=act)
    bld.emit(Instr(Op.CONCAT, c, c, m, tuple(parts), (whole,), arg=act), grp)
    return whole

  def backward(self, at: Anchor) -> None:
    s, m, grp = at.stage, at.mb, at.group
    bld, st = self.bld, self.st.stages[s]
    t = m // self.counts[s]
    loss_at = self.st.loss_outputs[0]
    groups, contribs = [], []
    for k, o in enumerate(st.outputs):
      got = []
      if o.diff:
        got = [self.cotangent_in(at, k, c) for c in o.consumers if self.consumer_diff(c, o.vid)]
        if (s, k) == loss_at:
          got.append(self.seed(s))
      groups.append(len(got))
      contribs.extend(got)
    arg = Cotangents(tuple(groups))
    self.cts[(s, m)] = (tuple(contribs), arg)
    pre = [self.res[(s, m)]] + ([self.packed_buf[(s, t)]] if self.spec.packed[s] else [])
    acts = [(j, r) for j, r in enumerate(st.inputs) if r.diff and r.kind == "act"]
    ict = tuple(
      bld.new(s, f"ct{r.index}.{m}@{s}", st.jaxpr.jaxpr.invars[j].aval, kind=BufferKind.CT)
      for j, r in acts
    )
    if self.split_w:
      self.kept[(s, m)] = kept = bld.new(
        s, f"kept{s}.{m}", nbytes=self.size(s, "kept"), kind=BufferKind.RES
      )
      bld.emit(Instr(Op.B, s, s, m, (*pre, *contribs), (kept, *ict), arg=arg), grp)
    else:
      acc = self.acc[(s, t)]
      self.acc[(s, t)] = new = bld.new(
        s, f"acc{s}.{m}", nbytes=self.size(s, "acc"), kind=BufferKind.ACC
      )
      bld.emit(Instr(Op.B, s, s, m, (*pre, acc, *contribs), (new, *ict), arg=arg), grp)
    for (_, r), b in zip(acts, ict):
      p, k = self.out_pos[r.index]
      self.cotangent_out(at, p, k, b)

  def weight(self, at: Anchor) -> None:
    s, m, grp = at.stage, at.mb, at.group
    bld = self.bld
    t = m // self.counts[s]
    contribs, arg = self.cts.pop((s, m))
    pre = [self.res[(s, m)]] + ([self.packed_buf[(s, t)]] if self.spec.packed[s] else [])
    acc = self.acc[(s, t)]
    self.acc[(s, t)] = new = bld.new(
      s, f"acc{s}.{m}", nbytes=self.size(s, "acc"), kind=BufferKind.ACC
    )
    reads = (*pre, self.kept[(s, m)], acc, *contribs)
    bld.emit(Instr(Op.W, s, s, m, reads, (new,), arg=arg), grp)

  def consumer_diff(self, c: int, vid: int) -> bool:
    return any(r.kind == "act" and r.index == vid and r.diff for r in self.st.stages[c].inputs)

  def seed(self, s: int) -> int:
    """d(mean loss) / d(chunk loss) = 1 / M_s, bound on the loss stage."""
    if s not in self.seeds:
      ls, lk = self.st.loss_outputs[0]
      aval = self.st.stages[ls].jaxpr.jaxpr.outvars[lk].aval
      self.seeds[s] = self.bld.bind(Binding("seed", s), s, f"seed{s}", aval, kind=BufferKind.DATA)
    return self.seeds[s]

  def cotangent_out(self, at: Anchor, p: int, k: int, ct: int) -> None:
    """Consumer s's cotangent (its chunk m, buffer ``ct``, computed by B(s, m) at ``at``) for
    output k of producer p -> p's chunks."""
    s, m, grp = at.stage, at.mb, at.group
    bld = self.bld
    Ms, Mp = self.counts[s], self.counts[p]
    kind = BufferKind.CT
    if Ms == Mp:
      name = f"ct{p}.{k}.{m}<{s}"
      dst = bld.keyed_buffer(("ct", p, k, m, s), p, name, bld.avals[ct], kind=kind)
      bld.send(ct, dst, p, _CT, at)
    elif Mp > Ms:
      r = Mp // Ms
      aval = _rows(bld.avals[ct], r)
      pieces = tuple(bld.new(s, f"ct{p}.{k}.{m}<{s}/{i}", aval, kind=kind) for i in range(r))
      bld.emit(Instr(Op.SPLIT, s, s, m, (ct,), pieces, arg=Count(r)), grp)
      for i, piece in enumerate(pieces):
        g = m * r + i
        dst = bld.keyed_buffer(("ct", p, k, g, s), p, f"ct{p}.{k}.{g}<{s}", aval, kind=kind)
        bld.send(piece, dst, p, _CT, at)
    else:
      name = f"ct{p}.{k}.{m}<{s}"
      dst = bld.keyed_buffer(("ctpart", p, k, m, s), p, name, bld.avals[ct], kind=kind)
      bld.send(ct, dst, p, _CT, at)

  def cotangent_in(self, at: Anchor, k: int, s: int) -> int:
    """Consumer s's cotangent for output k of p, as p's chunk m (B(p, m) at ``at``), received
    on p."""
    p, m, grp = at.stage, at.mb, at.group
    bld = self.bld
    Ms, Mp = self.counts[s], self.counts[p]
    aval = self.st.stages[p].jaxpr.jaxpr.outvars[k].aval
    kind = BufferKind.CT
    if Mp >= Ms:
      piece = aval
      b = bld.keyed_buffer(("ct", p, k, m, s), p, f"ct{p}.{k}.{m}<{s}", piece, kind=kind)
      bld.recv(b, s, _CT, at)
      return b
    r = Ms // Mp
    parts = []
    for g in range(m * r, m * r + r):
      name = f"ct{p}.{k}.{g}<{s}"
      b = bld.keyed_buffer(("ctpart", p, k, g, s), p, name, _rows(aval, r), kind=kind)
      bld.recv(b, s, _CT, at)
      parts.append(b)
    whole = bld.new(p, f"ct{p}.{k}.{m}<{s}", aval, kind=kind)
    bld.emit(Instr(Op.CONCAT, p, p, m, tuple(parts), (whole,), arg=kind), grp)
    return whole

  def update(self, s: int, t: int, grp) -> None:
    """Stage s's gradient sums of step t, one buffer per parameter it reads."""
    bld, st = self.bld, self.st.stages[s]
    ins = [(r, v) for r, v in zip(st.inputs, st.jaxpr.jaxpr.invars) if r.kind == "param"]
    grads = tuple(bld.new(s, f"g{r.index}.t{t}@{s}", v.aval, kind=BufferKind.GRAD) for r, v in ins)
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
        parts = [bld.on(g, own, BufferKind.GRAD) for g in self.grad_parts.get((t, k), [])]
        if len(parts) == 1:
          grads.append(parts[0])
          continue
        g = bld.new(own, f"g{k}.t{t}", self.loss_aval(k), kind=BufferKind.GRAD)
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
    if mode is Reduce.CONCAT:
      out_aval = aval.update(shape=(aval.shape[0] * M, *aval.shape[1:]))
    elif mode is Reduce.LAST:
      vals = vals[-1:]
    out = bld.new(ls, f"loss{q}.t{t}", out_aval, kind=BufferKind.LOSS)
    bld.emit(Instr(Op.REDUCE, ls, ls, t, tuple(vals), (out,), arg=mode))
    return out

  def stacked(self, bufs: Sequence[int], lanes: Sequence[int], aval, t: int) -> int:
    """One value as it is, or slices stacked again on the lane of the first."""
    if len(bufs) == 1:
      return bufs[0]
    bld = self.bld
    parts = tuple(bld.on(b, lanes[0], BufferKind.GRAD) for b in bufs)
    out = bld.new(lanes[0], f"stack.t{t}", aval, kind=BufferKind.GRAD)
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
          at = Anchor(grp, s, a.microbatch)
          if a.kind == "F":
            self.forward(at)
          elif a.kind == "B":
            self.backward(at)
          elif a.kind == "W":
            self.weight(at)
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


def reduction(index: int, aval, microbatch: int, state: bool, asked: str | None) -> Reduce:
  """How loss output ``index`` combines over micro-batches: the loss (index 0) is averaged;
  state the loss carries takes the last micro-batch's value; an aux leaf what ``aux_reduce``
  asked, else per-example values (leading axis = the micro-batch) are concatenated, other
  floating values averaged, the rest (integers) the last."""
  if index == 0:
    return Reduce.MEAN
  if state:
    return Reduce.LAST
  per_example = len(aval.shape) >= 1 and aval.shape[0] == microbatch
  if asked is not None:
    if asked == "concat" and not len(aval.shape):
      raise CaptureError(f"aux_reduce asks to concatenate aux leaf {index - 1}, a scalar")
    return Reduce(asked)
  if per_example:
    return Reduce.CONCAT
  return Reduce.MEAN if jnp.issubdtype(aval.dtype, jnp.inexact) else Reduce.LAST


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
