"""The lowering's program builder (``_Builder``: buffers, and instructions queued per lane or
floating, put in dispatch order by ``finish``; ``passes.lowering`` describes the order; a
transfer's instructions queued where its ``Anchor`` says) and what a lowering gives the
executor (``Lowered``, with a ``Binding`` per program input), with each lane's queue of
instruction groups (``_lane_groups``) and a program's places (``program_places``)."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Hashable, Sequence
from typing import Any

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.program import Buffer, BufferKind, Instr, Op, Program, Transfer, validate_program
from gpp_jax.ir.schedule import Action, Schedule, device_lanes_with_updates
from gpp_jax.passes.costs import aval_bytes


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


@dataclasses.dataclass(frozen=True)
class Anchor:
  """Where the instructions of a transfer go: the group they queue in (a stage's action or
  its set-up for a step) and the action they belong to, its stage and micro-batch (-1: none).

  Attributes:
    group: the instruction group (``_Builder.emit``).
    stage: the stage of the action (``Instr.stage``).
    mb: its micro-batch (``Instr.mb``).
  """

  group: Hashable
  stage: int = -1
  mb: int = -1


@dataclasses.dataclass
class _Pending:
  instr: Instr
  seq: int
  missing: int = 0


# Copies that hold what the transfer says (a parameter, the batch, a gradient); a copy sent for
# another reason (a step input, data) holds what its source holds.
_COPY_KINDS = frozenset({BufferKind.PARAM, BufferKind.BATCH, BufferKind.GRAD})


class _Builder:
  """Buffers and instructions, queued per lane or floating; ``finish`` orders them. Each
  buffer is made with its ``BufferKind``."""

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
    *,
    kind: BufferKind,
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
    self.buffers.append(Buffer(lane, name, shape, dtype, -1 if nbytes is None else nbytes, kind))
    self.avals.append(aval)
    return len(self.buffers) - 1

  def keyed_buffer(
    self, key: Hashable, lane: int, name: str, aval: Any = None, *, kind: BufferKind
  ) -> int:
    """The buffer named by ``key``, made on first use (both ends of a transfer meet there)."""
    b = self.keyed.get(key)
    if b is None:
      b = self.keyed[key] = self.new(lane, name, aval, kind=kind)
    return b

  def bind(self, binding: Binding, lane: int, name: str, aval: Any, *, kind: BufferKind) -> int:
    b = self.new(lane, name, aval, kind=kind)
    self.inputs.append(b)
    self.bindings.append(binding)
    return b

  def emit(self, instr: Instr, group: Hashable | None = None) -> Instr:
    """Queues ``instr`` in ``group`` (anchored), or floating when None."""
    p = _Pending(instr, self._seq)
    self._seq += 1
    (self.floating if group is None else self.groups.setdefault(group, [])).append(p)
    return instr

  def on(
    self, b: int, lane: int, kind: BufferKind, queue: Hashable | None = None, mb: int = -1
  ) -> int:
    """Buffer ``b`` on ``lane``: itself, or a copy sent there (made once per buffer and lane)
    by a transfer of ``kind``; the copy is of that kind where it is a parameter, the batch or
    a gradient, else of the source's kind.

    The SEND and RECV are queued in group ``queue`` (a stage's set-up) or float."""
    src = self.buffers[b].lane
    if src == lane:
      return b
    c = self.copies.get((b, lane))
    if c is None:
      src_buf = self.buffers[b]
      copy_kind = kind if kind in _COPY_KINDS else src_buf.kind
      c = self.copies[(b, lane)] = self.new(
        lane, f"{src_buf.name}@{lane}", self.avals[b], src_buf.nbytes, kind=copy_kind
      )
      arg = Transfer(kind)
      self.emit(Instr(Op.SEND, src, mb=mb, reads=(b,), writes=(c,), peer=lane, arg=arg), queue)
      self.emit(Instr(Op.RECV, lane, mb=mb, reads=(c,), peer=src, arg=arg), queue)
    return c

  def send(self, b: int, dst: int, lane: int, arg: Transfer, at: Anchor) -> None:
    """A SEND of ``b`` into the (keyed) buffer ``dst`` on ``lane``, queued at ``at``; its RECV
    is queued apart."""
    src = self.buffers[b].lane
    instr = Instr(Op.SEND, src, at.stage, at.mb, reads=(b,), writes=(dst,), peer=lane, arg=arg)
    self.emit(instr, at.group)

  def recv(self, dst: int, src_lane: int, arg: Transfer, at: Anchor) -> None:
    """The RECV of the (keyed) buffer ``dst`` from ``src_lane``, queued at ``at``."""
    lane = self.buffers[dst].lane
    instr = Instr(Op.RECV, lane, at.stage, at.mb, reads=(dst,), peer=src_lane, arg=arg)
    self.emit(instr, at.group)

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
