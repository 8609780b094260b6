"""Schedule generation pass: stage graph + micro-batch count -> Schedule.

Generators:
  gpipe:  all forwards, then all backwards, then the update (GPipe, with a flush).
  1f1b:   synchronous 1F1B (PipeDream-Flush) generalised to a stage DAG. Stage s issues
          warmup(s) = min(L(s), M) forwards before its first backward, where L(s) is the length
          (in stages) of the longest path from s to a sink; then alternates one backward and
          one forward; then drains its backwards. For a chain of S stages, stage i (0-based)
          warms up with S - i forwards, the classic schedule.
  graph-1f1b: synchronous 1F1B on a stage DAG by list scheduling, backward as early as
          possible (see passes/inflight.py); the same as 1f1b on a chain.
  zero-bubble: backward split into B (input cotangents) and W (parameter gradients), W placed
          into the bubbles under a per-stage memory bound (see passes/zero_bubble.py).
  pipedream-async, pipedream-async-vsync, 2bw: 1F1B lanes with stale-weight training semantics
          (weight stashing, vertical sync, two weight versions; see passes/weight_versions.py).
  interleaved-1f1b, looped-bfs, zb-v: for stages that share devices (several stages per
          device; see passes/shared_devices.py). gpipe, 1f1b, graph-1f1b and zero-bubble run
          on shared devices too, each place running its stages' actions in dispatch order.

Per-stage micro-batch counts (``counts``; stage s cuts the batch into counts[s] chunks, GraphPipe's
per-stage micro-batch sizes): gpipe, 1f1b, graph-1f1b and zero-bubble build lanes with counts[s]
forwards and backwards on stage s; 1F1B's warm-up (and zero-bubble's default memory bound) is
counted in samples (``passes/inflight.py``) and converted to each stage's own chunks. The
stale-weight generators refuse counts that differ.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.plan import has_mixed_microbatches, stage_microbatch_counts
from gpp_jax.ir.program import Op
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.inflight import (
  graph_1f1b,
  longest_path_to_sink,
  one_f_one_b_in_flight,
  stage_counts,
)
from gpp_jax.passes.shared_devices import SHARED_SCHEDULES, interleaved_1f1b, looped_bfs, zb_v
from gpp_jax.passes.weight_versions import weight_delays
from gpp_jax.passes.zero_bubble import zero_bubble


def gpipe(
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  update: bool = True,
  counts: Sequence[int] | None = None,
) -> Schedule:
  """GPipe: F for every micro-batch, then B for every micro-batch, per stage (stage s runs
  ``counts[s]`` micro-batches when given)."""
  M = num_microbatches
  cs = stage_counts(num_stages, M, counts)
  lanes = []
  for s in range(num_stages):
    Ms = M if cs is None else cs[s]
    lane = [Action(Op.F, s, m) for m in range(Ms)] + [Action(Op.B, s, m) for m in range(Ms)]
    if update:
      lane.append(Action(Op.UPDATE, s))
    lanes.append(tuple(lane))
  sched = Schedule("gpipe", M, tuple(sorted(edges)), tuple(lanes), cs)
  validate_schedule(sched)
  return sched


@functools.lru_cache(maxsize=1024)
def stage_actions(kind: Op, stage: int, count: int) -> tuple[Action, ...]:
  """``kind`` actions of ``stage`` for micro-batches 0..count-1 (the same objects every time:
  planners build thousands of schedules over the same stages)."""
  return tuple(Action(kind, stage, m) for m in range(count))


def one_f_one_b(
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  warmup: Sequence[int] | None = None,
  update: bool = True,
  counts: Sequence[int] | None = None,
) -> Schedule:
  """Synchronous 1F1B on a stage DAG; ``warmup[s]`` overrides the forwards before the first B.

  With ``counts`` (stage s runs counts[s] micro-batches) the default warm-up is
  ``inflight_chunks``: the same samples in flight whatever a stage's chunk size.
  """
  M = num_microbatches
  cs = stage_counts(num_stages, M, counts)
  L = list(warmup) if warmup is not None else one_f_one_b_in_flight(num_stages, edges, M, cs)
  lanes = []
  for s in range(num_stages):
    M = num_microbatches if cs is None else cs[s]
    w = max(1, min(L[s], M))
    fs, bs = stage_actions(Op.F, s, M), stage_actions(Op.B, s, M)
    # Warm-up, then B(i) F(w + i) in turn (interleaved by slices), then the last backwards.
    steady: list[Action] = [bs[0]] * (2 * (M - w))
    steady[::2] = bs[: M - w]
    steady[1::2] = fs[w:]
    lane = [*fs[:w], *steady, *bs[M - w :]]
    if update:
      lane.append(Action(Op.UPDATE, s))
    lanes.append(tuple(lane))
  sched = Schedule("1f1b", num_microbatches, tuple(sorted(edges)), tuple(lanes), cs)
  validate_schedule(sched)
  return sched


def pipedream_async(
  num_stages: int, edges: Sequence[tuple[int, int]], num_microbatches: int
) -> Schedule:
  """PipeDream's asynchronous 1F1B with weight stashing (passes/weight_versions.py): 1F1B
  lanes per step, each stage computing with weights ``L(s) - 1`` updates old."""
  sched = one_f_one_b(num_stages, edges, num_microbatches)
  return dataclasses.replace(sched, name="pipedream-async")


def pipedream_async_vsync(
  num_stages: int, edges: Sequence[tuple[int, int]], num_microbatches: int
) -> Schedule:
  """PipeDream's asynchronous 1F1B with weight stashing and vertical sync."""
  sched = one_f_one_b(num_stages, edges, num_microbatches)
  return dataclasses.replace(sched, name="pipedream-async-vsync")


