"""The plan phase of the compile chain (``runtime.compile``): ``Captured`` -> ``Planned``.

``plan_step`` calibrates (``runtime.calibration``), plans (``runtime.planning``) and chooses
among the planner's plan and the candidates a user would run instead (``baseline_plans``,
``fewer_device_plans``, the step in micro-batches on one device, ``ACCUMULATED``), each
predicted for this machine and, when calibrating, compiled and timed by trial (``_timed``,
``_interleaved``, ``checked_by_trial``); ``choose`` takes the fastest and says where each time
comes from (``Choice``)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import networkx as nx
from absl import logging

from gpp_jax.cost.host import HostCosts
from gpp_jax.errors import PlanError
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, Stage, validate_plan
from gpp_jax.passes.calibrate import Calibration
from gpp_jax.passes.partition.manual import ManualPlan
from gpp_jax.passes.partition.problem import check_min_stages
from gpp_jax.passes.simulation import simulate_on_host
from gpp_jax.runtime.calibration import (
  calibrate,
  calibrate_fusion,
  calibrate_spmd,
  calibrate_widths,
  probe_host,
  stage_widths,
  with_measured_link,
)
from gpp_jax.runtime.captured import Captured
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.planning import BASELINES, make_plan, planner_cluster, predict_seconds
from gpp_jax.runtime.processes import check_same_plan, exchange

# Where a candidate's time in the plan choice comes from (``Choice.how``, ``Planned.how``).
How = Literal["measured", "modelled"]
MEASURED: How = "measured"  # a timing trial of the candidate itself (``trial``)
MODELLED: How = "modelled"  # the cost model / simulator (``predict_seconds``)


@dataclasses.dataclass(frozen=True)
class Planned:
  """The plan and the graph it was made for.

  Attributes:
    plan: the validated plan (stages, devices, micro-batches, schedule name).
    layer_graph: the LayerGraph planned over (calibrated times where measured).
    calibration: the measured layer times (``calibrate=True``), else None.
    host: the host's measured costs (``calibrate=True``; with several processes, process
      0's of its own devices, ``probe_host``), else None.
    predicted_s: seconds per step predicted for the plan on this machine (with ``host``).
    alternatives: what else was predicted: candidate name -> seconds ("pipeline": the
      planner's plan, "plain jit", "jit data parallel").
    note: one line saying what was chosen and why ("" for a plan the user gave).
    measured: the candidates compiled and timed while choosing: name -> seconds per call of
      the compiled step (the host's time outside it not included).
    candidates: the plans ``alternatives`` predicted, by the same names (the planner's own
      plan is ``"pipeline"``, whichever was chosen), less any a trial found over the memory
      budget as compiled.
    how: per name of ``alternatives``, where its time comes from: ``"measured"`` (a timing
      trial of that candidate) or ``"modelled"`` (the cost model; ``Choice.how``).
    chosen: the name of the candidate that runs (``"pipeline"`` for the planner's own plan
      and a plan the user gave).
  """

  plan: Plan
  layer_graph: nx.DiGraph
  calibration: Calibration | None = None
  host: HostCosts | None = None
  predicted_s: float | None = None
  alternatives: Mapping[str, float] = dataclasses.field(default_factory=dict)
  note: str = ""
  trial: Any = None  # the chosen plan's compiled step, when a trial compiled it already
  measured: Mapping[str, float] = dataclasses.field(default_factory=dict)
  candidates: Mapping[str, Plan] = dataclasses.field(default_factory=dict)
  # Every candidate considered, those over the budget too: its modelled peak bytes per device.
  memory: Mapping[str, float] = dataclasses.field(default_factory=dict)
  memory_limit: float | None = None
  how: Mapping[str, How] = dataclasses.field(default_factory=dict)
  chosen: str = "pipeline"

  @property
  def predicted_how(self) -> How:
    """Where ``predicted_s`` comes from: the chosen candidate's ``how``."""
    return self.how.get(self.chosen, MODELLED)


def plan_step(
  captured: Captured,
  opts: Options,
  trial: Callable[[Plan], tuple[Any, float]] | None = None,
  again: Callable[[Any], float] | None = None,
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

  When calibrating, the planner searches with the host's measured costs (``make_plan(host=)``:
  every plan it compares is predicted for this machine), after the layers are timed at each
  width a pipeline's stage may take (``stage_widths``, ``calibrate_widths``; on CPU devices of
  one process), and once more after the trials below have fitted the fusion and the model's
  own SPMD factor (one-stage plans are priced with them only then).

  When calibrating, ``trial(plan)`` compiles and times plain jit (``(compiled step, seconds)``):
  the measured step calibrates the layer times' sum against what XLA makes of the whole
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

  ``again(compiled step)`` times a trial's step once more (seconds per call): the steps
  compared are then timed in turns (``_interleaved``), so that a slow or fast spell of the
  machine does not fall on one of them only."""
  graph = captured.layering.graph
  B = captured.batch_size
  given = isinstance(opts.planner, (Plan, ManualPlan))
  if not given:  # before anything is timed: the stages asked for must be possible
    check_min_stages(
      opts.min_stages, len(opts.devices), graph.number_of_nodes(), opts.layout is not None
    )
  calibration = host = None
  if opts.calibrate:
    calibration = calibrate(captured, opts)
    graph = calibration.apply(graph)
    if opts.host_probe is not None:
      host = probe_host(opts)
      opts = with_measured_link(opts, host)
  if calibration is not None and host is not None and not given:
    # The planner searches with the host's measured costs: every plan it compares is
    # predicted for this machine, as the candidates below are. A stage over several devices
    # is priced by its layers timed that wide, so each width a stage may take is timed first.
    widths = stage_widths(len(opts.devices), captured.microbatch_size)
    graph = calibrate_widths(captured, graph, (), host, opts.devices, widths)
  plan = make_plan(graph, B, opts, host)
  cluster = planner_cluster(opts)
  candidates = {"pipeline": plan}
  if not given:
    candidates.update(baseline_plans(graph, B, opts, sharded=any(captured.leaf_specs)))
    if host is not None:  # where the host is the bottleneck, fewer devices can be faster
      candidates.update(fewer_device_plans(graph, B, opts, host))
    candidates = {
      k: p for k, p in candidates.items() if k == "pipeline" or p.num_stages >= opts.min_stages
    }
  if calibration is not None:  # stages over several devices (of any width not timed yet)
    graph = calibrate_widths(captured, graph, candidates.values(), host, opts.devices)
  trials: dict[str, tuple[Any, float]] = {}
  # The plain step, timed, calibrates one-stage predictions (a given pipeline needs none).
  if host is not None and trial is not None and (not given or plan.num_stages == 1):
    graph, plan = _timed_baselines(
      captured, opts, graph, plan, candidates, trials, trial, again, host, cluster, given
    )
  measured = {k: t for k, (_, t) in trials.items()}
  chose = choose(candidates, lg.scaled(graph, B), cluster, host, measured)
  choice, predicted = chose.name, chose.predicted
  note = ""
  if trial is not None and not given and choice not in trials:
    choice, note = checked_by_trial(
      choice, trials, candidates, predicted, trial, opts.timeout_s, again
    )
  if note:
    logging.info("graph_pipeline: %s", note)
    plan = candidates[choice]
  else:
    choice, note = _choice_note(choice, plan, candidates, predicted, measured, host)
    plan = candidates[choice] if choice != "pipeline" else plan
  if not given and opts.min_stages > 1:
    kept_to = (
      f"min_stages={opts.min_stages}: {plan.planner}'s search kept to plans of at least "
      f"{opts.min_stages} stages"
    )
    note = f"{kept_to}; {note}" if note else kept_to
  if jax.process_count() > 1:
    check_same_plan(plan, opts.timeout_s)
  kept = trials[choice][0] if choice in trials else None
  measured = {k: t for k, (_, t) in trials.items()}
  plans = {k: candidates[k] for k in predicted if k in candidates}
  scaled = lg.scaled(graph, B)
  memory = {k: predicted_peak(p, scaled, cluster, host) for k, p in candidates.items()}
  return Planned(
    plan,
    graph,
    calibration,
    host,
    predicted[choice],
    predicted,
    note,
    kept,
    measured,
    plans,
    memory,
    cluster.memory_per_device,
    chose.how,
    choice,
  )


def _timed_baselines(
  captured: Captured,
  opts: Options,
  graph: nx.DiGraph,
  plan: Plan,
  candidates: dict[str, Plan],
  trials: dict[str, tuple[Any, float]],
  trial: Callable[[Plan], tuple[Any, float]],
  again: Callable[[Any], float] | None,
  host: HostCosts,
  cluster: Any,
  given: bool,
) -> tuple[nx.DiGraph, Plan]:
  """``plan_step``'s timing trials (into ``trials``) and what they calibrate: plain jit, its
  step in the planner's micro-batches, jit data parallel (and the planner's plan where it is
  that step in micro-batches), timed in turns with ``again``; the fusion and the model's own
  SPMD factor fitted to them; the planner searched again with them. Returns the calibrated
  graph and the planner's plan (``candidates`` follow it)."""
  B = captured.batch_size
  # Layers timed one call each add up to more than XLA makes of the whole model (it fuses
  # across layers): plain jit, compiled and timed, says by how much.
  plain = candidates.get("plain jit") or baseline_plans(graph, B, opts, (1,))["plain jit"]
  _timed(trials, "plain jit", plain, trial, candidates, opts.timeout_s)
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
  # below may return it. A throwaway dict: a plan over the memory budget leaves no
  # candidate here.
  acc = candidates["pipeline"]
  M = opts.num_microbatches or acc.num_microbatches
  one_acc = plain.replace(num_microbatches=M) if M > 1 and B % M == 0 else None
  if "plain jit" in trials and one_acc is not None and (not given or is_same(plan, one_acc)):
    name = "pipeline" if is_same(acc, one_acc) else ACCUMULATED
    _timed(trials, name, one_acc, trial, dict(candidates), opts.timeout_s)
  wide_acc = dp is not None and acc.num_stages == 1 and acc.num_microbatches > 1
  wide_acc = wide_acc and dp is not None and acc.stages[0].devices == dp.stages[0].devices
  if dp is not None:
    _timed(trials, "jit data parallel", dp, trial, candidates, opts.timeout_s)
    if "jit data parallel" in trials and wide_acc:
      _timed(trials, "pipeline", acc, trial, dict(candidates), opts.timeout_s)
  if again is not None:
    _interleaved(trials, list(trials), again, opts.timeout_s)
  if "plain jit" in trials:
    timed = trials.get(ACCUMULATED)
    if one_acc is not None and is_same(acc, one_acc):
      timed = trials.get("pipeline")
    pieces = (one_acc, timed[1]) if one_acc is not None and timed is not None else None
    graph = calibrate_fusion(graph, B, plain, cluster, host, trials["plain jit"][1], pieces)
  if dp is not None and "jit data parallel" in trials:
    pieces = (acc, trials["pipeline"][1]) if wide_acc and "pipeline" in trials else None
    graph = calibrate_spmd(graph, B, dp, cluster, host, trials["jit data parallel"][1], pieces)
  if not given and trials:
    # The search ran before the trials said what XLA makes of a step in one program (the
    # fusion, the model's own SPMD factor, the fixed seconds per micro-batch), so it priced
    # one-stage plans with the host's probe only: searched again with them, the planner's
    # plan replaces its first one.
    better_plan = make_plan(graph, B, opts, host)
    if plan_shape(better_plan) != plan_shape(plan):
      logging.info(
        "graph_pipeline: searched again with the trials' calibration, %s's plan has %d "
        "stage(s) (first: %d)",
        better_plan.planner,
        better_plan.num_stages,
        plan.num_stages,
      )
      plan = candidates["pipeline"] = better_plan
      trials.pop("pipeline", None)  # the first plan's timing
      if one_acc is not None and ACCUMULATED in trials and is_same(plan, one_acc):
        trials["pipeline"] = trials[ACCUMULATED]  # the step it timed
      graph = calibrate_widths(captured, graph, [plan], host, opts.devices)
  candidate = not given and opts.min_stages <= 1
  if one_acc is not None and ACCUMULATED in trials and candidate:
    if is_same(plan, one_acc):
      trials.pop(ACCUMULATED)  # the planner's plan, timed as "pipeline"
    else:  # timed: chosen where it measured faster than plain jit (``choose_plan``)
      candidates[ACCUMULATED] = one_acc
  else:
    trials.pop(ACCUMULATED, None)
  return graph, plan


