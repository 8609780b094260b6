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

The simulator times what it is given and builds nothing: a schedule on its lanes
(``simulate_lanes``, the devices-only model the planners search with), a lowered program
(``simulate_program``; a schedule's own with per-action times, ``simulate_lowered``; a compiled
step's with a plan's costs, ``simulate_step``), and a plan's times under the cost model or the
host-aware one (``plan_times``). Building a plan's schedule, the stale weights it keeps and a
schedule's lowered program are passes; the entry points that build them and call the
simulator are ``passes.simulation``:
  simulate_times(schedule, forward, backward, ...)  explicit per-stage (or per-action) times,
      so measured times can be replayed and compared with predictions action by action;
  simulate(plan, layer_graph, cluster, ...)  times, transfers and memory from the cost model.
``write_chrome_trace(result, path)`` writes a Chrome / Perfetto JSON trace of a SimResult.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

import networkx as nx

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import (
  DEFAULT_COST_MODEL,
  CostModel,
  LayerCosts,
  PlanCosts,
  layer_costs,
  plan_costs,
)
from gpp_jax.cost.memory import program_memory
from gpp_jax.ir.program import Instr, Op, Program, puts_together
from gpp_jax.ir.schedule import Action, Schedule, chunk_range, lanes_with_updates

Times = float | Sequence[float] | Mapping[int, float]


class ActionTime(NamedTuple):
  """When one action ran (a named tuple: planners build thousands per simulation)."""

  kind: str
  stage: int
  microbatch: int
  start: float
  end: float

  @property
  def action(self) -> Action:
    return Action(self.kind, self.stage, self.microbatch)


class TransferTime(NamedTuple):
  """When one transfer ran: ``kind`` is "activation" (src -> dst) or "cotangent" (src -> dst,
  flowing against the stage edge dst -> src)."""

  kind: str
  src: int
  dst: int
  microbatch: int
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
  """A simulated timeline.

  Attributes:
    schedule: name of the simulated schedule.
    num_stages, num_microbatches: shape of the schedule.
    iteration_time: seconds from the first action's start (0) to the last action's end.
    actions: every action with its start and end.
    transfers: every transfer with its start and end.
    busy: seconds each stage spends in F, B and W.
    bubble: 1 - busy / iteration_time, per stage.
    peak_in_flight: the most micro-batches whose activations a stage held at once.
    stage_memory: peak bytes per device of each stage (static + peak_in_flight * stash).
    stage_devices: the devices of each stage (empty tuples when not known).
    peak_memory: peak bytes per device, keyed by device index (empty when devices not known).
  """

  schedule: str
  num_stages: int
  num_microbatches: int
  iteration_time: float
  actions: tuple[ActionTime, ...]
  transfers: tuple[TransferTime, ...]
  busy: tuple[float, ...]
  bubble: tuple[float, ...]
  peak_in_flight: tuple[int, ...]
  stage_memory: tuple[float, ...]
  stage_devices: tuple[tuple[int, ...], ...]
  peak_memory: Mapping[int, float]

  def time_of(self, action: Action) -> tuple[float, float]:
    """(start, end) of ``action``."""
    for a in self.actions:
      if a.kind == action.kind and a.stage == action.stage and a.microbatch == action.microbatch:
        return a.start, a.end
    raise KeyError(f"{action} is not in the simulated schedule")

  def throughput(self, batch_size: float) -> float:
    """Samples per second for a mini-batch of ``batch_size`` samples."""
    return batch_size / self.iteration_time

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["actions"] = [a._asdict() for a in self.actions]
    d["transfers"] = [t._asdict() for t in self.transfers]
    d["peak_memory"] = {str(k): v for k, v in self.peak_memory.items()}
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_json(cls, s: str) -> SimResult:
    d = json.loads(s)
    return cls(
      schedule=d["schedule"],
      num_stages=d["num_stages"],
      num_microbatches=d["num_microbatches"],
      iteration_time=d["iteration_time"],
      actions=tuple(ActionTime(**a) for a in d["actions"]),
      transfers=tuple(TransferTime(**t) for t in d["transfers"]),
      busy=tuple(d["busy"]),
      bubble=tuple(d["bubble"]),
      peak_in_flight=tuple(d["peak_in_flight"]),
      stage_memory=tuple(d["stage_memory"]),
      stage_devices=tuple(tuple(x) for x in d["stage_devices"]),
      peak_memory={int(k): v for k, v in d["peak_memory"].items()},
    )

  def __str__(self) -> str:
    rows = [
      f"Simulated {self.schedule}: {self.num_stages} stages x {self.num_microbatches} "
      f"micro-batches, iteration {self.iteration_time * 1e3:.3f} ms",
      f"{'stage':>5s} {'busy ms':>9s} {'bubble':>7s} {'in-flight':>9s} {'mem MiB':>9s}",
    ]
    for s in range(self.num_stages):
      rows.append(
        f"{s:5d} {self.busy[s] * 1e3:9.3f} {self.bubble[s]:7.1%} "
        f"{self.peak_in_flight[s]:9d} {self.stage_memory[s] / 2**20:9.1f}"
      )
    return "\n".join(rows)


def _per_action(times: Any, what: str, num_stages: int) -> Callable[[int, int], float]:
  """Normalises per-stage times: a float per stage, or per micro-batch sequences/mappings."""
  if times is None:
    return lambda s, m: 0.0
  if len(times) != num_stages:
    raise ValueError(f"{what}: expected {num_stages} per-stage entries, got {len(times)}")

  def get(s: int, m: int) -> float:
    t = times[s]
    if isinstance(t, (int, float)):
      return float(t)
    return float(t[m])

  return get


def _given_times(
  schedule: Schedule,
  forward: Sequence[Times],
  backward: Sequence[Times],
  weight: Sequence[Times] | None,
  update: Sequence[float] | None,
  activation_transfer: Mapping[tuple[int, int], float] | None,
  cotangent_transfer: Mapping[tuple[int, int], float] | None,
) -> tuple[
  Callable[[int, int], float],
  Callable[[int, int], float],
  Callable[[int, int], float],
  list[float],
  dict[tuple[int, int], float],
  dict[tuple[int, int], float],
]:
  """The times ``simulate_lanes`` and ``simulate_lowered`` take, normalised: per stage and
  micro-batch the seconds of an F, B and W (``_per_action``, which checks there is an entry
  per stage), per stage the UPDATE's seconds (0 if None), and per stage edge the seconds of an
  activation's transfer and of a cotangent's (by default the activation's)."""
  S = schedule.num_stages
  tf = _per_action(forward, "forward", S)
  tb = _per_action(backward, "backward", S)
  tw = _per_action(weight, "weight", S)
  up = list(update) if update is not None else [0.0] * S
  act_x = dict(activation_transfer or {})
  cot_x = dict(cotangent_transfer if cotangent_transfer is not None else act_x)
  return tf, tb, tw, up, act_x, cot_x


