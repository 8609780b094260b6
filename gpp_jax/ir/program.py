"""Lowered schedule IR: a Program of instructions over named buffers, and its validator.

A ``Schedule`` says which forward and backward each stage runs in which order; a ``Program``
says everything the runtime does for it, in the order one host thread issues it. Lowering
(``passes.lowering``) turns a schedule (with the staged step, or with one value per stage edge
for the planners' simulations) into a program; the executor (``runtime.executor``) runs that
program and the simulator (``cost.simulator``) times the same one, so what is predicted and
what runs are one list of instructions.

Lanes. Lane s < S is stage s's devices; lane S (``Program.host``) is the host: values the
caller passes without a home (the batch, keys) live there. An instruction runs on its lane.

Buffers. Every value the program handles is a buffer, written once (static single
assignment: a gradient sum updated by a backward is a new buffer each time) and living on one
lane. A buffer is written by an instruction or bound from the program's inputs, read by later
instructions, and freed by the instruction after which nothing reads it (``Instr.frees``: the
executor drops it there), unless it is one of the program's outputs.

Transfers are instructions: ``SEND`` (on the source lane) reads a buffer there and writes a
buffer on the destination lane (``peer``); ``RECV`` on the destination lane marks its arrival,
and the destination reads it only after that. A stage reads only buffers of its own lane.

Stages sharing devices. ``Program.places`` numbers each lane's devices (lanes with one number
share them; the host has its own): their instructions run on those devices in program order,
one at a time, and a SEND between two of them is a local hand-over (the same array, or
re-sharded on the same devices where the two stages hold it differently), written ``HAND>``
in the text form, which moves nothing between devices.

Text form (``Program.to_text`` / ``Program.from_text``), one instruction a line::

  L1 F1.3 : %12 %40 -> %44 %45 | free %12
  L1 SEND>2 act : %44 -> %47
  L2 RECV<1 act : %47

``L<lane>``, the op with its stage and micro-batch where it has them, ``>peer`` / ``<peer`` for
transfers, the op's argument (``Instr.arg``, one word: ``Transfer``, ``Count``, ``Cotangents``,
``Reduce``, ``Piece``, ``Donate`` or a ``BufferKind``, each written by its ``str``), the buffers
read ``->`` written, and those freed.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from gpp_jax.errors import ScheduleError


class ProgramError(ScheduleError):
  """A lowered program that reads a value before it exists, or loses one."""


class Op(enum.StrEnum):
  """Instruction kinds, and the kinds of a schedule's actions (``ir.schedule.Action.kind``:
  ``F``, ``B``, ``W``, ``UPDATE``). A member equals its name as a string (``Op.F == "F"``)."""

  # Moving values (arg: Transfer).
  SEND = "SEND"  # a buffer to another lane (jax.device_put); RECV marks its arrival
  RECV = "RECV"
  # A stage's set-up for a step.
  CHUNK = "CHUNK"  # a batch array cut into the stage's micro-batches (arg: Count)
  PACK = "PACK"  # the stage's parameters packed into one buffer per dtype
  ZERO = "ZERO"  # the stage's gradient sums, zeroed
  # The schedule's actions.
  F = "F"  # forward of (stage, micro-batch)
  B = "B"  # backward (input cotangents only when the schedule has W; arg: Cotangents)
  W = "W"  # weight-gradient part of a split backward (arg: Cotangents)
  UPDATE = "UPDATE"  # the stage's gradient sums of a step are complete: one per parameter
  # Re-chunking between stages of different micro-batch sizes.
  SPLIT = "SPLIT"  # a chunk cut into smaller chunks (arg: Count)
  CONCAT = "CONCAT"  # chunks joined into a bigger one (arg: their BufferKind, act or ct)
  # Gradients and outputs.
  ADD = "ADD"  # a parameter's gradient contributions summed on its owner
  ZEROS = "ZEROS"  # the zero gradient of a parameter the loss never reads
  REDUCE = "REDUCE"  # a loss output over micro-batches (arg: Reduce)
  UNSTACK = "UNSTACK"  # a stacked (scanned) array cut into its slices
  STACK = "STACK"  # slices stacked into one array
  # The step around the pipeline.
  PIECE = "PIECE"  # a piece of the train step (passes.step_split; arg: Piece)
  STEP = "STEP"  # the whole step as one executable (one stage; arg: Donate, the reads it consumes)

  # Hashed as the string it equals, in C: schedules and simulations key dicts by kinds.
  __hash__ = str.__hash__


# Ops that compute on their lane's devices (the rest move or mark values).
COMPUTE = frozenset(Op) - {Op.SEND, Op.RECV}
# Ops whose stage and micro-batch are printed (``F1.3``, ``UPDATE1.0``).
_SCHEDULED = frozenset({Op.F, Op.B, Op.W, Op.UPDATE})


class BufferKind(enum.StrEnum):
  """What a buffer holds, for memory accounting (``cost.memory.CATEGORIES``), set where the
  lowering makes it. A member equals its value as a string (``BufferKind.ACT == "act"``)."""

  INPUT = "input"  # a step argument (and its copies), a constant, an older parameter version
  PARAM = "param"  # parameters: copies on the stages that read them, packed, slices of a scan
  BATCH = "batch"  # the batch, its copies and its chunks
  DATA = "data"  # other loss inputs (keys, constants) and the loss seed
  ACT = "act"  # activations
  CT = "ct"  # cotangents
  RES = "res"  # stashed residuals, and what a split backward keeps for W
  ACC = "acc"  # gradient sums
  GRAD = "grad"  # gradients (and scan slices stacked again)
  LOSS = "loss"  # loss outputs reduced over micro-batches
  PIECE = "piece"  # values of the step's pieces (the optimizer) and a fused step's outputs
  OTHER = "other"  # anything else (a schedule's values, lowered without the step)

  # Hashed as the string it equals, in C: dicts keyed by kinds are read with either.
  __hash__ = str.__hash__


# Every buffer kind, in ``BufferKind``'s order.
KINDS = tuple(BufferKind)


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A value of the program: where it lives and what it is.

  ``name`` is readable (``x12.3``: value 12 of micro-batch 3; ``res1.3``; ``acc1.2``);
  ``nbytes`` is its size per device holding it (-1 when lowering does not know it); ``kind``
  what it is for, for memory accounting."""

  lane: int
  name: str
  shape: tuple[int, ...] = ()
  dtype: str = ""
  nbytes: int = -1
  kind: BufferKind = BufferKind.OTHER


