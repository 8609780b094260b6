"""What a simulation returns: the timeline of a simulated schedule or program (``SimResult``,
each action's and transfer's start and end, the stages' busy time, bubble and memory), how
one is summed up from its actions (``Timed``, ``_summary``, ``_peaks``), and its Chrome /
Perfetto trace (``chrome_trace``, ``write_chrome_trace``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from gpp_jax.cost.stage_times import StageMemory
from gpp_jax.errors import counted
from gpp_jax.ir.program import Op
from gpp_jax.ir.schedule import Action


class ActionTime(NamedTuple):
  """When one action ran (a named tuple: planners build thousands per simulation)."""

  kind: str
  stage: int
  microbatch: int
  start: float
  end: float

  @property
  def action(self) -> Action:
    return Action(Op(self.kind), self.stage, self.microbatch)


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
      f"Simulated {self.schedule}: {counted(self.num_stages, 'stage')} x "
      f"{counted(self.num_microbatches, 'micro-batch', 'micro-batches')}, "
      f"iteration {self.iteration_time * 1e3:.3f} ms",
      f"{'stage':>5s} {'busy ms':>9s} {'bubble':>7s} {'in-flight':>9s} {'mem MiB':>9s}",
    ]
    for s in range(self.num_stages):
      rows.append(
        f"{s:5d} {self.busy[s] * 1e3:9.3f} {self.bubble[s]:7.1%} "
        f"{self.peak_in_flight[s]:9d} {self.stage_memory[s] / 2**20:9.1f}"
      )
    return "\n".join(rows)


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


class Timed(NamedTuple):
  """What a pass over a timeline found (``_summary`` sums it up into a SimResult).

  Attributes:
    iteration_time: the timeline's end.
    actions, transfers: its records (``ActionTime``, ``TransferTime``; empty where the caller
      asked for no timeline).
    busy: per stage, seconds of F, B, W (or STEP).
    peak: per stage, the most micro-batches whose stashes it holds at once (``_peaks``).
  """

  iteration_time: float
  actions: Sequence[ActionTime]
  transfers: Sequence[TransferTime]
  busy: Sequence[float]
  peak: Sequence[int]


def _summary(name: str, num_microbatches: int, timed: Timed, memory: StageMemory) -> SimResult:
  """The SimResult of a timeline of schedule or program ``name``: its stages' memory is their
  static memory plus the micro-batches they hold at once times the stashed bytes of one
  (``memory``, per device, summed over the stages a device holds)."""
  T, busy, peak = timed.iteration_time, timed.busy, timed.peak
  S = len(busy)
  stat, actm, devs = memory.per_stage(S)
  mem = [stat[s] + peak[s] * actm[s] for s in range(S)]
  per_dev: dict[int, float] = {}  # a device holding several stages holds all of their memory
  for s in range(S):
    for d in devs[s]:
      per_dev[d] = per_dev.get(d, 0.0) + mem[s]
  return SimResult(
    schedule=name,
    num_stages=S,
    num_microbatches=num_microbatches,
    iteration_time=T,
    actions=tuple(timed.actions),
    transfers=tuple(timed.transfers),
    busy=tuple(busy),
    bubble=tuple((1.0 - b / T) if T > 0 else 0.0 for b in busy),
    peak_in_flight=tuple(peak),
    stage_memory=tuple(mem),
    stage_devices=devs,
    peak_memory=per_dev,
  )


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