def simulate_lanes(
  schedule: Schedule,
  forward: Sequence[Times],
  backward: Sequence[Times],
  *,
  weight: Sequence[Times] | None = None,
  update: Sequence[float] | None = None,
  activation_transfer: Mapping[tuple[int, int], float] | None = None,
  cotangent_transfer: Mapping[tuple[int, int], float] | None = None,
  static_memory: Sequence[float] | None = None,
  activation_memory: Sequence[float] | None = None,
  stage_devices: Sequence[Sequence[int]] | None = None,
  timeline: bool = True,
) -> SimResult | None:
  """Schedule + explicit times -> SimResult under the devices-only model the planners search
  with (no host issuing the program, no cores shared, every transfer on a channel of its own,
  no stages sharing devices), computed on the schedule itself without lowering it
  (``_simulate_lanes``): the times of its lowered program (``simulate_lowered``; the tests
  hold the two equal). None when the lanes deadlock: the schedule's lowering names the
  deadlock. The arguments as ``passes.simulation.simulate_times`` takes them, which calls
  this where the model applies."""
  if schedule.shares_devices:
    raise ValueError(
      f"stages of schedule {schedule.name!r} share devices: time its lowered program "
      "(simulate_lowered)"
    )
  S = schedule.num_stages
  _, _, _, up, act_x, cot_x = _given_times(
    schedule, forward, backward, weight, update, activation_transfer, cotangent_transfer
  )
  timed = _simulate_lanes(schedule, forward, backward, weight, up, act_x, cot_x, timeline)
  if timed is None:
    return None
  return _summary(
    schedule.name,
    S,
    schedule.num_microbatches,
    *timed,
    list(static_memory) if static_memory is not None else [0.0] * S,
    list(activation_memory) if activation_memory is not None else [0.0] * S,
    tuple(tuple(d) for d in stage_devices) if stage_devices is not None else ((),) * S,
  )


def simulate_lowered(
  schedule: Schedule,
  program: Program,
  forward: Sequence[Times],
  backward: Sequence[Times],
  *,
  weight: Sequence[Times] | None = None,
  update: Sequence[float] | None = None,
  activation_transfer: Mapping[tuple[int, int], float] | None = None,
  cotangent_transfer: Mapping[tuple[int, int], float] | None = None,
  static_memory: Sequence[float] | None = None,
  activation_memory: Sequence[float] | None = None,
  stage_devices: Sequence[Sequence[int]] | None = None,
  host_dispatch: float | Mapping[Op, float] | Sequence[Mapping[Op, float]] | None = None,
  send_factors: Mapping[tuple[int, int], float] | None = None,
  cores: int | None = None,
  channels: Mapping[tuple[str, int, int], Any] | None = None,
  timeline: bool = True,
  processes: Sequence[Sequence[int]] | None = None,
) -> SimResult:
  """Schedule + its lowered program (``passes.lowering.lower_schedule``, which the caller
  builds) + explicit times -> SimResult: each instruction's seconds from the times (an F, B
  or W its action's, a SEND its edge's transfer, an UPDATE its stage's, the rest nothing),
  the program timed by ``simulate_program``. The arguments as ``passes.simulation
  .simulate_times`` takes them."""
  tf, tb, tw, up, act_x, cot_x = _given_times(
    schedule, forward, backward, weight, update, activation_transfer, cotangent_transfer
  )
  F, B, W, SEND = Op.F, Op.B, Op.W, Op.SEND
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
        act_x.get((i.lane, i.peer), 0.0) if i.arg == "act" else cot_x.get((i.peer, i.lane), 0.0)
      )
    elif op is Op.UPDATE:
      durations.append(float(up[i.stage]))
    else:
      durations.append(0.0)
  host: Any = None
  if isinstance(host_dispatch, Mapping):
    host = dict(host_dispatch)
  elif isinstance(host_dispatch, Sequence):
    host = list(host_dispatch)
  elif host_dispatch is not None:
    host = {op: float(host_dispatch) for op in (Op.F, Op.B, Op.W, Op.UPDATE)}
  res = simulate_program(
    program,
    durations,
    host_cost=host,
    send_factors=send_factors,
    cores=cores,
    channels=channels,
    static_memory=static_memory,
    activation_memory=activation_memory,
    stage_devices=stage_devices,
    num_microbatches=schedule.num_microbatches,
    processes=processes,
  )
  return res if timeline else dataclasses.replace(res, actions=(), transfers=())


def _stage_times(
  times: Any, S: int, lengths: Sequence[int]
) -> tuple[list[list[float]], list[float]]:
  """Per stage, the seconds of each of its micro-batches' actions (``_per_action``'s forms),
  and the shortest of them (NaN where one is NaN, inf where there are none)."""
  out, low = [], []
  for s in range(S):
    t = times[s] if times is not None else 0.0
    if isinstance(t, (int, float)):
      out.append([float(t)] * lengths[s])
      low.append(float(t))
    else:
      per_mb = [float(t[m]) for m in range(lengths[s])]
      out.append(per_mb)
      low.append(math.nan if any(map(math.isnan, per_mb)) else min(per_mb, default=math.inf))
  return out, low


class _LaneFacts(NamedTuple):
  """What ``_simulate_lanes`` reads of a schedule besides its times (``_lane_facts``).

  Attributes:
    lanes: the lanes, each ending with an UPDATE (``lanes_with_updates``).
    lengths: per stage, its micro-batches over all steps.
    edges: the stage edges, sorted, once each.
    chunks: (stage, neighbour) -> per micro-batch of the stage, the neighbour's micro-batches
      overlapping it, where the two cut the batch differently (``chunk_range``).
    peak: per stage, the most micro-batches whose stashes it holds at once counted in lane
      order (a stash taken at an F, freed at a B, or a W where the schedule splits B): the
      peak in time where every action of the stage lasts (``_simulate_lanes``).
    split_w: whether the schedule splits the backward (W actions).
    size: the actions of all lanes.
  """

  lanes: list[list[Action]]
  lengths: list[int]
  edges: list[tuple[int, int]]
  chunks: dict[tuple[int, int], list[range]]
  peak: list[int]
  split_w: bool
  size: int