# ---------------------------------------------------------------------- instruction arguments
# One type per shape of ``Instr.arg``; ``str`` of each is its word in the text form.

# Transfers whose value has the micro-batch as its leading axis (split over a stage's devices).
_BATCHED = frozenset({BufferKind.ACT, BufferKind.CT, BufferKind.BATCH})


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
  """SEND's and RECV's argument: what the transfer carries (``act``, ``ct``, ``param``,
  ``grad``, ``data``, ``batch``, ``input``). ``stacked``: a batch array's micro-batches stacked
  along a new leading axis, each split over the destination's devices (a fused step over
  several devices), written ``stacked``."""

  kind: BufferKind
  stacked: bool = False

  @property
  def batched(self) -> bool:
    """Whether the value's leading axis is the micro-batch (activations, cotangents, batch)."""
    return self.stacked or self.kind in _BATCHED

  def __str__(self) -> str:
    return "stacked" if self.stacked else self.kind.value

  @classmethod
  def parse(cls, word: str) -> Transfer:
    return cls(BufferKind.BATCH, stacked=True) if word == "stacked" else cls(BufferKind(word))


@dataclasses.dataclass(frozen=True, slots=True)
class Count:
  """CHUNK's and SPLIT's argument: how many pieces a value is cut into along its leading axis.
  ``stacked`` (CHUNK): the pieces stacked along a new leading axis in one array (a fused step
  over several devices), written ``4:stacked``."""

  n: int
  stacked: bool = False

  def __str__(self) -> str:
    return f"{self.n}:stacked" if self.stacked else str(self.n)

  @classmethod
  def parse(cls, word: str) -> Count:
    n, sep, how = word.partition(":")
    if sep and how != "stacked":
      raise ValueError(f"not a count: {word!r}")
    return cls(int(n), stacked=bool(sep))


