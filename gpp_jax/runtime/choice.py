"""The plan phase of the compile chain (``runtime.compile``): ``Captured`` -> ``Planned``.

``plan_step`` calibrates (``runtime.calibration``), plans (``runtime.planning``) and chooses
among the planner's plan and the candidates a user would run instead (``baseline_plans``,
``fewer_device_plans``, the step in micro-batches on one device, ``ACCUMULATED``), each
predicted for this machine and, when calibrating, compiled and timed by trial (``Trials``,
run by a ``TimingTrials``: ``_timed_baselines``, ``checked_by_trial``), the trials fitting this
machine's calibration (``cost.calibration.MachineCalibration``); ``choose`` takes the fastest
and says where each time comes from (``Choice``)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import jax
import networkx as nx
from absl import logging

from gpp_jax.cost.calibration import MachineCalibration
from gpp_jax.errors import PlanError, counted
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, Stage, validate_plan
from gpp_jax.passes.calibrate import Calibration
from gpp_jax.passes.partition.manual import ManualPlan
from gpp_jax.passes.partition.problem import check_min_stages
from gpp_jax.passes.simulation import simulate_on_host
from gpp_jax.runtime.calibration import (
  Predictor,
  Timed,
  calibrate,
  calibrate_fusion,
  calibrate_spmd,
  calibrate_widths,
  probe_host,
  stage_widths,
  width_groups,
  with_measured_link,
)
from gpp_jax.runtime.captured import Captured
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.planning import (
  BASELINES,
  Machine,
  make_plan,
  planner_cluster,
  predict_seconds,
)
from gpp_jax.runtime.processes import check_same_plan, exchange

# Where a candidate's time in the plan choice comes from (``Choice.how``, ``Planned.how``).
How = Literal["measured", "modelled"]
MEASURED: How = "measured"  # a timing trial of the candidate itself (``trial``)
MODELLED: How = "modelled"  # the cost model / simulator (``predict_seconds``)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One candidate of the plan choice: what would run and what it was judged by.

  Attributes:
    name: "pipeline" (the planner's own plan), "plain jit", "jit data parallel", "jit fsdp",
      "jit sharded", a planner's plan on fewer devices ("graphpipe on 2 devices"), or plain
      jit's step in the planner's micro-batches.
    plan: the plan it runs.
    peak_bytes: its modelled peak bytes per device.
    predicted_s: its predicted seconds per step, as compared; None where it does not fit the
      memory budget (it was not compared).
    how: where ``predicted_s`` comes from: ``"measured"`` (a timing trial of this candidate)
      or ``"modelled"`` (the cost model; ``Choice.how``).
    measured_s: its own timing trial's seconds per call of the compiled step (the host's
      time outside it not included), where it was timed.
  """

  name: str
  plan: Plan
  peak_bytes: float
  predicted_s: float | None = None
  how: How = "modelled"
  measured_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Planned:
  """The plan and the graph it was made for.

  Attributes:
    plan: the validated plan (stages, devices, micro-batches, schedule name).
    layer_graph: the LayerGraph planned over (calibrated times where measured).
    calibration: the measured layer times (``calibrate=True``), else None.
    host: this machine's calibration (``calibrate=True``, ``cost.calibration
      .MachineCalibration``): the host's measured costs (with several processes, process 0's
      of its own devices, ``probe_host``) and what the trials fitted on them (the fusion, the
      model's own SPMD factors), else None.
    predicted_s: seconds per step predicted for the plan on this machine (with ``host``).
    note: one line saying what was chosen and why ("" for a plan the user gave).
    trial: the chosen plan's compiled step, when a trial compiled it already.
    measured: the candidates compiled and timed while choosing: name -> seconds per call of
      the compiled step (the host's time outside it not included).
    candidates: every candidate considered, by name (``Candidate``), those over the memory
      budget too; less any a trial found over the budget as compiled.
    memory_limit: the memory budget per device the candidates were held to.
    chosen: the name of the candidate that runs (``"pipeline"`` for the planner's own plan
      and a plan the user gave).
  """

  plan: Plan
  layer_graph: nx.DiGraph
  calibration: Calibration | None = None
  host: MachineCalibration | None = None
  predicted_s: float | None = None
  note: str = ""
  trial: Any = None
  measured: Mapping[str, float] = dataclasses.field(default_factory=dict)
  candidates: Mapping[str, Candidate] = dataclasses.field(default_factory=dict)
  memory_limit: float | None = None
  chosen: str = "pipeline"

  @property
  def alternatives(self) -> dict[str, float]:
    """The candidates compared: name -> predicted seconds per step (those that fit)."""
    return {k: c.predicted_s for k, c in self.candidates.items() if c.predicted_s is not None}

  @property
  def how(self) -> dict[str, How]:
    """Per name of ``alternatives``, where its time comes from (``Candidate.how``)."""
    return {k: c.how for k, c in self.candidates.items() if c.predicted_s is not None}

  @property
  def memory(self) -> dict[str, float]:
    """Every candidate's modelled peak bytes per device, those over the budget too."""
    return {k: c.peak_bytes for k, c in self.candidates.items()}

  @property
  def plans(self) -> dict[str, Plan]:
    """The plans compared, by the names of ``alternatives``."""
    return {k: c.plan for k, c in self.candidates.items() if c.predicted_s is not None}

  @property
  def predicted_how(self) -> How:
    """Where ``predicted_s`` comes from: the chosen candidate's ``how``."""
    c = self.candidates.get(self.chosen)
    return c.how if c is not None else MODELLED