def _find_lane_facts(sched: Schedule) -> _LaneFacts | None:
  """The schedule's ``_LaneFacts``; None when a lane runs a B before its F or a W before its
  B (it waits for itself: the lanes deadlock)."""
  counts = sched.stage_counts
  steps = max(sched.steps, 1)
  lengths = [c * steps for c in counts]
  edges = sorted(set(sched.edges))
  chunks = {}
  for u, v in edges:
    if counts[u] != counts[v]:
      chunks[(v, u)] = [chunk_range(counts, v, m, u) for m in range(lengths[v])]
      chunks[(u, v)] = [chunk_range(counts, u, m, v) for m in range(lengths[u])]
  lanes = lanes_with_updates(sched)
  split_w = sched.splits_backward
  peak = []
  for lane in lanes:
    forwards, backwards = set(), set()
    held = most = 0
    for a in lane:  # one pass per action of every new schedule: kept to plain statements
      kind = a.kind
      if kind == "F":
        forwards.add(a.microbatch)
        held += 1
        if held > most:
          most = held
      elif kind == "B":
        m = a.microbatch
        if m not in forwards:
          return None
        if split_w:
          backwards.add(m)
        else:
          held -= 1
      elif kind == "W":
        if a.microbatch not in backwards:
          return None
        held -= 1
    peak.append(most)
  return _LaneFacts(lanes, lengths, edges, chunks, peak, split_w, sum(map(len, lanes)))


# ``_find_lane_facts`` per schedule, keyed by the schedule object's identity: the planners
# simulate one schedule (``plan_assembly._schedule``) for many candidate plans, and hashing a
# schedule costs a Python call per action. An entry holds its schedule, so the id is not
# reused while it is cached; a Schedule is immutable, so an entry never goes stale. At most
# _LANE_FACTS_SIZE entries (the oldest goes first).
_LANE_FACTS_SIZE = 512
_lane_facts_cache: dict[int, tuple[Schedule, _LaneFacts | None]] = {}


def _lane_facts(sched: Schedule) -> _LaneFacts | None:
  """``_find_lane_facts(sched)``, remembered (``_lane_facts_cache``)."""
  hit = _lane_facts_cache.get(id(sched))
  if hit is not None and hit[0] is sched:
    return hit[1]
  facts = _find_lane_facts(sched)
  if len(_lane_facts_cache) >= _LANE_FACTS_SIZE:
    del _lane_facts_cache[next(iter(_lane_facts_cache))]
  _lane_facts_cache[id(sched)] = (sched, facts)
  return facts


def _simulate_lanes(
  sched: Schedule,
  forward: Any,
  backward: Any,
  weight: Any,
  up: Sequence[float],
  act_x: Mapping[tuple[int, int], float],
  cot_x: Mapping[tuple[int, int], float],
  timeline: bool = True,
  record: bool = False,
) -> tuple[float, list[ActionTime], list[TransferTime], list[float], list[int]] | None:
  """What ``simulate_program`` finds for the schedule's lowered program when no host issues
  it and every transfer has its own channel, computed on the schedule itself: the planners
  simulate hundreds of candidate schedules, and lowering each into buffers and instructions
  cost most of their search. One pass in the dispatch order (``ir.schedule.dispatch_order``,
  the order the lowering emits): an action starts when its lane is free and its inputs have
  arrived (a RECV holds its lane until then, which is the same), a transfer when its sender
  has finished and its channel (kind, sender, receiver) is free. The actions and transfers
  come out in the program's order; ``tests/test_simulator.py`` holds the two paths equal.
  Returns (iteration time, actions, transfers (both empty unless ``timeline``), busy seconds
  per stage, peak stashes held per stage (``_peaks``)), or None when the lanes deadlock.

  Without a timeline, where no action lasts less than nothing (every duration >= 0, none
  NaN), each lane's actions end in lane order, so the iteration ends where the last lane
  does; and where every F of a stage lasts at least the spacing of floats at that end (an F
  ends after it starts), a stash freed before an F starts is one freed earlier in the lane, so
  the stage's peak is its peak in lane order (``_LaneFacts.peak``). Otherwise the pass
  records the timeline (as ``record`` asks) and counts both from it, as ``simulate_program``
  does."""
  facts = _lane_facts(sched)
  if facts is None:
    return None
  S = sched.num_stages
  lengths, edges = facts.lengths, facts.edges
  tf, f_low = _stage_times(forward, S, lengths)
  tb, b_low = _stage_times(backward, S, lengths)
  tw, w_low = _stage_times(weight, S, lengths)
  ups = [float(u) for u in up]
  lasting = all(t >= 0.0 for t in chain(f_low, b_low, w_low, ups))
  record = record or timeline or not lasting
  # Per edge (u, v): when each chunk's activation reaches v (indexed by u's chunks) and each
  # cotangent reaches u (by v's chunks); None until sent.
  act = {e: [None] * lengths[e[0]] for e in edges}
  cot = {e: [None] * lengths[e[1]] for e in edges}
  chunks = facts.chunks
  # Per stage, what its F / B waits for: (arrivals, the chunks per micro-batch or None for
  # the same micro-batch), and what it sends: (arrivals, channel, seconds, receiver).
  f_in: list[list[tuple[list, list[range] | None]]] = [[] for _ in range(S)]
  b_in: list[list[tuple[list, list[range] | None]]] = [[] for _ in range(S)]
  f_out: list[list[tuple[list, int, float, int]]] = [[] for _ in range(S)]
  b_out: list[list[tuple[list, int, float, int]]] = [[] for _ in range(S)]
  E = len(edges)
  for c, (u, v) in enumerate(edges):
    f_in[v].append((act[(u, v)], chunks.get((v, u))))
    f_out[u].append((act[(u, v)], c, act_x.get((u, v), 0.0), v))
  for c, (u, v) in enumerate(edges):  # the cotangents, in the order the program sends them
    b_in[u].append((cot[(u, v)], chunks.get((u, v))))
    b_out[v].append((cot[(u, v)], E + c, cot_x.get((u, v), 0.0), u))
  chan = [0.0] * (2 * E)  # when each channel is free
  lanes = facts.lanes
  lane_free = [0.0] * S
  busy = [0.0] * S
  actions: list[tuple] = []
  transfers: list[tuple] = []
  one_step = sched.steps == 1
  pos = [0] * S
  # What a lane's blocked head waits for (a list and an index): checked first when the round
  # comes back to the lane, so a lane still blocked costs one lookup.
  waits: list[tuple[list, int] | None] = [None] * S
  left = facts.size
  while left:
    progressed = False
    for s in range(S):
      w = waits[s]
      if w is not None:
        if w[0][w[1]] is None:
          continue
        waits[s] = None
      lane = lanes[s]
      n = len(lane)
      p = p0 = pos[s]
      free = lane_free[s]
      work = busy[s]
      fin, bin_ = f_in[s], b_in[s]
      while p < n:
        a = lane[p]
        kind, m = a.kind, a.microbatch
        start = free
        if kind == "F" or kind == "B":
          for arrived, span in fin if kind == "F" else bin_:
            # Equal micro-batch counts (no span) read one arrival; spelt out rather than
            # looping over (m,): the tuple per input costs 1.5-3% of a planner's search.
            if span is None:
              k = m
              t = arrived[k]
              if t is None:
                break
              if t > start:
                start = t
            else:
              for k in span[m]:
                t = arrived[k]
                if t is None:
                  break
                if t > start:
                  start = t
              else:
                continue
              break
          else:
            if kind == "F":
              end = start + tf[s][m]
              outs, what = f_out[s], "activation"
            else:
              end = start + tb[s][m]
              outs, what = b_out[s], "cotangent"
            for arrivals, c, x, o in outs:
              t0 = end if end > chan[c] else chan[c]
              chan[c] = arrivals[m] = t1 = t0 + x
              if record:
                transfers.append((what, s, o, m, t0, t1))
            work += end - start
            if record:
              actions.append((kind, s, m, start, end))
            free = end
            p += 1
            continue
          waits[s] = (arrived, k)
          break
        if kind == "W":
          end = start + tw[s][m]
          work += end - start
        else:
          end = start + ups[s]
          m = -1 if one_step else m
        if record:
          actions.append((kind, s, m, start, end))
        free = end
        p += 1
      if p > p0:
        busy[s] = work
        lane_free[s] = free
        left -= p - p0
        pos[s] = p
        progressed = True
    if not progressed:
      return None
  if not record:
    last = max([0.0, *lane_free])
    if all(t >= math.ulp(last) for t in f_low):
      return last, [], [], busy, facts.peak
    return _simulate_lanes(sched, forward, backward, weight, up, act_x, cot_x, False, True)
  last = max([0.0, *(a[4] for a in actions)])  # a NaN end is passed over (NaN > x is false)
  peak = _peaks(actions, S, facts.split_w)
  if not timeline:
    return last, [], [], busy, peak
  new = tuple.__new__
  return (
    last,
    [new(ActionTime, a) for a in actions],
    [new(TransferTime, t) for t in transfers],
    busy,
    peak,
  )


