"""A schedule alone lowered to its program (``lower_schedule``): one value per stage edge and
micro-batch, for the planners' simulations of candidate plans (no staged step exists yet;
``passes.lowering`` lowers a schedule with the staged step it runs)."""

from __future__ import annotations

import dataclasses

from gpp_jax.ir.program import Buffer, BufferKind, Instr, Op, Program, Transfer
from gpp_jax.ir.schedule import (
  Schedule,
  chunk_range,
  device_lanes_with_updates,
  dispatch_order,
  lanes_with_updates,
)
from gpp_jax.passes.program_builder import program_places

_ACT, _CT = Transfer(BufferKind.ACT), Transfer(BufferKind.CT)


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
  anon = [Buffer(l, "v", kind=BufferKind.OTHER) for l in range(S + 1)]
  buffers: list[Buffer] = []
  keyed: dict[tuple, int] = {}
  readers: dict[int, int] = {}  # received buffer -> reads still to come
  instrs: list[Instr] = []

  def new(lane: int) -> int:
    buffers.append(anon[lane])
    return len(buffers) - 1

  def arrive(key: tuple, s: int, src: int, kind: Transfer, m: int) -> int:
    """The buffer ``key`` sent from ``src`` to s, for s's chunk m: received (before its first
    reader), freed by its last (``uses``)."""
    b = keyed.get(key)
    if b is None:
      b = keyed[key] = new(s)
    if b not in readers:
      readers[b] = uses(s, src)
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
        arrive(("a", p, s, k), s, p, _ACT, m)
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
        instrs.append(Instr(Op.SEND, s, s, m, (out,), (dst,), last, c, _ACT))
    elif a.kind == "B":
      res = keyed[("res", s, m)]
      cts = [
        arrive(("c", c, s, k), s, c, _CT, m) for c in succs[s] for k in chunk_range(counts, s, m, c)
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
        instrs.append(Instr(Op.SEND, s, s, m, (ict,), (dst,), last, p, _CT))
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
