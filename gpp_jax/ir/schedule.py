"""Schedule IR: per-stage ordered action lists over (stage, micro-batch), and its validator.

A stage's action list is its "lane". Stages on disjoint devices run their lanes
independently. Stages may share devices (``Schedule.places``: several stages per device,
"virtual stages" in Megatron's words); the devices of one place then run the actions of all its
stages in one order (``Schedule.orders``, or the dispatch order's merge where none is given).
Actions:
  F(s, m)   forward of stage s on micro-batch m
  B(s, m)   backward of stage s on micro-batch m (input and weight gradients together)
  W(s, m)   weight-gradient part when a schedule splits it from B (optional; then B computes
            input gradients only)
  UPDATE(s) optimizer update of the parameters stage s owns, after all its backwards.
A schedule usually covers one step (one optimizer update). A schedule over several steps
(``Schedule.steps`` = K > 1, ``passes.schedules.stream_schedule``) numbers micro-batches
globally (micro-batch m of step t is ``t * M_s + m`` on a stage with M_s per step) and has
one ``UPDATE(s, t)`` per step (``microbatch`` = t); consecutive steps may then overlap
(PipeDream's 1F1B without flushes), as far as the weight version each forward reads allows.
Transfers are implied by the stage graph: an activation moves when its producer's F ends, a
cotangent when its consumer's B ends. The simulator and the driver read the same Schedule.

Stages may cut the mini-batch into different numbers of micro-batches (``Schedule.counts``,
GraphPipe's per-stage micro-batch sizes): micro-batch m of a stage with M_s micro-batches covers
samples [m * B / M_s, (m + 1) * B / M_s). Along an edge the counts align (one divides the
other), and an action depends on every chunk of the neighbouring stage that overlaps its
samples: several smaller ones, or the one bigger one containing it (``dependencies``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import operator
from collections.abc import Iterable, Sequence

import networkx as nx

from gpp_jax.errors import ScheduleError, counted
from gpp_jax.ir.program import Op

KINDS = (Op.F, Op.B, Op.W, Op.UPDATE)
_KIND = {str(k): k for k in KINDS}


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One action of a lane: ``kind`` (``Op.F``, ``Op.B``, ``Op.W`` or ``Op.UPDATE``, the same
  ``Op`` as the lowered program's instructions; a string naming one is taken as it), the
  stage, and the micro-batch (for an UPDATE over several steps, the step; -1 for a step's
  only one)."""

  kind: Op
  stage: int
  microbatch: int = -1

  def __post_init__(self):
    kind = _KIND.get(self.kind)
    if kind is None:
      raise ValueError(
        f"unknown action kind {self.kind!r}; expected one of {[str(k) for k in KINDS]}"
      )
    if kind is not self.kind:
      object.__setattr__(self, "kind", kind)

  def __str__(self) -> str:
    if self.kind is Op.UPDATE and self.microbatch < 0:
      return f"UPDATE{self.stage}"
    return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-stage action lists.

  Attributes:
    name: generator name ("gpipe", "1f1b", ...).
    num_microbatches: M; without ``counts`` every stage runs F and B for each micro-batch
      0..M-1.
    edges: stage-graph edges (i, j): stage i's outputs feed stage j.
    lanes: ``lanes[s]`` is the ordered action list of stage s.
    counts: micro-batches per stage when they differ (stage s runs 0..counts[s]-1); None for
      M everywhere.
    steps: optimizer steps the lanes cover (1 for a step's schedule); with K > 1 stage s
      runs micro-batches 0..K*counts[s]-1 and ``UPDATE(s, t)`` for t = 0..K-1.
    delays: over several steps, how many updates each stage's weights lag (the stale-weight
      schedules, ``passes.weight_versions``); None for none (a forward of step u then needs
      the update of step u - 1).
    places: per stage, the devices it runs on as a number (stages with the same place share
      their devices); None: every stage has devices of its own.
    orders: per place, the order in which its devices run the actions of its stages (each
      stage's actions in its lane's order); None: the dispatch order merges the lanes.
  """

  name: str
  num_microbatches: int
  edges: tuple[tuple[int, int], ...]
  lanes: tuple[tuple[Action, ...], ...]
  counts: tuple[int, ...] | None = None
  steps: int = 1
  delays: tuple[int, ...] | None = None
  places: tuple[int, ...] | None = None
  orders: tuple[tuple[Action, ...], ...] | None = None

  @property
  def num_stages(self) -> int:
    return len(self.lanes)

  @property
  def num_places(self) -> int:
    return self.num_stages if self.places is None else max(self.places, default=-1) + 1

  @property
  def shares_devices(self) -> bool:
    """Whether some stages share their devices (several stages on one place)."""
    return self.places is not None and len(set(self.places)) < len(self.places)

  def place_stages(self) -> list[list[int]]:
    """The stages of each place, in index order."""
    out: list[list[int]] = [[] for _ in range(self.num_places)]
    for s in range(self.num_stages):
      out[s if self.places is None else self.places[s]].append(s)
    return out

  def device_lanes(self) -> tuple[tuple[Action, ...], ...]:
    """What each place's devices run in order: ``orders``, or the lanes where every stage has a
    place of its own, or (places without orders) each place's actions in dispatch order."""
    if self.orders is not None:
      return self.orders
    if not self.shares_devices:
      return self.lanes
    where = self.places or ()
    out: list[list[Action]] = [[] for _ in range(self.num_places)]
    for a in dispatch_order(dataclasses.replace(self, places=None)):
      out[where[a.stage]].append(a)
    return tuple(map(tuple, out))

  @functools.cached_property
  def splits_backward(self) -> bool:
    """Whether the lanes split backwards into B and W (a W action anywhere)."""
    kind = operator.attrgetter("kind")
    return any("W" in map(kind, lane) for lane in self.lanes)  # map: no Python call per action

  @property
  def stage_counts(self) -> tuple[int, ...]:
    """Micro-batches per stage (``counts``, or M for every stage)."""
    return self.counts if self.counts is not None else (self.num_microbatches,) * self.num_stages

  def stage_graph(self) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(self.num_stages))
    g.add_edges_from(self.edges)
    return g

  def to_json(self) -> str:
    return json.dumps(
      {
        "name": self.name,
        "num_microbatches": self.num_microbatches,
        "edges": [list(e) for e in self.edges],
        "lanes": [[[a.kind, a.stage, a.microbatch] for a in lane] for lane in self.lanes],
        "counts": None if self.counts is None else list(self.counts),
        "steps": self.steps,
        "delays": None if self.delays is None else list(self.delays),
        "places": None if self.places is None else list(self.places),
        "orders": None
        if self.orders is None
        else [[[a.kind, a.stage, a.microbatch] for a in lane] for lane in self.orders],
      }
    )

  @classmethod
  def from_json(cls, s: str) -> Schedule:
    d = json.loads(s)
    return cls(
      d["name"],
      d["num_microbatches"],
      tuple(tuple(e) for e in d["edges"]),
      tuple(tuple(Action(*a) for a in lane) for lane in d["lanes"]),
      None if d.get("counts") is None else tuple(int(c) for c in d["counts"]),
      int(d.get("steps", 1)),
      None if d.get("delays") is None else tuple(int(x) for x in d["delays"]),
      None if d.get("places") is None else tuple(int(x) for x in d["places"]),
      None
      if d.get("orders") is None
      else tuple(tuple(Action(*a) for a in lane) for lane in d["orders"]),
    )

  def grid(self, mark: Action | None = None) -> str:
    """The schedule as a text grid, one row per stage; ``mark`` is shown in brackets."""
    rows = []
    if self.shares_devices:  # the devices' orders: what runs where, in turn
      for p, lane in enumerate(self.device_lanes()):
        cells = [f"[{a}]" if a == mark else f" {a} " for a in lane]
        rows.append(f"place {p:2d} |" + "".join(f"{c:9s}" for c in cells))
      return "\n".join(rows)
    for s, lane in enumerate(self.lanes):
      cells = [f"[{a}]" if a == mark else f" {a} " for a in lane]
      rows.append(f"stage {s:2d} |" + "".join(f"{c:9s}" for c in cells))
    return "\n".join(rows)

  def __str__(self) -> str:
    shape = (
      f"{self.num_microbatches} micro-batch{'es' if self.num_microbatches != 1 else ''}"
      if self.counts is None
      else f"micro-batches per stage {list(self.counts)}"
    )
    steps = f" x {self.steps} steps" if self.steps > 1 else ""
    stages = counted(self.num_stages, "stage")
    return f"Schedule {self.name}: {stages} x {shape}{steps}\n" + self.grid()

  def step_of(self, a: Action) -> int:
    """The step an action belongs to (0 for a one-step schedule)."""
    if a.kind == "UPDATE":
      return max(a.microbatch, 0)
    return a.microbatch // self.stage_counts[a.stage]


