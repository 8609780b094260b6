"""The planning contract: one ``PlanningProblem`` built once, and the ``Planner`` protocol.

A planning problem is what every planner starts from: the validated LayerGraph and its
per-layer costs, the Cluster (its ``memory_per_device`` is the memory budget), the mini-batch
size, the cost model, the schedule family the plan names and the micro-batch sizes a planner
may choose from, and, where the machine was measured, its host's costs (``host``: every
planner's simulations are then the prediction for that machine, not the devices-only one).
``PlanningProblem.build`` makes it from what users pass (a device count becomes a
``cpu_cluster``; the batch defaults to the LayerGraph's).

A planner is any callable ``planner(layer_graph, cluster, batch_size, *, num_microbatches=None,
**options) -> Plan`` (``Planner``): a user's function passed as ``planner=`` qualifies. Every
registered planner (``passes.partition.PLANNERS``) also has ``plan(problem, options)``:
``ProblemPlanner`` (every built-in planner) takes the problem and a frozen options dataclass
(calling it with the keyword form builds both); ``KeywordPlanner`` adapts a user's planner
written in the keyword form (``as_registered``; ``passes.partition.as_planner``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import networkx as nx

from gpp_jax.cost.cluster import Cluster, as_cluster
from gpp_jax.cost.cost_model import DEFAULT_COST_MODEL, CostModel, LayerCosts, layer_costs
from gpp_jax.errors import PlanError, counted
from gpp_jax.ir.layer_graph import validate_layer_graph
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.idle import with_idle_reason
from gpp_jax.passes.partition.plan_assembly import MAX_MICROBATCHES, microbatch_sizes
from gpp_jax.passes.partition.plan_assembly import predict as predict_plan
from gpp_jax.passes.partition.stage_shapes import choose_stage_shapes


@dataclasses.dataclass(frozen=True, eq=False)
class PlanningProblem:
  """What a planner is asked: plan ``layer_graph`` for ``cluster`` at ``batch_size``.

  Attributes:
    layer_graph: the validated LayerGraph with costs.
    cluster: the Cluster; ``memory_per_device`` is the memory budget.
    batch_size: the mini-batch size.
    cost_model: the CostModel planners price stages with.
    costs: per-layer costs of ``layer_graph`` (``cost_model.layer_costs``).
    schedule: the schedule generator the plans name ("1f1b", "graph-1f1b", "gpipe", ...).
    num_microbatches: fixed M (micro-batch = batch / M), or None to sweep sizes.
    max_microbatches: a sweep skips sizes needing more micro-batches than this.
    host: the machine's measured host costs (``cost.host.HostCosts``, ``runtime.host.
      measure_host``), or None. Given, every simulation the planner compares plans by is the
      prediction for that machine (``passes.simulation.simulate_on_host``: the host thread
      issuing each instruction, the cores forced CPU devices share, a one-stage plan as one
      jitted step); the planners' own objectives (per-stage times in their DPs) stay the
      cost model's. None: the devices-only model (every device computes on its own, the host
      costs nothing), as the papers' planners assume.
    min_stages: the fewest stages a plan may have (``graph_pipeline(min_stages=)``): every
      planner's search is kept to plans of at least this many stages and returns its best
      such plan (1: any plan, a one-stage plan included). A planner that cannot search under
      it raises ``PlanError`` naming itself; none hands the problem to another planner.
    stage_shapes: over a mesh (the layer graph's ``mesh`` attribute), whether every built-in
      planner's plan then gets each stage's inner shape chosen by prediction
      (``passes.partition.stage_shapes``); False keeps the mesh's shape in every stage.
  """

  layer_graph: nx.DiGraph
  cluster: Cluster
  batch_size: int
  cost_model: CostModel
  costs: LayerCosts
  schedule: str = "1f1b"
  num_microbatches: int | None = None
  max_microbatches: int | None = MAX_MICROBATCHES
  host: Any = None
  min_stages: int = 1
  stage_shapes: bool = True
  memo: dict = dataclasses.field(default_factory=dict, repr=False)  # work planners share

  @classmethod
  def build(
    cls,
    layer_graph: nx.DiGraph,
    cluster: Cluster | int | None = None,
    batch_size: int | None = None,
    *,
    cost_model: CostModel | None = None,
    schedule: str = "1f1b",
    num_microbatches: int | None = None,
    max_microbatches: int | None = MAX_MICROBATCHES,
    host: Any = None,
    min_stages: int = 1,
    stage_shapes: bool = True,
  ) -> PlanningProblem:
    """The problem from what a user passes: a device count becomes a ``cpu_cluster``, the
    batch defaults to the LayerGraph's ``batch_size``, the cost model to the default one.
    ``PlanError`` where ``min_stages`` asks for more stages than there are devices or
    layers."""
    validate_layer_graph(layer_graph)
    cluster = as_cluster(cluster)
    check_min_stages(min_stages, cluster.num_devices, layer_graph.number_of_nodes())
    return cls(
      layer_graph=layer_graph,
      cluster=cluster,
      batch_size=int(batch_size or layer_graph.graph["batch_size"]),
      cost_model=cost_model or DEFAULT_COST_MODEL,
      costs=layer_costs(layer_graph),
      schedule=schedule,
      num_microbatches=num_microbatches,
      max_microbatches=max_microbatches,
      host=host,
      min_stages=int(min_stages),
      stage_shapes=bool(stage_shapes),
    )

  @property
  def memory_limit(self) -> float:
    """Bytes per device a plan may use."""
    return float(self.cluster.memory_per_device)

  @property
  def num_devices(self) -> int:
    return self.cluster.num_devices

  def microbatch_sizes(self) -> list[int]:
    """The micro-batch sizes a planner may choose from (``plan_assembly.microbatch_sizes``,
    over the cluster's devices)."""
    return microbatch_sizes(
      self.batch_size, self.num_microbatches, self.max_microbatches, self.num_devices
    )

  def simulations(self) -> dict | None:
    """The simulations run for this problem, shared by its planners (``predict`` keeps
    them); None where it keeps none (``without_memo``)."""
    return self.memo.setdefault("simulations", {})

  def without_memo(self) -> PlanningProblem:
    """The same problem keeping none of the simulations run for it (``simulations`` is None):
    for a search that meets every plan once, where keeping them would only hold memory."""
    return dataclasses.replace(self, memo={**self.memo, "simulations": None})

  def predict(
    self, plan: Plan, *, idle: Sequence[int] = (), info: dict[str, Any] | None = None
  ) -> Plan:
    """``plan`` with ``predicted`` filled in for this problem (``plan_assembly.predict``),
    ``idle`` the devices it leaves idle."""
    return predict_plan(self, plan, idle=idle, info=info)

  def inputs(self) -> tuple[Cluster, CostModel, int, LayerCosts]:
    """(cluster, cost model, batch size, layer costs): the four values planners price with."""
    return self.cluster, self.cost_model, self.batch_size, self.costs

  def enough_stages(self, plan: Plan) -> bool:
    """Whether ``plan`` has at least ``min_stages`` stages (a plan the search may return)."""
    return plan.num_stages >= self.min_stages


def check_min_stages(
  min_stages: int, num_devices: int, num_layers: int, rows: bool = False
) -> None:
  """``PlanError`` where ``min_stages`` asks for more stages than there are devices (``rows``:
  rows of the mesh's first axis, which the planners count as devices) or layers: every
  stage takes at least one of each."""
  k = int(min_stages)
  if k < 1:
    raise PlanError(f"min_stages must be at least 1, got {min_stages}")
  if k <= min(num_devices, num_layers):
    return
  what = "rows of the mesh's first axis" if rows else "devices"
  raise PlanError(
    f"min_stages={k} asks for more stages than there are "
    + (f"{what} ({num_devices})" if num_devices < k else f"layers ({num_layers})")
    + "; pass a smaller min_stages"
  )


def too_few_stages_error(planner: str, plan: Plan, min_stages: int, keyword: bool) -> PlanError:
  """The error for a planner whose plan has fewer than ``min_stages`` stages: ``min_stages``
  constrains the planner's own search, and is never a reason to run another planner.
  ``keyword``: whether the planner was passed ``min_stages`` (else its signature takes no
  such keyword, and the fix is to give it one)."""
  stages = counted(plan.num_stages, "stage")
  head = f"{planner}'s plan has {stages}, fewer than min_stages={min_stages}"
  if keyword:
    return PlanError(
      f"{head} although it was passed min_stages={min_stages}; its search must return plans "
      "of at least that many stages (pass a smaller min_stages meanwhile)"
    )
  return PlanError(
    f"{head}, and {planner} takes no min_stages keyword to search under it; give it a "
    "min_stages keyword (the fewest stages its plan may have), choose a planner that takes "
    "it (graphpipe, pipedream, piper, bapipe, luo, exhaustive, balanced), or drop min_stages"
  )


def no_plan_with_stages_error(planner: str, min_stages: int, why: str = "") -> PlanError:
  """The error for a planner whose search finds no plan of at least ``min_stages`` stages."""
  return PlanError(
    f"{planner}: no plan of at least min_stages={min_stages} stages"
    + (f" ({why})" if why else "")
    + f"; pass a smaller min_stages, or another planner by name (min_stages never swaps "
    f"{planner} for another planner)"
  )


@runtime_checkable
class Planner(Protocol):
  """Anything that plans: ``planner(layer_graph, cluster, batch_size, *, num_microbatches=None,
  **options) -> Plan``. Users' functions passed as ``planner=`` are Planners."""

  def __call__(
    self,
    layer_graph: nx.DiGraph,
    cluster: Any = None,
    batch_size: int | None = None,
    *,
    num_microbatches: int | None = None,
    **options: Any,
  ) -> Plan: ...


Options = TypeVar("Options")

# The keyword arguments that make the problem rather than a planner's options.
PROBLEM_KEYWORDS = (
  "cost_model",
  "schedule",
  "max_microbatches",
  "host",
  "min_stages",
  "stage_shapes",
)


@dataclasses.dataclass(frozen=True)
class ProblemPlanner(Generic[Options]):
  """A built-in planner: ``plan(problem, options)`` with a frozen options dataclass.

  ``stages_per_device`` (an int above one, or ``"auto"``) plans with several stages on a
  device (``passes.partition.shared``). Otherwise, calling it with the keyword form
  (``Planner``) builds the ``PlanningProblem`` (from
  ``cost_model``, ``schedule``, ``max_microbatches``, ``host``, ``min_stages`` and
  ``num_microbatches``) and the options (every other keyword, checked against the options'
  fields) and runs ``plan``, whose plan must have at least ``min_stages`` stages (each
  planner's search honours it; ``PlanError`` naming the planner otherwise).
  """

  name: str
  options_type: type[Options]
  run: Callable[[PlanningProblem, Options], Plan]
  doc: str = ""
  # Whether its plans get each stage's shape over a mesh chosen by prediction
  # (``PlanningProblem.stage_shapes``): not for a planner that prices nothing (balanced).
  shapes_stages: bool = True

  def options(self, **kw: Any) -> Options:
    names = {f.name for f in dataclasses.fields(self.options_type)}  # type: ignore[arg-type]
    bad = sorted(set(kw) - names)
    if bad:
      raise TypeError(
        f"{self.name}: unknown option(s) {bad}; the options are {sorted(names)} and "
        f"{list(PROBLEM_KEYWORDS)}"
      )
    return self.options_type(**kw)

  def plan(
    self, problem: PlanningProblem, options: Options | Mapping[str, Any] | None = None
  ) -> Plan:
    """The plan for ``problem`` under ``options`` (the dataclass, or its fields as a mapping;
    None: the defaults), with ``predicted["idle_reason"]`` where it leaves devices idle
    (``idle.idle_reason``)."""
    if options is None:
      options = self.options_type()
    elif isinstance(options, Mapping):
      options = self.options(**options)
    plan = self.run(problem, options)
    if not problem.enough_stages(plan):  # a search that ignored the constraint: a bug
      raise too_few_stages_error(self.name, plan, problem.min_stages, keyword=True)
    if problem.stage_shapes and self.shapes_stages:
      plan = choose_stage_shapes(plan, problem)
    return with_idle_reason(plan, problem, options)

  def __call__(
    self,
    layer_graph: nx.DiGraph,
    cluster: Cluster | int | None = None,
    batch_size: int | None = None,
    *,
    num_microbatches: int | None = None,
    **kw: Any,
  ) -> Plan:
    per_device = kw.pop("stages_per_device", None)
    if per_device is not None and per_device != 1:  # several stages per device
      from gpp_jax.passes.partition.shared import plan_with_shared_devices

      return plan_with_shared_devices(
        self,
        layer_graph,
        as_cluster(cluster),
        batch_size,
        stages_per_device=per_device,
        num_microbatches=num_microbatches,
        **kw,
      )
    problem_kw = {k: kw.pop(k) for k in PROBLEM_KEYWORDS if k in kw}
    problem = PlanningProblem.build(
      layer_graph, cluster, batch_size, num_microbatches=num_microbatches, **problem_kw
    )
    return self.plan(problem, self.options(**kw))


def device_unit(num_devices: int, grid: int | None) -> int:
  """The smallest power of two u with at most ``grid`` slots of u devices (1 for None): the
  DPs count devices in such slots, so their tables do not grow with the cluster."""
  u = 1
  while grid is not None and num_devices // u > grid:
    u *= 2
  return u


@dataclasses.dataclass(frozen=True)
class KeywordPlanner:
  """A planner written in the keyword form (``Planner``), e.g. a user's function, with the
  same ``plan(problem, options)`` as ``ProblemPlanner``: the problem's cost model, schedule
  and micro-batch limit are passed to it where its signature takes them, its host costs
  where it has them and the signature takes ``host``, and its ``min_stages`` where it asks
  for more than one stage and the signature takes ``min_stages``. A plan of fewer stages
  than ``min_stages`` is a ``PlanError`` naming the planner (``too_few_stages_error``)."""

  name: str
  fn: Callable[..., Plan]

  def accepts(self) -> set[str] | None:
    """The keyword names ``fn`` takes (None: any, it has ``**kwargs``)."""
    try:
      params = inspect.signature(self.fn).parameters.values()
    except (TypeError, ValueError):
      return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
      return None
    return {p.name for p in params}

  def plan(self, problem: PlanningProblem, options: Mapping[str, Any] | None = None) -> Plan:
    names = self.accepts()
    given = {
      "cost_model": problem.cost_model,
      "schedule": problem.schedule,
      "max_microbatches": problem.max_microbatches,
    }
    if problem.host is not None:
      given["host"] = problem.host
    if problem.min_stages > 1:
      given["min_stages"] = problem.min_stages
    kw = {k: v for k, v in given.items() if names is None or k in names}
    plan = self.fn(
      problem.layer_graph,
      problem.cluster,
      problem.batch_size,
      num_microbatches=problem.num_microbatches,
      **{**kw, **(options or {})},
    )
    if not problem.enough_stages(plan):
      raise too_few_stages_error(self.name, plan, problem.min_stages, "min_stages" in kw)
    return plan

  def __call__(self, *args: Any, **kw: Any) -> Plan:
    return self.fn(*args, **kw)


RegisteredPlanner = ProblemPlanner | KeywordPlanner


def as_registered(planner: Planner) -> RegisteredPlanner:
  """A registered planner, or any callable in the keyword form (a user's planner) -> an object
  with ``plan(problem, options)`` (``passes.partition.as_planner`` also takes a name)."""
  if isinstance(planner, (ProblemPlanner, KeywordPlanner)):
    return planner
  if not callable(planner):
    raise TypeError(
      f"a planner is a name or a callable (layer_graph, cluster, batch_size, *, "
      f"num_microbatches=None, **options) -> Plan; got {type(planner).__name__}"
    )
  return KeywordPlanner(planner_name(planner), planner)


def planner_name(planner: Planner | str) -> str:
  """A planner's name: its registry name, else the callable's ``__name__``."""
  if isinstance(planner, str):
    return planner
  name = getattr(planner, "name", None) or getattr(planner, "__name__", None)
  return str(name or type(planner).__name__)