@dataclasses.dataclass(frozen=True, slots=True)
class Cotangents:
  """B's and W's argument: per output of the stage, how many cotangent contributions it reads
  (consumers' cotangents, and the loss seed on the loss output), written ``2.0.1``."""

  groups: tuple[int, ...]

  def __str__(self) -> str:
    return ".".join(map(str, self.groups))

  @classmethod
  def parse(cls, word: str) -> Cotangents:
    return cls(tuple(int(x) for x in word.split(".")))


class Reduce(enum.StrEnum):
  """REDUCE's argument: how a loss output combines over micro-batches."""

  MEAN = "mean"
  SUM = "sum"
  CONCAT = "concat"  # per-example values, joined along the leading axis
  LAST = "last"  # the last micro-batch's value (carried state, integers)

  __hash__ = str.__hash__


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
  """PIECE's argument: the index of the step's piece (``passes.step_split``) it runs."""

  index: int

  def __str__(self) -> str:
    return str(self.index)

  @classmethod
  def parse(cls, word: str) -> Piece:
    return cls(int(word))


@dataclasses.dataclass(frozen=True, slots=True)
class Donate:
  """STEP's argument: the positions among its reads that it consumes (donates to its
  executable), sorted; written ``donate=0-3.7`` (``format_indices``)."""

  reads: tuple[int, ...]

  def __str__(self) -> str:
    return f"donate={format_indices(self.reads)}"

  @classmethod
  def parse(cls, word: str) -> Donate:
    head, sep, rest = word.partition("=")
    if head != "donate" or not sep:
      raise ValueError(f"not a donation: {word!r}")
    return cls(parse_indices(rest))


# What ``Instr.arg`` holds (None: no argument).
Arg = Transfer | Count | Cotangents | Reduce | Piece | Donate | BufferKind

# The argument each op takes, read back from its word (ops not here take none).
_ARG_OF: dict[Op, Callable[[str], Arg]] = {
  Op.SEND: Transfer.parse,
  Op.RECV: Transfer.parse,
  Op.CHUNK: Count.parse,
  Op.SPLIT: Count.parse,
  Op.CONCAT: BufferKind,
  Op.B: Cotangents.parse,
  Op.W: Cotangents.parse,
  Op.REDUCE: Reduce,
  Op.PIECE: Piece.parse,
  Op.STEP: Donate.parse,
}


class Instr(NamedTuple):
  """One instruction (a named tuple: programs have thousands, and the planners lower many).

  Attributes:
    op: what it does.
    lane: where it runs (a stage's devices, or the host lane).
    stage, mb: the schedule coordinates of F/B/W (micro-batch numbered over all steps) and
      UPDATE (``mb`` = the step); for other ops the stage and micro-batch they serve, or -1.
    reads, writes, frees: buffer ids.
    peer: SEND's destination lane, RECV's source lane (-1 otherwise).
    arg: the op's argument, or None: a transfer's ``Transfer`` (what it carries), CHUNK's and
      SPLIT's ``Count``, CONCAT's ``BufferKind`` (what it joins), B's and W's ``Cotangents``
      (per output), REDUCE's ``Reduce`` mode, PIECE's ``Piece``, STEP's ``Donate``.
  """

  op: Op
  lane: int
  stage: int = -1
  mb: int = -1
  reads: tuple[int, ...] = ()
  writes: tuple[int, ...] = ()
  frees: tuple[int, ...] = ()
  peer: int = -1
  arg: Arg | None = None

  def label(self) -> str:
    """``F1.3``, ``UPDATE1.0``, ``SEND>2[1.3]``, ``RECV<1[2.3]``, ``PIECE[-1.0]`` ...: other ops
    than F/B/W/UPDATE show the stage and micro-batch they serve in brackets, where set."""
    if self.op in _SCHEDULED:
      return f"{self.op.value}{self.stage}.{self.mb}"
    where = f"[{self.stage}.{self.mb}]" if (self.stage, self.mb) != (-1, -1) else ""
    if self.op is Op.SEND:
      return f"SEND>{self.peer}{where}"
    if self.op is Op.RECV:
      return f"RECV<{self.peer}{where}"
    return self.op.value + where

  def __str__(self) -> str:
    word = "" if self.arg is None else str(self.arg)
    head = f"L{self.lane} {self.label()}" + (f" {word}" if word else "")
    body = " ".join(f"%{b}" for b in self.reads)
    if self.writes:
      body += (" " if body else "") + "-> " + " ".join(f"%{b}" for b in self.writes)
    tail = f" | free {' '.join(f'%{b}' for b in self.frees)}" if self.frees else ""
    return f"{head} : {body}{tail}" if body or tail else head