def _choice_note(
  choice: str,
  plan: Plan,
  candidates: Mapping[str, Plan],
  predicted: Mapping[str, float],
  measured: Mapping[str, float],
  host: HostCosts | None,
) -> tuple[str, str]:
  """What runs and why, where no trial overturned the prediction: (the choice, the note said
  of it). Without the host's costs the planner's plan is kept, and a faster baseline only
  noted; else the candidate predicted fastest runs, and the note says what it beat (or, for
  the planner's one-stage plan in micro-batches, what its measurement beat)."""
  note = ""
  if choice != "pipeline" and host is None:
    # Devices-only layer estimates are not this machine's: say so, keep the planner's plan.
    if predicted[choice] < predicted["pipeline"]:
      note = (
        f"{choice} is predicted faster than {plan.planner}'s pipeline of {plan.num_stages} "
        f"stage{'s' if plan.num_stages != 1 else ''} by the devices-only model "
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


def predicted_peak(plan: Plan, graph: nx.DiGraph, cluster: Any, host: HostCosts | None) -> float:
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
  trials: dict[str, tuple[Any, float]],
  candidates: dict[str, Plan],
  predicted: Mapping[str, float],
  trial: Callable[[Plan], tuple[Any, float]],
  timeout_s: float,
  again: Callable[[Any], float] | None = None,
) -> tuple[str, str]:
  """The candidate predicted fastest, compiled and timed like the baselines before it is
  taken: (the choice, "" where it stands; else the fastest candidate timed, and the note that
  says why). Where no baseline among ``candidates`` was timed, the prediction stands alone.
  The predictions of one-call steps are their measurements; a pipeline's is the simulator's,
  which misses what the host and the devices do to it on some machines
  (docs/results/fidelity.md). Its compiled step is kept, so a pipeline that stands is compiled
  once. With ``again``, it and the fastest baseline are then timed in turns
  (``_interleaved``)."""
  # Only candidates the cost model found to fit the memory budget (``predicted``) compete: a
  # baseline timed to calibrate (plain jit, always) may not.
  timed = [k for k in trials if k in candidates and k in predicted]
  if not timed:
    return choice, ""
  _timed(trials, choice, candidates[choice], trial, candidates, timeout_s)
  best = min(timed, key=lambda k: trials[k][1])
  what = f"{choice} ({predicted[choice] * 1e3:.2f} ms predicted)"
  if choice not in trials:
    return best, f"{what} does not fit the memory budget as compiled: {best} runs instead"
  if again is not None:  # the two compared, timed in turns
    _interleaved(trials, [best, choice], again, timeout_s)
  mine, theirs = trials[choice][1], trials[best][1]
  if mine <= theirs:
    return choice, ""
  return best, (
    f"{what} measured {mine * 1e3:.2f} ms per step, slower than {best}'s {theirs * 1e3:.2f} ms: "
    f"{best} runs instead (min_stages=2 runs a pipeline regardless)"
  )