def overlapping(m: int, count: int, other: int) -> range:
  """Micro-batches of a stage cutting the batch into ``other`` chunks that overlap chunk ``m``
  of a stage cutting it into ``count``: samples [m/count, (m+1)/count) of the batch."""
  return range(m * other // count, -(-(m + 1) * other // count))


def chunk_range(counts: Sequence[int], s: int, m: int, other: int) -> range:
  """``overlapping`` for micro-batches numbered over several steps: the chunks of stage
  ``other`` (``counts[other]`` per step) that overlap chunk ``m`` of stage ``s``."""
  t, lm = divmod(m, counts[s])
  base = t * counts[other]
  r = overlapping(lm, counts[s], counts[other])
  return range(base + r.start, base + r.stop)


def lanes_with_updates(sched: Schedule) -> list[list[Action]]:
  """The lanes, each ending with an UPDATE (added to a one-step lane that has none)."""
  lanes = []
  for s, lane in enumerate(sched.lanes):
    out = list(lane)
    if not (lane and lane[-1].kind == "UPDATE") and not any(a.kind == "UPDATE" for a in lane):
      out.append(Action(Op.UPDATE, s))
    lanes.append(out)
  return lanes


def device_lanes_with_updates(sched: Schedule) -> list[list[Action]]:
  """``Schedule.device_lanes``, each stage's UPDATE added after its place's last action where
  its lane has none (``lanes_with_updates``)."""
  lanes = sched.device_lanes()
  if all(any(a.kind == "UPDATE" for a in lane) for lane in sched.lanes):
    return [list(l) for l in lanes]
  if not sched.shares_devices:
    return lanes_with_updates(sched)
  out = []
  for p, lane in enumerate(lanes):
    order = list(lane)
    for s in sched.place_stages()[p]:
      if not any(a.kind == "UPDATE" for a in sched.lanes[s]):
        order.append(Action(Op.UPDATE, s))
    out.append(order)
  return out


def dependencies(
  a: Action, g: nx.DiGraph, split_w: bool = False, counts: Sequence[int] | None = None
) -> Iterable[Action]:
  """Actions that must finish before ``a`` can start (cross-stage and same-stage).

  ``counts[s]``: micro-batches of stage s (None: all equal). With per-stage counts, F(s, m)
  needs the forward of every producer chunk overlapping its samples, B(s, m) the backward of
  every consumer chunk overlapping them.
  """
  m, s = a.microbatch, a.stage

  def chunks(t: int) -> Iterable[int]:
    return (m,) if counts is None else overlapping(m, counts[s], counts[t])

  if a.kind == "F":
    for p in g.predecessors(s):
      for k in chunks(p):
        yield Action(Op.F, p, k)
  elif a.kind == "B":
    yield Action(Op.F, s, m)
    for c in g.successors(s):
      for k in chunks(c):
        yield Action(Op.B, c, k)
  elif a.kind == "W":
    yield Action(Op.B, s, m)


_TRUSTED = contextvars.ContextVar("trusted_schedule_generators", default=False)


@contextlib.contextmanager
def trusted_generators():
  """Within this context ``validate_schedule`` checks nothing: the planners' inner loops build
  thousands of schedules with the project's own generators (whose output the schedule tests
  validate), and the runtime validates the schedule it executes outside the context."""
  token = _TRUSTED.set(True)
  try:
    yield
  finally:
    _TRUSTED.reset(token)


def validate_schedule(sched: Schedule) -> None:
  """Raises ScheduleError unless ``sched`` is complete, ordered, and runs without deadlock.

  Checks: every stage runs F and B exactly once per micro-batch of its own (``stage_counts``;
  and W if it uses W anywhere); per-stage counts align along every edge;
  per-stage order F^k before F^(k+1), B^k before B^(k+1), F^k before B^k (B^k before W^k);
  UPDATE, if any stage has one, ends every lane; and executing the lanes in order (each action
  waits for its dependencies) finishes. Over several steps: a lane runs UPDATE(s, t) in step
  order, each after its step's backwards and before the next step's, and a forward of step u
  after the update that makes the weights it reads (``UPDATE(s, u - d(s) - 1)``, d(s) =
  ``delays[s]``, 0 without). The message
  names the missing or misplaced action and shows the schedule grid with the offending action
  marked.
  """
  if _TRUSTED.get():
    return
  _check_places(sched)
  g = sched.stage_graph()
  if not nx.is_directed_acyclic_graph(g):
    raise ScheduleError(f"stage graph has a cycle {nx.find_cycle(g)}")
  if set(g.nodes) != set(range(sched.num_stages)):
    raise ScheduleError(f"edges {sched.edges} name stages outside 0..{sched.num_stages - 1}")
  counts = sched.stage_counts
  if len(counts) != sched.num_stages or any(c < 1 for c in counts):
    raise ScheduleError(
      f"counts {list(counts)} must give a positive micro-batch count for each of the "
      f"{sched.num_stages} stages"
    )
  for i, j in sched.edges:
    lo, hi = sorted((counts[i], counts[j]))
    if hi % lo:
      raise ScheduleError(
        f"stages {i} and {j} are connected but run {counts[i]} and {counts[j]} micro-batches; "
        "along an edge one count must divide the other so that chunks line up"
      )
  split_w = sched.splits_backward
  has_update = any(a.kind == "UPDATE" for lane in sched.lanes for a in lane)
  K = sched.steps
  if K < 1:
    raise ScheduleError(f"a schedule covers at least one step, not {K}")
  if K > 1 and not has_update:
    raise ScheduleError(
      f"a schedule over {K} steps needs an UPDATE per step on every lane; it has none\n"
      f"{sched.grid()}"
    )
  delays = sched.delays or (0,) * sched.num_stages
  if len(delays) != sched.num_stages:
    raise ScheduleError(f"delays {list(delays)} must give one count per stage")
  for s, lane in enumerate(sched.lanes):
    M = counts[s]
    total = M * K
    seen = set()
    last = {"F": -1, "B": -1, "W": -1}
    updated = -1  # the last step whose UPDATE this lane ran (several-step schedules)
    for i, a in enumerate(lane):
      if a.stage != s:
        _fail(sched, a, f"action {a} is in the lane of stage {s}")
      if a in seen:
        _fail(sched, a, f"action {a} appears twice")
      seen.add(a)
      if a.kind == "UPDATE":
        if K == 1:
          if i != len(lane) - 1:
            _fail(sched, a, f"{a} must be the last action of stage {s}, not before {lane[-1]}")
          continue
        if a.microbatch != updated + 1:
          expected = Action(Op.UPDATE, s, updated + 1)
          _fail(
            sched,
            a,
            f"stage {s} runs its updates out of order: {a} comes where {expected} should "
            f"({expected} is missing or later in the lane)",
          )
        for k in (Op.B, Op.W) if split_w else (Op.B,):
          if last[k] < (a.microbatch + 1) * M - 1:
            _fail(
              sched,
              a,
              f"{a} comes before {Action(k, s, last[k] + 1)}, a {k} of step {a.microbatch} "
              "whose gradient it applies",
            )
        updated = a.microbatch
        continue
      if not 0 <= a.microbatch < total:
        _fail(sched, a, f"micro-batch {a.microbatch} outside 0..{total - 1} of stage {s}")
      if a.microbatch != last[a.kind] + 1:
        expected = Action(a.kind, s, last[a.kind] + 1)
        _fail(
          sched,
          a,
          f"stage {s} runs {a.kind} out of order: {a} comes where {expected} should "
          f"({expected} is missing or later in the lane)",
        )
      last[a.kind] = a.microbatch
      if a.kind == "B" and Action(Op.F, s, a.microbatch) not in seen:
        _fail(sched, a, f"{a} comes before F{s}.{a.microbatch} on its stage")
      if a.kind == "W" and Action(Op.B, s, a.microbatch) not in seen:
        _fail(sched, a, f"{a} comes before B{s}.{a.microbatch} on its stage")
      if K > 1:
        u = a.microbatch // M
        if a.kind != "F" and u > updated + 1:
          _fail(
            sched,
            a,
            f"{a} (step {u}) comes before UPDATE{s}.{u - 1}: a step's gradients are summed "
            "until its update",
          )
        need = u - delays[s] - 1
        if a.kind == "F" and need > updated:
          _fail(
            sched,
            a,
            f"{a} (step {u}) computes with the weights UPDATE{s}.{need} makes "
            f"(stage {s} is {delays[s]} updates behind) but comes before it",
          )
    end = Action(Op.UPDATE, s) if K == 1 else Action(Op.UPDATE, s, K - 1)
    if has_update and (not lane or lane[-1] != end):
      missing = end if K == 1 else Action(Op.UPDATE, s, updated + 1)
      raise ScheduleError(
        f"stage {s} never runs {missing}: other stages end with an UPDATE, so every lane must "
        f"(add {missing} at the end of stage {s}'s lane)\n{sched.grid()}"
      )
    kinds = (Op.F, Op.B, Op.W) if split_w else (Op.F, Op.B)
    for k in kinds:
      if last[k] != total - 1:
        missing = Action(k, s, last[k] + 1)
        raise ScheduleError(f"schedule incomplete: stage {s} never runs {missing}\n{sched.grid()}")
  dispatch_order(sched)


def _check_places(sched: Schedule) -> None:
  """``places`` gives every stage a place numbered from 0 without gaps, and ``orders`` runs
  exactly its place's stages' actions, each stage's in its lane's order."""
  if sched.places is None:
    if sched.orders is not None:
      raise ScheduleError("a schedule with orders per place needs places (one per stage)")
    return
  S, places = sched.num_stages, sched.places
  if len(places) != S or sorted(set(places)) != list(range(len(set(places)))):
    raise ScheduleError(
      f"places {list(places)} must give each of the {S} stages a place, numbered 0, 1, ... "
      "without gaps"
    )
  if sched.orders is None:
    return
  stages = sched.place_stages()
  if len(sched.orders) != len(stages):
    raise ScheduleError(f"{len(sched.orders)} orders for {len(stages)} places")
  for p, order in enumerate(sched.orders):
    for s in stages[p]:
      mine = tuple(a for a in order if a.stage == s)
      if mine != sched.lanes[s]:
        raise ScheduleError(
          f"place {p} runs stage {s}'s actions as {[str(a) for a in mine][:8]}..., not in "
          f"its lane's order {[str(a) for a in sched.lanes[s]][:8]}...\n{sched.grid()}"
        )
    strays = sorted({a.stage for a in order} - set(stages[p]))
    if strays:
      raise ScheduleError(f"place {p} runs actions of stages {strays}, which are not on it")


def dispatch_order(sched: Schedule) -> list[Action]:
  """The order in which a single thread issues the actions: round-robin over the lanes of
  devices (``Schedule.device_lanes``: a stage's, or a place's where stages share devices),
  each advancing while its next action's dependencies have been issued.

  The order is a pure function of the schedule, so every process of a multi-process run issues
  the same actions (and the same transfers) in the same order. Raises ScheduleError, with the
  grid and the blocked action marked, if the lanes deadlock; where stages share devices the
  message names the cycle of places waiting on one another.
  """
  return list(_dispatch_order(sched))


@functools.lru_cache(maxsize=256)
def _dispatch_order(sched: Schedule) -> tuple[Action, ...]:
  # Cached: the validator, the simulator and the driver all ask for the same schedule's order.
  g = sched.stage_graph()
  counts = sched.counts
  lanes = sched.orders if sched.orders is not None else sched.lanes
  done: set[Action] = set()
  order: list[Action] = []
  pos = [0] * len(lanes)
  total = sum(len(l) for l in lanes)
  while len(order) < total:
    progressed = False
    for s, lane in enumerate(lanes):
      while pos[s] < len(lane):
        a = lane[pos[s]]
        deps = list(dependencies(a, g, counts=counts)) if a.kind != "UPDATE" else []
        if all(d in done for d in deps):
          done.add(a)
          order.append(a)
          pos[s] += 1
          progressed = True
        else:
          break
    if not progressed:
      heads = {q: lanes[q][pos[q]] for q in range(len(lanes)) if pos[q] < len(lanes[q])}
      waits = {
        q: [d for d in dependencies(a, g, counts=counts) if d not in done] for q, a in heads.items()
      }
      if sched.orders is not None:
        raise ScheduleError(_place_cycle(sched, heads, waits))
      text = "; ".join(f"{heads[q]} waits for {[str(d) for d in w]}" for q, w in waits.items())
      raise ScheduleError(
        f"schedule deadlocks: {text}\n{sched.grid(mark=next(iter(heads.values())))}"
      )
  return tuple(order)


def _place_cycle(sched: Schedule, heads: dict[int, Action], waits: dict[int, list[Action]]) -> str:
  """The deadlock of places that share devices, as the cycle of places waiting on each other:
  each place's next action waits for an action that another place runs after its own next."""
  places = sched.places or ()
  wait_for = nx.DiGraph()
  for q, deps in waits.items():
    for d in deps:
      wait_for.add_edge(q, places[d.stage], need=d)
  cycle = nx.find_cycle(wait_for)
  steps = [
    f"place {q} runs {heads[q]} next, which waits for {wait_for.edges[q, r]['need']} on place {r}"
    for q, r in cycle
  ]
  return (
    "schedule deadlocks: the stages sharing devices wait on each other in a cycle: "
    + "; ".join(steps)
    + " (reorder the places' actions or put the stages on other devices)\n"
    + sched.grid(mark=heads[cycle[0][0]])
  )


def _fail(sched: Schedule, a: Action, msg: str):
  raise ScheduleError(f"{msg}\n{sched.grid(mark=a)}")


def lanes_from(stage_lists: Sequence[Sequence[Action]]) -> tuple[tuple[Action, ...], ...]:
  return tuple(tuple(l) for l in stage_lists)