def _peaks(actions: Sequence[tuple], S: int, split_w: bool) -> list[int]:
  """Per stage, the most micro-batches whose stashes it holds at once: a stash is taken where
  its F starts and freed where its B (its W where the schedule splits B, ``split_w``) ends.
  ``actions``: (kind, stage, micro-batch, start, end) each, ``ActionTime``s or plain tuples."""
  events: list[list[tuple[float, int]]] = [[] for _ in range(S)]
  free_kind = "W" if split_w else "B"
  for kind, s, _, start, end in actions:
    if kind == "F":
      events[s].append((start, 1))
    elif kind == free_kind:
      events[s].append((end, -1))
  peak = []
  for ev in events:
    cur = best = 0
    for _, d in sorted(ev):  # frees before allocations at ties
      cur += d
      if cur > best:
        best = cur
    peak.append(best)
  return peak


_TRANSFER_KINDS = {"act": "activation", "ct": "cotangent"}


def simulate_program(
  program: Program,
  durations: Sequence[float] | Callable[[Instr], float],
  *,
  host_cost: Mapping[Op, float] | Sequence[Mapping[Op, float]] | None = None,
  send_factors: Mapping[tuple[int, int], float] | None = None,
  send_extra: float | None = None,
  cores: int | None = None,
  channels: Mapping[tuple[str, int, int], Any] | None = None,
  static_memory: Sequence[float] | None = None,
  activation_memory: Sequence[float] | None = None,
  stage_devices: Sequence[Sequence[int]] | None = None,
  num_microbatches: int | None = None,
  processes: Sequence[Sequence[int]] | None = None,
) -> SimResult:
  """Times a lowered program (``ir.program``): the instructions in its dispatch order.

  ``durations``: seconds of each instruction (a sequence in program order, or a function of
  the instruction). A computing instruction starts when its lane is free and every buffer it
  reads is there, and occupies its lane for its duration. A SEND starts when its buffer exists
  and its channel (kind, source lane, destination lane; ``channels`` may map several onto one)
  is free, and occupies the channel, not a lane; the RECV that follows on the destination holds
  that lane until the buffer has arrived, as a device that runs its queue in order waits for an
  input. With ``host_cost`` (seconds per op, or a mapping per lane: ``HostCosts.lane_costs``;
  ops not in it cost the host nothing; a SEND between stages costs what its source or
  destination lane's SEND costs, the more, times its stage edge's ``send_factors``, either
  way; one from the host lane what the host lane's costs) one host thread
  issues the instructions one after another in program order, and none starts before it is
  issued; with ``cores`` the computing instructions and the issuing thread share that many
  cores (forced CPU devices): an instruction of a stage over k devices (``stage_devices``)
  runs on k device threads and holds min(k, cores) of them. The result's actions are the F,
  B, W and UPDATE instructions, its transfers the SENDs; memory as ``passes.simulation
  .simulate_times`` describes. The executor puts consecutive transfers between stages together
  (``ir.program.puts_together``, by destination); with ``send_extra`` (``HostCosts
  .send_extra``) the host pays for such a group at its first SEND, a lone put plus
  ``send_extra`` of one for each other array, and issues the others with it (without it,
  each SEND is a lone put).

  ``processes``: per lane, the processes that issue its instructions (several processes,
  ``HostCosts.lane_processes``): each process has an issuing thread of its own; an
  instruction is issued by each of its lane's processes (a SEND by those of both its ends)
  and starts once all have issued it. ``cores`` are then what all processes' computations
  and threads share (processes on one machine share its cores: how many compute at full
  speed at once is measured across them). None: one thread issues everything.
  """
  S = program.num_stages
  instrs = program.instrs
  if callable(durations):
    durations = [durations(i) for i in instrs]
  if len(durations) != len(instrs):
    raise ValueError(f"{len(durations)} durations for {len(instrs)} instructions")
  stat = list(static_memory) if static_memory is not None else [0.0] * S
  actm = list(activation_memory) if activation_memory is not None else [0.0] * S
  devs = tuple(tuple(d) for d in stage_devices) if stage_devices is not None else ((),) * S
  ready = [0.0] * len(program.buffers)
  # Lanes on the same devices (``Program.places``) run one instruction at a time between them.
  place = list(program.places) if program.places is not None else list(range(program.num_lanes))
  lane_free = [0.0] * (max(place) + 1)
  chan_free: dict[Any, float] = defaultdict(float)
  chan_of = dict(channels or {})
  core_free = [0.0] * cores if cores else None
  # Cores an instruction of each lane holds: its stage's devices (the host lane: one).
  widths = [
    max(1, min(len(devs[lane]) if lane < S else 1, cores or 1)) for lane in range(program.num_lanes)
  ]
  issuers = [tuple(p) for p in processes] if processes is not None else None
  if issuers is not None and len(issuers) != program.num_lanes:
    raise ValueError(f"processes for {len(issuers)} lanes, not {program.num_lanes}")
  # Each process's issuing thread's clock (one process: one thread issues everything).
  host_clock = [0.0] * (1 + max((max(p) for p in issuers or () if p), default=0))
  one = (0,)
  if host_cost is None or isinstance(host_cost, Mapping):
    lane_host = [host_cost or {}] * program.num_lanes
  else:
    lane_host = list(host_cost)
    if len(lane_host) != program.num_lanes:
      raise ValueError(f"host costs for {len(lane_host)} lanes, not {program.num_lanes}")
  hosted = any(lane_host)
  # Puts issued together: the host's cost of each SEND as a share of a lone put's.
  share: dict[int, float] = {}
  if hosted and send_extra is not None:

    def where(k: int) -> Any:
      i = instrs[k]
      if i.op is not Op.SEND or i.lane == program.host or place[i.lane] == place[i.peer]:
        return None
      return (i.peer, i.arg if len(devs[i.peer]) > 1 else None)

    for members in puts_together(instrs, where):
      share[members[0]] = 1.0 + (len(members) - 1) * send_extra
      share.update(dict.fromkeys(members[1:], 0.0))
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
      kind = kinds.get(i.arg, i.arg)
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
  return _result(program.name, S, num_microbatches, actions, transfers, stat, actm, devs)


