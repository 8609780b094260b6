"""The capture phase of the compile chain (``runtime.compile``): a train step and its arguments
-> ``Captured``: the step's Jaxpr (calls inlined), its loss after the scan split and the loss's
layers, the role of each loss input, the batch arguments and the state the loss carries.

The ``value_and_grad`` marker the step records its loss with and the NNX functionalisation are
``runtime.capture_step``'s."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.extend import core as xc

from gpp_jax.errors import BatchError, CaptureError
from gpp_jax.ir.layering import Layering
from gpp_jax.ir.scan import ScanSplit
from gpp_jax.passes.capture import inline_calls
from gpp_jax.passes.layering import layer_program
from gpp_jax.passes.lowering import BATCH, BROADCAST, KEY, STATE
from gpp_jax.passes.scan_split import split_scans
from gpp_jax.runtime.capture_step import PureStep, recording, value_and_grad_p
from gpp_jax.runtime.input_checks import check_loss_is_pure
from gpp_jax.runtime.layer_memory import step_memory
from gpp_jax.runtime.loss_state import StatePair, check_state_returned
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.placement import PACK_LIMIT_BYTES, pack_limit
from gpp_jax.runtime.sharding import (
  check_specs,
  leaf_names,
  mesh_facts,
  param_shards,
  step_leaf_specs,
  tensor_parallel,
)


@dataclasses.dataclass(frozen=True)
class Captured:
  """The traced step (no planning, no compilation).

  Attributes:
    out_tree: the tree of the step's outputs (its own and the new NNX state).
    step: the whole step's ClosedJaxpr (calls inlined); ``marker_index`` its value-and-grad.
    loss: the loss's ClosedJaxpr after the scan split; ``layering`` its layers.
    roles: per marker input: None for a parameter, else BATCH, KEY, BROADCAST or STATE.
    state: state the loss updates (``runtime.loss_state``).
    scan_split: how stacked parameters were cut per layer (``passes.scan_split``).
    nparam: parameters of the captured loss.
    batch_size, microbatch_size: examples per step and per micro-batch (as traced).
    batch_leaves: the flat step arguments that are batch arrays (traced at micro-batch size).
    donated: the flat step arguments of ``donate_argnums`` (``donated_leaves``).
    reduce: per loss output, how it combines over micro-batches (``value_and_grad``'s
      ``aux_reduce``; None: the default rule).
    loss_as_traced: the loss at micro-batch size before the scan split (the fused step's).
  """

  out_tree: Any
  step: xc.ClosedJaxpr
  marker_index: int
  loss: xc.ClosedJaxpr
  layering: Layering
  roles: tuple[str | None, ...]
  state: tuple[StatePair, ...]
  scan_split: ScanSplit
  nparam: int
  batch_size: int
  microbatch_size: int
  batch_leaves: tuple[int, ...] = ()
  reduce: tuple[str | None, ...] = ()
  donated: tuple[int, ...] = ()
  loss_as_traced: xc.ClosedJaxpr | None = None
  # Per flat step argument: its partition spec (None: replicated) and a readable path.
  leaf_specs: tuple[Any, ...] = ()
  leaf_names: tuple[str, ...] = ()

  @property
  def marker(self) -> xc.JaxprEqn:
    return self.step.jaxpr.eqns[self.marker_index]


def capture(
  pure: PureStep,
  args: Sequence[Any],
  leaves: Sequence[Any],
  opts: Options,
  microbatch_size: int | None = None,
) -> Captured:
  """Traces the step and layers its loss, at micro-batches of ``microbatch_size`` samples
  (default: batch / num_microbatches).

  The loss is traced at the micro-batch size. The rest of the step is too, unless it reads
  the batch itself (metrics such as an accuracy computed from the batch and the logits the loss
  returned): then the step is traced once more at the whole batch, and that trace is the step
  the pipeline runs around its loss."""
  batch_idx, B = batch_leaves(pure, args, leaves, opts)
  mb = B // opts.num_microbatches if microbatch_size is None else microbatch_size
  step, rec, mk = _trace(pure, leaves, batch_idx, mb)
  traced_loss = inline_calls(step.jaxpr.eqns[mk].params["loss_jaxpr"])
  batch_vars = {step.jaxpr.invars[i] for i in batch_idx}
  if mb != B and _reads_batch_outside_loss(step.jaxpr, mk, batch_vars):
    step, _, mk = _trace(pure, leaves, batch_idx, B)
  J = step.jaxpr
  marker = J.eqns[mk]
  batch_vars = {J.invars[i] for i in batch_idx}
  if any(isinstance(a, xc.Var) and a in batch_vars for a in marker.invars[: rec.num_params]):
    raise CaptureError("a batch array is passed as the differentiated argument")
  # Batch arrays are split, never carried (an aux leaf named like a batch entry is no state).
  state = [p for p in rec.state if p.input is None or marker.invars[p.input] not in batch_vars]
  roles = input_roles(marker, rec.num_params, batch_vars, state, rec.module_state)
  check_state_returned(J, marker, state)
  pairs = [(p.input, p.output) for p in state if p.input is not None]
  loss, split_paths, scan_split = split_scans(traced_loss, rec.num_params, rec.param_paths, pairs)
  layering = layer_program(
    loss,
    split_paths + [None] * (len(loss.jaxpr.invars) - len(split_paths)),
    batch_size=mb,
    layer_depth=opts.layer_depth,
    name=opts.name,
  )
  check_loss_is_pure(loss, layering.eqn_layer)
  # The model's own partition specs hold over a mesh the user gave (``devices=`` alone runs as
  # before: stages replicate their parameters).
  specs = step_leaf_specs(pure, args, opts.layout) if opts.layout is not None else ()
  if len(specs) != len(leaves):  # a box holding several arrays: the specs cannot be told apart
    specs = (None,) * len(leaves)
  captured = Captured(
    out_tree=pure.out_tree[-1],
    step=step,
    marker_index=mk,
    loss=loss,
    layering=layering,
    roles=roles,
    state=tuple(state),
    scan_split=scan_split,
    nparam=rec.num_params,
    batch_size=B,
    microbatch_size=mb,
    batch_leaves=tuple(batch_idx),
    reduce=rec.reduce,
    donated=donated_leaves(pure, args, opts),
    loss_as_traced=traced_loss,
    leaf_specs=specs,
    leaf_names=tuple(leaf_names(pure, args)) if any(specs) else (),
  )
  # Stages over several rows sum their own gradients and reduce them once per step where
  # nothing the loss does depends on how the micro-batch is split (``row_local_programs``).
  layering.graph.graph["reduce_once"] = not (
    opts.remat or state or KEY in roles or jax.process_count() > 1
  )
  if opts.layout is not None:
    shapes = [None if i in batch_idx else tuple(np.shape(x)) for i, x in enumerate(leaves)]
    layering.graph.graph["mesh"] = mesh_facts(specs, shapes, opts.layout)
  if any(specs) and opts.layout is not None:
    # Axes the mesh lacks are refused here; what divides what, per plan (``plan_leaf_specs``).
    check_specs(specs, shapes, captured.leaf_names, opts.layout, ())
    # What the cost model holds per device.
    layering.graph.graph["param_shards"] = param_shards(captured, opts.layout)
    layering.graph.graph["tensor_parallel"] = tensor_parallel(captured, opts.layout)
  if microbatch_size is None:  # the capture the planners plan on
    # What each layer holds besides its parameters, for the cost model's memory: residuals,
    # packed copies, optimizer state, batch (``runtime.layer_memory``). Layers that cannot be
    # traced as stages of their own leave it out: the planners then use the layers' saved
    # bytes and the cost model's fixed factors.
    with contextlib.suppress(Exception):  # a refinement of the estimate, never an error
      limit = pack_limit(opts.devices[0]) if opts.devices else PACK_LIMIT_BYTES["cpu"]
      layering.graph.graph["step_memory"] = step_memory(captured, limit, opts.fuse)
  return captured


def _trace(pure: PureStep, leaves: Sequence[Any], batch_idx: Sequence[int], size: int):
  """The step's ClosedJaxpr (calls inlined) with the batch leaves at ``size`` examples, the
  loss's record, and the marker's position."""
  abstract = [
    jax.ShapeDtypeStruct(
      ((size,) + tuple(np.shape(x))[1:]) if i in batch_idx else tuple(np.shape(x)),
      canonical_dtype(x),
    )
    for i, x in enumerate(leaves)
  ]
  with recording() as recs:
    # A fresh function each time: make_jaxpr caches traces by function, and a cached trace
    # runs none of the Python that records the loss.
    step = jax.make_jaxpr(lambda *a: pure.fn(*a))(*abstract)
  if not recs:
    raise CaptureError(
      "the step never calls gpp_jax.value_and_grad; replace "
      "jax.value_and_grad / nnx.value_and_grad by gpp_jax.value_and_grad"
    )
  step = inline_calls(step)
  markers = [k for k, e in enumerate(step.jaxpr.eqns) if e.primitive is value_and_grad_p]
  if len(markers) != 1:
    raise CaptureError(
      f"expected one gpp_jax.value_and_grad in the step, found {len(markers)} "
      "(it may not sit inside jax.lax control flow)"
    )
  return step, recs[0], markers[0]


def _reads_batch_outside_loss(J: xc.Jaxpr, mk: int, batch_vars: set) -> bool:
  """Whether the step reads (or returns) the batch outside its loss function."""
  return any(
    k != mk and any(isinstance(a, xc.Var) and a in batch_vars for a in e.invars)
    for k, e in enumerate(J.eqns)
  ) or any(isinstance(a, xc.Var) and a in batch_vars for a in J.outvars)


def batch_leaves(
  pure: PureStep, args: Sequence[Any], leaves: Sequence[Any], opts: Options
) -> tuple[list[int], int]:
  """The flat step arguments that are batch arrays, and the batch size (checked to split
  into the micro-batches)."""
  M = opts.num_microbatches
  bpos = opts.batch_positions(len(args), pure.num_positional)
  # Flat indices of batch leaves: graph state first, then the other arguments in order.
  nstate = (
    len(jax.tree.leaves(nnx.state(tuple(args[i] for i in pure.graph_positions))))
    if pure.graph_positions
    else 0
  )
  for i in pure.graph_positions:
    if i in bpos:
      raise CaptureError(f"argument {i} is an NNX object, not a batch; set batch_argnums")
  others = _other_arg_leaves(pure, args, nstate)
  batch_idx = [k for i, r in others.items() if i in bpos for k in r]
  if not batch_idx:
    raise BatchError(
      f"the batch arguments {bpos} hold no arrays; pass the batch there or set batch_argnums"
    )
  sizes = {np.shape(leaves[i])[0] if np.ndim(leaves[i]) else None for i in batch_idx}
  if None in sizes or len(sizes) != 1:
    raise BatchError(
      f"batch leaves must share one leading (batch) dimension; got sizes {sorted(map(str, sizes))}"
    )
  B = sizes.pop()
  assert B is not None  # None in sizes raised above
  if opts.batch_argnums is None and M > 1:
    _check_no_batch_left_whole(others, bpos, leaves, B, pure.num_positional)
  if B % M:
    raise BatchError(
      f"the batch of {B} examples does not split into {M} micro-batches; use a "
      f"batch size divisible by {M} or a num_microbatches that divides {B}"
    )
  return batch_idx, B


def donated_leaves(pure: PureStep, args: Sequence[Any], opts: Options) -> tuple[int, ...]:
  """The flat step arguments of the arguments at ``opts.donate_argnums``: every array of a
  pytree there, and of an NNX object there its Variables' values (a Variable two objects
  share belongs to the first)."""
  if not opts.donate_argnums:
    return ()
  npos = pure.num_positional if pure.num_positional >= 0 else len(args)
  donate = set()
  for a in opts.donate_argnums:
    if not -npos <= a < npos:
      raise ValueError(
        f"donate_argnums {opts.donate_argnums} out of range for {npos} positional arguments"
      )
    donate.add(a % npos)
  out: list[int] = []
  gpos = pure.graph_positions
  nstate = 0
  if gpos:
    _, state = nnx.split(tuple(args[i] for i in gpos))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    out = [k for k, path in enumerate(paths) if gpos[path[0].key] in donate]
    nstate = len(paths)
  out += [k for i, r in _other_arg_leaves(pure, args, nstate).items() if i in donate for k in r]
  return tuple(out)


def _check_no_batch_left_whole(
  others: dict[int, range], bpos: Sequence[int], leaves: Sequence[Any], B: int, npos: int
) -> None:
  """BatchError where, the batch being the last argument by default and split into several
  micro-batches, another positional argument looks like part of it: every one of its arrays
  has the batch's leading dimension (``step(model, optimizer, x, y)``). Left whole it would
  meet micro-batches of the rest, a shape error at best and a silently broadcast loss at
  worst."""
  for i, r in others.items():
    if i in bpos or (0 <= npos <= i) or not r:
      continue
    arrays = [leaves[k] for k in r]
    if all(np.ndim(x) >= 1 and np.shape(x)[0] == B and not _is_key(x) for x in arrays):
      last = bpos[-1]
      raise BatchError(
        f"argument {i} has the batch's leading dimension ({B}) in every array but is not "
        f"split into micro-batches: by default the batch is the last positional argument "
        f"({last}) alone. If argument {i} is part of the batch, pass "
        f"batch_argnums=({i}, {last}) (or put the batch in one argument); if it is not, pass "
        f"batch_argnums={last} to say so"
      )


def _other_arg_leaves(pure: PureStep, args: Sequence[Any], nstate: int) -> dict[int, range]:
  """The flat step arguments of each argument that is not an NNX object, in argument order:
  the flat arguments are the ``nstate`` leaves of the NNX objects' state, then these."""
  out: dict[int, range] = {}
  offset = nstate
  for i, a in enumerate(args):
    if i not in pure.graph_positions:
      n = len(jax.tree.leaves(a))
      out[i] = range(offset, offset + n)
      offset += n
  return out


