"""The host of the machine a plan runs on: what issuing each instruction costs, measured.

The executor issues a step's program from one Python thread (``runtime.executor``). On a GPU
each issued computation then runs on its own device; on forced CPU devices, or processes
pinned to cores, the devices share the host's cores with each other and with the issuing
thread. Planners that ignore this pick plans whose predicted time is a fraction of what the
machine gives (BUILD_NOTES, "Plans for the machine at hand"). ``HostCosts`` holds what the
simulator needs to include the host, measured like the layer times:

* ``per_op``: seconds the thread spends issuing one instruction of each op (F, B, W, SEND, ...),
  the medians of a real pipeline's per-instruction timeline (``runtime.host.measure_host``);
* ``per_stage``: seconds per stage and step of the work a schedule-level program leaves out
  (parameter copies, packing, zeroed sums, batch chunks, gradient sums, the optimizer's pieces),
  added to each stage's UPDATE when a planner simulates a candidate from its schedule alone;
* ``outside``: seconds per call spent outside the program (the step's arguments flattened,
  NNX objects split and updated);
* ``parallel``: how many device computations run at full speed at once (forced CPU devices on
  a 2-core host whose XLA already uses both cores for one large computation: about 1), None
  for independent devices (accelerators);
* ``spmd`` and ``spmd_call``: one computation with its batch sharded over k devices, whose
  one-device time is t, takes ``spmd_call[k] + spmd[k] * t / k`` (``runtime.host
  .measure_spmd`` fits the two on a small step at two batch sizes): on forced CPU devices the k
  devices share the host's cores (the factor, at least 1) and every call pays a fixed cost for
  starting k device threads and meeting at each collective, whatever its size (the seconds).
  A pipeline stage over k devices pays that per action, so a factor alone, measured on a whole
  step, put its small micro-batches' actions at a fraction of their time. None where not
  measured (accelerators; ``spmd_call`` in costs saved before it was measured).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Mapping
from typing import Any

from gpp_jax.ir.program import Op

# Ops of a schedule-level program (``passes.lowering.lower_schedule``).
SCHEDULE_OPS = ("F", "B", "W", "UPDATE", "SEND", "RECV")


@dataclasses.dataclass(frozen=True)
class HostCosts:
  """Host seconds per instruction and per step (see the module docstring)."""

  per_op: Mapping[str, float]
  per_stage: float = 0.0
  outside: float = 0.0
  parallel: float | None = None
  cores: int | None = None
  device: str = ""
  spmd: Mapping[int, float] | None = None
  spmd_call: Mapping[int, float] | None = None

  def op_costs(self) -> dict[Op, float]:
    """Seconds per op of a compiled step's program (``simulate_program(host_cost=)``)."""
    return {Op(k): v for k, v in self.per_op.items()}

  def schedule_costs(self) -> dict[Op, float]:
    """Seconds per op of a schedule-level program: a stage's per-step work beyond its actions
    and transfers falls on its UPDATE."""
    costs = {Op(k): self.per_op.get(k, 0.0) for k in SCHEDULE_OPS}
    costs[Op.UPDATE] = costs.get(Op.UPDATE, 0.0) + self.per_stage
    return costs

  def compute_servers(self) -> int | None:
    """Device computations at full speed at once (``simulate_times(cores=)``), or None."""
    if self.parallel is None:
      return None
    return max(1, round(self.parallel))

  def spmd_factor(self, k: int) -> float | None:
    """How much slower than 1/k of its one-device time a computation sharded over ``k``
    devices runs (``spmd``; 1 for one device), interpolated linearly between the measured
    widths and the largest one's beyond them; None where not measured."""
    if k <= 1:
      return 1.0
    if not self.spmd:
      return None
    return _interpolated(self.spmd, k, 1.0)

  def spmd_call_seconds(self, k: int) -> float:
    """Seconds every computation sharded over ``k`` devices costs whatever its size
    (``spmd_call``; 0 for one device and where not measured), interpolated like
    ``spmd_factor``."""
    if k <= 1 or not self.spmd_call:
      return 0.0
    return _interpolated(self.spmd_call, k, 0.0)

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    for key in _BY_WIDTH:
      if d.get(key) is not None:
        d[key] = {str(k): v for k, v in d[key].items()}
    return json.dumps(d, indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, s: str) -> HostCosts:
    d = json.loads(s)
    for key in _BY_WIDTH:
      if d.get(key) is not None:  # JSON keys are strings
        d[key] = {int(k): float(v) for k, v in d[key].items()}
    return cls(**d)


_BY_WIDTH = ("spmd", "spmd_call")  # HostCosts fields keyed by a number of devices


def _interpolated(by_width: Mapping[int, float], k: int, at_one: float) -> float:
  """The value at ``k`` devices, linear between the measured widths (``at_one`` at one
  device), the widest one's beyond them."""
  known = sorted({1: at_one, **{int(w): float(f) for w, f in by_width.items()}}.items())
  for (w0, f0), (w1, f1) in itertools.pairwise(known):
    if k <= w1:
      return f0 + (f1 - f0) * (k - w0) / (w1 - w0)
  return known[-1][1]


# Ops whose host cost a schedule-level program carries itself; the rest is per-stage work.
_SCHEDULED = {"F", "B", "W", "SEND", "RECV"}


def host_costs_from_timeline(timeline: Any, num_stages: int, call_seconds: float) -> HostCosts:
  """Per-op medians of a run's dispatch timeline (``measure`` off), its per-stage remainder
  and the time its call spent outside the program."""
  per: dict[str, list[float]] = {}
  for e in timeline.events:
    per.setdefault(e.action, []).append(e.end - e.start)
  per_op = {k: statistics.median(v) for k, v in per.items()}
  rest = sum(sum(v) for k, v in per.items() if k not in _SCHEDULED)
  return HostCosts(
    per_op=per_op,
    per_stage=rest / max(num_stages, 1),
    outside=max(call_seconds - timeline.total, 0.0),
  )
