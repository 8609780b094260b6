"""Runtime driver: executes a StagedProgram over a Schedule on real devices.

The driver walks the per-stage action lists round-robin and dispatches every action whose
inputs exist, without blocking: JAX's asynchronous dispatch lets the devices overlap. Values
move between stages only through explicit ``jax.device_put`` (one copy per consumer stage);
cotangents from several consumers are summed inside the producer's backward; parameters read by
several stages live on their owner and send gradients back to it.

Multi-process: every process runs the same driver over the same dispatch order (a pure
function of the schedule). A process computes only the stages on its own devices and stands
in placeholders (arrays with no local shards) for the outputs of the others; every process
issues the same ``jax.device_put`` calls in the same order, so each cross-process edge is a
matched send (on the producer's process) and receive (on the consumer's), JAX's own cross-host
transfer.

Stages with their own micro-batch sizes (``Schedule.counts``): stage s cuts the batch into
M_s chunks. Along an edge between stages of different sizes the driver re-chunks on device: a
producer's chunk is split (``jnp.split`` where it was computed) into the consumer's smaller
chunks, or the consumer's bigger chunk is concatenated where it runs from the producer chunks
it covers; cotangents go back the same way. The loss stage seeds each backward with
``1 / M_s`` (= b_s / B), so the parameter gradients, summed over every stage's own chunks, are
the gradient of the mean loss over the batch.

With ``measure=True`` each stage runs in its own thread that blocks on every action, which
gives a measured per-action timeline (start/end on the device) at some cost in overhead.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpp_jax.errors import BatchError, GppError, ScheduleError
from gpp_jax.ir.schedule import Action, Schedule, dispatch_order
from gpp_jax.passes.staging import StagedProgram, stage_functions
from gpp_jax.runtime.loss_state import StatePair, state_carries
from gpp_jax.runtime.placement import StagePlacement, pack_limit, transfer

BATCH, KEY, BROADCAST = "batch", "key", "broadcast"
STATE = "state"  # state the loss updates: carried from one micro-batch to the next


@dataclasses.dataclass
class TimelineEvent:
  action: str
  stage: int
  microbatch: int
  start: float
  end: float


@dataclasses.dataclass
class Timeline:
  """Per-action times of one step (seconds from the step's start).

  ``measured`` is True when ``end`` is when the device finished the action (measure mode);
  otherwise start/end bracket only the host-side dispatch.
  """

  events: list[TimelineEvent]
  total: float
  measured: bool
  stage_devices: tuple[tuple[int, ...], ...] = ()  # the plan's device indices per stage

  def to_chrome_trace(self) -> dict:
    """Chrome / Perfetto trace laid out like the simulator's (``cost.simulator.chrome_trace``):
    one track per stage, named with its devices; the track says whether its spans are device
    times (measured) or the host's dispatch of each action."""
    ev: list[dict] = []
    stages = sorted({e.stage for e in self.events} | set(range(len(self.stage_devices))))
    what = "device (measured)" if self.measured else "host dispatch"
    for s in stages:
      devs = self.stage_devices[s] if s < len(self.stage_devices) else ()
      label = f"stage {s}" + (f" (devices {','.join(map(str, devs))})" if devs else "")
      ev.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": label}})
      ev.append({"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}})
      ev.append({"ph": "M", "name": "thread_name", "pid": s, "tid": 0, "args": {"name": what}})
    for e in self.events:
      ev.append(
        {
          "name": f"{e.action}{e.stage}.{e.microbatch}",
          "ph": "X",
          "cat": e.action,
          "pid": e.stage,
          "tid": 0,
          "ts": e.start * 1e6,
          "dur": max(e.end - e.start, 0) * 1e6,
          "args": {"microbatch": e.microbatch},
        }
      )
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def _is_key(x) -> bool:
  dt = getattr(x, "dtype", None)
  if dt is None:
    return False
  if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
    return True
  return dt == np.uint32 and tuple(getattr(x, "shape", ())) == (2,)


def placeholder(aval, sharding):
  """An array with no local data standing for a value computed on another process."""
  return jax.make_array_from_single_device_arrays(tuple(aval.shape), sharding, [], dtype=aval.dtype)


def is_local(placement: StagePlacement) -> bool:
  """Whether this process takes part in the stage: it holds one of the stage's devices (a
  stage spanning processes runs as one SPMD program that each of its processes calls)."""
  return any(d.process_index == jax.process_index() for d in placement.devices)


def wait_for(values, timeout_s: float) -> None:
  """Blocks until this process's shards of ``values`` are ready, or raises after a timeout.

  A peer process that died or stalls leaves a receive unfinished forever; this turns that hang
  into a clear error within ``timeout_s`` seconds.
  """
  arrays = [x for x in jax.tree.leaves(values) if isinstance(x, jax.Array)]
  done = threading.Event()
  failure = []

  def block():
    try:
      for x in arrays:
        for shard in x.addressable_shards:
          shard.data.block_until_ready()
    except BaseException as e:  # surfaced in the caller
      failure.append(e)
    done.set()

  threading.Thread(target=block, daemon=True, name="gpp-wait").start()
  if not done.wait(timeout_s):
    raise GppError(
      f"the pipelined step did not finish within {timeout_s:.0f} s on process "
      f"{jax.process_index()} of {jax.process_count()}: a peer process has died or "
      "stalls (its activations or gradients never arrived). Check the other "
      "processes' logs; raise timeout_s if steps are legitimately this slow."
    )
  if failure:
    where = f"process {jax.process_index()} of {jax.process_count()}"
    if jax.process_count() > 1:
      raise GppError(
        f"the pipelined step failed on {where}: a transfer with a peer process "
        f"broke, so the peer process has died or closed its connection. Check the "
        f"other processes' logs. Cause: {failure[0]}"
      ) from failure[0]
    raise GppError(f"the pipelined step failed on {where}: {failure[0]}") from failure[0]


@jax.jit
def _fold(key, m):
  return jax.random.fold_in(key, m)


@functools.partial(jax.jit, static_argnums=1)
def _split_on_device(x, M):
  return jnp.split(x, M)


def _split_batch(x, M: int) -> list[Any]:
  """A batch array cut into M contiguous micro-batches: a device array on its device (no round
  trip through the host; each chunk then moves device to device), host data on the host."""
  if isinstance(x, jax.Array) and x.is_fully_addressable and len(x.sharding.device_set) == 1:
    return list(_split_on_device(x, M))
  return np.split(np.asarray(jax.device_get(x)), M)


@jax.jit
def _mean(xs):
  return sum(xs[1:], xs[0]) / len(xs)


@jax.jit
def _concat(xs):
  return jnp.concatenate(xs, axis=0)


@jax.jit
def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


class PipelineRunner:
  """Runs the pipelined value-and-grad of a StagedProgram for one step."""

  def __init__(
    self,
    staged: StagedProgram,
    schedule: Schedule,
    placements: Sequence[StagePlacement],
    data_roles: Sequence[str | None],
    remat: bool = False,
    state: Sequence[StatePair] = (),
  ):
    """
    Args:
      staged: the staged loss.
      schedule: per-stage action lists (validated); stage s runs ``schedule.stage_counts[s]``
        micro-batches.
      placements: ``placements[s]`` says where stage s runs (a device or a sub-mesh).
      data_roles: for each loss invar: None for a parameter, else BATCH (split into
        micro-batches), KEY (micro-batch index folded in), BROADCAST (same for all) or
        STATE (the value the previous micro-batch left, see ``state``).
      state: state the loss updates; the stage computing a new value carries it to its own
        next micro-batch, and the step returns the last micro-batch's value.
    """
    self.staged = staged
    self.schedule = schedule
    self.place = list(placements)
    self.roles = list(data_roles)
    self.counts = schedule.stage_counts
    self.fns = [
      stage_functions(
        s,
        remat=remat,
        pack_residuals=len(p.devices) == 1,
        pack_limit=pack_limit(p.devices[0]),
      )
      for s, p in zip(staged.stages, self.place)
    ]
    self._zeros = [
      jax.jit(f.zeros_acc, out_shardings=p.replicated) for f, p in zip(self.fns, self.place)
    ]
    self._nparam = [sum(1 for r in st.inputs if r.kind == "param") for st in staged.stages]
    # Producer output position of each value id, and expected cotangent counts.
    self.out_pos: dict[int, tuple[int, int]] = {}
    for st in staged.stages:
      for k, o in enumerate(st.outputs):
        self.out_pos[o.vid] = (st.index, k)
    self.expect: dict[tuple[int, int], int] = {}
    for st in staged.stages:
      for r in st.inputs:
        if r.kind == "act" and r.diff:
          key = self.out_pos[r.index]
          self.expect[key] = self.expect.get(key, 0) + 1
    self.last_timeline: Timeline | None = None
    self.order = dispatch_order(schedule)
    # With W actions (zero-bubble) B computes the input cotangents only and W the parameter
    # gradients later, from the same residuals and output cotangents.
    self.split_w = any(a.kind == "W" for lane in schedule.lanes for a in lane)
    self.local = [is_local(p) for p in self.place]
    self.multiprocess = jax.process_count() > 1
    self._out_avals = [[v.aval for v in st.jaxpr.jaxpr.outvars] for st in staged.stages]
    self._in_avals = [[v.aval for v in st.jaxpr.jaxpr.invars] for st in staged.stages]
    self.carries = state_carries(staged, state)
    self.state_outputs = {p.output for p in state}
    self._batch_size: int | None = None  # of the step being run
    if len(set(self.counts)) > 1:
      self._check_mixed(state)

  def _check_mixed(self, state: Sequence[StatePair]) -> None:
    """Raises GppError for what cannot run with per-stage micro-batch sizes."""
    what = f"the stages run {list(self.counts)} micro-batches (per-stage micro-batch sizes)"
    fix = "give every stage the same micro-batch size (Stage.microbatch_size)"
    if state:
      raise GppError(
        f"{what}, but the loss carries state from one micro-batch to the next (e.g. "
        f"BatchNorm statistics), whose order depends on the micro-batch size; {fix}"
      )
    if KEY in self.roles:
      raise GppError(
        f"{what}, but the loss reads a random key, into which each stage folds its own "
        f"micro-batch index, so stages would draw from different chunks; {fix}, or pass "
        "no key to the loss"
      )
    if self.multiprocess:
      raise GppError(f"{what}, which runs in a single process only; {fix}")

  def _remote(self, aval, s):
    """Placeholder for a value of stage ``s`` computed on another process."""
    return placeholder(aval, self.place[s].for_array(aval))

  # ---------------------------------------------------------------- per-step inputs
  def _prepare(
    self, params: Sequence[Any], data: Sequence[Any], versions: Sequence[Sequence[Any]] | None
  ) -> None:
    """Every stage's per-step inputs (``_prepare_stage``). ``versions[s]``, when given, is the
    parameter list stage s reads instead of ``params`` (stale weights of the asynchronous
    schedules; each on its owner's devices)."""
    for s in range(len(self.staged.stages)):
      self._prepare_stage(s, params if versions is None else versions[s], data)

  def _prepare_stage(self, s: int, params: Any, data: Any) -> None:
    """Stage s's per-step inputs that do not change across micro-batches (``_fixed[s][j]``:
    parameters, broadcast data, keys before folding), the batch chunks it reads, its packed
    parameters and its zeroed gradient sum. ``params[i]`` and ``data[i]`` are read only for the
    inputs the stage has."""
    st = self.staged.stages[s]
    rep = self.place[s].replicated
    for j, r in enumerate(st.inputs):
      if r.kind == "param":
        x = params[r.index]
        owner = self.staged.param_owner[r.index]
        # Every process issues the same put: a local copy, a send, a receive or a no-op.
        self._fixed[s][j] = x if owner == s else transfer(x, rep)
      elif r.kind == "data":
        role = self.roles[r.index]
        x = data[r.index]
        if role in (BROADCAST, KEY, STATE):  # keys get the micro-batch index folded in per F
          self._fixed[s][j] = transfer(x, rep)
        elif role == BATCH and (r.index, self.counts[s]) not in self._batch_chunks:
          M = self.counts[s]
          if np.shape(x)[0] % M:
            raise BatchError(
              f"batch input of shape {np.shape(x)} does not split into {M} micro-batches "
              f"(stage {s})"
            )
          self._batch_size = np.shape(x)[0]
          if not isinstance(x, jax.Array) and self.local[s] and len(self.place[s].devices) == 1:
            # Host data goes to the first stage that reads it in one put and is cut there,
            # instead of one host-to-device put per micro-batch.
            x = jax.device_put(np.asarray(x), self.place[s].replicated)
          self._batch_chunks[(r.index, M)] = _split_batch(x, M)
    fn = self.fns[s]
    self._pparams[s] = (
      fn.pack_params([x for x, r in zip(self._fixed[s], st.inputs) if r.kind == "param"])
      if fn.pack_params is not None and self.local[s]
      else None
    )
    self._acc[s] = self._zeros[s]() if self.local[s] else None

  def _stage_args(self, s, m):
    st = self.staged.stages[s]
    place = self.place[s]
    diff, nondiff = [], []
    for j, r in enumerate(st.inputs):
      if r.kind == "param":
        v = self._fixed[s][j]
      elif r.kind == "act":
        v = self._inbox.pop((s, r.index, m))
      else:
        role = self.roles[r.index]
        if role == BATCH:
          v = place.put(self._batch_chunks[(r.index, self.counts[s])][m])
        elif role == KEY:
          v = _fold(self._fixed[s][j], transfer(np.uint32(m), place.replicated))
        elif role == STATE:
          v = self._carry.get((s, r.index), self._fixed[s][j])
        else:
          v = self._fixed[s][j]
      (diff if r.diff else nondiff).append(v)
    return diff, nondiff

  def _ready(self, a: Action) -> bool:
    """Data readiness of a local action (used by the threaded measuring executor)."""
    st = self.staged.stages[a.stage]
    if a.kind == "F":
      return all(
        (a.stage, r.index, a.microbatch) in self._inbox for r in st.inputs if r.kind == "act"
      )
    if a.kind == "B":
      if (a.stage, a.microbatch) not in self._res:
        return False
      return all(
        len(self._ctbox.get((a.stage, k, a.microbatch), ())) == self.expect.get((a.stage, k), 0)
        for k in range(len(st.outputs))
      )
    if a.kind == "W":
      return (a.stage, a.microbatch) in self._wbox
    return True

  def _run_action(self, a: Action):
    s, m = a.stage, a.microbatch
    st = self.staged.stages[s]
    fn = self.fns[s]
    if a.kind == "F":
      if self.local[s]:
        diff, nondiff = self._stage_args(s, m)
        if fn.pack_params is not None:
          outs, res = fn.fwd(self._pparams[s], diff[self._nparam[s] :], nondiff)
        else:
          outs, res = fn.fwd(diff, nondiff)
        self._res[(s, m)] = res
        for j, k in self.carries.get(s, ()):
          self._carry[(s, j)] = outs[k]
        for li, (ls, lk) in enumerate(self.staged.loss_outputs):
          if ls == s:
            self._loss_vals[m][li] = outs[lk]
      else:
        for r in st.inputs:
          if r.kind == "act":
            self._inbox.pop((s, r.index, m))
        outs = [
          self._remote(v, s) if o.consumers else None
          for v, o in zip(self._out_avals[s], st.outputs)
        ]
      for k, o in enumerate(st.outputs):
        for c in o.consumers:
          self._send_activation(outs[k], s, c, o.vid, m)
    elif a.kind == "B":
      cts: list[tuple[Any, ...]] = []
      for k, o in enumerate(st.outputs):
        contribs = list(self._ctbox.pop((s, k, m), ()))
        if o.diff and self.staged.loss_outputs[0] == (s, k):
          contribs.append(self._seed)
        cts.append(tuple(contribs))
      acts = [(j, r) for j, r in enumerate(st.inputs) if r.diff and r.kind == "act"]
      if self.split_w:
        self._wbox[(s, m)] = (cts, None)
      if self.local[s] and self.split_w:
        pre = (self._res[(s, m)],) + (() if fn.pack_params is None else (self._pparams[s],))
        assert fn.bwd_input is not None  # stage_functions always builds the split backward
        in_cts, kept = fn.bwd_input(*pre, cts)
        self._wbox[(s, m)] = (cts, kept)
        if self._measuring:
          self._bout[(s, m)] = in_cts
      elif self.local[s]:
        if fn.pack_params is not None:
          self._acc[s], in_cts = fn.bwd(self._res.pop((s, m)), self._pparams[s], cts, self._acc[s])
        else:
          self._acc[s], in_cts = fn.bwd(self._res.pop((s, m)), cts, self._acc[s])
      else:
        in_cts = [self._remote(self._in_avals[s][j], s) for j, _ in acts]
      for (_, r), ct in zip(acts, in_cts):
        p, k = self.out_pos[r.index]
        self._send_cotangent(ct, s, p, k, m)
    elif a.kind == "W":
      cts, kept = self._wbox.pop((s, m))
      res = self._res.pop((s, m), None)
      if self.local[s]:
        pre = (res,) + (() if fn.pack_params is None else (self._pparams[s],))
        assert fn.bwd_weight is not None
        self._acc[s] = fn.bwd_weight(*pre, cts, kept, self._acc[s])
    elif a.kind == "UPDATE":
      pass
    else:
      raise ScheduleError(f"the runtime cannot execute action kind {a.kind}")

  # ---------------------------------------------------------------- re-chunking edges
  def _send_activation(self, x, s: int, c: int, vid: int, m: int) -> None:
    """Chunk m of stage s's output ``vid`` -> the inbox of consumer c, in c's chunks."""
    Ms, Mc = self.counts[s], self.counts[c]
    if Ms == Mc:
      self._inbox[(c, vid, m)] = self.place[c].put(x)
    elif Mc > Ms:  # c's chunks are smaller: split where x was computed, send each piece
      r = Mc // Ms
      for i, piece in enumerate(_split_on_device(x, r)):
        self._inbox[(c, vid, m * r + i)] = self.place[c].put(piece)
    else:  # c's chunk covers r of ours: gather them on c, concatenate when all are there
      r = Ms // Mc
      whole = self._gathered((c, vid, m // r), m % r, r, self.place[c].put(x))
      if whole is not None:
        self._inbox[(c, vid, m // r)] = self.place[c].put(_concat(whole))

  def _send_cotangent(self, ct, s: int, p: int, k: int, m: int) -> None:
    """Cotangent of chunk m of consumer s for output k of producer p -> p's chunks."""
    Ms, Mp = self.counts[s], self.counts[p]
    if Ms == Mp:
      self._ctbox.setdefault((p, k, m), []).append(self.place[p].put(ct))
    elif Mp > Ms:  # p's chunks are smaller: split here, one contribution per p chunk
      r = Mp // Ms
      for i, piece in enumerate(_split_on_device(ct, r)):
        self._ctbox.setdefault((p, k, m * r + i), []).append(self.place[p].put(piece))
    else:  # p's chunk covers r of ours: one contribution once all r are there
      r = Ms // Mp
      whole = self._gathered(("ct", p, k, m // r, s), m % r, r, self.place[p].put(ct))
      if whole is not None:
        self._ctbox.setdefault((p, k, m // r), []).append(self.place[p].put(_concat(whole)))

  def _gathered(self, key, i: int, r: int, piece) -> list[Any] | None:
    """Files ``piece`` as part i of r under ``key``; returns the r parts once all arrived."""
    parts = self._pieces.setdefault(key, [None] * r)
    parts[i] = piece
    if any(x is None for x in parts):
      return None
    del self._pieces[key]
    return parts

  # ---------------------------------------------------------------- one step
  def run(
    self,
    params: Sequence[Any],
    data: Sequence[Any],
    measure: bool = False,
    versions: Sequence[Sequence[Any]] | None = None,
  ):
    """Returns (loss outputs averaged over micro-batches, parameter gradients on owners).

    ``versions[s]``: the parameters stage s computes with, when not ``params`` (stale weights).
    """
    if measure and self.multiprocess:
      raise GppError(
        "measure=True records device-side times with one thread per stage and "
        "runs in a single process only; leave it off for multi-process runs"
      )
    t0 = self.begin(measure)
    self._prepare(params, data, versions)
    events: list[TimelineEvent] = []
    if measure:
      self._run_threaded(events, t0)
    else:
      for a in self.order:
        t = time.perf_counter()
        self._run_action(a)
        events.append(
          TimelineEvent(a.kind, a.stage, a.microbatch, t - t0, time.perf_counter() - t0)
        )
    grads = self._gather_grads(params)
    outs = self.loss_outputs()
    self.last_timeline = Timeline(events, time.perf_counter() - t0, measure)
    return outs, grads

  def begin(self, measure: bool = False) -> float:
    """Starts a step: empty per-step state (stages are prepared by ``_prepare_stage``)."""
    self._measuring = measure
    # (consumer stage, value id, micro-batch) -> the value, put on the consumer.
    self._inbox: dict[tuple[int, int, int], Any] = {}
    # (producer stage, output position, micro-batch) -> cotangent contributions.
    self._ctbox: dict[tuple[int, int, int], list[Any]] = {}
    # (stage, micro-batch) -> forward residuals.
    self._res: dict[tuple[int, int], Any] = {}
    # (stage, micro-batch) -> (output cotangents, B's values) a W action still needs.
    self._wbox: dict[tuple[int, int], Any] = {}
    self._bout: dict[tuple[int, int], Any] = {}  # B's input cotangents (measure mode waits)
    # Chunks of a bigger chunk on the other side of an edge, until all have arrived.
    self._pieces: dict[Any, list[Any]] = {}
    self._batch_size = None
    # (stage, loss input) -> the state the stage's last forward left.
    self._carry: dict[tuple[int, int], Any] = {}
    S = len(self.staged.stages)
    self._fixed: list[list[Any]] = [[None] * len(st.inputs) for st in self.staged.stages]
    # (loss input, micro-batches) -> the batch cut into that many chunks.
    self._batch_chunks: dict[tuple[int, int], list[Any]] = {}
    self._pparams: list[Any] = [None] * S
    self._acc: list[Any] = [None] * S
    self._acc_leaves: dict[int, list[Any]] = {}  # stage -> its unpacked gradient sums
    nloss = len(self.staged.loss_outputs)
    self._loss_vals: list[list[Any]] = [[None] * nloss for _ in range(max(self.counts))]
    ls, lk = self.staged.loss_outputs[0]
    loss_aval = self._out_avals[ls][lk]
    # d(mean loss) / d(chunk loss) = b_s / B = 1 / M_s for the stage computing the loss.
    self._seed = transfer(
      np.asarray(1.0 / self.counts[ls], dtype=loss_aval.dtype), self.place[ls].replicated
    )
    return time.perf_counter()

  def loss_outputs(self) -> list[Any]:
    """The step's loss outputs: means over micro-batches, per-example values concatenated,
    carried state as the last micro-batch left it (placeholders for other processes')."""
    outs = []
    B = self._batch_size
    for li, (ls, lk) in enumerate(self.staged.loss_outputs):
      M = self.counts[ls]
      mb = None if B is None else B // M
      if not self.local[ls]:
        aval = self._out_avals[ls][lk]
        per_example = li > 0 and li not in self.state_outputs and aval.ndim >= 1
        if per_example and mb is not None and aval.shape[0] == mb:
          aval = aval.update(shape=(mb * M,) + aval.shape[1:])
        outs.append(self._remote(aval, ls))
        continue
      vals = [self._loss_vals[m][li] for m in range(M)]
      v0 = vals[0]
      if (
        li > 0
        and li not in self.state_outputs
        and getattr(v0, "ndim", 0) >= 1
        and mb is not None
        and v0.shape[0] == mb
      ):
        outs.append(_concat(vals))
      else:
        inexact = jnp.issubdtype(v0.dtype, jnp.inexact)
        outs.append(_mean(vals) if inexact and li not in self.state_outputs else vals[-1])
    return outs

  def _run_threaded(self, events, t0):
    cond = threading.Condition()
    errors = []
    lanes = self.schedule.lanes

    def worker(s):
      try:
        for a in lanes[s]:
          with cond:
            while not self._ready(a) and not errors:
              if not cond.wait(timeout=300):
                raise ScheduleError(f"stage {s} waited 300 s for the inputs of {a}")
            if errors:
              return
            t = time.perf_counter()
            self._run_action(a)
            produced = self._produced(a)
          jax.block_until_ready(produced)
          with cond:
            events.append(
              TimelineEvent(a.kind, a.stage, a.microbatch, t - t0, time.perf_counter() - t0)
            )
            cond.notify_all()
      except BaseException as e:  # propagate to the caller
        with cond:
          errors.append(e)
          cond.notify_all()

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(len(lanes))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    if errors:
      raise errors[0]
    events.sort(key=lambda e: e.start)

  def _produced(self, a: Action):
    if a.kind == "F":
      return self._res.get((a.stage, a.microbatch))
    if a.kind == "B":
      return self._bout.pop((a.stage, a.microbatch), self._acc[a.stage])
    if a.kind == "W":
      return self._acc[a.stage]
    return None

  def _gather_grads(self, params):
    return [self.grad_of(i, x) for i, x in enumerate(params)]

  @functools.cached_property
  def param_readers(self) -> list[list[tuple[int, int, int]]]:
    """For each parameter, (stage, input position, position among the stage's parameter
    gradients) of every stage that reads it."""
    readers: list[list[tuple[int, int, int]]] = [[] for _ in self.staged.param_owner]
    for s, st in enumerate(self.staged.stages):
      k = 0
      for j, r in enumerate(st.inputs):
        if r.kind == "param":
          readers[r.index].append((s, j, k))
          k += 1
    return readers

  def grad_of(self, i: int, x) -> Any:
    """Parameter i (``x``: its value or aval) -> its gradient on its owner: the sum of its
    readers' gradient sums (which must be complete), zeros if the loss never reads it, None
    if no stage owns it."""
    owner = self.staged.param_owner[i]
    g = None
    for s, j, k in self.param_readers[i]:
      if self.local[s]:
        if s not in self._acc_leaves:
          unpack = self.fns[s].acc_leaves
          assert unpack is not None  # stage_functions always builds it
          self._acc_leaves[s] = unpack(self._acc[s])
        gs = self._acc_leaves[s][k]
      else:
        gs = self._remote(self._in_avals[s][j], s)
      if owner != s:
        gs = transfer(gs, self.place[owner].replicated)
      if g is None:
        g = gs
      elif self.local[owner]:
        g = _add(g, gs)
    if g is None and owner >= 0:  # a parameter the loss never reads
      shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
      dtype = getattr(x, "dtype", None) or np.result_type(x)
      g = transfer(np.zeros(shape, dtype), self.place[owner].replicated)
    return g