class TimingTrials(Protocol):
  """What compiles and times the plan choice's candidates (``runtime.compile.StepTrials``):
  the trials ``plan_step`` takes (``Trials``)."""

  def time(self, plan: Plan, outside: float = 0.0) -> tuple[Any, float]:
    """``plan``'s step, compiled and timed: (the compiled step, seconds per call in a
    training loop whose host spends ``outside`` seconds a step outside the program, less
    those: ``runtime.build.time_step``). Raises ``PlanError`` where its compiled program does
    not fit the memory budget."""
    ...

  def again(self, step: Any, outside: float = 0.0) -> float:
    """Seconds per call of a trial's compiled ``step`` (as ``time``), timed once more."""
    ...


class Trials:
  """The timing trials taken while choosing (``taken``: candidate name -> (compiled step,
  seconds per call)), run by a ``TimingTrials``, each as a training loop whose host spends
  ``outside`` seconds a step outside the program runs it (``HostCosts.outside``; the seconds
  kept leave them out, as the predictions add them). With several processes all take process
  0's clock (plain jit runs there alone), and a candidate that does not fit on one process
  fits on none, so that all choose alike."""

  def __init__(self, timing: TimingTrials, timeout_s: float, outside: float = 0.0):
    self.timing = timing
    self.timeout_s = timeout_s
    self.outside = outside
    self.taken: dict[str, tuple[Any, float]] = {}

  def take(self, name: str, plan: Plan) -> bool:
    """Times ``plan`` into ``taken[name]``; False where it does not fit the memory budget (its
    compiled program says so; the caller decides whether the candidate leaves)."""
    try:
      result: tuple[Any, float] | None = self.timing.time(plan, self.outside)
    except PlanError:
      result = None
    if jax.process_count() > 1:
      times = exchange("trial", "-" if result is None else repr(result[1]), self.timeout_s)
      if result is not None:
        result = None if "-" in times else (result[0], float(times[0]))
    if result is None:
      return False
    self.taken[name] = result
    return True

  def interleave(self, names: Sequence[str], rounds: int | None = None) -> None:
    """The trials ``names`` timed ``rounds`` (default ``TRIAL_ROUNDS``) more times in turns
    (``TimingTrials.again``), backwards and forwards in alternate rounds; each keeps the
    median of its times, the trial's own included. Trials taken one after another fall in
    different spells of a shared machine's speed, which last from milliseconds to seconds:
    on 2 cores, one step measured 1.4x apart in one run (docs/results/fidelity.md), enough to
    flip a choice between steps within 20% of each other. With several processes every
    process times the same steps in the same order, and all take process 0's clock, as
    ``take`` does."""
    taken = self.taken
    names = [k for k in names if k in taken]
    rounds = TRIAL_ROUNDS if rounds is None else rounds
    if len(names) < 2 or rounds < 1:
      return
    seen = {k: [taken[k][1]] for k in names}
    for r in range(rounds):
      order = names[::-1] if r % 2 == 0 else names
      times = [self.timing.again(taken[k][0], self.outside) for k in order]
      if jax.process_count() > 1:
        times = json.loads(exchange("retime", json.dumps(times), self.timeout_s)[0])
      for k, t in zip(order, times):
        seen[k].append(t)
    for k in names:
      taken[k] = (taken[k][0], statistics.median(seen[k]))


TRIAL_ROUNDS = 2  # rounds of timing in turns after the trials (``Trials.interleave``)


