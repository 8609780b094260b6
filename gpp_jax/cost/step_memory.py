"""What a captured step holds per device, per stage: the memory terms ``plan_costs`` prices a
stage of a captured step by (the layer graph's ``step_memory`` attribute, ``cost_model
.StepMemoryCosts``), in two phases, the pipeline's and the update's, the larger being the
stage's."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import networkx as nx

if TYPE_CHECKING:
  from gpp_jax.cost.cost_model import CostModel, LayerCosts


@dataclasses.dataclass(frozen=True)
class HeldStage:
  """A stage of a captured step as its memory is priced (``step_memory_terms``).

  Attributes:
    layers: its layers.
    params: its parameter bytes per device (its shard under the model's specs).
    microbatch: samples per micro-batch.
    dp: the devices a micro-batch is split over.
    one_device: the stage runs on one device (its program then packs its parameters and
      residuals, ``passes.staging.stage_functions``).
    batch: samples per step.
    one_call: the stage is a one-stage plan's, run as one call of the whole step
      (``runtime.build.fuses``).
    in_flight: the micro-batches the stage holds at once where the plan says
      (``Stage.in_flight``), else 1.
  """

  layers: tuple[str, ...]
  params: float
  microbatch: float
  dp: int
  one_device: bool
  batch: float
  one_call: bool = False
  in_flight: float = 1.0


def step_memory_terms(
  cm: CostModel, costs: LayerCosts, stage: HeldStage
) -> tuple[dict[str, float], dict[str, float]]:
  """A stage's memory per device from what its captured step holds (``costs.memory``): (bytes
  held for the whole step, bytes per micro-batch in flight), by term, for ``stage``
  (``HeldStage``: its parameter bytes ``params`` per device, its micro-batch split over
  ``dp`` devices, ``batch`` samples per step). During the pipeline a device holds:

  * its parameters, and on one device their packed copy (its forward and backward read);
  * the gradient sums (as many bytes as the parameters) and the optimizer's own state
    (``StepMemoryCosts.state``, sharded like the parameters);
  * the step's batch its layers read, cut into micro-batches at the start: a forward consumes
    one (what the backward needs of it is among the residuals), so a micro-batch in flight
    holds one fewer (the per micro-batch term "batch", negative);
  * the temporaries of its forward and backward: the largest of what a one-device stage's
    forward packs, the largest residuals of one of its layers (a backward's working set) and,
    on several devices, the parameters' gradients a backward computes before adding them to
    the sums;
  * one micro-batch of the activations it receives and sends, and of their cotangents;
  * per micro-batch in flight the vjp residuals (split over ``dp``), and on several devices a
    copy of the parameters among them.

  During the optimizer update after the pipeline the old parameters and state stay alive until
  the new ones are written: twice the parameters and state, plus the gradients. The stage's
  peak is the larger of the two phases; the static memory holds the difference as "update"
  where the update's is larger with ``in_flight`` micro-batches in flight (exact when the
  schedule holds that many; where it holds more, over by what each further one adds, where
  fewer, under by as much).

  ``one_call``: the step's arguments (parameters, state, batch), its new parameters and
  state, and in its temporaries the gradients and one micro-batch's residuals at a time,
  whatever the schedule."""
  layers, params, microbatch, dp = stage.layers, stage.params, stage.microbatch, stage.dp
  one_device, batch = stage.one_device, stage.batch
  mem = costs.memory
  assert mem is not None
  sums = costs._memory.get(("sums", layers))
  if sums is None:
    idx = [costs.index[l] for l in layers]
    mine = set(idx)
    sent: dict[int, float] = {}  # per layer of the stage, its largest output leaving it
    received: dict[int, float] = {}  # per layer outside, its largest output coming in
    for u, v, b in costs.edges:
      if (u in mine) != (v in mine):
        ends = sent if u in mine else received
        ends[u] = max(ends.get(u, 0.0), b)
    sums = costs._memory[("sums", layers)] = (
      float(costs.param_bytes[idx].sum()),
      float(mem.residual_ps[idx].sum()),
      float(mem.packed_residual_ps[idx].sum())
      + sum(n for l, src, n in mem.kept_inputs if l in mine and src in mine),
      float(mem.residual_ps[idx].max(initial=0.0)),
      float(mem.state[idx].sum()),
      float(mem.batch_ps[idx].sum()),
      sum(sent.values()) + sum(received.values()),
    )
  full, res_ps, packed_ps, largest_ps, state, batch_ps, edge_ps = sums
  share = params / full if full > 0 else 1.0  # the state is sharded like the parameters
  opt = state * share
  residuals = res_ps * microbatch / dp
  chunk = min(batch_ps * microbatch / dp, residuals)
  if stage.one_call:
    fixed = {
      "parameters": params,
      "gradients": cm.gradient_factor * params,
      "optimizer state": opt,
      "batch": batch_ps * batch / dp,
      "temporaries": residuals,
      "update": params + opt,
    }
    return fixed, {}
  temps = max(packed_ps * microbatch if one_device else params, largest_ps * microbatch / dp)
  fixed = {
    "parameters": params * (2.0 if one_device else 1.0),
    "gradients": cm.gradient_factor * params,
    "optimizer state": opt,
    "batch": batch_ps * (batch + microbatch) / dp,
    "temporaries": temps,
    "activations and cotangents": 2.0 * edge_ps * microbatch / dp,
  }
  per_mb = {
    "stashed activations": residuals + (0.0 if one_device else params),
    "batch": -chunk,
  }
  update = 2.0 * (params + opt) + cm.gradient_factor * params
  fixed["update"] = max(0.0, update - stage.in_flight * sum(per_mb.values()) - sum(fixed.values()))
  return fixed, per_mb


def _held_memory(cm: CostModel, costs: LayerCosts, stage: HeldStage) -> tuple[float, float]:
  """``step_memory_terms`` summed: (static, per micro-batch) bytes, remembered per stage."""
  key = (stage, cm)
  hit = costs._memory.get(key)
  if hit is None:
    fixed, per_mb = step_memory_terms(cm, costs, stage)
    hit = costs._memory[key] = (sum(fixed.values()), sum(per_mb.values()))
  return hit


def _one_call(costs: LayerCosts, plan: Any) -> bool:
  """Whether ``plan`` runs as one call of the whole step: one stage of a step that allows it
  (``StepMemoryCosts.one_call``), under a schedule that keeps no older weights."""
  if costs.memory is None or not costs.memory.one_call or plan.num_stages != 1:
    return False
  return getattr(plan, "schedule", None) not in costs.memory.stale_schedules


def _row_width(layer_graph: nx.DiGraph, stage: Any) -> int:
  """Devices per row of ``stage``: the product of its inner axes (``Stage.inner``, else the
  mesh's), 1 without a mesh."""
  inner = getattr(stage, "inner", None)
  if inner is None:
    mesh = layer_graph.graph.get("mesh")
    inner = mesh["inner"] if mesh else ()
  return math.prod(inner)