def _result(name, S, M, actions, transfers, stat, actm, devs) -> SimResult:
  busy = [0.0] * S
  for at in actions:
    if at.kind in ("F", "B", "W", "STEP"):
      busy[at.stage] += at.end - at.start
  T = max((a.end for a in actions), default=0.0)
  peak = _peaks(actions, S, any(a.kind == "W" for a in actions))
  return _summary(name, S, M, T, actions, transfers, busy, peak, stat, actm, devs)


def _summary(name, S, M, T, actions, transfers, busy, peak, stat, actm, devs) -> SimResult:
  """The SimResult of a timeline: ``T`` its end, ``busy`` seconds of F, B, W (or STEP) per
  stage, ``peak`` per stage the most micro-batches whose stashes it holds at once
  (``_peaks``)."""
  mem = [stat[s] + peak[s] * actm[s] for s in range(S)]
  per_dev: dict[int, float] = {}  # a device holding several stages holds all of their memory
  for s in range(S):
    for d in devs[s]:
      per_dev[d] = per_dev.get(d, 0.0) + mem[s]
  return SimResult(
    schedule=name,
    num_stages=S,
    num_microbatches=M,
    iteration_time=T,
    actions=tuple(actions),
    transfers=tuple(transfers),
    busy=tuple(busy),
    bubble=tuple((1.0 - b / T) if T > 0 else 0.0 for b in busy),
    peak_in_flight=tuple(peak),
    stage_memory=tuple(mem),
    stage_devices=devs,
    peak_memory=per_dev,
  )


def split_backward(
  schedule: Schedule, backward: Sequence[float], weight_fraction: Sequence[float]
) -> tuple[list[float], list[float] | None]:
  """Per-stage (B, W) seconds: the whole backward and no W unless the schedule has W actions;
  then W is ``weight_fraction`` of the backward and B the rest."""
  if not schedule.splits_backward:
    return list(backward), None
  weight = [b * f for b, f in zip(backward, weight_fraction)]
  return [b - w for b, w in zip(backward, weight)], weight


@dataclasses.dataclass(frozen=True)
class PlanTimes:
  """A plan's times, transfers and memory as the simulator takes them (``plan_times``): what
  ``passes.simulation.simulate`` times the plan's schedule (``simulate_times``' keywords) or
  its compiled step's program (``simulate_step``) with.

  Attributes:
    costs: the plan's costs (``plan_costs``); under the host-aware model with each stage's
      forward and backward seconds over its devices and its UPDATE seconds as the host prices
      them (``_spmd_times``, ``_host_updates``).
    backward, weight: per stage, seconds of a B and of a W (``split_backward``: no W unless
      the schedule splits the backward); under the host-aware model with the gradients'
      all-reduce where each backward pays it.
    static_memory: per stage, bytes per device of its weights and optimizer state, with the
      older versions of its weights a stale-weight schedule keeps.
    stage_devices: the devices of each stage.
    channels: the channel each transfer between nodes queues on (``nic_channels``); None:
      each transfer has its own.
    host_cost: per lane, the host's seconds per op (``HostCosts.lane_costs``), or what the
      caller gave; None: nothing issues the program.
    send_factors: per stage edge, what a SEND along it costs to issue in lone SENDs
      (``HostCosts.send_factors``); None without a host.
    send_extra: ``HostCosts.send_extra`` (a compiled step's puts together); None without one.
    processes: per lane, the processes that issue it (``HostCosts.lane_processes``).
    outside: the host's seconds outside the program, added to the iteration time.
  """

  costs: PlanCosts
  backward: list[float]
  weight: list[float] | None
  static_memory: list[float]
  stage_devices: list[tuple[int, ...]]
  channels: dict[tuple[str, int, int], Any] | None
  host_cost: Any
  send_factors: dict[tuple[int, int], float] | None
  send_extra: float | None
  processes: Any
  outside: float


def plan_times(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  schedule: Schedule,
  delays: Sequence[int] | None,
  *,
  cost_model: CostModel | None = None,
  costs: LayerCosts | None = None,
  shared_nic: bool = False,
  step: bool = False,
  host_cost: Mapping[Op, float] | None = None,
  host: Any = None,
) -> PlanTimes:
  """Plan + LayerGraph + Cluster + the plan's schedule -> the plan's ``PlanTimes``: its costs
  under the cost model, or under the host-aware one (``host``, the machine's ``cost.host
  .HostCosts``: a stage over k devices computes 1/k of its one-device time times the SPMD
  factor for k, ``spmd_factor``, or in its layers' times measured over k devices where the
  graph has them, ``measured_width_times``; the gradients' all-reduce and the update as
  ``_host_updates`` prices them; the host's issue costs per op, for the schedule's lowering or,
  with ``step``, for a compiled step's program, and its time outside the program).

  When the schedule has W actions, each stage's backward is split into B and W by the cost
  model's ``weight_fraction``. ``delays``: per stage, the older versions of its weights the
  schedule keeps (a stale-weight schedule's ``passes.weight_versions.weight_delays``; None
  for a synchronous one), counted in its static memory. ``shared_nic=True`` makes the
  transfers that cross nodes into one node queue on that node's one inbound interface
  (``nic_channels``). ``host_cost``: the host's seconds per op without a ``host``."""
  if schedule.num_stages != plan.num_stages:
    raise ValueError(
      f"the schedule has {schedule.num_stages} stages but the plan "
      f"{plan.num_stages}; build the schedule from this plan"
    )
  costs = costs or layer_costs(layer_graph)
  pc = plan_costs(plan, layer_graph, cluster, cost_model, costs)
  outside = 0.0
  processes = None
  wide: dict[int, tuple[float, float]] = {}
  if host is not None:
    processes = host.lane_processes([s.devices for s in plan.stages], cluster.num_devices)
    host_cost = host.lane_costs([len(s.devices) for s in plan.stages], schedule=not step)
    outside = host.outside
    wide = measured_width_times(plan, layer_graph, cluster, cost_model, costs)
    fw, bw = _spmd_times(plan, layer_graph, cluster, cost_model, costs, pc, host, wide=wide)
    pc = dataclasses.replace(pc, forward=fw, backward=bw)
  backward, weight = split_backward(schedule, pc.backward, pc.weight_fraction)
  if host is not None:  # the gradients' all-reduce in each backward; the step's own update
    # Stages whose rows sum their own gradients reduce them once, in the UPDATE
    # (``passes.staging.row_local_functions``; not where the backward is split).
    once = bool(layer_graph.graph.get("reduce_once")) and weight is None
    per_call, update = _host_updates(
      plan, pc, layer_graph, cluster, cost_model, host, wide, reduce_once=once
    )
    grads = weight if weight is not None else backward
    for i, t in enumerate(per_call):
      grads[i] += t
    pc = dataclasses.replace(pc, update=update)
  static = list(pc.static_memory)
  if delays is not None:
    static = [m + d * p for m, d, p in zip(static, delays, pc.param_bytes)]
  return PlanTimes(
    costs=pc,
    backward=backward,
    weight=weight,
    static_memory=static,
    stage_devices=[s.devices for s in plan.stages],
    channels=nic_channels(plan, cluster) if shared_nic else None,
    host_cost=host_cost,
    send_factors=host.send_factors(pc.edge_arrays) if host is not None else None,
    send_extra=host.send_extra if host is not None else None,
    processes=processes,
    outside=outside,
  )