@dataclasses.dataclass(frozen=True)
class Program:
  """A lowered schedule: instructions in dispatch order over named buffers.

  Attributes:
    name: the schedule's name.
    num_lanes: stages + 1 (the last lane is the host).
    buffers: every buffer, indexed by id.
    instrs: the instructions in the order the host issues them; ``lane(l)`` is lane l's
      program (its instructions in that order).
    inputs: buffers bound from the program's inputs, in order.
    outputs: buffers returned, in order.
    steps: optimizer steps the program covers.
    places: per lane, the devices it runs on as a number (lanes with one number share their
      devices); None: every lane has its own.
  """

  name: str
  num_lanes: int
  buffers: tuple[Buffer, ...]
  instrs: tuple[Instr, ...]
  inputs: tuple[int, ...] = ()
  outputs: tuple[int, ...] = ()
  steps: int = 1
  places: tuple[int, ...] | None = None

  def place(self, lane: int) -> int:
    """The number of ``lane``'s devices (its own index where no lanes share devices)."""
    return lane if self.places is None else self.places[lane]

  def local(self, ins: Instr) -> bool:
    """Whether ``ins`` is a SEND between two lanes on the same devices: a local hand-over."""
    return (
      self.places is not None
      and ins.op is Op.SEND
      and ins.peer >= 0
      and self.places[ins.lane] == self.places[ins.peer]
    )

  def show(self, ins: Instr) -> str:
    """``str(ins)``, a local hand-over written ``HAND>``."""
    return str(ins).replace(" SEND>", " HAND>", 1) if self.local(ins) else str(ins)

  @property
  def host(self) -> int:
    return self.num_lanes - 1

  @property
  def num_stages(self) -> int:
    return self.num_lanes - 1

  def lane(self, l: int) -> tuple[Instr, ...]:
    return tuple(i for i in self.instrs if i.lane == l)

  def count(self, op: Op) -> int:
    return sum(i.op is op for i in self.instrs)

  def replace_instr(self, k: int, instr: Instr) -> Program:
    """The program with instruction k replaced (tests and tools mutate programs this way)."""
    instrs = list(self.instrs)
    instrs[k] = instr
    return dataclasses.replace(self, instrs=tuple(instrs))

  # ------------------------------------------------------------------ text form
  def to_text(self) -> str:
    where = "" if self.places is None else " places=" + ",".join(map(str, self.places))
    lines = [f"program {self.name} lanes={self.num_lanes} steps={self.steps}{where}"]
    for k, b in enumerate(self.buffers):
      shape = ",".join(map(str, b.shape))
      lines.append(f"buffer %{k} L{b.lane} {b.name} [{shape}] {b.dtype or '-'} {b.nbytes} {b.kind}")
    lines.append("inputs " + " ".join(f"%{b}" for b in self.inputs))
    lines.append("outputs " + " ".join(f"%{b}" for b in self.outputs))
    lines.extend(map(self.show, self.instrs))
    return "\n".join(lines) + "\n"

  @classmethod
  def from_text(cls, text: str) -> Program:
    lines = [l for l in text.splitlines() if l.strip()]
    m = re.fullmatch(r"program (\S*) lanes=(\d+) steps=(\d+)(?: places=([\d,]+))?", lines[0])
    if not m:
      raise ProgramError(f"not a program header: {lines[0]!r}")
    name, num_lanes, steps = m.group(1), int(m.group(2)), int(m.group(3))
    places = None if m.group(4) is None else tuple(int(x) for x in m.group(4).split(","))
    buffers: list[Buffer] = []
    instrs: list[Instr] = []
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    for line in lines[1:]:
      if line.startswith("buffer "):
        bm = re.fullmatch(r"buffer %(\d+) L(\d+) (\S+) \[([\d,]*)\] (\S+) (-?\d+) (\S+)", line)
        if not bm or int(bm.group(1)) != len(buffers):
          raise ProgramError(f"bad buffer line {line!r}")
        shape = tuple(int(x) for x in bm.group(4).split(",") if x)
        dtype = "" if bm.group(5) == "-" else bm.group(5)
        try:
          kind = BufferKind(bm.group(7))
        except ValueError:
          raise ProgramError(
            f"unknown buffer kind in {line!r}; kinds are {[k.value for k in BufferKind]}"
          ) from None
        buffers.append(Buffer(int(bm.group(2)), bm.group(3), shape, dtype, int(bm.group(6)), kind))
      elif line.startswith("inputs"):
        inputs = _ids(line[len("inputs") :])
      elif line.startswith("outputs"):
        outputs = _ids(line[len("outputs") :])
      else:
        hand = " HAND>" in line
        ins = _parse_instr(line.replace(" HAND>", " SEND>", 1) if hand else line)
        same = places is not None and places[ins.lane] == places[ins.peer]
        if hand != (ins.op is Op.SEND and same):
          raise ProgramError(
            f"{line!r}: a transfer between lanes on the same devices (places in the header) "
            "is written HAND>, one between different devices SEND>"
          )
        instrs.append(ins)
    return cls(name, num_lanes, tuple(buffers), tuple(instrs), inputs, outputs, steps, places)

  def __str__(self) -> str:
    rows = [f"Program {self.name}: {len(self.instrs)} instructions, {len(self.buffers)} buffers"]
    for l in range(self.num_lanes):
      what = "host" if l == self.host else f"stage {l}"
      if self.places is not None:
        what += f" @{self.places[l]}"
      labels = (
        i.label().replace("SEND>", "HAND>", 1) if self.local(i) else i.label() for i in self.lane(l)
      )
      rows.append(f"{what:>8s} | " + " ".join(labels))
    return "\n".join(rows)

  def listing(self, mark: int | None = None) -> str:
    """The instructions one a line, instruction ``mark`` flagged (for error messages)."""
    out = []
    for k, i in enumerate(self.instrs):
      out.append(f"{'>>' if k == mark else '  '} {k:4d} {self.show(i)}")
    return "\n".join(out)


