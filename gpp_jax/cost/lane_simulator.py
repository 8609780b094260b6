"""The devices-only model the planners search with: a schedule timed on its lanes, without
lowering it (``simulate_lanes``; no host issuing the program, no cores shared, every transfer
on a channel of its own)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

from gpp_jax.cost.sim_result import ActionTime, SimResult, Timed, TransferTime, _peaks, _summary
from gpp_jax.cost.stage_times import StageTimes
from gpp_jax.ir.schedule import Action, Schedule, chunk_range, lanes_with_updates


def simulate_lanes(
  schedule: Schedule, times: StageTimes, *, timeline: bool = True
) -> SimResult | None:
  """Schedule + its stages' times -> SimResult under the devices-only model the planners
  search with (no host issuing the program, no cores shared, every transfer on a channel of
  its own, no stages sharing devices), computed on the schedule itself without lowering it
  (``_simulate_lanes``): the times of its lowered program (``cost.simulator
  .simulate_lowered``; the tests hold the two equal). None when the lanes deadlock: the
  schedule's lowering names the deadlock. ``timeline=False`` leaves the result's actions and
  transfers empty. ``passes.simulation.simulate_times`` calls this where the model
  applies."""
  if schedule.shares_devices:
    raise ValueError(
      f"stages of schedule {schedule.name!r} share devices: time its lowered program "
      "(simulate_lowered)"
    )
  timed = _simulate_lanes(schedule, times, timeline)
  if timed is None:
    return None
  return _summary(schedule.name, schedule.num_microbatches, timed, times.memory)


def _stage_times(
  times: Any, S: int, lengths: Sequence[int]
) -> tuple[list[list[float]], list[float]]:
  """Per stage (each a ``cost.stage_times.Times``), the seconds of each of its micro-batches'
  actions, and the shortest of them (NaN where one is NaN, inf where there are none)."""
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


def _wiring(
  facts: _LaneFacts,
  S: int,
  act_x: Mapping[tuple[int, int], float],
  cot_x: Mapping[tuple[int, int], float],
) -> tuple[list, list, list, list]:
  """``_simulate_lanes``' arrivals, per stage: what its F and B wait for ((arrivals, the
  chunks per micro-batch or None for the same micro-batch)), and what they send ((arrivals,
  channel, seconds, receiver)). Per edge (u, v) the arrivals are when each chunk's activation
  reaches v (indexed by u's chunks) and each cotangent reaches u (by v's chunks), None until
  sent; channel c carries edge c's activations, E + c its cotangents."""
  lengths, edges, chunks = facts.lengths, facts.edges, facts.chunks
  act = {e: [None] * lengths[e[0]] for e in edges}
  cot = {e: [None] * lengths[e[1]] for e in edges}
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
  return f_in, b_in, f_out, b_out


def _simulate_lanes(
  sched: Schedule, times: StageTimes, timeline: bool = True, record: bool = False
) -> Timed | None:
  """What ``simulate_program`` finds for the schedule's lowered program when no host issues
  it and every transfer has its own channel, computed on the schedule itself: the planners
  simulate hundreds of candidate schedules, and lowering each into buffers and instructions
  cost most of their search. One pass in the dispatch order (``ir.schedule.dispatch_order``,
  the order the lowering emits): an action starts when its lane is free and its inputs have
  arrived (a RECV holds its lane until then, which is the same), a transfer when its sender
  has finished and its channel (kind, sender, receiver) is free. The actions and transfers
  come out in the program's order; ``tests/test_simulator.py`` holds the two paths equal.
  Returns the ``Timed`` (its actions and transfers empty unless ``timeline``; peak stashes
  held per stage as ``_peaks`` counts them), or None when the lanes deadlock.

  Without a timeline, where no action lasts less than nothing (every duration >= 0, none
  NaN), each lane's actions end in lane order, so the iteration ends where the last lane
  does; and where every F of a stage lasts at least the spacing of floats at that end (an F
  ends after it starts), a stash freed before an F starts is one freed earlier in the lane, so
  the stage's peak is its peak in lane order (``_LaneFacts.peak``). Otherwise the pass
  records the timeline (as ``record`` asks) and counts both from it, as ``simulate_program``
  does."""
  S = sched.num_stages
  given = times.given(S)  # checks an entry per stage
  facts = _lane_facts(sched)
  if facts is None:
    return None
  lengths, edges = facts.lengths, facts.edges
  tf, f_low = _stage_times(times.forward, S, lengths)
  tb, b_low = _stage_times(times.backward, S, lengths)
  tw, w_low = _stage_times(times.weight, S, lengths)
  ups = [float(u) for u in given.update]
  lasting = all(t >= 0.0 for t in chain(f_low, b_low, w_low, ups))
  record = record or timeline or not lasting
  f_in, b_in, f_out, b_out = _wiring(facts, S, given.activation_transfer, given.cotangent_transfer)
  chan = [0.0] * (2 * len(edges))  # when each channel is free
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
      return Timed(last, [], [], busy, facts.peak)
    return _simulate_lanes(sched, times, False, True)
  last = max([0.0, *(a[4] for a in actions)])  # a NaN end is passed over (NaN > x is false)
  peak = _peaks(actions, S, facts.split_w)
  if not timeline:
    return Timed(last, [], [], busy, peak)
  new = tuple.__new__
  return Timed(
    last,
    [new(ActionTime, a) for a in actions],
    [new(TransferTime, t) for t in transfers],
    busy,
    peak,
  )
