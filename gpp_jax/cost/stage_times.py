"""What the simulator times a schedule with: each stage's times, transfers and memory
(``StageTimes``, with ``StageMemory``) and the host side of the machine, the thread issuing
the program, the cores and the shared channels (``HostSide``). ``cost.step_model.plan_times``
builds both for a plan; ``passes.simulation.simulate_times`` and the engines in ``cost``
(``simulate_lanes``, ``simulate_lowered``, ``simulate_program``) take them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from gpp_jax.ir.program import Op

# Seconds of one action of a stage: the same for every micro-batch, or per micro-batch (a
# sequence or a mapping indexed by micro-batch, e.g. measured times).
Times = float | Sequence[float] | Mapping[int, float]
# The host's seconds per op: one float for F, B, W and UPDATE, a mapping per op, or such a
# mapping per lane (``cost.host.HostCosts.lane_costs``).
Dispatch = float | Mapping[Op, float] | Sequence[Mapping[Op, float]]


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """What each stage holds per device.

  Attributes:
    static: per stage, bytes per device for weights and optimizer state (0 if None).
    activation: per stage, bytes per device of one stashed micro-batch (0 if None).
    devices: the devices of each stage, to report peak memory per device (None: not known).
  """

  static: Sequence[float] | None = None
  activation: Sequence[float] | None = None
  devices: Sequence[Sequence[int]] | None = None

  def per_stage(
    self, num_stages: int
  ) -> tuple[list[float], list[float], tuple[tuple[int, ...], ...]]:
    """(static bytes, bytes per stashed micro-batch, devices) of each of ``num_stages``
    stages, with the defaults filled in."""
    S = num_stages
    stat = list(self.static) if self.static is not None else [0.0] * S
    actm = list(self.activation) if self.activation is not None else [0.0] * S
    devs = tuple(tuple(d) for d in self.devices) if self.devices is not None else ((),) * S
    return stat, actm, devs


class GivenTimes(NamedTuple):
  """``StageTimes`` normalised (``StageTimes.given``).

  Attributes:
    forward, backward, weight: (stage, micro-batch) -> seconds of an F, B and W.
    update: per stage, seconds of its UPDATE.
    activation_transfer, cotangent_transfer: per stage edge (i, j), seconds of one
      activation's transfer and of one cotangent's.
  """

  forward: Callable[[int, int], float]
  backward: Callable[[int, int], float]
  weight: Callable[[int, int], float]
  update: list[float]
  activation_transfer: dict[tuple[int, int], float]
  cotangent_transfer: dict[tuple[int, int], float]


@dataclasses.dataclass(frozen=True)
class StageTimes:
  """Each stage's times, transfers and memory, as the simulator takes them.

  Attributes:
    forward, backward, weight: per stage, seconds of one F / B / W action (``Times``: a
      float, or a sequence or mapping indexed by micro-batch for per-action times); no W
      seconds (None) where the schedule does not split the backward.
    update: per stage, seconds of the UPDATE action (0 if None).
    activation_transfer: seconds to move one micro-batch's activations along stage edge
      (i, j) (missing edges: 0; a micro-batch of the producer i).
    cotangent_transfer: the same for the way back (a micro-batch of the consumer j);
      None: the same as ``activation_transfer``.
    static_memory, activation_memory, stage_devices: what each stage holds
      (``StageMemory``'s static, activation and devices).
  """

  forward: Sequence[Times]
  backward: Sequence[Times]
  weight: Sequence[Times] | None = None
  update: Sequence[float] | None = None
  activation_transfer: Mapping[tuple[int, int], float] | None = None
  cotangent_transfer: Mapping[tuple[int, int], float] | None = None
  static_memory: Sequence[float] | None = None
  activation_memory: Sequence[float] | None = None
  stage_devices: Sequence[Sequence[int]] | None = None

  @property
  def memory(self) -> StageMemory:
    """What each stage holds (``StageMemory``)."""
    return StageMemory(self.static_memory, self.activation_memory, self.stage_devices)

  def given(self, num_stages: int) -> GivenTimes:
    """The times normalised for ``num_stages`` stages: per stage and micro-batch the seconds
    of an F, B and W (``_per_action``, which checks there is an entry per stage), per stage the
    UPDATE's seconds (0 if None), and per stage edge the seconds of an activation's transfer
    and of a cotangent's (by default the activation's)."""
    S = num_stages
    act_x = dict(self.activation_transfer or {})
    cot = self.cotangent_transfer
    return GivenTimes(
      _per_action(self.forward, "forward", S),
      _per_action(self.backward, "backward", S),
      _per_action(self.weight, "weight", S),
      list(self.update) if self.update is not None else [0.0] * S,
      act_x,
      dict(cot if cot is not None else act_x),
    )


def _per_action(times: Any, what: str, num_stages: int) -> Callable[[int, int], float]:
  """Per-stage times (``Times`` each, or None for none) as (stage, micro-batch) -> seconds;
  raises ValueError unless there is an entry per stage."""
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


_ACTIONS = (Op.F, Op.B, Op.W, Op.UPDATE)


@dataclasses.dataclass(frozen=True)
class HostSide:
  """The host side of the machine a program runs on: who issues its instructions and at what
  cost, the cores they share, and the channels transfers queue on. The default (every field
  None) is the devices-only model: independent devices, free issue, a channel per transfer.

  Attributes:
    dispatch: seconds the host's issuing thread spends on one instruction (``Dispatch``: one
      float for each F, B, W and UPDATE, seconds per op, ``cost.host.HostCosts.op_costs``, or
      such a mapping per lane, ``HostCosts.lane_costs``; ops not in it cost nothing); when
      set, no instruction starts before the host has issued it, in program order. A SEND
      between stages costs what its source or destination lane's SEND costs, the more.
    send_factors: per stage edge (i, j), what a SEND along it (either way) costs to issue in
      lone SENDs (``HostCosts.send_factors``: an edge carries several arrays, put together;
      default one).
    send_extra: ``HostCosts.send_extra``: consecutive puts between stages issued together
      (``ir.program.puts_together``) cost the host a lone put plus this much of one for each
      other array, paid at the first (None: each SEND a lone put).
    cores: the host has this many cores, shared by the computing instructions (forced CPU
      devices share them) and by the issuing thread while it issues one; None for
      independent devices.
    channels: maps a transfer (kind, src, dst) to the channel it queues on; transfers mapped
      to one key share it one after another (a node's network interface). Unmapped
      transfers each have their own channel.
    processes: per lane (the stages', then the host lane), the processes that issue its
      instructions, each with its own issuing thread (``HostCosts.lane_processes``); None:
      one thread issues everything.
  """

  dispatch: Dispatch | None = None
  send_factors: Mapping[tuple[int, int], float] | None = None
  send_extra: float | None = None
  cores: int | None = None
  channels: Mapping[tuple[str, int, int], Any] | None = None
  processes: Sequence[Sequence[int]] | None = None

  @property
  def devices_only(self) -> bool:
    """Whether nothing here changes the devices-only model: no host issuing the program, no
    cores shared, no channels shared."""
    return self.dispatch is None and self.cores is None and not self.channels

  def lane_costs(self, num_lanes: int) -> list[Mapping[Op, float]]:
    """``dispatch`` as one mapping per lane (empty ones without)."""
    d = self.dispatch
    if d is None:
      return [{}] * num_lanes
    if isinstance(d, Mapping):
      return [dict(d)] * num_lanes
    if isinstance(d, Sequence):
      lanes = list(d)
      if len(lanes) != num_lanes:
        raise ValueError(f"host costs for {len(lanes)} lanes, not {num_lanes}")
      return lanes
    return [dict.fromkeys(_ACTIONS, float(d))] * num_lanes
