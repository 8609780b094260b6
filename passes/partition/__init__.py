"""Partitioners (planners): LayerGraph (+ Cluster) -> Plan.

``PLANNERS`` maps a planner name to a planner (``problem.Planner``): callable with the common
signature ``planner(layer_graph, cluster, batch_size, *, num_microbatches=None, **options) ->
Plan`` (``cluster`` a ``gpp_jax.cost.cluster.Cluster`` or a device count, a ``cpu_cluster``),
and with ``plan(problem, options)`` on a ``problem.PlanningProblem`` built once. Every
built-in planner is a ``problem.ProblemPlanner`` whose options are a frozen dataclass
(``PiperOptions``, ...); a user's planner in the keyword form is a Planner too (``as_planner``
adapts it).

  graphpipe   stage DAG: series-parallel DP + binary search on time per sample (GraphPipe)
  pipedream   chain of replicated stages over the linearised graph (PipeDream)
  piper       chain of stages that are differences of downsets (Piper)
  bapipe      balanced chain + schedule mode (GPipe / 1F1B) chosen by simulation (BaPipe)
  luo         chain mapped onto a two-level topology + micro-batch order (Luo et al.)
  exhaustive  every acyclic partition, device count and micro-batch size, simulated: the
              optimum of the plan space, to check the others (at most 8 layers and 8 devices
              by default; the cost grows like the Bell number of the layer count)
  balanced    FLOP-balanced chain, one device per stage (no cost model)
  graphpipe-stage-mb  GraphPipe, then a micro-batch size per stage by coordinate descent on
              the simulated time (``stage_microbatches``)

The papers: GraphPipe, Jeon et al., ASPLOS 2025 (arXiv:2406.17145); PipeDream, Narayanan et
al., SOSP 2019 (arXiv:1806.03377); Piper, Tarnawski et al., NeurIPS 2021; BaPipe, Zhao et al.
(arXiv:2012.12544); Luo et al., "Efficient Pipeline Planning for Expedited Distributed DNN
Training", IEEE INFOCOM 2022 (arXiv:2204.10562).
"""

from gpp_jax.passes.partition.balanced import BALANCED, BalancedOptions, balanced_plan
from gpp_jax.passes.partition.bapipe import BAPIPE, BaPipeOptions, bapipe_plan
from gpp_jax.passes.partition.exhaustive import EXHAUSTIVE, ExhaustiveOptions, exhaustive_plan
from gpp_jax.passes.partition.graphpipe import graphpipe_plan
from gpp_jax.passes.partition.graphpipe.search import GRAPHPIPE, GraphPipeOptions
from gpp_jax.passes.partition.luo import LUO, LuoOptions, luo_plan
from gpp_jax.passes.partition.pipedream import PIPEDREAM, PipeDreamOptions, pipedream_plan
from gpp_jax.passes.partition.piper import PIPER, PiperOptions, piper_plan
from gpp_jax.passes.partition.problem import (
  KeywordPlanner,
  Planner,
  PlanningProblem,
  ProblemPlanner,
  RegisteredPlanner,
  as_registered,
)
from gpp_jax.passes.partition.stage_microbatches import (
  GRAPHPIPE_STAGE_MB,
  StageMicrobatchOptions,
  graphpipe_stage_microbatch_plan,
)

PLANNERS: dict[str, RegisteredPlanner] = {
  "balanced": BALANCED,
  "graphpipe": GRAPHPIPE,
  "pipedream": PIPEDREAM,
  "piper": PIPER,
  "bapipe": BAPIPE,
  "luo": LUO,
  "exhaustive": EXHAUSTIVE,
  "graphpipe-stage-mb": GRAPHPIPE_STAGE_MB,
}
SEQUENTIAL_PLANNERS = ("pipedream", "piper", "bapipe", "luo")


__all__ = [
  "PLANNERS",
  "SEQUENTIAL_PLANNERS",
  "BaPipeOptions",
  "BalancedOptions",
  "ExhaustiveOptions",
  "GraphPipeOptions",
  "KeywordPlanner",
  "LuoOptions",
  "PipeDreamOptions",
  "PiperOptions",
  "Planner",
  "PlanningProblem",
  "ProblemPlanner",
  "StageMicrobatchOptions",
  "as_planner",
  "balanced_plan",
  "bapipe_plan",
  "exhaustive_plan",
  "get_planner",
  "graphpipe_plan",
  "graphpipe_stage_microbatch_plan",
  "luo_plan",
  "pipedream_plan",
  "piper_plan",
]


def as_planner(planner: str | Planner) -> RegisteredPlanner:
  """A planner name (``PLANNERS``), a registered planner, or any callable in the keyword form
  (a user's planner) -> an object with ``plan(problem, options)``."""
  if isinstance(planner, str):
    return get_planner(planner)
  return as_registered(planner)


def get_planner(name: str) -> RegisteredPlanner:
  try:
    return PLANNERS[name]
  except KeyError:
    raise ValueError(
      f"unknown planner {name!r}; choose one of {sorted(PLANNERS)} or pass a Plan"
    ) from None
