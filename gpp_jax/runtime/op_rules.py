"""The executor's rule per op (``_RULES``): each turns one instruction of a lowered program into
the call that runs it, its operands resolved once, at build time (``runtime.executor
.Executor``), and where a SEND puts its array (``send_sharding``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from gpp_jax.ir.program import Cotangents, Count, Instr, Op, Piece, Reduce, Transfer
from gpp_jax.runtime.array_ops import (
  _add,
  _concat,
  _fold,
  _mean,
  _reshape,
  _split_batch,
  _split_on_device,
  _stack,
  _sum,
  _unstack,
)
from gpp_jax.runtime.placement import place_input, transfer

if TYPE_CHECKING:
  from gpp_jax.runtime.executor import Executor


def send_sharding(ex: Executor, ins: Instr) -> Any:
  """Where a SEND puts its array: its destination stage's sharding for what it carries
  (``Transfer``; a step argument with a partition spec: by its spec over the stage's
  sub-mesh)."""
  place = ex.lanes[ins.peer].placement
  assert place is not None, "a SEND to the host lane"
  aval = ex.lowered.avals[ins.writes[0]]
  arg = ins.arg
  assert isinstance(arg, Transfer), f"{ins} carries no Transfer"
  if arg.stacked:  # micro-batches stacked: each split over the devices
    return place.stacked
  if arg.batched and aval is not None:
    return place.for_array(aval)
  spec = ex.specs.get(ins.writes[0])
  if spec is not None and aval is not None and hasattr(aval, "ndim"):
    return place.sharded(spec, aval.ndim)
  return place.replicated


def _send(ex: Executor, ins: Instr) -> Callable[[], None]:
  (src_lst, si), (dst_lst, di) = ex.where[ins.reads[0]], ex.where[ins.writes[0]]
  sharding = send_sharding(ex, ins)
  if ins.lane == ex.program.host:  # what the caller passed: each process has its own copy
    # Most arguments are last step's outputs, already where they go: an equal sharding on a
    # committed array says so in a microsecond, where ``place_input``'s general test takes a
    # few (a few hundred arguments a step). Equal means equally decided on every process only
    # for one device, or in one process.
    # The sharding object found equal last time stands for the test after it: a step's
    # outputs carry their executable's sharding objects, the same ones every call.
    # In one process, an uncommitted array already on a single-device home (a batch made with
    # jnp.asarray) goes in as it is, as jit takes it: committing it is a device_put of tens of
    # microseconds a call. Across processes it is committed as before: passed uncommitted, its
    # stage's sends to another process never arrived (JAX 0.12; tests/test_multiprocess.py).
    single = jax.process_count() == 1
    quick = single or len(sharding.device_set) == 1
    home = sharding.device_set if single and len(sharding.device_set) == 1 else None
    seen: list[Any] = [None]

    def send_input():
      x = src_lst[si]
      if quick and isinstance(x, jax.Array):
        s = x.sharding
        if x.committed:
          if s is seen[0] or s == sharding:
            seen[0] = s
            dst_lst[di] = x
            return
        elif home is not None and s.device_set == home:
          dst_lst[di] = x
          return
      dst_lst[di] = place_input(x, sharding)

    return send_input

  if ex.program.local(ins):  # stages on the same devices: hand the array over

    def hand_over():
      x = src_lst[si]
      same = isinstance(x, jax.Array) and x.sharding == sharding
      dst_lst[di] = x if same else transfer(x, sharding)

    return hand_over

  def send():
    dst_lst[di] = transfer(src_lst[si], sharding)

  if not ex.multiprocess:  # a run of such puts may go as one (``_batched_sends``)
    send.batch = ((src_lst, si), (dst_lst, di), sharding)  # type: ignore[attr-defined]
  return send


def _chunk(ex: Executor, ins: Instr) -> Callable[[], None]:
  arg = ins.arg
  assert isinstance(arg, Count), f"{ins} has no Count"
  M = arg.n
  (lst, i) = ex.where[ins.reads[0]]
  put = ex._setter(ins.writes)
  if arg.stacked:  # one array, the micro-batches along a new leading axis

    def stack():
      x = lst[i]
      shape = (M, x.shape[0] // M, *x.shape[1:])
      put([_reshape(x, shape) if isinstance(x, jax.Array) else np.reshape(x, shape)])

    return stack
  if ins.lane == ex.program.host:
    return lambda: put(_split_batch(lst[i], M))
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  return lambda: put(_split_on_device(lst[i], M))


def _pack(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  pack = ex.kernels.stages[ins.lane].fns.pack_params
  get, (lst, i) = ex._getter(ins.reads), ex.where[ins.writes[0]]

  def run():
    lst[i] = pack(get())

  return run


def _zero(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  zeros = ex.kernels.stages[ins.lane].zeros
  lst, i = ex.where[ins.writes[0]]

  def run():
    lst[i] = zeros()

  return run


def _forward(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  k = ex.kernels.stages[ins.lane]
  st, fns = k.stage, k.fns
  packed = fns.pack_params is not None
  nparam = sum(1 for r in st.inputs if r.kind == "param")
  ndiff = st.num_diff - (nparam if packed else 0)
  first = 1 if packed else 0
  get = ex._getter(ins.reads)
  put = ex._setter(ins.writes)
  fwd = fns.fwd
  M = ex.lowered.counts[ins.lane]
  keys = k.key_positions if M > 1 else ()  # one micro-batch: the step's own key
  m = ins.mb % M
  fold_m = ex.fold_index(ins.lane, m) if keys else None

  def args():
    vals = get()
    diff = vals[first : first + ndiff]
    nondiff = vals[first + ndiff :]
    for p in keys:
      nondiff[p] = _fold(nondiff[p], fold_m)
    return (vals[0], diff, nondiff) if packed else (diff, nondiff)

  def run():
    outs, res = fwd(*args())
    put((res, *outs))

  return _with_kernel(run, fwd, args)


def _with_kernel(run: Callable[[], None], kernel: Any, args: Callable[[], Any]):
  """``run``, carrying the jitted function it calls and its arguments (``run.kernel``), so
  that a memory-measuring run can ask XLA for the executable's temporaries."""
  run.kernel = (kernel, args)  # type: ignore[attr-defined]
  return run


