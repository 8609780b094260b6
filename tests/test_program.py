"""The lowered schedule IR: text form, the validator, and one program for executor and simulator."""

import dataclasses

import jax
import numpy as np
import pytest
from harness import DAG_STAGES, OPTIMIZERS, dag_model, dag_params, make_batch, max_diff, mse_step

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.cost.simulator import simulate_program
from gpp_jax.ir.program import (
  Arg,
  BufferKind,
  Cotangents,
  Count,
  Donate,
  Instr,
  Op,
  Piece,
  Program,
  ProgramError,
  Reduce,
  Transfer,
  _parse_instr,
  validate_program,
)
from gpp_jax.passes.lowering import lower_schedule
from gpp_jax.passes.schedules import make_schedule, stream_schedule
from gpp_jax.passes.simulation import HostSide, StageTimes, simulate_times
from gpp_jax.runtime.executor import Executor

EDGES = [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]


@pytest.fixture(scope="module")
def dag():
  """A four-stage DAG pipeline after one step, and its reference values."""
  tx = OPTIMIZERS["clip_adam"]()
  params = dag_params()
  batch = make_batch(3, 8, 5, 2)
  pp = gpp_jax.graph_pipeline(
    mse_step(dag_model, tx),
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(DAG_STAGES),
  )
  out = pp(params, tx.init(params), batch)
  return pp, params, tx, batch, out


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero-bubble", "2bw"])
def test_lowered_schedules_are_valid_and_read_back_from_text(name):
  prog = lower_schedule(make_schedule(name, 4, EDGES, 4))
  validate_program(prog)
  text = prog.to_text()
  back = Program.from_text(text)
  assert back == prog
  assert back.to_text() == text
  # Every stage edge carries one activation and one cotangent per micro-batch.
  assert prog.count(Op.SEND) == 2 * len(EDGES) * 4
  assert prog.count(Op.RECV) == prog.count(Op.SEND)


def test_lowering_with_per_stage_counts_and_several_steps_is_valid():
  validate_program(lower_schedule(make_schedule("1f1b", 3, [(0, 1), (1, 2)], 4, counts=(2, 4, 8))))
  multi = stream_schedule(make_schedule("2bw", 3, [(0, 1), (1, 2)], 4), 3)
  prog = lower_schedule(multi)
  validate_program(prog)
  assert prog.steps == 3 and prog.count(Op.UPDATE) == 9


def test_the_step_program_reads_back_from_text(dag):
  pp = dag[0]
  prog = pp.program
  validate_program(prog)
  assert Program.from_text(prog.to_text()) == prog
  kinds = {i.arg.kind for i in prog.instrs if isinstance(i.arg, Transfer) and i.op is Op.SEND}
  # Activations and cotangents between stages, parameters onto their owners, the batch onto
  # the stages that read it, gradients and optimizer values between the step's pieces.
  assert {"act", "ct", "param", "batch"} <= kinds, kinds
  assert prog.count(Op.F) == prog.count(Op.B) == 4 * 4
  assert prog.count(Op.PIECE) == len(pp.compiled.prog.before + pp.compiled.prog.after)


@pytest.mark.parametrize(
  "op, arg, word",
  [
    (Op.SEND, Transfer(BufferKind.PARAM), "param"),
    (Op.RECV, Transfer(BufferKind.BATCH, stacked=True), "stacked"),
    (Op.CHUNK, Count(4, stacked=True), "4:stacked"),
    (Op.SPLIT, Count(2), "2"),
    (Op.CONCAT, BufferKind.CT, "ct"),
    (Op.B, Cotangents((2, 0, 1)), "2.0.1"),
    (Op.REDUCE, Reduce.CONCAT, "concat"),
    (Op.PIECE, Piece(3), "3"),
    (Op.STEP, Donate((0, 1, 2, 5)), "donate=0-2.5"),
  ],
)
def test_an_instruction_argument_is_one_word_that_reads_back(op, arg, word):
  peer = 1 if op in (Op.SEND, Op.RECV) else -1
  ins = Instr(op, 0, 0, 0, (1,), (2,), peer=peer, arg=arg)
  assert str(ins).split(" : ")[0].endswith(f" {word}")
  back = _parse_instr(str(ins))
  assert back == ins and type(back.arg) is type(arg)


def test_the_text_form_rejects_an_argument_it_cannot_read():
  with pytest.raises(ProgramError, match="takes no argument"):
    _parse_instr("L1 F1.3 2 : %1")
  with pytest.raises(ProgramError, match="cannot read SEND's argument"):
    _parse_instr("L1 SEND>2 weights : %1 -> %2")


def _drop(prog: Program, k: int) -> Program:
  instrs = list(prog.instrs)
  del instrs[k]
  return dataclasses.replace(prog, instrs=tuple(instrs))


def _first(prog: Program, op: Op, arg: Arg | None = None) -> int:
  return next(k for k, i in enumerate(prog.instrs) if i.op is op and arg in (None, i.arg))


def test_the_validator_catches_a_missing_recv():
  prog = lower_schedule(make_schedule("1f1b", 2, [(0, 1)], 2))
  bad = _drop(prog, _first(prog, Op.RECV))
  with pytest.raises(ProgramError, match="before it arrives|missing RECV"):
    validate_program(bad)


def test_the_validator_catches_a_read_before_arrival():
  prog = lower_schedule(make_schedule("1f1b", 2, [(0, 1)], 2))
  k = _first(prog, Op.RECV)
  instrs = list(prog.instrs)
  recv = instrs.pop(k)
  instrs.insert(k + 1, recv)  # after the forward that reads what it receives
  with pytest.raises(ProgramError, match="before it arrives"):
    validate_program(dataclasses.replace(prog, instrs=tuple(instrs)))


