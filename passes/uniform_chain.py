"""Closed-form checks: a chain of equal stages timed through the generator, the lowering and
the simulator every plan goes through (``simulate_uniform_chain``)."""

from __future__ import annotations

from gpp_jax.cost.stage_times import StageTimes
from gpp_jax.errors import ScheduleError
from gpp_jax.passes.schedules import make_schedule
from gpp_jax.passes.shared_devices import round_robin_places, v_places
from gpp_jax.passes.simulation import simulate_times


def uniform_chain_places(
  schedule: str, num_devices: int, stages_per_device: int
) -> tuple[int, ...]:
  """Where a chain of ``num_devices * stages_per_device`` equal stages goes under
  ``schedule``: in a V for zb-v (two stages per device), round robin otherwise (Megatron's
  interleaving; one stage per device for v = 1)."""
  S = num_devices * stages_per_device
  if schedule == "zb-v":
    if stages_per_device != 2:
      raise ScheduleError(f"zb-v puts two stages on each device, not {stages_per_device}")
    return v_places(S)
  return round_robin_places(S, num_devices)


def simulate_uniform_chain(
  schedule: str,
  num_devices: int,
  num_microbatches: int,
  stages_per_device: int = 1,
  forward: float = 1.0,
  backward: float = 2.0,
  weight: float | None = None,
) -> float:
  """The simulated makespan of a chain of ``num_devices * stages_per_device`` equal stages.

  Each stage's forward takes ``forward / stages_per_device`` and its backward
  ``backward / stages_per_device``; ``weight`` (part of ``backward``) is the weight-gradient
  part a schedule with W actions runs apart (zero-bubble, zb-v; default half the backward
  there). Stages go where the schedule puts them (``uniform_chain_places``); transfers and the
  host are free. The schedule is built by the same generator, lowered by the same lowering and
  timed by the same simulator as a plan's, so the textbook forms check all three: GPipe and
  1F1B (m + p - 1)(f + b), interleaved 1F1B m(f + b) + (p - 1)(f + b)/v, ZB-V about
  m(f + b + w) when f = b = w.
  """
  if num_devices < 1 or num_microbatches < 1 or stages_per_device < 1:
    raise ValueError("num_devices, num_microbatches and stages_per_device must be >= 1")
  v = stages_per_device
  S = num_devices * v
  places = uniform_chain_places(schedule, num_devices, v)
  sched = make_schedule(
    schedule, S, [(s, s + 1) for s in range(S - 1)], num_microbatches, places=places
  )
  split = sched.splits_backward
  if weight is None:
    weight = backward / 2 if split else 0.0
  if not split:
    weight = 0.0
  times = StageTimes(
    [forward / v] * S, [(backward - weight) / v] * S, weight=[weight / v] * S if split else None
  )
  res = simulate_times(sched, times)
  return res.iteration_time