def plan_step(
  captured: Captured,
  opts: Options,
  timing: TimingTrials | None = None,
  call_outside: Callable[[], float | None] | None = None,
) -> Planned:
  """Calibrates (if asked), plans, validates; with several processes, checks that every
  process has the same plan.

  What a user would run instead of a pipeline is in the plan space: a planner's plan competes
  with plain jit on one device, jit data parallel over the devices (one-stage plans, run as
  one jitted step) and its own plans on fewer devices, each predicted for this machine
  (``predict_seconds`` with the host's measured costs), and the fastest is taken.
  ``min_stages`` keeps the planner's own search to plans of at least that many stages (its
  best such plan is its plan: ``PlanningProblem.min_stages``; no other planner stands in) and
  leaves out the candidates of fewer stages. Without calibration (layer times estimated, the
  host not measured) the planner's plan is kept and a faster baseline only noted. A plan the
  user gives is run as it is, with the same prediction.

  The host's time outside the program per call is what ``call_outside`` measures where given, in
  one process (on the step's own arguments, on the path it is called by:
  ``GraphPipeline.seconds_outside``, ``CachedStep.seconds_outside``), else the host probe's
  (a small functional step's; with several processes, process 0's, so that all plan alike).

  When calibrating, the planner searches with the host's measured costs (``make_plan(host=)``
  with a ``MachineCalibration``: every plan it compares is predicted for this machine), after
  the layers are timed at each width a pipeline's stage may take (``stage_widths``,
  ``calibrate_widths``; on CPU devices of one process), and once more after the trials below
  have fitted the fusion and the model's own SPMD factor into the calibration (one-stage
  plans are priced with them only then).

  When calibrating, ``timing`` (``TimingTrials.time``) compiles and times plain jit: the
  measured step calibrates the layer times' sum against what XLA makes of the whole
  model (``fusion``: their ratio, applied to the one-stage candidates, which XLA compiles as
  one program; a pipeline's stages are compiled apart, as the layers were timed), and if
  plain jit is chosen its compiled step is kept (``Planned.trial``). Jit data parallel is
  timed the same way (``calibrate_spmd``). Plain jit's step in the planner's micro-batches
  on its device (gradient accumulation) is timed beside plain jit, and the planner's plan
  where it is jit data parallel's step in micro-batches beside that: the two times of one
  width fit the fusion (one device) or the model's SPMD factor (several) and the fixed
  seconds each micro-batch pays apart. The step in micro-batches on one device is then a
  candidate too (``"plain jit in micro-batches"``, unless ``min_stages`` asks for a
  pipeline), chosen where it measured faster than plain jit. The candidate then predicted
  fastest, if none of these, is timed before it is taken (``checked_by_trial``).

  ``TimingTrials.again`` times a trial's step once more: the steps compared are then timed
  in turns (``Trials.interleave``), so that a slow or fast spell of the machine does not
  fall on one of them only."""
  graph = captured.layering.graph
  B = captured.batch_size
  given = given_plan(opts)
  if not given:  # before anything is timed: the stages asked for must be possible
    check_min_stages(
      opts.min_stages, len(opts.devices), graph.number_of_nodes(), opts.layout is not None
    )
  calibration = machine = None
  if opts.calibrate:
    calibration = calibrate(captured, opts)
    graph = calibration.apply(graph)
    if opts.host_probe is not None:
      host = probe_host(opts)
      if host is not None and call_outside is not None and jax.process_count() == 1:
        path = call_outside()
        if path is not None:  # the step's own call path
          host = dataclasses.replace(host, outside=path)
      opts = with_measured_link(opts, host)
      machine = MachineCalibration(host) if host is not None else None
  if calibration is not None and machine is not None and not given:
    # The planner searches with the host's measured costs: every plan it compares is
    # predicted for this machine, as the candidates below are. A stage over several devices
    # is priced by its layers timed that wide, so each width a stage may take is timed first.
    widths = stage_widths(len(opts.devices), captured.microbatch_size)
    graph = calibrate_widths(captured, graph, machine, width_groups(opts.devices, (), widths))
  plan = make_plan(graph, B, opts, machine)
  cluster = planner_cluster(opts)
  candidates = {"pipeline": plan}
  if not given:
    candidates.update(baseline_plans(graph, B, opts, sharded=any(captured.leaf_specs)))
    if machine is not None:  # where the host is the bottleneck, fewer devices can be faster
      candidates.update(fewer_device_plans(graph, B, opts, machine))
    candidates = {
      k: p for k, p in candidates.items() if k == "pipeline" or p.num_stages >= opts.min_stages
    }
  if calibration is not None:  # stages over several devices (of any width not timed yet)
    groups = width_groups(opts.devices, candidates.values())
    graph = calibrate_widths(captured, graph, machine, groups)
  outside = machine.outside if machine is not None else 0.0
  trials = Trials(timing, opts.timeout_s, outside) if timing is not None else None
  # The plain step, timed, calibrates one-stage predictions (a given pipeline needs none).
  if machine is not None and trials is not None and (not given or plan.num_stages == 1):
    baselines = _timed_baselines(graph, B, opts, candidates, trials)
    machine = baselines.fitted(trials, Predictor(lg.scaled(graph, B), cluster), machine)
    if not given and trials.taken:
      graph, plan = _searched_again(captured, opts, graph, machine, candidates)
    baselines.settle(trials, candidates, not given and opts.min_stages <= 1)
  taken = trials.taken if trials is not None else {}
  measured = {k: t for k, (_, t) in taken.items()}
  chose = choose(candidates, lg.scaled(graph, B), cluster, machine, measured)
  choice, predicted = chose.name, chose.predicted
  note = ""
  if trials is not None and not given and choice not in taken:
    choice, note = checked_by_trial(choice, trials, candidates, predicted)
  if note:
    logging.info("graph_pipeline: %s", note)
    plan = candidates[choice]
  else:
    choice, note = _choice_note(chose, candidates, measured, machine)
    plan = candidates[choice] if choice != "pipeline" else plan
  if not given and opts.min_stages > 1:
    kept_to = (
      f"min_stages={opts.min_stages}: {plan.planner}'s search kept to plans of at least "
      f"{opts.min_stages} stages"
    )
    note = f"{kept_to}; {note}" if note else kept_to
  if jax.process_count() > 1:
    check_same_plan(plan, opts.timeout_s)
  kept = taken[choice][0] if choice in taken else None
  measured = {k: t for k, (_, t) in taken.items()}
  scaled = lg.scaled(graph, B)
  judged = {
    k: Candidate(
      k,
      p,
      predicted_peak(p, scaled, cluster, machine),
      predicted.get(k),
      chose.how.get(k, MODELLED),
      measured.get(k),
    )
    for k, p in candidates.items()
  }
  return Planned(
    plan,
    graph,
    calibration,
    machine,
    predicted[choice],
    note,
    kept,
    measured,
    judged,
    cluster.memory_per_device,
    choice,
  )