def two_bw(num_stages: int, edges: Sequence[tuple[int, int]], num_microbatches: int) -> Schedule:
  """PipeDream-2BW: double-buffered weights, gradients coalesced over a step's micro-batches."""
  sched = one_f_one_b(num_stages, edges, num_microbatches)
  return dataclasses.replace(sched, name="2bw")


def stream_schedule(sched: Schedule, steps: int) -> Schedule:
  """One step's schedule -> the lanes of ``steps`` consecutive steps (``Schedule.steps``).

  Synchronous schedules, and those that split the backward (W), repeat their lanes step after
  step: a step's forwards need the previous step's update, so the pipeline drains in between
  (the flush). The stale-weight schedules (``pipedream-async``, ``-vsync``, ``2bw``) run one
  1F1B over all the steps' micro-batches without a flush, as PipeDream does: stage s keeps
  ``w(s)`` micro-batches in flight across the step boundary and runs ``UPDATE(s, t)`` right
  after the last backward of step t, so the next step's first forwards overlap this step's
  last backwards. ``w(s) = min(L(s), d(s) * M + 1)``: L(s) is the step's 1F1B warm-up and the
  cap keeps every forward after the update that makes its weights (d(s) updates old).
  """
  if steps < 1:
    raise ValueError(f"steps must be at least 1, got {steps}")
  if sched.steps != 1:
    raise ScheduleError(f"schedule {sched.name!r} already covers {sched.steps} steps")
  if steps == 1:
    return sched
  if not all(lane and lane[-1].kind == "UPDATE" for lane in sched.lanes):
    raise ScheduleError(
      f"schedule {sched.name!r} has no UPDATE ending every lane; steps are separated by "
      "their updates"
    )
  counts = sched.stage_counts
  delays = weight_delays(sched)
  split_w = sched.splits_backward
  lanes: list[list[Action]] = []
  if delays is None or split_w:
    for s, lane in enumerate(sched.lanes):
      out = []
      for t in range(steps):
        for a in lane:
          if a.kind == "UPDATE":
            out.append(Action(Op.UPDATE, s, t))
          else:
            out.append(Action(a.kind, s, t * counts[s] + a.microbatch))
      lanes.append(out)
  else:
    M = sched.num_microbatches
    total = steps * M
    L = longest_path_to_sink(sched.num_stages, sched.edges)
    for s in range(sched.num_stages):
      w = max(1, min(L[s], delays[s] * M + 1, total))
      out = [Action(Op.F, s, g) for g in range(w)]
      f = w
      for b in range(total):
        out.append(Action(Op.B, s, b))
        if (b + 1) % M == 0:
          out.append(Action(Op.UPDATE, s, b // M))
        if f < total:
          out.append(Action(Op.F, s, f))
          f += 1
      lanes.append(out)
  multi = Schedule(
    sched.name,
    sched.num_microbatches,
    sched.edges,
    tuple(map(tuple, lanes)),
    sched.counts,
    steps,
    delays,
  )
  validate_schedule(multi)
  return multi


# Generators that build lanes with per-stage micro-batch counts.
PER_STAGE_COUNTS = ("gpipe", "1f1b", "graph-1f1b", "zero-bubble")

GENERATORS: dict[str, Callable[..., Schedule]] = {
  "gpipe": gpipe,
  "1f1b": one_f_one_b,
  "graph-1f1b": graph_1f1b,
  "zero-bubble": zero_bubble,
  "pipedream-async": pipedream_async,
  "pipedream-async-vsync": pipedream_async_vsync,
  "2bw": two_bw,
  "interleaved-1f1b": interleaved_1f1b,
  "looped-bfs": looped_bfs,
  "zb-v": zb_v,
}
# Stale-weight generators: one place per stage.
STALE_WEIGHTS = ("pipedream-async", "pipedream-async-vsync", "2bw")


def make_schedule(
  name: str,
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  memory_bound: Sequence[int] | None = None,
  counts: Sequence[int] | None = None,
  places: Sequence[int] | None = None,
) -> Schedule:
  """Builds the named schedule; raises ValueError naming the known generators.

  ``memory_bound`` (zero-bubble only): per stage, the most micro-batches held at once.
  ``counts``: micro-batches per stage when stages use different micro-batch sizes (gpipe,
  1f1b, graph-1f1b and zero-bubble; the others raise ScheduleError).
  ``places``: per stage, its devices as a number (``Plan.places``; stages with one number
  share their devices); None: each stage its own.
  """
  try:
    gen = GENERATORS[name]
  except KeyError:
    raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(GENERATORS)}") from None
  if name in SHARED_SCHEDULES:
    if memory_bound is not None:
      raise ValueError(f"memory_bound applies to the zero-bubble schedule only, not {name!r}")
    return gen(num_stages, edges, num_microbatches, places, counts)
  shared = places is not None and len(set(places)) < len(places)
  if shared and name in STALE_WEIGHTS:
    raise ScheduleError(
      f"schedule {name!r} runs one stage per device, but stages share devices here; give each "
      f"stage devices of its own or use one of {list(SHARED_SCHEDULES)}, 1f1b, gpipe"
    )
  kw: dict = {}
  if memory_bound is not None:
    if name != "zero-bubble":
      raise ValueError(f"memory_bound applies to the zero-bubble schedule only, not {name!r}")
    kw["memory_bound"] = memory_bound
  cs = _per_stage_counts(name, num_stages, num_microbatches, counts)
  if cs is not None:
    kw["counts"] = cs
  sched = gen(num_stages, edges, num_microbatches, **kw)
  if shared:
    sched = dataclasses.replace(sched, places=tuple(places or ()))
    validate_schedule(sched)
  return sched


def _per_stage_counts(
  name: str, num_stages: int, num_microbatches: int, counts: Sequence[int] | None
) -> tuple[int, ...] | None:
  """The stages' micro-batch counts where they differ (``stage_counts``; None where they do
  not); raises ScheduleError where they differ and generator ``name`` builds lanes with one
  count (not one of ``PER_STAGE_COUNTS``)."""
  cs = stage_counts(num_stages, num_microbatches, counts)
  if cs is not None and name not in PER_STAGE_COUNTS:
    raise ScheduleError(
      f"schedule {name!r} needs one micro-batch size for every stage, but the stages run "
      f"{list(cs)} micro-batches; use one of {list(PER_STAGE_COUNTS)} or give every stage "
      "the same micro-batch size"
    )
  return cs


def plan_schedule(plan, batch_size: int | None = None) -> Schedule:
  """Plan -> the Schedule the simulator and the runtime execute for it.

  A zero-bubble plan whose stages all carry ``in_flight`` uses those counts as its memory
  bound (planners set them from device memory); otherwise the generator's default. A plan whose
  stages have different micro-batch sizes gets per-stage counts ``batch / size``
  (``batch_size``, default the plan's).
  """
  bound = None
  if plan.schedule == "zero-bubble" and all(s.in_flight for s in plan.stages):
    bound = tuple(int(s.in_flight) for s in plan.stages)
  counts = None
  if has_mixed_microbatches(plan):
    batch = batch_size if batch_size is not None else plan.batch_size
    if batch is None:
      raise ScheduleError(
        "the plan's stages have different micro-batch sizes but neither the plan nor the "
        "caller gives the batch size; set Plan.batch_size or pass batch_size"
      )
    counts = stage_microbatch_counts(plan, batch)
  return make_schedule(
    plan.schedule,
    plan.num_stages,
    tuple(plan.edges),
    plan.num_microbatches,
    memory_bound=bound,
    counts=counts,
    places=plan.places(),
  )


def plan_variants(plan) -> dict[str, tuple[Any, Schedule]]:
  """``plan`` under every schedule generator that builds a schedule for it (the stale-weight
  ones need a place per stage, those for shared devices one micro-batch size; the others are
  left out), by name in name order: the plan naming that schedule and its schedule
  (``plan_schedule``). Where ``plan`` is not a zero-bubble plan, its zero-bubble variant leaves
  out the stages' in-flight counts (set for another schedule), so the generator's default
  bound holds."""
  out: dict[str, tuple[Any, Schedule]] = {}
  for name in sorted(GENERATORS):
    p = plan.replace(schedule=name)
    if name != plan.schedule and name == "zero-bubble":
      p = p.replace(stages=tuple(dataclasses.replace(s, in_flight=None) for s in p.stages))
    try:
      out[name] = (p, plan_schedule(p))
    except ScheduleError:
      continue
  return out
