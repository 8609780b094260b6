"""Measured memory of a pipelined step, per device, beside the prediction.

A measuring step (``GraphPipeline.measure_memory``) runs the step's program one instruction at
a time, waiting for each, and at every instruction boundary (after it ran, before the buffers
it frees are dropped) adds up the bytes of every array JAX has alive on each device
(``jax.live_arrays``: not only the executor's own buffers, so an array kept by mistake shows
up), plus the temporaries of the executable that ran (``memory_analysis`` of its compiled
form). The peak per device is the largest sum; the breakdown at the peak sorts the arrays by
what holds them (the program's buffer kinds, ``cost.memory.CATEGORIES``; arrays the step does
not hold are "outside the step": the constants its executables keep among them, which the
prediction counts as "constants"). On GPU and TPU the device's own ``peak_bytes_in_use`` is
kept beside it. The prediction is ``cost.memory.program_memory`` of the same program.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from gpp_jax.cost.memory import CATEGORIES

OUTSIDE = "outside the step"
TEMPS = "temporaries"


def parse_bytes(value: int | float | str) -> int:
  """Bytes from a number or a string such as ``512MiB``, ``12GiB``, ``1.5GB``, ``800k``."""
  if isinstance(value, (int, float)):
    if value <= 0:
      raise ValueError(f"a memory size must be positive, got {value}")
    return int(value)
  units = {
    "": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
    "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40,
  }  # fmt: skip
  text = str(value).strip().lower().replace(" ", "")
  number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
  unit = text[len(number) :]
  try:
    n = float(number)
  except ValueError:
    n = -1.0
  if unit not in units or n <= 0:
    raise ValueError(
      f"cannot read the memory size {value!r}; give bytes or a number with a unit such as "
      "512MiB, 12GiB or 2GB"
    )
  return int(n * units[unit])


def device_bytes(x: jax.Array) -> dict[Any, int]:
  """Bytes ``x`` holds on each of this process's devices."""
  sharding = x.sharding
  shard = sharding.shard_shape(x.shape)
  nbytes = int(np.prod(shard, dtype=np.int64)) * x.dtype.itemsize
  me = jax.process_index()
  return {d: nbytes for d in sharding.device_set if getattr(d, "process_index", me) == me}


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """One device's peak: measured, predicted, and what held the bytes."""

  device: str
  measured_peak_bytes: int
  predicted_peak_bytes: int
  breakdown: Mapping[str, int]
  predicted_breakdown: Mapping[str, int]
  peak_bytes_in_use: int | None = None  # the device's own counter (GPU/TPU)

  @property
  def error(self) -> float:
    """Predicted / measured - 1."""
    return self.predicted_peak_bytes / max(self.measured_peak_bytes, 1) - 1.0

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Peak memory per device of one measured step (``GraphPipeline.measure_memory``)."""

  devices: tuple[DeviceMemory, ...]
  counters: Mapping[str, Sequence[tuple[float, int]]] = dataclasses.field(
    default_factory=dict
  )  # device -> (seconds from the step's start, bytes) at each instruction boundary

  def to_json(self) -> str:
    return json.dumps([d.to_dict() for d in self.devices], indent=1)

  def __str__(self) -> str:
    rows = [
      f"{'device':>10s} {'measured MiB':>13s} {'predicted MiB':>14s} {'error':>7s}  biggest",
    ]
    for d in self.devices:
      big = max(d.breakdown.items(), key=lambda kv: kv[1], default=("-", 0))
      rows.append(
        f"{d.device:>10s} {d.measured_peak_bytes / 2**20:13.3f} "
        f"{d.predicted_peak_bytes / 2**20:14.3f} {d.error:+7.1%}  {big[0]} "
        f"{big[1] / 2**20:.3f} MiB"
      )
    return "\n".join(rows)


class Census:
  """Counts live arrays per device at instruction boundaries and keeps each device's peak."""

  def __init__(self, executor: Any, kinds: Mapping[int, str]):
    self.ex = executor
    self.kinds = kinds  # buffer -> kind, where the program's own differs
    self.peak: dict[Any, int] = {}
    self.breakdown: dict[Any, dict[str, int]] = {}
    self.counters: dict[Any, list[tuple[float, int]]] = {}

  def _owners(self) -> dict[int, str]:
    """id of each array the step's buffers hold -> its category."""
    owners: dict[int, str] = {}
    P = self.ex.program
    # The stages' buffers first: an argument already placed is the same array on its lane.
    order = sorted(range(len(P.buffers)), key=lambda b: P.buffers[b].lane == P.host)
    for b in order:
      lst, i = self.ex.where[b]
      value = lst[i]
      if value is None:
        continue
      category = CATEGORIES.get(self.kinds.get(b, P.buffers[b].kind), "other")
      for x in jax.tree.leaves(value):
        owners.setdefault(id(x), category)
    return owners

  def count(self, t: float, temps: Mapping[Any, int]) -> None:
    owners = self._owners()
    per: dict[Any, dict[str, int]] = {}
    for x in jax.live_arrays():
      if x.is_deleted():
        continue
      category = owners.get(id(x), OUTSIDE)
      for d, n in device_bytes(x).items():
        per.setdefault(d, {})
        per[d][category] = per[d].get(category, 0) + n
    for d, n in temps.items():
      per.setdefault(d, {})
      per[d][TEMPS] = per[d].get(TEMPS, 0) + n
    for d, cats in per.items():
      total = sum(cats.values())
      self.counters.setdefault(d, []).append((t, total))
      if total > self.peak.get(d, -1):
        self.peak[d], self.breakdown[d] = total, cats


def executable_temps(call: Any, cache: dict) -> int:
  """Temporaries (bytes per device) of the executable an instruction's call runs, if known."""
  kernel = getattr(call, "kernel", None)
  if kernel is None:
    return 0
  fn, args = kernel
  values = args()
  key = (id(fn), str(jax.tree.structure(values)), tuple(_sig(x) for x in jax.tree.leaves(values)))
  if key not in cache:
    try:
      cache[key] = int(fn.lower(*values).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # an executable without memory statistics: counted as none
      cache[key] = 0
  return cache[key]


def _sig(x) -> tuple:
  return (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))


def report(
  census: Census,
  predicted: Any,
  device_names: Mapping[Hashable, str] | None = None,
) -> MemoryReport:
  """The measured census beside ``cost.memory.program_memory``'s prediction."""
  out = []
  here = jax.process_index()
  for d in sorted(census.peak, key=lambda d: getattr(d, "id", 0)):
    if getattr(d, "process_index", here) != here:  # another process's: measured there
      continue
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    out.append(
      DeviceMemory(
        device=str(d),
        measured_peak_bytes=int(census.peak[d]),
        predicted_peak_bytes=int(predicted.peak.get(d, 0)),
        breakdown=dict(census.breakdown[d]),
        predicted_breakdown=dict(predicted.breakdown.get(d, {})),
        peak_bytes_in_use=None if not stats else stats.get("peak_bytes_in_use"),
      )
    )
  counters = {str(d): tuple(v) for d, v in census.counters.items()}
  return MemoryReport(tuple(out), counters)