def given_plan(opts: Options) -> bool:
  """Whether the user gave the plan (a ``Plan`` or a manual plan): it runs as it is."""
  return isinstance(opts.planner, (Plan, ManualPlan))


@dataclasses.dataclass(frozen=True)
class _Baselines:
  """The plans ``_timed_baselines`` timed, and what their trials calibrate.

  Attributes:
    plain: plain jit.
    one_acc: plain jit's step in the planner's micro-batches on its device (gradient
      accumulation); None where the batch does not split into them.
    dp: jit data parallel; None where it is no candidate.
    first: the planner's plan when they were timed.
    wide_acc: whether ``first`` is jit data parallel's step in micro-batches.
  """

  plain: Plan
  one_acc: Plan | None
  dp: Plan | None
  first: Plan
  wide_acc: bool

  def fitted(
    self, trials: Trials, predictor: Predictor, machine: MachineCalibration
  ) -> MachineCalibration:
    """``machine`` with the fusion and the model's own SPMD factor fitted to the trials
    (``calibrate_fusion``, ``calibrate_spmd``; each with the fixed seconds a micro-batch pays,
    where the step in micro-batches of the same width was timed too)."""
    taken, one_acc = trials.taken, self.one_acc
    if "plain jit" in taken:
      timed = taken.get(ACCUMULATED)
      if one_acc is not None and is_same(self.first, one_acc):
        timed = taken.get("pipeline")
      pieces = Timed(one_acc, timed[1]) if one_acc is not None and timed is not None else None
      plain = Timed(self.plain, taken["plain jit"][1])
      machine = calibrate_fusion(predictor, machine, plain, pieces)
    if self.dp is not None and "jit data parallel" in taken:
      wide = self.wide_acc and "pipeline" in taken
      pieces = Timed(self.first, taken["pipeline"][1]) if wide else None
      dp = Timed(self.dp, taken["jit data parallel"][1])
      machine = calibrate_spmd(predictor, machine, dp, pieces)
    return machine

  def settle(self, trials: Trials, candidates: dict[str, Plan], keep: bool) -> None:
    """The trials as the candidates stand after the planner's last search: a new plan drops
    the first one's timing (it takes the step in micro-batches' where it is that step).
    Where ``keep`` (the plan is the planner's and ``min_stages`` asks for no pipeline), plain
    jit's step in micro-batches, timed, is a candidate, chosen where it measured faster than
    plain jit (``choose``), unless it is the planner's plan, timed as ``"pipeline"``; else
    its timing is dropped."""
    taken, one_acc, plan = trials.taken, self.one_acc, candidates["pipeline"]
    if not is_same(plan, self.first):
      taken.pop("pipeline", None)  # the first plan's timing
      if one_acc is not None and ACCUMULATED in taken and is_same(plan, one_acc):
        taken["pipeline"] = taken[ACCUMULATED]  # the step it timed
    if one_acc is not None and ACCUMULATED in taken and keep:
      if is_same(plan, one_acc):
        taken.pop(ACCUMULATED)  # the planner's plan, timed as "pipeline"
      else:  # timed: chosen where it measured faster than plain jit (``choose_plan``)
        candidates[ACCUMULATED] = one_acc
    else:
      taken.pop(ACCUMULATED, None)


