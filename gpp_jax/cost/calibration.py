"""This machine, measured, as the cost model takes it: ``MachineCalibration``.

Two kinds of measurement say what a step costs on this machine beyond its layers' times:

* the host's costs of driving the devices (``cost.host.HostCosts``), probed on a small
  pipeline (``runtime.host.measure_host``): the issue of each instruction, the time outside
  the program, the SPMD factor and the fixed seconds of a computation over k devices;
* what the timing trials of whole one-stage steps fitted on top of them
  (``runtime.calibration``): how XLA's fusion of the whole step in one program scales the
  layers' times (``fusion``), and the model's own SPMD factor and fixed seconds per
  computation over k devices (``model_spmd``, ``model_call``), where a small probe only
  guesses what the model's step pays.

A ``MachineCalibration`` goes wherever the cost model takes the machine's host
(``passes.simulation.simulate(host=)``, ``simulate_on_host``, ``PlanningProblem.host``): it
answers for the host's costs as the ``HostCosts`` it refines does (its fields and methods,
forwarded), and the cost model reads the fits from it (``cost.step_model.spmd_factor``,
``spmd_call``, ``fused_times``). A bare ``HostCosts`` there is a machine with nothing fitted
(``as_calibration``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gpp_jax.cost.host import HostCosts
from gpp_jax.ir.program import Op


@dataclasses.dataclass(frozen=True)
class MachineCalibration:
  """The host's measured costs and the trials' fits on top of them (see the module docstring).

  Attributes:
    host: the host's costs, as probed (``HostCosts``).
    fusion: the factor by which the layers' times scale in a one-stage step compiled as one
      program (plain jit's trial, ``runtime.calibration.calibrate_fusion``); None: not fitted.
    model_spmd: per number of devices k > 1, the model's own SPMD factor of its step over k
      devices (jit data parallel's trial, ``runtime.calibration.calibrate_spmd``).
    model_call: per number of devices k, the model's own fixed seconds of one computation
      over k devices (with ``model_spmd``; for one device, with ``fusion``: what each
      micro-batch of a fused step pays).
  """

  host: HostCosts
  fusion: float | None = None
  model_spmd: Mapping[int, float] = dataclasses.field(default_factory=dict)
  model_call: Mapping[int, float] = dataclasses.field(default_factory=dict)

  def with_fusion(self, factor: float, call: float | None = None) -> MachineCalibration:
    """This calibration with the fusion ``factor`` (and, where given, the fixed seconds each
    micro-batch of a fused step on one device pays, ``call``)."""
    calls = self.model_call if call is None else {**self.model_call, 1: call}
    return dataclasses.replace(self, fusion=factor, model_call=calls)

  def with_width(self, k: int, factor: float, call: float | None = None) -> MachineCalibration:
    """This calibration with the model's own SPMD ``factor`` over ``k`` devices (and, where
    given, its fixed seconds per computation over them, ``call``)."""
    calls = self.model_call if call is None else {**self.model_call, k: call}
    return dataclasses.replace(self, model_spmd={**self.model_spmd, k: factor}, model_call=calls)

  # The host's costs (``HostCosts``), forwarded: the calibration stands where they do.
  @property
  def per_op(self) -> Mapping[str, float]:
    return self.host.per_op

  @property
  def per_stage(self) -> float:
    return self.host.per_stage

  @property
  def outside(self) -> float:
    return self.host.outside

  @property
  def parallel(self) -> float | None:
    return self.host.parallel

  @property
  def cores(self) -> int | None:
    return self.host.cores

  @property
  def device(self) -> str:
    return self.host.device

  @property
  def spmd(self) -> Mapping[int, float] | None:
    """The probe's SPMD factors (``HostCosts.spmd``; the model's own: ``model_spmd``)."""
    return self.host.spmd

  @property
  def spmd_call(self) -> Mapping[int, float] | None:
    """The probe's fixed seconds per call (``HostCosts.spmd_call``; the model's own:
    ``model_call``)."""
    return self.host.spmd_call

  @property
  def allreduce(self) -> Mapping[int, float] | None:
    return self.host.allreduce

  @property
  def wide_ops(self) -> Mapping[int, Mapping[str, float]] | None:
    return self.host.wide_ops

  @property
  def wide_per_stage(self) -> Mapping[int, float] | None:
    return self.host.wide_per_stage

  @property
  def send_extra(self) -> float | None:
    return self.host.send_extra

  @property
  def input_send(self) -> float | None:
    return self.host.input_send

  @property
  def processes(self) -> int:
    return self.host.processes

  @property
  def cross_link(self) -> tuple[float, float] | None:
    return self.host.cross_link

  def op_costs(self, width: int = 1) -> dict[Op, float]:
    return self.host.op_costs(width)

  def schedule_costs(self, width: int = 1) -> dict[Op, float]:
    return self.host.schedule_costs(width)

  def lane_costs(self, widths: Sequence[int], schedule: bool) -> list[dict[Op, float]]:
    return self.host.lane_costs(widths, schedule)

  def send_factors(self, edge_arrays: Mapping[tuple[int, int], int]) -> dict:
    return self.host.send_factors(edge_arrays)

  def issue_seconds(self, op: str, width: int = 1) -> float:
    return self.host.issue_seconds(op, width)

  def stage_seconds(self, width: int = 1) -> float:
    return self.host.stage_seconds(width)

  def lane_processes(
    self, stage_devices: Sequence[Sequence[int]], num_devices: int
  ) -> list[tuple[int, ...]] | None:
    return self.host.lane_processes(stage_devices, num_devices)

  def compute_servers(self) -> int | None:
    return self.host.compute_servers()

  def spmd_factor(self, k: int) -> float | None:
    """The probe's factor over ``k`` devices (``HostCosts.spmd_factor``); the model's own
    where the trials timed it: ``cost.step_model.spmd_factor``."""
    return self.host.spmd_factor(k)

  def spmd_call_seconds(self, k: int) -> float:
    """The probe's fixed seconds over ``k`` devices (``HostCosts.spmd_call_seconds``); the
    model's own where the trials timed them: ``cost.step_model.spmd_call``."""
    return self.host.spmd_call_seconds(k)

  def allreduce_seconds(self, k: int, nbytes: float) -> float | None:
    return self.host.allreduce_seconds(k, nbytes)


def as_calibration(host: HostCosts | MachineCalibration) -> MachineCalibration:
  """``host`` as a calibration: itself, or the host's costs with nothing fitted on them."""
  return host if isinstance(host, MachineCalibration) else MachineCalibration(host)
