"""gpp-jax: graph pipeline parallelism for JAX.

Trace a train step, cut its loss into a DAG of stages, place each stage on its own device and
pipeline micro-batches through them::

  @gpp_jax.graph_pipeline(num_microbatches=8)
  def train_step(state, batch):
    loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
    ...
"""

from gpp_jax import checkpoint, distributed
from gpp_jax.errors import (
  BatchError,
  CaptureError,
  CheckpointError,
  GppError,
  PlanError,
  ScheduleError,
)
from gpp_jax.ir.plan import Plan, Stage, validate_plan
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.partition.manual import ManualPlan, manual_plan
from gpp_jax.passes.uniform_chain import simulate_uniform_chain
from gpp_jax.runtime.capture_step import value_and_grad
from gpp_jax.runtime.pipeline import GraphPipeline, graph_pipeline

__all__ = [
  "Action",
  "BatchError",
  "CaptureError",
  "CheckpointError",
  "GppError",
  "GraphPipeline",
  "ManualPlan",
  "Plan",
  "PlanError",
  "Schedule",
  "ScheduleError",
  "Stage",
  "checkpoint",
  "distributed",
  "graph_pipeline",
  "manual_plan",
  "simulate_uniform_chain",
  "validate_plan",
  "validate_schedule",
  "value_and_grad",
]
__version__ = "0.1.0"