def simulate_step(
  program: Program,
  plan,
  cluster: Cluster,
  times: PlanTimes,
  *,
  num_microbatches: int,
  cores: int | None = None,
) -> SimResult:
  """The lowered program of a plan's compiled step (``GraphPipeline.program``, the one the
  executor runs) timed with the plan's ``times`` (``plan_times(step=True)``): each of its
  transfers between stages costs its bytes over the link between their devices
  (``step_durations``), the host issues it at ``times.host_cost`` with ``cores`` compute
  servers as ``simulate_program`` takes them, and the host's time outside the program is added
  to the iteration time. Memory is the program's own (``cost.memory``: its buffers' sizes and
  lifetimes, without the executables' temporaries), not the cost model's."""
  pc = times.costs
  durations = step_durations(program, plan, cluster, pc, times.backward, times.weight)
  lanes = [tuple(s.devices) for s in plan.stages] + [()]
  mem = program_memory(program, lanes)
  stage_memory = tuple(
    float(max((mem.peak.get(d, 0) for d in s.devices), default=0)) for s in plan.stages
  )
  peak = {int(d): float(n) for d, n in mem.peak.items()}  # type: ignore[call-overload]
  res = simulate_program(
    program,
    durations,
    host_cost=times.host_cost,
    send_extra=times.send_extra,
    cores=cores,
    channels=times.channels,
    static_memory=times.static_memory,
    activation_memory=pc.activation_memory,
    stage_devices=times.stage_devices,
    num_microbatches=num_microbatches,
    processes=times.processes,
  )
  return dataclasses.replace(
    res,
    stage_memory=stage_memory,
    peak_memory=peak,
    iteration_time=res.iteration_time + times.outside,
  )


def _model_or_probe(
  layer_graph: nx.DiGraph,
  key: str,
  k: int,
  probe_at: Callable[[int], float | None],
  like_model: bool,
  floor: float,
) -> float | None:
  """What a computation over ``k`` devices costs by the measure ``key`` of the layer graph
  (``"spmd"``, ``"spmd_call"``): the model's own where the trial timed its step over ``k``
  devices, else the host's probe (``probe_at(k)``); with ``like_model``, at a width the trial
  did not time, the probe's value times the model's own over the probe's at the widest width
  the trial timed (at least ``floor``)."""
  timed = layer_graph.graph.get(key, {})  # string keys: the graph goes to JSON
  own = timed.get(str(k))
  if own is not None:
    return float(own)
  probe = probe_at(k)
  wide = [int(x) for x in timed if int(x) > 1]  # one device's is no SPMD measure
  if not like_model or probe is None or not wide:
    return probe
  w = max(wide)
  at_w = probe_at(w)
  return max(floor, probe * float(timed[str(w)]) / at_w) if at_w else probe


def spmd_factor(
  host: Any, layer_graph: nx.DiGraph, k: int, like_model: bool = False
) -> float | None:
  """The SPMD factor of a computation over ``k`` devices: the model's own where its step over
  ``k`` devices was timed (``layer_graph.graph["spmd"]``, set by the training program's trial
  of jit data parallel), else the host's probe (``HostCosts.spmd_factor``); None where neither
  says. ``like_model`` (a whole step over k devices, as the trial's): at a width the trial did
  not time, the probe's factor times the model's own over the probe's at the widest width
  the trial timed, at least 1 (tiny MMT on 4 forced CPU devices: 7.1 against the probe's 2.2,
  so its step over 2 devices, which the probe puts at 1.4, measured twice plain jit's time)."""
  probe_at = host.spmd_factor if host is not None else (lambda _: None)
  return _model_or_probe(layer_graph, "spmd", k, probe_at, like_model, 1.0)


def spmd_call(host: Any, layer_graph: nx.DiGraph, k: int, like_model: bool = False) -> float:
  """The fixed seconds of one computation over ``k`` devices, whatever its size: the model's
  own where its step over ``k`` devices was timed (``layer_graph.graph["spmd_call"]``, set
  with its factor by the trial of jit data parallel, and for one device with the fusion by
  the trials of plain jit and the step in micro-batches, ``runtime.compile
  .calibrate_fusion``), else the host's probe (``HostCosts.spmd_call_seconds``; 0 for one
  device, without a host or where not measured); ``like_model`` as ``spmd_factor`` takes
  it."""
  if host is None:
    return 0.0
  if k <= 1:
    return float(layer_graph.graph.get("spmd_call", {}).get("1", 0.0))
  v = _model_or_probe(layer_graph, "spmd_call", k, host.spmd_call_seconds, like_model, 0.0)
  return 0.0 if v is None else v


def _narrow(plan):
  """``plan`` with every stage on its first device only."""
  return plan.replace(
    stages=tuple(dataclasses.replace(s, devices=s.devices[:1]) for s in plan.stages)
  )