def _timed_baselines(
  graph: nx.DiGraph, batch_size: int, opts: Options, candidates: dict[str, Plan], trials: Trials
) -> _Baselines:
  """``plan_step``'s timing trials of the baselines (into ``trials``): plain jit, its step in
  the planner's micro-batches, jit data parallel (and the planner's plan where it is that
  step in micro-batches), timed in turns (``Trials.interleave``). A baseline over the memory
  budget as compiled leaves the candidates."""
  B, given = batch_size, given_plan(opts)
  # Layers timed one call each add up to more than XLA makes of the whole model (it fuses
  # across layers): plain jit, compiled and timed, says by how much.
  plain = candidates.get("plain jit") or baseline_plans(graph, B, opts, (1,))["plain jit"]
  if not trials.take("plain jit", plain):
    candidates.pop("plain jit", None)
  # Jit data parallel timed too: how much slower than 1/k of plain jit's time its step is
  # over k devices depends on the model (its share of work per device against the
  # collectives), which the host's probe of a small MLP only guesses (measured 0.5x to 3.5x
  # off: BUILD_NOTES.md, "Choosing what runs"). It is what a user would run: measured, not
  # modelled.
  dp = candidates.get("jit data parallel")
  # Plain jit's step in the planner's micro-batches on its one device (gradient
  # accumulation) is timed beside it, and where the planner's plan is jit data parallel's
  # step in micro-batches, that too: the two times of one width tell the fixed seconds each
  # micro-batch pays from the share of work that divides (``calibrate_fusion``,
  # ``calibrate_spmd``). Timed whatever the planner's first plan, since the second search
  # may return it. A plan over the memory budget leaves no candidate here.
  acc = candidates["pipeline"]
  M = opts.num_microbatches or acc.num_microbatches
  one_acc = plain.replace(num_microbatches=M) if M > 1 and B % M == 0 else None
  if "plain jit" in trials.taken and one_acc is not None and (not given or is_same(acc, one_acc)):
    trials.take("pipeline" if is_same(acc, one_acc) else ACCUMULATED, one_acc)
  wide_acc = dp is not None and acc.num_stages == 1 and acc.num_microbatches > 1
  wide_acc = wide_acc and dp is not None and acc.stages[0].devices == dp.stages[0].devices
  if dp is not None:
    if not trials.take("jit data parallel", dp):
      candidates.pop("jit data parallel", None)
    if "jit data parallel" in trials.taken and wide_acc:
      trials.take("pipeline", acc)
  trials.interleave(list(trials.taken))
  return _Baselines(plain, one_acc, dp, acc, wide_acc)


def _searched_again(
  captured: Captured,
  opts: Options,
  graph: nx.DiGraph,
  machine: MachineCalibration,
  candidates: dict[str, Plan],
) -> tuple[nx.DiGraph, Plan]:
  """The planner's search again on ``machine`` as the trials calibrated it: the first search
  ran before the trials said what XLA makes of a step in one program (the fusion, the
  model's own SPMD factor, the fixed seconds per micro-batch), so it priced one-stage plans
  with the host's probe only. A new plan replaces the first as ``candidates["pipeline"]``,
  its stages' widths timed (``calibrate_widths``). Returns the graph and the planner's plan."""
  plan = candidates["pipeline"]
  better_plan = make_plan(graph, captured.batch_size, opts, machine)
  if plan_shape(better_plan) == plan_shape(plan):
    return graph, plan
  logging.info(
    "graph_pipeline: searched again with the trials' calibration, %s's plan has %s (first: %d)",
    better_plan.planner,
    counted(better_plan.num_stages, "stage"),
    plan.num_stages,
  )
  candidates["pipeline"] = better_plan
  groups = width_groups(opts.devices, [better_plan])
  return calibrate_widths(captured, graph, machine, groups), better_plan