def _ids(s: str) -> tuple[int, ...]:
  return tuple(int(x[1:]) for x in s.split() if x.startswith("%"))


_INSTR = re.compile(
  r"L(\d+) (?P<op>[A-Z]+)(?:(?P<stage>\d+)\.(?P<mb>\d+)|(?P<dir>[<>])(?P<peer>\d+))?"
  r"(?:\[(?P<wstage>-?\d+)\.(?P<wmb>-?\d+)\])?"
  r"(?: (?P<arg>[^:%|\s][^%|\s]*))?(?: : (?P<body>[^|]*?))?\s*(?:\| free (?P<frees>.*))?$"
)


def _parse_instr(line: str) -> Instr:
  m = _INSTR.fullmatch(line.strip())
  if not m:
    raise ProgramError(f"cannot read the instruction {line!r}")
  try:
    op = Op(m.group("op"))
  except ValueError:
    raise ProgramError(f"unknown op in {line!r}; ops are {[o.value for o in Op]}") from None
  body = m.group("body") or ""
  reads, _, writes = body.partition("->")
  arg: Arg | None = None
  word = m.group("arg")
  if word is not None:
    read_arg = _ARG_OF.get(op)
    if read_arg is None:
      raise ProgramError(f"{op.value} takes no argument, got {word!r} in {line!r}")
    try:
      arg = read_arg(word)
    except ValueError:
      raise ProgramError(f"cannot read {op.value}'s argument {word!r} in {line!r}") from None
  stage, mb = m.group("stage") or m.group("wstage"), m.group("mb") or m.group("wmb")
  return Instr(
    op,
    int(m.group(1)),
    int(stage) if stage is not None else -1,
    int(mb) if mb is not None else -1,
    _ids(reads),
    _ids(writes),
    _ids(m.group("frees") or ""),
    int(m.group("peer")) if m.group("peer") is not None else -1,
    arg,
  )