def test_the_validator_catches_a_recv_without_send():
  prog = lower_schedule(make_schedule("1f1b", 2, [(0, 1)], 2))
  k = _first(prog, Op.SEND, Transfer(BufferKind.ACT))
  send = prog.instrs[k]
  instrs = list(prog.instrs)
  instrs.insert(k, Instr(Op.RECV, send.peer, reads=send.writes, peer=send.lane))
  with pytest.raises(ProgramError, match="recv without a send"):
    validate_program(dataclasses.replace(prog, instrs=tuple(instrs)))


def test_the_validator_catches_a_leaked_buffer_and_a_read_after_free():
  prog = lower_schedule(make_schedule("1f1b", 2, [(0, 1)], 2))
  k = next(k for k, i in enumerate(prog.instrs) if i.frees)
  kept = prog.replace_instr(k, prog.instrs[k]._replace(frees=()))
  with pytest.raises(ProgramError, match="leaked buffer"):
    validate_program(kept)
  # Free the first forward's residuals right away: its backward reads them later.
  f = _first(prog, Op.F)
  res = prog.instrs[f].writes[0]
  early = prog.replace_instr(f, prog.instrs[f]._replace(frees=(res,)))
  early = dataclasses.replace(
    early,
    instrs=tuple(
      i._replace(frees=tuple(b for b in i.frees if b != res)) if j > f else i
      for j, i in enumerate(early.instrs)
    ),
  )
  with pytest.raises(ProgramError, match="after instruction"):
    validate_program(early)


def test_simulate_times_is_the_lowered_schedule_timed():
  sched = make_schedule("1f1b", 4, EDGES, 4)
  a = simulate_times(
    sched, StageTimes([1.0] * 4, [2.0] * 4, activation_transfer=dict.fromkeys(EDGES, 0.25))
  )
  prog = lower_schedule(sched)

  def dur(i: Instr) -> float:  # cotangents cost what activations do unless told otherwise
    return {Op.F: 1.0, Op.B: 2.0, Op.SEND: 0.25}.get(i.op, 0.0)

  b = simulate_program(prog, dur)
  assert a.iteration_time == b.iteration_time
  assert sorted(a.actions, key=str) == sorted(b.actions, key=str)


def _delay_a_forward(prog: Program) -> tuple[Program, Instr, Instr]:
  """The program with one forward (and the sends that follow it on its lane) issued later:
  moved past the instructions of other lanes after it, up to the first that reads what it
  writes or frees what it reads, or one of its own lane. Returns (program, the forward, a
  forward of another lane it now follows)."""
  instrs = list(prog.instrs)
  for k, a in enumerate(instrs):
    if a.op is not Op.F:
      continue
    e = k + 1
    while e < len(instrs) and instrs[e].lane == a.lane and instrs[e].op is Op.SEND:
      e += 1
    block = instrs[k:e]
    writes = {b for i in block for b in i.writes}
    reads = {b for i in block for b in i.reads}
    q, passed = e, None
    while q < len(instrs):
      b = instrs[q]
      if b.lane == a.lane or writes & set(b.reads) or reads & set(b.frees):
        break
      if b.op is Op.F:
        passed = b
      q += 1
    if passed is not None:
      moved = instrs[:k] + instrs[e:q] + block + instrs[q:]
      return dataclasses.replace(prog, instrs=tuple(moved)), a, passed
  raise AssertionError("no forward can be issued later")


def test_executor_and_simulator_run_the_same_program(dag):
  """Mutating the program changes what the executor issues and what the simulator predicts;
  the values stay those of the reference."""
  pp, params, tx, batch, out = dag
  c = pp.compiled
  lowered = c.lowered
  swapped, a, b = _delay_a_forward(lowered.program)
  validate_program(swapped)
  ex = Executor(dataclasses.replace(lowered, program=swapped), c.kernels, seeds=c.seeds, history=[])
  leaves = jax.tree.leaves((params, tx.init(params), batch))
  outs = ex.run([leaves])[0]
  assert max_diff(outs, jax.tree.leaves(out)) <= 1e-6
  order = [(e.action, e.stage, e.microbatch) for e in ex.last_timeline.events]
  assert order.index(("F", b.stage, b.mb)) < order.index(("F", a.stage, a.mb))
  original = [(e.action, e.stage, e.microbatch) for e in pp.timeline.events]
  assert original.index(("F", a.stage, a.mb)) < original.index(("F", b.stage, b.mb))

  host = dict.fromkeys(Op, 1.0)
  before = simulate_program(lowered.program, lambda i: 0.0, HostSide(dispatch=host))
  after = simulate_program(swapped, lambda i: 0.0, HostSide(dispatch=host))
  start = {(x.kind, x.stage, x.microbatch): x.start for x in before.actions}
  moved = {(x.kind, x.stage, x.microbatch): x.start for x in after.actions}
  assert moved[("F", a.stage, a.mb)] > start[("F", a.stage, a.mb)]
  assert moved[("F", b.stage, b.mb)] < start[("F", b.stage, b.mb)]


def test_the_predicted_timeline_times_the_step_program(dag):
  from gpp_jax.cli.reporting import predicted_timeline

  pp = dag[0]
  res = predicted_timeline(pp, cpu_cluster(4))
  prog = pp.program
  assert len(res.actions) == sum(i.op in (Op.F, Op.B, Op.W, Op.UPDATE) for i in prog.instrs)
  assert len(res.transfers) == prog.count(Op.SEND)
  assert res.iteration_time > 0
  assert np.isfinite(res.iteration_time)