def measured_width_times(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  cost_model: Any = None,
  costs: LayerCosts | None = None,
) -> dict[int, tuple[float, float]]:
  """Per stage over k > 1 devices whose layers were all timed as a stage over k devices runs
  them (``ir.layer_graph.widths_measured``, ``runtime.compile.calibrate_widths``): its
  (forward, backward) seconds per micro-batch, those times summed and scaled to its
  micro-batch as one-device times are (``plan_costs`` of ``LayerCosts.at_width``; ``costs``,
  the graph's, keeps them between calls). They hold what the layers pay over k devices (the
  split work, the devices' sharing of the host's cores, each op's cost on every device, the
  gradients' all-reduce in the backward), which the SPMD factor only guesses. A layer timed
  alone paid an all-reduce of its own; the times leave its fixed seconds out, and a stage with
  parameters pays them once per backward (``graph.graph["allreduce_call_at"]``, measured with
  the layers: XLA combines a stage's all-reduces into one)."""
  costs = costs or layer_costs(layer_graph)
  if not costs.time_at:
    return {}
  by_width: dict[int, list[int]] = {}
  for s in plan.stages:
    k = len(s.devices)
    if k > 1 and costs.timed_at(k, [costs.index[n] for n in s.layers]):
      by_width.setdefault(k, []).append(s.index)
  out: dict[int, tuple[float, float]] = {}
  allreduce = layer_graph.graph.get("allreduce_call_at", {})
  for k, stages in by_width.items():
    pc = plan_costs(_narrow(plan), layer_graph, cluster, cost_model, costs.at_width(k))
    once = float(allreduce.get(str(k), 0.0))
    for i in stages:
      out[i] = (float(pc.forward[i]), float(pc.backward[i]) + (once if pc.param_bytes[i] else 0.0))
  return out


