"""Memory of a lowered program: the bytes each device holds, instruction by instruction.

The program says when every buffer is written and freed and how large it is
(``ir.program.Buffer.nbytes``), so its memory follows from walking it in order: a buffer
counts on its lane's devices from the instruction that writes it to the one that frees it;
the step's arguments that already live on a device (parameters and optimizer state the caller
passes, placed where the step left them) count for the whole step, since the caller holds
them; outputs count from their write to the end; and the instruction running holds its
executable's temporaries (``temps``, from ``jax.stages.Compiled.memory_analysis`` when known).
A backward donates the gradient sums it updates (``passes.staging``), so the new sums take the
old ones' place; a fused step consumes the arguments of ``donate_argnums`` the same way.
The peak per device is the largest sum over the walk. ``runtime.memory`` measures the same
quantity on the devices, at the same instruction boundaries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

from gpp_jax.ir.program import BufferKind, Op, Program, Transfer, step_donates


def format_bytes(n: float) -> str:
  """``1.5 GiB``, ``12.0 MiB``, ``3.2 KiB``, ``512 B``."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} B"


# Transfers from the host lane whose destination is the caller's own array when it is already
# placed (the step's arguments: parameters, optimizer state), not a new one.
_ALIASING_SENDS = frozenset({Transfer(BufferKind.INPUT), Transfer(BufferKind.PARAM)})

# Buffer kinds -> the categories a memory breakdown reports (read with a kind's string too).
CATEGORIES: dict[str, str] = {
  BufferKind.PARAM: "parameters",
  BufferKind.INPUT: "optimizer state",
  BufferKind.ACC: "gradients",
  BufferKind.GRAD: "gradients",
  BufferKind.RES: "stashed activations",
  BufferKind.ACT: "activations and cotangents",
  BufferKind.CT: "activations and cotangents",
  BufferKind.BATCH: "batch",
  BufferKind.PIECE: "optimizer work",
  BufferKind.LOSS: "other",
  BufferKind.DATA: "other",
  BufferKind.OTHER: "other",
}


@dataclasses.dataclass(frozen=True)
class MemoryTrace:
  """Peak bytes per device of a program walked in order.

  Attributes:
    peak: device -> its largest total.
    at: device -> the instruction at whose end (before its frees) the peak is reached.
    breakdown: device -> bytes by category (``CATEGORIES`` values, and "temporaries") at the
      peak.
  """

  peak: Mapping[Hashable, int]
  at: Mapping[Hashable, int]
  breakdown: Mapping[Hashable, Mapping[str, int]]


def pinned_buffers(program: Program) -> set[int]:
  """Buffers that are the caller's own arrays once placed (held for the whole step)."""
  host = program.host
  return {
    w
    for i in program.instrs
    if i.op is Op.SEND and i.lane == host and i.arg in _ALIASING_SENDS
    for w in i.writes
  }


def program_memory(
  program: Program,
  lane_devices: Sequence[Sequence[Hashable]],
  temps: Mapping[int, int] | None = None,
  kinds: Mapping[int, str] | None = None,
  constants: Mapping[int, int] | None = None,
  shares: Mapping[int, float] | None = None,
) -> MemoryTrace:
  """Walks ``program`` in order and returns the peak bytes per device.

  ``lane_devices[l]``: the devices of lane l (a buffer's ``nbytes`` is what each of them
  holds); the host lane holds nothing on a device. ``temps[k]``: temporaries of instruction k
  on each device of its lane. ``kinds``: buffer -> kind where it differs from the buffer's own
  (a pinned step argument that is a parameter, say). ``constants[l]``: bytes of the constants
  lane l's executables hold on its devices (a jitted function keeps its own copy of the arrays
  its program closes over), for the whole step. ``shares[b]``: the fraction of buffer b's
  ``nbytes`` each device holds where it is sharded over its lane's devices (a parameter by
  its partition spec). Buffers of unknown size count nothing.
  """
  shares = shares or {}
  temps = temps or {}
  kinds = kinds or {}
  host = program.host
  pinned = pinned_buffers(program)
  outputs = set(program.outputs)
  devices = sorted({d for l in range(program.num_stages) for d in lane_devices[l]}, key=str)
  live: dict[Hashable, dict[str, int]] = {d: {} for d in devices}

  def add(b: int, sign: int) -> None:
    buf = program.buffers[b]
    if buf.lane == host or buf.nbytes <= 0:
      return
    category = CATEGORIES.get(kinds.get(b, buf.kind), "other")
    nbytes = int(buf.nbytes * shares[b]) if b in shares else buf.nbytes
    for d in lane_devices[buf.lane]:
      live[d][category] = live[d].get(category, 0) + sign * nbytes

  for b in pinned:
    add(b, +1)
  for lane, nbytes in (constants or {}).items():
    for d in lane_devices[lane] if lane != host else ():
      live[d]["constants"] = live[d].get("constants", 0) + nbytes
  peak = {d: sum(live[d].values()) for d in devices}
  at = dict.fromkeys(devices, -1)
  breakdown = {d: dict(live[d]) for d in devices}
  for k, ins in enumerate(program.instrs):
    # A backward donates the gradient sums it reads: the new sums take their memory; a fused
    # step the arguments given by donate_argnums (the caller's arrays, or their placed copies).
    if ins.op in (Op.B, Op.W):
      donated = {b for b in ins.frees if program.buffers[b].kind == BufferKind.ACC}
    elif ins.op is Op.STEP:
      donated = {ins.reads[i] for i in step_donates(ins)}
    else:
      donated = set()
    for b in donated:
      add(b, -1)
    for b in ins.writes:
      if b not in pinned:
        add(b, +1)
    t = temps.get(k, 0)
    lane_devs = set(lane_devices[ins.lane]) if ins.lane != host else set()
    for d in devices:
      total = sum(live[d].values()) + (t if d in lane_devs else 0)
      if total > peak[d]:
        peak[d], at[d] = total, k
        breakdown[d] = dict(live[d])
        if t and d in lane_devs:
          breakdown[d]["temporaries"] = t
    for b in ins.frees:
      if b not in pinned and b not in outputs and b not in donated:
        add(b, -1)
  return MemoryTrace(peak, at, breakdown)
