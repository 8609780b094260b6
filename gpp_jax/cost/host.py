"""The host of the machine a plan runs on: what issuing each instruction costs, measured.

The executor issues a step's program from one Python thread (``runtime.executor``). On a GPU
each issued computation then runs on its own device; on forced CPU devices, or processes
pinned to cores, the devices share the host's cores with each other and with the issuing
thread. Planners that ignore this pick plans whose predicted time is a fraction of what the
machine gives (BUILD_NOTES.md, "The simulator and the cost model"). ``HostCosts`` holds what the
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
* ``allreduce``: per number of devices k, seconds per byte of parameter gradients that a
  backward sharded over k devices pays beyond the same backward on one device (``runtime.host
  .measure_allreduce``). A stage over k devices keeps its parameters replicated and its batch
  split, so XLA all-reduces the gradients in each of its backward calls, once per micro-batch,
  not once per step; on forced CPU devices each of the k devices writes its whole partial
  gradient and the reduction reads them all on the host's shared cores (on a 2-core host
  0.5-0.9 ms per MiB over 2 devices, 3-4 over 8, more as the gradients outgrow the caches:
  more than a medium model's stage computes). None where not
  measured (accelerators; costs saved before it was measured): the cost model's all-reduce,
  once per step in the stage's UPDATE, stands in.
* ``wide_ops`` and ``wide_per_stage``: ``per_op`` and ``per_stage`` for a stage over k > 1
  devices, measured on the same small pipeline with stages that wide. Issuing a sharded
  computation or a put onto k devices handles k buffers per array: over 2 forced CPU devices of
  a 2-core host a forward took 3.7x and a transfer 1.5x what they take for one device. Between
  the measured widths they are interpolated, beyond the widest the widest's; None where not
  measured (one device; costs saved before they were measured): every width then costs what
  one device costs.
* ``send_extra``: what each array beyond the first of a stage edge adds to its SEND, as a
  share of a lone put: the executor puts the arrays of one edge with one ``jax.device_put``
  (about a third on forced CPU devices). None where not measured: each array a lone put.
* ``processes``: how many processes drive the devices (``jax.distributed``), each on a block
  of the devices in order (the first ``num_devices / processes`` on process 0, ...), with an
  issuing thread of its own: a stage's instructions are issued by the processes holding its
  devices (a stage over devices of several, by each), every SEND by its two ends'
  processes. ``parallel`` is then measured across the processes (their computations share
  the machine's cores and memory), the per-op costs are process 0's, measured on its own
  devices. 1: one process.
* ``cross_link``: (alpha seconds, beta bytes per second) of a transfer between two processes'
  devices, measured (``runtime.host.measure_link_across``); planning replaces the cluster's
  link between nodes with it. None: one process, or not measured.
* ``input_send``: what a SEND from the host lane costs: the step's arguments put where they
  go, mostly already there (a committed array on its sharding is kept as it is), so far less
  than a put between stages (``per_op["SEND"]``, the stages' own). None where not measured:
  a SEND between stages.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Mapping, Sequence
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
  allreduce: Mapping[int, float] | None = None
  wide_ops: Mapping[int, Mapping[str, float]] | None = None
  wide_per_stage: Mapping[int, float] | None = None
  send_extra: float | None = None
  input_send: float | None = None
  processes: int = 1
  cross_link: tuple[float, float] | None = None

  def op_costs(self, width: int = 1) -> dict[Op, float]:
    """Seconds per op of a compiled step's program (``cost.stage_times.HostSide.dispatch``), for a
    stage over ``width`` devices."""
    return {Op(k): self.issue_seconds(k, width) for k in self.per_op}

  def schedule_costs(self, width: int = 1) -> dict[Op, float]:
    """Seconds per op of a schedule-level program, for a stage over ``width`` devices: a
    stage's per-step work beyond its actions and transfers falls on its UPDATE."""
    costs = {Op(k): self.issue_seconds(k, width) for k in SCHEDULE_OPS}
    costs[Op.UPDATE] += self.stage_seconds(width)
    return costs

  def lane_costs(self, widths: Sequence[int], schedule: bool) -> list[dict[Op, float]]:
    """Per lane of a program (a stage over ``widths[s]`` devices; the host lane after them,
    one), seconds per op (``schedule_costs`` for a schedule-level program, else
    ``op_costs``): what ``HostSide.dispatch`` takes."""
    per = self.schedule_costs if schedule else self.op_costs
    by_width = {w: per(w) for w in set(widths) | {1}}
    host = by_width[1]
    if self.input_send is not None:
      host = {**host, Op.SEND: self.input_send}
    return [by_width[w] for w in widths] + [host]

  def send_factors(self, edge_arrays: Mapping[tuple[int, int], int]) -> dict:
    """Per stage edge carrying ``a`` arrays, what one SEND along it costs in lone SENDs: the
    executor puts an edge's arrays together (``runtime.executor._batched_sends``), each
    beyond the first for ``send_extra`` of a lone put (1 where not measured)."""
    extra = 1.0 if self.send_extra is None else self.send_extra
    return {e: 1.0 + (a - 1) * extra for e, a in edge_arrays.items()}

  def issue_seconds(self, op: str, width: int = 1) -> float:
    """Seconds to issue one ``op`` of a stage over ``width`` devices (``per_op``; for several
    devices ``wide_ops`` interpolated, see the module docstring)."""
    base = self.per_op.get(op, 0.0)
    if width <= 1 or not self.wide_ops:
      return base
    known = {w: ops[op] for w, ops in self.wide_ops.items() if op in ops}
    return _interpolated(known, width, base) if known else base

  def stage_seconds(self, width: int = 1) -> float:
    """``per_stage`` of a stage over ``width`` devices (``wide_per_stage`` interpolated)."""
    if width <= 1 or not self.wide_per_stage:
      return self.per_stage
    return _interpolated(self.wide_per_stage, width, self.per_stage)

  def lane_processes(
    self, stage_devices: Sequence[Sequence[int]], num_devices: int
  ) -> list[tuple[int, ...]] | None:
    """Per lane of a program over stages on ``stage_devices`` (of ``num_devices``; the host
    lane last: every process), the processes that issue its instructions; None for one
    process (``HostSide.processes``)."""
    if self.processes <= 1:
      return None
    per = max(num_devices // self.processes, 1)
    last = self.processes - 1
    lanes = [tuple(sorted({min(d // per, last) for d in devs})) for devs in stage_devices]
    return [*lanes, tuple(range(self.processes))]

  def compute_servers(self) -> int | None:
    """Device computations at full speed at once (``cost.stage_times.HostSide.cores``),
    or None."""
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

  def allreduce_seconds(self, k: int, nbytes: float) -> float | None:
    """Seconds one backward over ``k`` devices pays for all-reducing ``nbytes`` of parameter
    gradients (``allreduce``, interpolated like ``spmd_factor``; 0 for one device or no
    bytes); None where not measured."""
    if k <= 1 or nbytes <= 0:
      return 0.0
    if not self.allreduce:
      return None
    return _interpolated(self.allreduce, k, 0.0) * nbytes

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    for key in (*_BY_WIDTH, "wide_ops"):
      if d.get(key) is not None:
        d[key] = {str(k): v for k, v in d[key].items()}
    return json.dumps(d, indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, s: str) -> HostCosts:
    d = json.loads(s)
    for key in _BY_WIDTH:
      if d.get(key) is not None:  # JSON keys are strings
        d[key] = {int(k): float(v) for k, v in d[key].items()}
    if d.get("cross_link") is not None:
      d["cross_link"] = tuple(float(v) for v in d["cross_link"])
    if d.get("wide_ops") is not None:
      d["wide_ops"] = {
        int(w): {op: float(v) for op, v in ops.items()} for w, ops in d["wide_ops"].items()
      }
    return cls(**d)


# HostCosts fields keyed by a number of devices
_BY_WIDTH = ("spmd", "spmd_call", "allreduce", "wide_per_stage")


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


def host_costs_from_timeline(
  timeline: Any, num_stages: int, call_seconds: float, stages_only: bool = False
) -> HostCosts:
  """Per-op medians of a run's dispatch timeline (``measure`` off), its per-stage remainder
  and the time its call spent outside the program. A SEND's median is of the transfers
  between stages; the host lane's SENDs (the step's arguments, mostly already in place,
  which cost next to nothing) give ``input_send``. ``stages_only``: of the stages'
  instructions alone."""
  per: dict[str, list[float]] = {}
  inputs: list[float] = []  # the host lane's SENDs
  for e in timeline.events:
    if e.stage >= num_stages:
      if stages_only:
        continue
      if e.action == "SEND":
        inputs.append(e.end - e.start)
        continue
    per.setdefault(e.action, []).append(e.end - e.start)
  if inputs and "SEND" not in per:  # no transfer between stages: the inputs' stand in
    per["SEND"] = inputs
  per_op = {k: statistics.median(v) for k, v in per.items()}
  rest = sum(sum(v) for k, v in per.items() if k not in _SCHEDULED)
  return HostCosts(
    per_op=per_op,
    per_stage=rest / max(num_stages, 1),
    outside=max(call_seconds - timeline.total, 0.0),
    input_send=statistics.median(inputs) if inputs else None,
  )