def _groups(ins: Instr) -> tuple[int, ...]:
  """B's or W's cotangent contributions per output (none without a ``Cotangents``)."""
  return ins.arg.groups if isinstance(ins.arg, Cotangents) else ()


def _grouped(groups: Sequence[int], flat: Sequence[Any]) -> list[tuple[Any, ...]]:
  out, k = [], 0
  for n in groups:
    out.append(tuple(flat[k : k + n]))
    k += n
  return out


def _backward(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  fns = ex.kernels.stages[ins.lane].fns
  packed = fns.pack_params is not None
  groups = _groups(ins)
  get, put = ex._getter(ins.reads), ex._setter(ins.writes)
  pre = 2 if packed else 1
  if ins.lane in ex.split_lanes:  # B computes input cotangents only; W the gradient sums
    bwd_input = fns.bwd_input

    def split_args():
      vals = get()
      return (*vals[:pre], _grouped(groups, vals[pre:]))

    def run_split():
      in_cts, kept = bwd_input(*split_args())
      put((kept, *in_cts))

    return _with_kernel(run_split, bwd_input, split_args)
  bwd = fns.bwd

  def args():
    vals = get()
    return (*vals[:pre], _grouped(groups, vals[pre + 1 :]), vals[pre])

  def run():
    acc, in_cts = bwd(*args())
    put((acc, *in_cts))

  return _with_kernel(run, bwd, args)


def _weight(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  fns = ex.kernels.stages[ins.lane].fns
  pre = 2 if fns.pack_params is not None else 1
  groups = _groups(ins)
  get, (lst, i) = ex._getter(ins.reads), ex.where[ins.writes[0]]
  bwd_weight = fns.bwd_weight

  def args():
    vals = get()  # residuals, (packed parameters), kept, sums, cotangents
    return (*vals[:pre], _grouped(groups, vals[pre + 2 :]), vals[pre], vals[pre + 1])

  def run():
    lst[i] = bwd_weight(*args())

  return _with_kernel(run, bwd_weight, args)


def _update(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  unpack = ex.kernels.stages[ins.lane].fns.acc_leaves
  (lst, i), put = ex.where[ins.reads[0]], ex._setter(ins.writes)
  return lambda: put(unpack(lst[i]))


def _split(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  assert isinstance(ins.arg, Count), f"{ins} has no Count"
  r = ins.arg.n
  (lst, i), put = ex.where[ins.reads[0]], ex._setter(ins.writes)
  return lambda: put(_split_on_device(lst[i], r))


def _concat_rule(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  place = ex.lanes[ins.lane].placement
  assert place is not None
  get, (lst, i) = ex._getter(ins.reads), ex.where[ins.writes[0]]

  def run():
    lst[i] = place.put(_concat(get()))

  return run


def _add_rule(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  get, (lst, i) = ex._getter(ins.reads), ex.where[ins.writes[0]]

  def run():
    parts = get()
    g = parts[0]
    for x in parts[1:]:
      g = _add(g, x)
    lst[i] = g

  return run


def _zeros_rule(ex: Executor, ins: Instr) -> Callable[[], None]:
  aval = ex.lowered.avals[ins.writes[0]]
  place = ex.lanes[ins.lane].placement
  assert place is not None
  lst, i = ex.where[ins.writes[0]]
  shape, dtype = tuple(aval.shape), aval.dtype

  def run():
    lst[i] = transfer(np.zeros(shape, dtype), place.replicated)

  return run


def _reduce(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  get, (lst, i) = ex._getter(ins.reads), ex.where[ins.writes[0]]
  mode = ins.arg
  assert isinstance(mode, Reduce), f"{ins} has no Reduce mode"
  if mode is Reduce.LAST:
    src, j = ex.where[ins.reads[-1]]

    def last():
      lst[i] = src[j]

    return last
  f = {Reduce.CONCAT: _concat, Reduce.SUM: _sum, Reduce.MEAN: _mean}[mode]

  def run():
    lst[i] = f(get())

  return run


def _unstack_rule(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  (lst, i), put = ex.where[ins.reads[0]], ex._setter(ins.writes)

  def run():
    x = lst[i]
    put(_unstack(x) if isinstance(x, jax.Array) else list(np.asarray(x)))

  return run


def _stack_rule(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  get, (lst, i) = ex._getter(ins.reads), ex.where[ins.writes[0]]

  def run():
    lst[i] = _stack(get())

  return run


def _piece(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)
  if remote is not None:
    return remote
  assert isinstance(ins.arg, Piece), f"{ins} has no Piece"
  f = ex.kernels.pieces[ins.arg.index]
  get, put = ex._getter(ins.reads), ex._setter(ins.writes)
  return _with_kernel(lambda: put(f(*get())), f, get)


def _step(ex: Executor, ins: Instr) -> Callable[[], None]:
  remote = ex._remote(ins)  # plain jit on another process's device
  if remote is not None:
    return remote
  f = ex.kernels.fused
  assert f is not None
  get, put = ex._getter(ins.reads), ex._setter(ins.writes)
  return _with_kernel(lambda: put(f(*get())), f, get)


_RULES: dict[Op, Callable[[Executor, Instr], Callable[[], None]]] = {
  Op.SEND: _send,
  Op.CHUNK: _chunk,
  Op.PACK: _pack,
  Op.ZERO: _zero,
  Op.F: _forward,
  Op.B: _backward,
  Op.W: _weight,
  Op.UPDATE: _update,
  Op.SPLIT: _split,
  Op.CONCAT: _concat_rule,
  Op.ADD: _add_rule,
  Op.ZEROS: _zeros_rule,
  Op.REDUCE: _reduce,
  Op.UNSTACK: _unstack_rule,
  Op.STACK: _stack_rule,
  Op.PIECE: _piece,
  Op.STEP: _step,
}