def input_roles(marker, nparam: int, batch_vars: set, state, module_state) -> tuple:
  """Per loss input: None for a parameter, BATCH (split into micro-batches), STATE (carried
  from micro-batch to micro-batch), KEY (micro-batch index folded in) or BROADCAST."""
  roles: list[str | None] = [None] * nparam
  carried = {p.input for p in state if p.input is not None}
  for i, a in enumerate(marker.invars[nparam:], nparam):
    if isinstance(a, xc.Var) and a in batch_vars:
      roles.append(BATCH)
    elif i in carried:
      roles.append(STATE)
    elif _is_key(a.aval) and i not in module_state:
      roles.append(KEY)
    else:
      roles.append(BROADCAST)
  if BATCH not in roles:
    raise CaptureError(
      "the loss function does not read the batch; the pipeline splits the "
      "batch read inside the loss into micro-batches"
    )
  return tuple(roles)


def canonical_dtype(x) -> Any:
  dtype = getattr(x, "dtype", None) or np.result_type(x)
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype
  return jax.dtypes.canonicalize_dtype(dtype)


def _is_key(x) -> bool:
  dt = getattr(x, "dtype", None)
  if dt is None:
    return False
  if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
    return True
  return dt == np.uint32 and tuple(getattr(x, "shape", ())) == (2,)