def _timed(
  trials: dict[str, tuple[Any, float]],
  name: str,
  plan: Plan,
  trial: Callable[[Plan], tuple[Any, float]],
  candidates: dict[str, Plan],
  timeout_s: float,
) -> None:
  """Runs ``trial(plan)`` into ``trials[name]``; a candidate that does not fit the memory
  budget (its compiled program says so) leaves the candidates. With several processes all
  take process 0's clock (plain jit runs there alone), and a candidate that does not fit on
  one process leaves them on all, so that all choose alike."""
  try:
    result: tuple[Any, float] | None = trial(plan)
  except PlanError:
    result = None
  if jax.process_count() > 1:
    times = exchange("trial", "-" if result is None else repr(result[1]), timeout_s)
    if result is not None:
      result = None if "-" in times else (result[0], float(times[0]))
  if result is None:
    candidates.pop(name, None)
  else:
    trials[name] = result


TRIAL_ROUNDS = 2  # rounds of timing in turns after the trials (``_interleaved``)


def _interleaved(
  trials: dict[str, tuple[Any, float]],
  names: Sequence[str],
  again: Callable[[Any], float],
  timeout_s: float,
  rounds: int | None = None,
) -> None:
  """The trials ``names`` timed ``rounds`` (default ``TRIAL_ROUNDS``) more times in turns
  (``again(compiled step)``), backwards and forwards in alternate rounds; each keeps the
  median of its times, the trial's own included. Trials taken one after another fall in
  different spells of a shared machine's speed, which last from milliseconds to seconds: on
  2 cores, one step measured 1.4x apart in one run (docs/results/fidelity.md), enough to flip a
  choice between steps within 20% of each other. With several processes every process times
  the same steps in the same order, and all take process 0's clock, as ``_timed`` does."""
  names = [k for k in names if k in trials]
  rounds = TRIAL_ROUNDS if rounds is None else rounds
  if len(names) < 2 or rounds < 1:
    return
  seen = {k: [trials[k][1]] for k in names}
  for r in range(rounds):
    order = names[::-1] if r % 2 == 0 else names
    times = [again(trials[k][0]) for k in order]
    if jax.process_count() > 1:
      times = json.loads(exchange("retime", json.dumps(times), timeout_s)[0])
    for k, t in zip(order, times):
      seen[k].append(t)
  for k in names:
    trials[k] = (trials[k][0], statistics.median(seen[k]))