def _choice_note(
  chose: Choice,
  candidates: Mapping[str, Plan],
  measured: Mapping[str, float],
  machine: MachineCalibration | None,
) -> tuple[str, str]:
  """What runs and why, where no trial overturned the prediction ``chose``: (the choice, the
  note said of it). Without the host's costs (``machine`` None) the planner's plan
  (``candidates["pipeline"]``) is kept, and a faster baseline only noted; else the candidate
  predicted fastest runs, and the note says what it beat (or, for the planner's one-stage
  plan in micro-batches, what its measurement beat)."""
  choice, predicted, plan = chose.name, chose.predicted, candidates["pipeline"]
  note = ""
  if choice != "pipeline" and machine is None:
    # Devices-only layer estimates are not this machine's: say so, keep the planner's plan.
    if predicted[choice] < predicted["pipeline"]:
      note = (
        f"{choice} is predicted faster than {plan.planner}'s pipeline of "
        f"{counted(plan.num_stages, 'stage')} by the devices-only model "
        f"({predicted[choice] * 1e3:.2f} against {predicted['pipeline'] * 1e3:.2f} ms); "
        "calibrate=True measures this machine and "
        "chooses by it"
      )
      logging.info("graph_pipeline: %s", note)
    choice = "pipeline"
  elif choice != "pipeline":
    theirs = (
      f"pipeline of {plan.num_stages} stages"
      if plan.num_stages > 1
      else f"one stage of {plan.num_microbatches} micro-batches"
    )
    note = (
      f"{choice} is predicted fastest on this machine: {predicted[choice] * 1e3:.2f} ms per "
      f"step against {predicted['pipeline'] * 1e3:.2f} ms for {plan.planner}'s {theirs}"
    )
    if predicted[choice] > predicted["pipeline"]:  # the planner's plan accumulates gradients
      note = (
        f"{choice} runs the step in one call ({predicted[choice] * 1e3:.2f} ms predicted): "
        f"{plan.planner}'s {theirs} ({predicted['pipeline'] * 1e3:.2f} ms predicted) is the "
        "same computation in pieces, which saves memory, not time"
      )
    if candidates[choice].num_stages == 1:
      note += " (min_stages=2 runs a pipeline regardless)"
    logging.info("graph_pipeline: %s", note)
  elif choice == "pipeline" and plan.num_stages == 1 and plan.num_microbatches > 1:
    base = "plain jit" if len(plan.stages[0].devices) == 1 else "jit data parallel"
    if "pipeline" in measured and base in measured:  # chosen for its measurement
      note = (
        f"{plan.planner}'s one stage of {plan.num_microbatches} micro-batches measured "
        f"{measured['pipeline'] * 1e3:.2f} ms per step, faster than {base}'s "
        f"{measured[base] * 1e3:.2f} ms in one call"
      )
      logging.info("graph_pipeline: %s", note)
  return choice, note


def predicted_peak(plan: Plan, graph: nx.DiGraph, cluster: Any, host: Machine | None) -> float:
  """The cost model's peak bytes per device of ``plan`` (its largest stage's)."""
  if not plan.batch_size:
    plan = plan.replace(batch_size=graph.graph["batch_size"])
  return max(simulate_on_host(plan, graph, cluster, host).stage_memory, default=0.0)


def plan_shape(plan: Plan) -> tuple:
  """What makes two plans the same step: each stage's layers and devices, the micro-batches."""
  return tuple((s.layers, s.devices) for s in plan.stages), plan.num_microbatches


def is_same(a: Plan, b: Plan) -> bool:
  """Whether ``a`` and ``b`` are the same step (``plan_shape``)."""
  return plan_shape(a) == plan_shape(b)


# The trial of plain jit's step in the planner's micro-batches (gradient accumulation on one
# device), where that is not the planner's plan: it fits the fusion, and it is a candidate,
# chosen where it measured faster than plain jit (medium MMT on 8 forced CPU devices: 0.81x).
ACCUMULATED = "plain jit in micro-batches"