def _spmd_times(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  cost_model: Any,
  costs: Any,
  pc: Any,
  host: Any,
  per_call: bool = True,
  like_model: bool = False,
  wide: Mapping[int, tuple[float, float]] | None = None,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per stage (forward, backward) seconds under the host-aware model: a stage in ``wide``
  (``measured_width_times``) takes its measured times; another stage over k > 1 devices
  computes 1/k of its micro-batch's one-device time times the SPMD factor for k
  (``spmd_factor``, measured against that same 1/k: it includes the devices' smaller shares
  and their sharing of the cores), and each of its forwards and backwards, one sharded call
  each, pays the host's fixed seconds per call over k devices (``HostCosts
  .spmd_call_seconds``); other stages, and widths not measured, as ``pc`` has them (the cost
  model's time of each device's share). ``per_call=False`` leaves the fixed seconds out;
  ``like_model`` as ``spmd_factor`` takes it."""
  wide = wide or {}
  factors = {
    s.index: spmd_factor(host, layer_graph, len(s.devices), like_model)
    for s in plan.stages
    if len(s.devices) > 1 and s.index not in wide
  }
  factors = {i: f for i, f in factors.items() if f is not None}
  if not factors and not wide:
    return tuple(pc.forward), tuple(pc.backward)
  fw, bw = list(pc.forward), list(pc.backward)
  for i, (tf, tb) in wide.items():
    fw[i], bw[i] = tf, tb
  if not factors:
    return tuple(fw), tuple(bw)
  one = plan_costs(_narrow(plan), layer_graph, cluster, cost_model, costs)
  for i, f in factors.items():
    k = len(plan.stages[i].devices)
    call = host.spmd_call_seconds(k) if per_call else 0.0
    fw[i] = one.forward[i] / k * f + call
    bw[i] = one.backward[i] / k * f + call
  return tuple(fw), tuple(bw)


def _host_updates(
  plan,
  pc: Any,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  cost_model: CostModel | None,
  host: Any,
  inside: Collection[int] = (),
  reduce_once: bool = False,
) -> tuple[list[float], tuple[float, ...]]:
  """Per stage, under the host-aware model: the seconds each of its backward calls pays for
  all-reducing its gradients, and its UPDATE seconds.

  Where the host measured what the all-reduce costs (``HostCosts.allreduce``), a stage over
  k > 1 devices pays it in every backward (the executor's stage all-reduces its gradients in
  each, ``runtime.placement.StagePlacement``) and its UPDATE leaves out the cost model's
  all-reduce once per step; a stage in ``inside`` (its backward's measured time holds the
  all-reduce, ``measured_width_times``) pays nothing more in the backward and none in the
  UPDATE either; other stages keep the all-reduce in the UPDATE. The update itself is the
  step's own, timed (``layer_graph.graph["update_per_byte"]``, ``passes.calibrate
  .measure_update``), where measured, else the cost model's. Without either measurement these
  are ``pc``'s UPDATE seconds and no all-reduce in the backward. Zeroing the stage's gradient
  sums, once per step (the program's ZERO), is paid with the UPDATE where the layers' timing
  measured it (``layer_graph.graph["zero_per_byte"]``, seconds per parameter byte)."""
  cm = cost_model or DEFAULT_COST_MODEL
  per_byte = layer_graph.graph.get("update_per_byte")
  zero = float(layer_graph.graph.get("zero_per_byte", 0.0))
  per_call: list[float] = []
  update: list[float] = []
  for s in plan.stages:
    i, k, nbytes = s.index, len(s.devices), pc.param_bytes[s.index]
    if i in inside:
      t: float | None = 0.0
    else:
      t = host.allreduce_seconds(k, nbytes) if k > 1 and host.allreduce else None
    if t is not None and reduce_once and i not in inside:  # paid once, with the UPDATE
      link = cluster.group_link(s.devices)
      update.append(cm.update_time(nbytes, cluster.device, 1, link, per_byte) + t + zero * nbytes)
      per_call.append(0.0)
      continue
    per_call.append(0.0 if t is None else float(t))
    if t is None and per_byte is None:
      update.append(pc.update[i] + zero * nbytes)
      continue
    n = k if t is None else 1  # the all-reduce stays in the UPDATE, or is paid elsewhere
    link = cluster.group_link(s.devices)
    update.append(cm.update_time(nbytes, cluster.device, n, link, per_byte) + zero * nbytes)
  return per_call, tuple(update)


def predict_fused(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  host: Any = None,
  cost_model: CostModel | None = None,
) -> float:
  """Seconds of a one-stage plan's step, run as one jitted function (``runtime.fused``): its M
  micro-batches' forwards and backwards (on k devices each computes 1/k of a micro-batch; with
  ``host``, 1/k of the one-device time times the SPMD factor for k, ``spmd_factor`` with
  ``like_model``: a step like the trial's, plus the fixed seconds of a computation over k
  devices, ``spmd_call`` with ``like_model``, per micro-batch: each micro-batch of the step's
  loop is a sharded computation of its own, with its collectives; where no factor is
  measured, the share's time times k over the devices that compute at once), the gradient
  all-reduce and update (where the host measured the all-reduce, ``HostCosts.allreduce``, it
  is paid by every micro-batch's backward instead; the update is the step's own where timed,
  ``_host_updates``), and the host's issue and time outside the step."""
  if plan.num_stages != 1:
    raise ValueError(f"predict_fused takes a one-stage plan, not {plan.num_stages} stages")
  pc = plan_costs(plan, layer_graph, cluster, cost_model)
  k = len(plan.stages[0].devices)
  fw, bw, slowdown, call = pc.forward, pc.backward, 1.0, 0.0
  if host is not None and spmd_factor(host, layer_graph, k) is not None:
    fw, bw = _spmd_times(
      plan, layer_graph, cluster, cost_model, None, pc, host, per_call=False, like_model=True
    )
    call = spmd_call(host, layer_graph, k, like_model=True)
  elif host is not None and host.compute_servers():  # not measured: k over the servers
    slowdown = k / min(host.compute_servers(), k)
  update = pc.update[0]
  if host is not None:  # each micro-batch's backward all-reduces the gradients
    per_call, updates = _host_updates(plan, pc, layer_graph, cluster, cost_model, host)
    call += per_call[0]
    update = updates[0]
  compute = plan.num_microbatches * ((fw[0] + bw[0]) * slowdown + call)
  issue = host.per_op.get("STEP", host.per_op.get("F", 0.0)) + host.outside if host else 0.0
  return compute + update + issue


def fused_times(layer_graph: nx.DiGraph) -> nx.DiGraph:
  """``layer_graph`` with its layer times scaled by what XLA makes of the whole step where it
  was measured (``graph.graph["fusion"]``, ``runtime.compile.calibrate_fusion``): the times
  of a one-stage plan compiled as one program. Layers' times measured over several devices
  (``time_f_at`` / ``time_b_at``) are left as measured. The graph itself where none."""
  factor = layer_graph.graph.get("fusion")
  if factor is None:
    return layer_graph
  out = layer_graph.copy()
  for n in out:
    for k in ("time_f", "time_b"):
      if out.nodes[n].get(k) is not None:
        out.nodes[n][k] = out.nodes[n][k] * factor
  out.graph.pop("fusion", None)  # applied
  return out


def step_durations(
  program: Program,
  plan,
  cluster: Cluster,
  pc: Any,
  backward: Sequence[float],
  weight: Sequence[float] | None,
) -> list[float]:
  """Seconds of each instruction of a compiled step's program under the cost model: F, B, W
  and UPDATE as for the schedule (``plan_costs``); a SEND between stages its buffer's bytes
  over their link (nothing from the host lane, whose puts the device-only model leaves out);
  a fused step M forwards and backwards and the update; the rest nothing."""
  S = program.num_stages
  devs = [plan.stages[s].devices for s in range(min(S, plan.num_stages))]
  out = []
  for i in program.instrs:
    op = i.op
    if op is Op.F:
      out.append(float(pc.forward[i.stage]))
    elif op is Op.B:
      out.append(float(backward[i.stage]))
    elif op is Op.W:
      out.append(float(weight[i.stage]) if weight is not None else 0.0)
    elif op is Op.UPDATE:
      out.append(float(pc.update[i.stage]))
    elif op is Op.STEP:
      M = plan.num_microbatches
      out.append(M * float(pc.forward[0] + pc.backward[0]) + float(pc.update[0]))
    elif op is Op.SEND and i.lane < S and i.peer < S:
      nbytes = max(program.buffers[i.writes[0]].nbytes, 0)
      link = cluster.link_between(devs[i.lane], devs[i.peer])
      out.append(link.time(nbytes) if set(devs[i.lane]) != set(devs[i.peer]) else 0.0)
    else:
      out.append(0.0)
  return out


def nic_channels(plan, cluster: Cluster) -> dict[tuple[str, int, int], Any]:
  """Transfers between stages on different nodes -> the inbound interface of the receiving
  stage's node (its first device's), for ``passes.simulation.simulate_times(channels=...)``."""
  out: dict[tuple[str, int, int], Any] = {}
  node = [cluster.node_of(s.devices[0]) if s.devices else 0 for s in plan.stages]
  for i, j in plan.edges:
    devs_i, devs_j = plan.stages[i].devices, plan.stages[j].devices
    if cluster.link_between(devs_i, devs_j) is cluster.intra_link:
      continue
    out[("activation", i, j)] = ("nic-in", node[j])
    out[("cotangent", j, i)] = ("nic-in", node[i])
  return out


def chrome_trace(result: SimResult) -> dict[str, Any]:
  """A SimResult as a Chrome / Perfetto trace (``traceEvents``, times in microseconds)."""
  ev: list[dict[str, Any]] = []
  for s in range(result.num_stages):
    devs = result.stage_devices[s] if result.stage_devices else ()
    label = f"stage {s}" + (f" (devices {','.join(map(str, devs))})" if devs else "")
    ev.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": label}})
    ev.append({"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}})
    ev.append({"ph": "M", "name": "thread_name", "pid": s, "tid": 0, "args": {"name": "compute"}})
  links = result.num_stages
  ev.append({"ph": "M", "name": "process_name", "pid": links, "args": {"name": "transfers"}})
  colors = {"F": "good", "B": "bad", "W": "terrible", "UPDATE": "generic_work", "STEP": "good"}
  for a in result.actions:
    name = f"{a.kind}{a.stage}" if a.kind == "UPDATE" else f"{a.kind}{a.stage}.{a.microbatch}"
    ev.append(
      {
        "ph": "X",
        "name": name,
        "cat": a.kind,
        "pid": a.stage,
        "tid": 0,
        "ts": a.start * 1e6,
        "dur": (a.end - a.start) * 1e6,
        "cname": colors[a.kind],
        "args": {"microbatch": a.microbatch},
      }
    )
  chans: dict[tuple[str, int, int], int] = {}
  for t in result.transfers:
    if t.end <= t.start:
      continue
    tid = chans.setdefault((t.kind, t.src, t.dst), len(chans))
    ev.append(
      {
        "ph": "X",
        "name": f"{'act' if t.kind == 'activation' else 'cot'} {t.src}->{t.dst} m{t.microbatch}",
        "cat": t.kind,
        "pid": links,
        "tid": tid,
        "ts": t.start * 1e6,
        "dur": (t.end - t.start) * 1e6,
      }
    )
  for (kind, src, dst), tid in chans.items():
    ev.append(
      {
        "ph": "M",
        "name": "thread_name",
        "pid": links,
        "tid": tid,
        "args": {"name": f"{kind} {src}->{dst}"},
      }
    )
  return {
    "traceEvents": ev,
    "displayTimeUnit": "ms",
    "otherData": {"schedule": result.schedule, "iteration_time_s": result.iteration_time},
  }


def write_chrome_trace(result: SimResult, path: str) -> None:
  """Writes ``result`` as a Chrome / Perfetto JSON trace (open in ui.perfetto.dev)."""
  with open(path, "w") as f:
    json.dump(chrome_trace(result), f)