# A candidate's prediction counts as its trial's where the two agree to this (relative): the
# fits (``calibrate_fusion``, ``calibrate_spmd``) solve for it exactly, and miss it only where
# a floor held the factor (the prediction is then the model's, calibrated).
SAME_AS_TRIAL = 1e-3


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``choose`` decided.

  Attributes:
    name: the candidate predicted fastest (of those it may choose: ``choose``).
    predicted: seconds per step of each candidate that fits the memory budget (the
      ``"pipeline"`` always), as compared.
    how: per name of ``predicted``, where its time comes from: ``"measured"`` where it is a
      timing trial's of that very candidate (the fits make a timed one-call step's
      prediction its measurement plus the host's time outside the step; gradient
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
  host: HostCosts | None,
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
  host: HostCosts | None,
  measured: Mapping[str, float] | None = None,
) -> Choice:
  """The candidate predicted fastest, the seconds predicted per candidate and where each
  time comes from (``Choice``), over ``graph`` (scaled to the batch) on ``cluster`` with the
  host's costs (``predict_seconds``).
  Candidates whose predicted memory does not fit are left out, except ``"pipeline"`` (the
  planner's own plan, which fits by construction or was asked for); on a tie it wins.

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

  Each time is labelled (``Choice.how``): measured where it is the candidate's own trial's
  (``measured``, plus the host's time outside the step, which the fits add), else
  modelled."""
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
  outside = host.outside if host is not None else 0.0
  how: dict[str, How] = {
    k: MEASURED
    if host is not None
    and k in timed
    and math.isclose(t, timed[k] + outside, rel_tol=SAME_AS_TRIAL)
    else MODELLED
    for k, t in predicted.items()
  }
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
  name = min(choosable, key=lambda k: (predicted[k], k != "pipeline"))
  return Choice(name, predicted, how)


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
  graph: nx.DiGraph, batch_size: int, opts: Options, host: HostCosts | None = None
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