def validate_program(program: Program) -> None:
  """Raises ProgramError unless every value exists where and when it is read and none leaks.

  Checks, in dispatch order: every buffer is bound from the inputs or written by exactly one
  instruction, on its own lane; a buffer is read after it is written and before it is freed;
  an instruction other than a transfer reads only its own lane's buffers; a buffer a SEND
  writes lives on the SEND's destination, has exactly one RECV there, and nothing reads it
  before that RECV; every RECV has its SEND; every buffer that is not an output is freed,
  exactly once. The message names the instruction and shows the listing with it marked.
  """
  check = _Checker(program)
  for b in program.inputs:
    check.bind(b)
  for k, ins in enumerate(program.instrs):
    if not 0 <= ins.lane < program.num_lanes:
      check.fail(k, f"{ins} runs on lane {ins.lane}, outside 0..{program.num_lanes - 1}")
    for b in ins.reads:
      check.read(k, ins, b)
    for b in ins.writes:
      check.write(k, ins, b)
    for b in ins.frees:
      check.free(k, ins, b)
  check.end()


class _Checker:
  """``validate_program``'s state: who wrote, sent, received and freed each buffer."""

  def __init__(self, program: Program):
    self.P = program
    self.written: dict[int, int] = {}  # buffer -> instruction that wrote it (-1: an input)
    self.freed: dict[int, int] = {}
    self.received: dict[int, int] = {}  # transferred buffer -> its RECV
    self.sent: set[int] = set()

  def fail(self, k: int | None, msg: str):
    raise ProgramError(f"{msg}\n{self.P.listing(mark=k)}")

  def name(self, b: int) -> str:
    return f"%{b} ({self.P.buffers[b].name})"

  def exists(self, k: int | None, b: int) -> None:
    if not 0 <= b < len(self.P.buffers):
      self.fail(k, f"instruction {k} names buffer %{b}, which does not exist")

  def bind(self, b: int) -> None:
    self.exists(None, b)
    if b in self.written:
      self.fail(None, f"buffer %{b} is bound from the inputs twice")
    self.written[b] = -1

  def read(self, k: int, ins: Instr, b: int) -> None:
    self.exists(k, b)
    what = f"{ins.label()} reads {self.name(b)}"
    if ins.op is Op.RECV and b not in self.sent:
      self.fail(k, f"{ins.label()} receives %{b}, which no SEND wrote: a recv without a send")
    if b not in self.written:
      self.fail(k, f"{what} before anything writes it")
    if b in self.freed:
      self.fail(k, f"{what} after instruction {self.freed[b]} freed it")
    lane = self.P.buffers[b].lane
    if ins.op is Op.RECV:
      src = self.P.instrs[self.written[b]].lane
      if ins.peer != src:
        self.fail(k, f"{ins.label()} names lane {ins.peer} as the source of %{b}, sent by {src}")
      if lane != ins.lane:
        self.fail(k, f"{ins.label()} on lane {ins.lane} receives %{b}, which lands on lane {lane}")
      if b in self.received:
        self.fail(k, f"%{b} is received twice (instructions {self.received[b]} and {k})")
      self.received[b] = k
      return
    if b in self.sent and b not in self.received:
      self.fail(k, f"{what} before it arrives: its RECV on lane {lane} comes later or never")
    if lane != ins.lane:
      self.fail(
        k,
        f"{what}, which lives on lane {lane}, not on its own lane {ins.lane}: values move "
        "between lanes only by SEND and RECV",
      )

  def write(self, k: int, ins: Instr, b: int) -> None:
    self.exists(k, b)
    if b in self.written:
      self.fail(k, f"{ins.label()} writes {self.name(b)}, already written")
    self.written[b] = k
    lane = self.P.buffers[b].lane
    if ins.op is Op.SEND:
      if lane != ins.peer:
        self.fail(k, f"{ins.label()} writes %{b}, which lives on lane {lane}, not {ins.peer}")
      self.sent.add(b)
    elif lane != ins.lane:
      self.fail(k, f"{ins.label()} on lane {ins.lane} writes %{b}, which lives on lane {lane}")

  def free(self, k: int, ins: Instr, b: int) -> None:
    self.exists(k, b)
    if b not in self.written:
      self.fail(k, f"{ins.label()} frees %{b} before anything writes it")
    if b in self.freed:
      self.fail(k, f"{ins.label()} frees {self.name(b)} again (freed by {self.freed[b]})")
    self.freed[b] = k

  def end(self) -> None:
    P, written, freed = self.P, self.written, self.freed
    missing = sorted(self.sent - set(self.received))
    if missing:
      b = missing[0]
      self.fail(
        written[b],
        f"{self.name(b)} is sent to lane {P.buffers[b].lane} but never received there: a "
        "missing RECV",
      )
    outputs = set(P.outputs)
    for b in outputs:
      if not 0 <= b < len(P.buffers) or b not in written:
        self.fail(None, f"program output %{b} is never written")
      if b in freed:
        self.fail(freed[b], f"program output {self.name(b)} is freed before the end")
    for b in range(len(P.buffers)):
      if b not in written:
        self.fail(None, f"buffer {self.name(b)} is declared but never written")
      if b not in freed and b not in outputs:
        k = written[b]
        leak = f"buffer {self.name(b)} is never freed and is no output: a leaked buffer"
        self.fail(None if k < 0 else k, leak)


