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
  for independent devices (accelerators).
"""

from __future__ import annotations

import dataclasses
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

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, s: str) -> HostCosts:
    return cls(**json.loads(s))


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
