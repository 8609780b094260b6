"""Discrete-event simulation of a Schedule: Schedule + stage times -> SimResult (a timeline).

The simulator executes the same ``Schedule`` the runtime driver executes. Each stage runs its
lane in order; an action starts when the previous action of its lane has ended and its inputs
have arrived:

  F(s, m)  waits for the activation of micro-batch m from every predecessor stage;
  B(s, m)  waits for F(s, m) and for the cotangent of m from every successor stage;
  W(s, m)  waits for B(s, m);
  UPDATE   runs after the lane's last backward (gradient all-reduce + optimizer; with a
           host that measured it, ``cost.host.HostCosts.allreduce``, the all-reduce is paid in
           every backward of a stage over several devices instead, as the executor does).

An activation leaves stage p for stage s when F(p, m) ends, a cotangent leaves s for p when
B(s, m) ends. With per-stage micro-batch counts (``Schedule.counts``) each chunk is sent as it
is produced and an action waits for every chunk of the neighbouring stage overlapping its
samples (``ir.schedule.dependencies``); each stage's action times are those at its own size.
Every directed stage pair and direction is its own channel: transfers on one channel go one at
a time in the order the sender produced them and overlap with compute.
Stashed activations of micro-batch m are held on stage s from the start of F(s, m) to the end
of B(s, m) (of W(s, m) when the schedule splits it).

The simulator times what it is given and builds nothing. What it is given is typed
(``cost.stage_times``): each stage's times, transfers and memory (``StageTimes``) and the host
side of the machine, the thread issuing the program, its cores and shared channels
(``HostSide``). It times a schedule on its lanes (``simulate_lanes``, the devices-only model
the planners search with) or a lowered program (``simulate_program``; a schedule's own with
a ``StageTimes``, ``simulate_lowered``; a compiled step's with a plan's ``PlanTimes``,
``simulate_step``). A plan's times under the cost model or the host-aware one come from
``plan_times``. Building a plan's schedule, the stale weights it keeps and a schedule's
lowered program are passes; the entry points that build them and call the simulator are
``passes.simulation``:
  simulate_times(schedule, times, host)  a schedule timed with a ``StageTimes`` (explicit
      per-stage or per-action times, so measured times can be replayed and compared with
      predictions action by action) on a ``HostSide``;
  simulate(plan, layer_graph, cluster, ...)  times, transfers and memory from the cost model.
``write_chrome_trace(result, path)`` writes a Chrome / Perfetto JSON trace of a SimResult.

This module times programs (``simulate_program``, ``simulate_lowered``, ``simulate_step``);
the other parts are in modules of their own, all importable from here: ``cost.stage_times``
(``StageTimes``, ``StageMemory``, ``HostSide``), ``cost.sim_result`` (what a simulation
returns, ``SimResult``, and its Chrome trace), ``cost.lane_simulator`` (the devices-only model
on a schedule's lanes, ``simulate_lanes``) and ``cost.step_model`` (a plan's times under the
cost model or the host-aware one, ``plan_times``, ``predict_fused``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.lane_simulator import simulate_lanes  # noqa: F401
from gpp_jax.cost.memory import program_memory
from gpp_jax.cost.sim_result import (  # noqa: F401
  ActionTime,
  SimResult,
  Timed,
  TransferTime,
  _peaks,
  _summary,
  chrome_trace,
  write_chrome_trace,
)
from gpp_jax.cost.stage_times import (  # noqa: F401
  HostSide,
  StageMemory,
  StageTimes,
  Times,
  _per_action,
)
from gpp_jax.cost.step_model import (  # noqa: F401
  PlanTimes,
  fused_times,
  measured_width_times,
  nic_channels,
  plan_times,
  predict_fused,
  split_backward,
  spmd_call,
  spmd_factor,
  step_durations,
)
from gpp_jax.ir.program import BufferKind, Instr, Op, Program, Transfer, puts_together
from gpp_jax.ir.schedule import Schedule


def simulate_lowered(
  schedule: Schedule,
  program: Program,
  times: StageTimes,
  host: HostSide | None = None,
  *,
  timeline: bool = True,
) -> SimResult:
  """Schedule + its lowered program (``passes.lowering.lower_schedule``, which the caller
  builds) + its stages' times -> SimResult: each instruction's seconds from the times (an F,
  B or W its action's, a SEND its edge's transfer, an UPDATE its stage's, the rest nothing),
  the program timed by ``simulate_program`` on ``host`` (None: the devices-only model).
  ``timeline=False`` leaves the result's actions and transfers empty."""
  tf, tb, tw, up, act_x, cot_x = times.given(schedule.num_stages)
  F, B, W, SEND, ACT = Op.F, Op.B, Op.W, Op.SEND, _ACT
  durations = []
  for i in program.instrs:
    op = i.op
    if op is F:
      durations.append(tf(i.stage, i.mb))
    elif op is B:
      durations.append(tb(i.stage, i.mb))
    elif op is W:
      durations.append(tw(i.stage, i.mb))
    elif op is SEND:
      durations.append(
        act_x.get((i.lane, i.peer), 0.0) if i.arg == ACT else cot_x.get((i.peer, i.lane), 0.0)
      )
    elif op is Op.UPDATE:
      durations.append(float(up[i.stage]))
    else:
      durations.append(0.0)
  res = simulate_program(
    program, durations, host, memory=times.memory, num_microbatches=schedule.num_microbatches
  )
  return res if timeline else dataclasses.replace(res, actions=(), transfers=())


_ACT = Transfer(BufferKind.ACT)
# What a transfer carries -> its kind in the result (``TransferTime.kind``; others by their word).
_TRANSFER_KINDS: dict[Any, str] = {_ACT: "activation", Transfer(BufferKind.CT): "cotangent"}


def simulate_program(
  program: Program,
  durations: Sequence[float] | Callable[[Instr], float],
  host: HostSide | None = None,
  *,
  memory: StageMemory | None = None,
  num_microbatches: int | None = None,
) -> SimResult:
  """Times a lowered program (``ir.program``): the instructions in its dispatch order.

  ``durations``: seconds of each instruction (a sequence in program order, or a function of
  the instruction). A computing instruction starts when its lane is free and every buffer it
  reads is there, and occupies its lane for its duration. A SEND starts when its buffer exists
  and its channel (kind, source lane, destination lane; ``host.channels`` may map several onto
  one) is free, and occupies the channel, not a lane; the RECV that follows on the destination
  holds that lane until the buffer has arrived, as a device that runs its queue in order waits
  for an input.

  ``host`` (``HostSide``; None: the devices-only model). With ``host.dispatch`` (ops not in
  it cost the host nothing; a SEND between stages costs what its source or destination lane's
  SEND costs, the more, times its stage edge's ``send_factors``, either way; one from the host
  lane what the host lane's costs) one host thread issues the instructions one after another
  in program order, and none starts before it is issued; with ``cores`` the computing
  instructions and the issuing thread share that many cores (forced CPU devices): an
  instruction of a stage over k devices (``memory.devices``) runs on k device threads and
  holds min(k, cores) of them. The executor puts consecutive transfers between stages
  together (``ir.program.puts_together``, by destination); with ``send_extra`` the host pays
  for such a group at its first SEND, a lone put plus ``send_extra`` of one for each other
  array, and issues the others with it (without it, each SEND is a lone put). With
  ``processes`` (per lane, the processes that issue its instructions) each process has an
  issuing thread of its own; an instruction is issued by each of its lane's processes (a SEND
  by those of both its ends) and starts once all have issued it; ``cores`` are then what all
  processes' computations and threads share (processes on one machine share its cores: how
  many compute at full speed at once is measured across them).

  The result's actions are the F, B, W and UPDATE instructions, its transfers the SENDs; its
  memory from ``memory`` (``StageMemory``: each stage's static memory plus the most
  micro-batches it holds at once times one's stash). ``num_microbatches``: the result's
  (default: the most forwards of a stage per step).
  """
  S = program.num_stages
  instrs = program.instrs
  if callable(durations):
    durations = [durations(i) for i in instrs]
  if len(durations) != len(instrs):
    raise ValueError(f"{len(durations)} durations for {len(instrs)} instructions")
  host = host or HostSide()
  memory = memory or StageMemory()
  devs = memory.per_stage(S)[2]
  cores, send_factors = host.cores, host.send_factors
  ready = [0.0] * len(program.buffers)
  # Lanes on the same devices (``Program.places``) run one instruction at a time between them.
  place = list(program.places) if program.places is not None else list(range(program.num_lanes))
  lane_free = [0.0] * (max(place) + 1)
  chan_free: dict[Any, float] = defaultdict(float)
  chan_of = dict(host.channels or {})
  core_free = [0.0] * cores if cores else None
  # Cores an instruction of each lane holds: its stage's devices (the host lane: one).
  widths = [
    max(1, min(len(devs[lane]) if lane < S else 1, cores or 1)) for lane in range(program.num_lanes)
  ]
  issuers = [tuple(p) for p in host.processes] if host.processes is not None else None
  if issuers is not None and len(issuers) != program.num_lanes:
    raise ValueError(f"processes for {len(issuers)} lanes, not {program.num_lanes}")
  # Each process's issuing thread's clock (one process: one thread issues everything).
  host_clock = [0.0] * (1 + max((max(p) for p in issuers or () if p), default=0))
  one = (0,)
  lane_host = host.lane_costs(program.num_lanes)
  hosted = any(lane_host)
  share = _put_shares(program, place, devs, host.send_extra) if hosted else {}
  actions: list[ActionTime] = []
  transfers: list[TransferTime] = []
  one_step = program.steps == 1
  SEND, RECV, kinds = Op.SEND, Op.RECV, _TRANSFER_KINDS
  F, B, W, UPDATE, STEP = Op.F, Op.B, Op.W, Op.UPDATE, Op.STEP
  for n, (i, dur) in enumerate(zip(instrs, durations)):
    op = i.op
    issued = 0.0
    cost = lane_host[i.lane].get(op) if hosted else None
    if op is SEND and cost is not None and i.lane != program.host:
      cost = max(cost, lane_host[i.peer].get(op, cost))  # a put onto the wider stage costs more
      if send_factors:
        cost *= send_factors.get((i.lane, i.peer)) or send_factors.get((i.peer, i.lane)) or 1.0
      cost *= share.get(n, 1.0)
    if cost is not None:
      who = one if issuers is None else issuers[i.lane]
      if op is SEND and issuers is not None and i.lane != program.host:
        who = tuple(sorted({*who, *issuers[i.peer]}))
      for p in who:
        if core_free is None:
          host_clock[p] += cost
        else:  # the issuing thread needs a core as well
          k = min(range(len(core_free)), key=core_free.__getitem__)
          host_clock[p] = max(host_clock[p], core_free[k]) + cost
          core_free[k] = host_clock[p]
        if host_clock[p] > issued:
          issued = host_clock[p]
    dep = 0.0
    for b in i.reads:
      if ready[b] > dep:
        dep = ready[b]
    if op is SEND and place[i.lane] == place[i.peer]:  # a local hand-over: nothing moves
      for b in i.writes:
        ready[b] = max(dep, issued)
      continue
    if op is SEND:
      kind = kinds.get(i.arg) or ("" if i.arg is None else str(i.arg))
      key = (kind, i.lane, i.peer)
      chan = chan_of.get(key, key)
      start = max(dep, chan_free[chan], issued)
      end = start + dur
      chan_free[chan] = end
      for b in i.writes:
        ready[b] = end
      transfers.append(TransferTime(kind, i.lane, i.peer, i.mb, start, end))
      continue
    lane = place[i.lane]
    if op is RECV:
      if dep > lane_free[lane]:
        lane_free[lane] = dep
      continue
    start = max(lane_free[lane], dep, issued)
    if core_free is not None and dur > 0:
      held = sorted(range(len(core_free)), key=core_free.__getitem__)[: widths[i.lane]]
      start = max(start, max(core_free[k] for k in held))
      for k in held:
        core_free[k] = start + dur
    end = start + dur
    lane_free[lane] = end
    for b in i.writes:
      ready[b] = end
    if op is F or op is B or op is W:
      actions.append(ActionTime(op.value, i.stage, i.mb, start, end))
    elif op is UPDATE:
      actions.append(ActionTime("UPDATE", i.stage, -1 if one_step else i.mb, start, end))
    elif op is STEP:  # a fused step: every micro-batch and the update in one call
      actions.append(ActionTime("STEP", i.stage, -1, start, end))
  if num_microbatches is None:
    forwards = [sum(a.kind == "F" and a.stage == s for a in actions) for s in range(S)]
    num_microbatches = max(forwards, default=0) // max(program.steps, 1)
  return _result(program, num_microbatches, actions, transfers, memory)


def _put_shares(
  program: Program,
  place: Sequence[int],
  devs: Sequence[Sequence[int]],
  send_extra: float | None,
) -> dict[int, float]:
  """Puts issued together (``ir.program.puts_together``): per SEND among them, the host's cost
  as a share of a lone put's (the first pays for the group, the others nothing); none without
  ``send_extra``."""
  share: dict[int, float] = {}
  if send_extra is None:
    return share
  instrs = program.instrs

  def where(k: int) -> Any:
    i = instrs[k]
    if i.op is not Op.SEND or i.lane == program.host or place[i.lane] == place[i.peer]:
      return None
    return (i.peer, i.arg if len(devs[i.peer]) > 1 else None)

  for members in puts_together(instrs, where):
    share[members[0]] = 1.0 + (len(members) - 1) * send_extra
    share.update(dict.fromkeys(members[1:], 0.0))
  return share


def _result(
  program: Program,
  num_microbatches: int,
  actions: list[ActionTime],
  transfers: list[TransferTime],
  memory: StageMemory,
) -> SimResult:
  """The SimResult of ``program``'s timed actions and transfers (``_summary``)."""
  S = program.num_stages
  busy = [0.0] * S
  for at in actions:
    if at.kind in ("F", "B", "W", "STEP"):
      busy[at.stage] += at.end - at.start
  T = max((a.end for a in actions), default=0.0)
  peak = _peaks(actions, S, any(a.kind == "W" for a in actions))
  return _summary(program.name, num_microbatches, Timed(T, actions, transfers, busy, peak), memory)


def simulate_step(
  program: Program, plan, cluster: Cluster, times: PlanTimes, *, num_microbatches: int
) -> SimResult:
  """The lowered program of a plan's compiled step (``GraphPipeline.program``, the one the
  executor runs) timed with the plan's ``times`` (``plan_times(step=True)``): each of its
  transfers between stages costs its bytes over the link between their devices
  (``step_durations``), the host issues it as ``times.host`` says (``simulate_program``), and
  the host's time outside the program is added to the iteration time. Memory is the program's
  own (``cost.memory``: its buffers' sizes and lifetimes, without the executables'
  temporaries), not the cost model's."""
  st = times.stages
  durations = step_durations(program, plan, cluster, times)
  lanes = [tuple(s.devices) for s in plan.stages] + [()]
  mem = program_memory(program, lanes)
  stage_memory = tuple(
    float(max((mem.peak.get(d, 0) for d in s.devices), default=0)) for s in plan.stages
  )
  peak = {int(d): float(n) for d, n in mem.peak.items()}  # type: ignore[call-overload]
  res = simulate_program(
    program, durations, times.host, memory=st.memory, num_microbatches=num_microbatches
  )
  return dataclasses.replace(
    res,
    stage_memory=stage_memory,
    peak_memory=peak,
    iteration_time=res.iteration_time + times.outside,
  )
