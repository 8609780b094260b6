"""gpp-jax: graph pipeline parallelism for JAX.

Trace a train step, cut its loss into a DAG of stages, place each stage on its own device and
pipeline micro-batches through them::

  @gpp_jax.graph_pipeline(num_microbatches=8)
  def train_step(state, batch):
    loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
    ...
"""
import warnings as _warnings

# ``python -m gpp_jax.plan`` runs the planning CLI from the Plan IR module, which this package
# imports first; runpy then warns that the module runs a second time as ``__main__``. The CLI
# imports Plan from ``gpp_jax.plan`` only, so the second copy is harmless.
_warnings.filterwarnings("ignore", message=r"'gpp_jax\.plan' found in sys\.modules",
                         category=RuntimeWarning)

from gpp_jax.api import GraphPipeline, graph_pipeline  # noqa: E402
from gpp_jax.capture_step import value_and_grad
from gpp_jax.errors import BatchError, CaptureError, GppError, PlanError, ScheduleError
from gpp_jax.manual import ManualPlan, manual_plan
from gpp_jax.plan import Plan, Stage, validate_plan
from gpp_jax.schedule import Action, Schedule, validate_schedule

__all__ = [
    "Action", "BatchError", "CaptureError", "GppError", "GraphPipeline", "ManualPlan", "Plan",
    "PlanError", "Schedule", "ScheduleError", "Stage", "graph_pipeline", "manual_plan",
    "validate_plan", "validate_schedule", "value_and_grad",
]
__version__ = "0.1.0"