def checked_by_trial(
  choice: str,
  trials: Trials,
  candidates: dict[str, Plan],
  predicted: Mapping[str, float],
) -> tuple[str, str]:
  """The candidate predicted fastest, compiled and timed like the baselines before it is
  taken (``trials``): (the choice, "" where it stands; else the fastest candidate timed, and
  the note that says why). Where no baseline among ``candidates`` was timed, the prediction
  stands alone. The predictions of one-call steps are their measurements; a pipeline's is the
  simulator's, which misses what the host and the devices do to it on some machines
  (docs/results/fidelity.md). Its compiled step is kept, so a pipeline that stands is compiled
  once. It and the fastest baseline are then timed in turns (``Trials.interleave``); one that
  does not fit the memory budget as compiled leaves the candidates."""
  # Only candidates the cost model found to fit the memory budget (``predicted``) compete: a
  # baseline timed to calibrate (plain jit, always) may not.
  taken = trials.taken
  timed = [k for k in taken if k in candidates and k in predicted]
  if not timed:
    return choice, ""
  if not trials.take(choice, candidates[choice]):
    candidates.pop(choice, None)
  best = min(timed, key=lambda k: taken[k][1])
  what = f"{choice} ({predicted[choice] * 1e3:.2f} ms predicted)"
  if choice not in taken:
    return best, f"{what} does not fit the memory budget as compiled: {best} runs instead"
  trials.interleave([best, choice])  # the two compared, timed in turns
  mine, theirs = taken[choice][1], taken[best][1]
  if mine <= theirs:
    return choice, ""
  return best, (
    f"{what} measured {mine * 1e3:.2f} ms per step, slower than {best}'s {theirs * 1e3:.2f} ms: "
    f"{best} runs instead (min_stages=2 runs a pipeline regardless)"
  )


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``choose`` decided.

  Attributes:
    name: the candidate predicted fastest (of those it may choose: ``choose``).
    predicted: seconds per step of each candidate that fits the memory budget (the
      ``"pipeline"`` always), as compared.
    how: per name of ``predicted``, where its time comes from: ``"measured"`` where it is a
      timing trial's of that very candidate (with the host's costs, a timed one-call step's
      prediction is its measurement plus the host's time outside the step; gradient
      accumulation measured faster than its one-call step is that step's measured time
      scaled by the two measurements), ``"modelled"`` where it is the cost model's
      (simulator's) prediction, calibrated or not, whether or not the candidate was timed
      (a pipeline timed before it is taken keeps its modelled time here: the trial that
      checks it is ``Planned.measured``'s).
  """

  name: str
  predicted: dict[str, float]
  how: dict[str, How]


def choose_plan(
  candidates: Mapping[str, Plan],
  graph: nx.DiGraph,
  cluster: Any,
  host: Machine | None,
  measured: Mapping[str, float] | None = None,
) -> tuple[str, dict[str, float]]:
  """(the name of the candidate predicted fastest, seconds predicted per candidate):
  ``choose``'s name and predictions (its ``how`` left out)."""
  c = choose(candidates, graph, cluster, host, measured)
  return c.name, c.predicted


def choose(
  candidates: Mapping[str, Plan],
  graph: nx.DiGraph,
  cluster: Any,
  host: Machine | None,
  measured: Mapping[str, float] | None = None,
) -> Choice:
  """The candidate predicted fastest, the seconds predicted per candidate and where each
  time comes from (``Choice``), over ``graph`` (scaled to the batch) on ``cluster`` with the
  host's costs (``predict_seconds``).
  Candidates whose predicted memory does not fit are left out, except ``"pipeline"`` (the
  planner's own plan, which fits by construction or was asked for); on a tie (``TIE``) it
  wins, then a measured time over a modelled one.

  Gradient accumulation (one stage, several micro-batches) is the one-call step's
  computation in pieces: it saves memory, mostly not time (the loop measured 1.3-2.6x plain
  jit's step, on an H200 and on forced CPU devices; over 4 forced CPU devices, 1.5-2.8x jit
  data parallel's), though the cost model, linear in the micro-batch, ties the two where the
  fixed seconds each micro-batch pays were not fitted (``calibrate_fusion``,
  ``calibrate_spmd``). Where a one-call candidate over the same number of devices fits (plain
  jit on one, jit data parallel on all), it is not chosen, unless trials timed both
  (``measured``: name -> seconds per call) and the step in micro-batches measured faster
  (medium MMT on one forced CPU device in 4 micro-batches: 0.92x plain jit's time,
  docs/results/fidelity.md): it is then predicted at the one-call step's prediction times the
  ratio of the two measurements.

  With the host's costs, a one-call step that was timed is predicted at its trial
  (``measured``) plus the host's time outside the step, labelled measured (``Choice.how``);
  every other time is modelled."""
  predicted = {}
  for name, p in candidates.items():
    seconds, fits = predict_seconds(p, graph, cluster, host)
    if fits or name == "pipeline":
      predicted[name] = seconds

  def one_stage_width(p: Plan) -> int | None:
    return len(p.stages[0].devices) if p.num_stages == 1 else None

  in_one_call: dict[int | None, str] = {}
  for k in BASELINES:  # the first of each width: plain jit, jit data parallel
    if k in predicted:
      in_one_call.setdefault(one_stage_width(candidates[k]), k)
  timed = measured or {}
  how: dict[str, How] = dict.fromkeys(predicted, MODELLED)
  if host is not None:
    # A one-call step that was timed is predicted at its trial's time plus the host's outside
    # the step. The fits solve for that, except where a floor held the factor (tiny steps, on
    # which the calibrated model then prices plain jit above its trial); the trial times the
    # very step.
    for k in predicted:
      p = candidates[k]
      if k in timed and p.num_stages == 1 and p.num_microbatches <= 1:
        predicted[k] = timed[k] + host.outside
        how[k] = MEASURED
  choosable = []
  for k in predicted:
    p = candidates[k]
    base = in_one_call.get(one_stage_width(p))
    if k in BASELINES or p.num_microbatches <= 1 or base is None:
      choosable.append(k)  # not gradient accumulation beside a one-call step
    elif k in timed and base in timed and timed[k] < timed[base]:
      predicted[k] = predicted[base] * timed[k] / timed[base]
      how[k] = how[base]  # the one-call step's time, scaled by the two trials
      choosable.append(k)  # measured faster than the one-call step
  return Choice(fastest(choosable, predicted, how), predicted, how)


def fastest(names: Sequence[str], predicted: Mapping[str, float], how: Mapping[str, How]) -> str:
  """The name of ``names`` predicted fastest; among those tied with it (``TIE``) the
  planner's plan (``"pipeline"``), then a measured time over a modelled one."""
  best = min(predicted[k] for k in names)
  tied = [k for k in names if predicted[k] <= best * (1 + TIE)]
  return min(tied, key=lambda k: (k != "pipeline", how[k] != MEASURED, predicted[k]))


# Predictions this close (relative) are a tie, which the planner's plan wins, then a measured
# time over a modelled one: a baseline's trial and another's fitted model of the same step
# differ in the last bits, and which of them is smaller should not decide the step.
TIE = 1e-9


def baseline_plans(
  graph: nx.DiGraph,
  batch_size: int,
  opts: Options,
  widths: Sequence[int] | None = None,
  sharded: bool = False,
) -> dict[str, Plan]:
  """What a user would run instead, the whole batch in one call (one micro-batch): all
  layers as one stage on the first device (plain jit) and over all devices, the batch split
  over them: jit data parallel (parameters replicated), jit fsdp (parameters, gradients and
  optimizer state sharded over all devices, ``Plan.param_sharding``) and, where the model has
  partition specs (``sharded``), jit sharded (them over the user's whole mesh); ``widths``
  picks by number of devices (default: both)."""
  layers = tuple(lg.topo_layers(graph))
  out = {}
  n = len(opts.devices)
  for k in widths or (1, n):
    if k == 1:
      kinds = {"plain jit": "model"}
    elif k < 2 or batch_size % k:
      continue
    else:
      kinds = {"jit data parallel": "replicated" if sharded else "model", "jit fsdp": "fsdp"}
      if sharded:
        kinds["jit sharded"] = "model"
    for name, how in kinds.items():
      plan = Plan(
        (Stage(0, layers, tuple(range(k))),),
        (),
        1,
        planner=name,
        batch_size=batch_size,
        param_sharding=how,
      )
      validate_plan(plan, graph, n, batch_size)
      out[name] = plan
  return out


def fewer_device_plans(
  graph: nx.DiGraph, batch_size: int, opts: Options, host: Machine | None = None
) -> dict[str, Plan]:
  """The planner's plans on the first 2, 4, 8, ... of the devices (fewer than all), for a
  machine where more devices do not compute more at once (forced CPU devices sharing the
  host's cores) or each action's issue costs more than it saves (searched with ``host``, as
  ``make_plan``); none on fewer devices than ``min_stages`` stages need."""
  out: dict[str, Plan] = {}
  n = len(opts.devices)
  cluster = planner_cluster(opts)
  if cluster.inter_link is not None:
    return out
  k = 2
  while k < opts.min_stages:
    k *= 2
  while k < n:
    sub = dataclasses.replace(
      opts, devices=tuple(opts.devices[:k]), cluster=cluster.replace(num_devices=k)
    )
    try:
      out[f"{opts.planner if isinstance(opts.planner, str) else 'planner'} on {k} devices"] = (
        make_plan(graph, batch_size, sub, host)
      )
    except PlanError as e:
      logging.info("graph_pipeline: no plan on %d devices: %s", k, e)
    k *= 2
  return out