def format_indices(idx: Sequence[int]) -> str:
  """``0-447.450``: sorted indices as dot-separated runs (``parse_indices`` reads it back)."""
  runs: list[list[int]] = []
  for i in sorted(idx):
    if runs and i == runs[-1][1] + 1:
      runs[-1][1] = i
    else:
      runs.append([i, i])
  return ".".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def parse_indices(text: str) -> tuple[int, ...]:
  out: list[int] = []
  for part in filter(None, text.split(".")):
    a, _, b = part.partition("-")
    out.extend(range(int(a), int(b or a) + 1))
  return tuple(out)


def step_donates(ins: Instr) -> tuple[int, ...]:
  """Positions among a STEP's reads that it consumes (donates to its executable)."""
  return ins.arg.reads if ins.op is Op.STEP and isinstance(ins.arg, Donate) else ()


def puts_together(
  instrs: Sequence[Instr], key: Callable[[int], Hashable | None]
) -> list[list[int]]:
  """The instructions (indices into ``instrs``) that a driver issues as one put: within each
  run of consecutive instructions whose ``key`` is not None (transfers that may go together;
  the key names where they go), those of one key, when two or more. RECVs are not issued (a
  lane waits for its input), so they do not break a run. A run where one of them reads what
  another writes stays apart. The executor puts each group with one call
  (``runtime.executor._batched_sends``) and the simulator charges it so
  (``cost.simulator.simulate_program``)."""
  issued = [k for k, i in enumerate(instrs) if i.op is not Op.RECV]
  groups: list[list[int]] = []
  p = 0
  while p < len(issued):
    q = p
    while q < len(issued) and key(issued[q]) is not None:
      q += 1
    run = issued[p:q]
    written = {b for k in run for b in instrs[k].writes}
    if len(run) >= 2 and not any(b in written for k in run for b in instrs[k].reads):
      by_key: dict[Hashable, list[int]] = {}
      for k in run:
        by_key.setdefault(key(k), []).append(k)
      groups.extend(members for members in by_key.values() if len(members) >= 2)
    p = max(q, p + 1)
  return groups
