"""Capturing a train step: the ``value_and_grad`` marker and NNX functionalisation.

``gpp_jax.value_and_grad(loss_fn)(params)`` behaves exactly like ``jax.value_and_grad`` (or
``nnx.value_and_grad`` for an NNX module) when called outside a ``graph_pipeline``. Inside one,
while the step is being traced, it records the loss function as a ClosedJaxpr (the part to
partition into stages) and emits one marker equation whose outputs are the loss (and aux) and
the gradients; the rest of the step stays ordinary JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from flax.errors import TraceContextError
from jax.extend import core as xc

from gpp_jax.errors import CaptureError
from gpp_jax.runtime.input_checks import check_loss_dtype
from gpp_jax.runtime.loss_state import (
  StatePair,
  clear_step_inputs,
  key_name,
  pair_by_path,
  path_names,
  record_step_inputs,
  step_input_path,
)

value_and_grad_p = xc.Primitive("gpp_value_and_grad")
value_and_grad_p.multiple_results = True


def _abstract_eval(*avals, loss_jaxpr, num_params, **_):
  del avals
  return [v.aval for v in loss_jaxpr.jaxpr.outvars] + [
    v.aval for v in loss_jaxpr.jaxpr.invars[:num_params]
  ]


def _impl(*args, **_):
  raise CaptureError(
    "the gpp_value_and_grad marker only exists while graph_pipeline traces a "
    "step; it cannot be executed directly"
  )


value_and_grad_p.def_abstract_eval(_abstract_eval)
value_and_grad_p.def_impl(_impl)


@dataclasses.dataclass
class LossRecord:
  """What the marker recorded about the loss function."""

  param_paths: list[str]
  num_params: int
  has_aux: bool
  # State the loss updates (carried from micro-batch to micro-batch), indices into the loss
  # jaxpr's inputs and outputs.
  state: list[StatePair] = dataclasses.field(default_factory=list)
  # Loss inputs that are NNX variables of the module: keys among them are not folded with the
  # micro-batch index (an ``nnx.Rngs`` stream advances its own counter instead).
  module_state: frozenset[int] = frozenset()
  # How each output of the loss (the loss, then the aux leaves) combines over micro-batches:
  # "mean", "sum", "concat", "last", or None for the default rule (``AUX_REDUCTIONS``).
  reduce: tuple[str | None, ...] = ()


AUX_REDUCTIONS = ("mean", "sum", "concat", "last")


class _State(threading.local):
  recording: list | None = None


_STATE = _State()


@contextlib.contextmanager
def recording():
  """While active, ``value_and_grad`` emits the marker and appends a LossRecord."""
  prev = _STATE.recording
  _STATE.recording = []
  try:
    yield _STATE.recording
  finally:
    _STATE.recording = prev


def layer_path(path) -> str:
  """Layer path of a parameter from its pytree path.

  ``['params']['block0']['fc']['kernel']`` (Linen) and ``['block0']['fc']['kernel'].value``
  (NNX) both give ``block0/fc``; a top-level leaf keeps its own name.
  """
  parts = [key_name(k) for k in path]
  if parts and parts[-1] == "value":
    parts = parts[:-1]
  if len(parts) > 1 and parts[0] == "params":
    parts = parts[1:]
  return "/".join(parts[:-1]) if len(parts) > 1 else "/".join(parts)


def _is_graph_node(x) -> bool:
  return isinstance(x, nnx.Module)


def value_and_grad(fun: Callable, has_aux: bool = False, aux_reduce: Any = None) -> Callable:
  """Like ``jax.value_and_grad(fun, has_aux=has_aux)``, differentiating the first argument.

  Inside a ``graph_pipeline`` step, marks where the pipelined forward ends: ``fun`` is the part
  of the step that is split into stages. The first argument may be a pytree of parameters or a
  Flax NNX module (its ``nnx.Param`` variables are differentiated, as ``nnx.value_and_grad``
  does). The loss must be a scalar mean over the examples of the batch.

  ``aux_reduce`` says how aux values combine over the micro-batches of a pipelined step: one of
  ``"mean"``, ``"sum"`` (a summed metric such as a token count), ``"concat"`` (per-example values,
  along the leading axis) or ``"last"``, for every aux leaf, or a pytree of them matching the aux
  (a prefix of it, or a dict naming some of its top-level entries). Unnamed leaves keep the
  default: floating values are averaged, arrays whose leading axis is the micro-batch
  concatenated, others (integers) take the last micro-batch's. Outside a pipeline it is ignored.
  """
  _check_reduce_spec(aux_reduce)

  def wrapped(params, *args, **kwargs):
    if _STATE.recording is None:
      if _is_graph_node(params):
        return nnx.value_and_grad(fun, has_aux=has_aux)(params, *args, **kwargs)
      return jax.value_and_grad(fun, has_aux=has_aux)(params, *args, **kwargs)
    if _STATE.recording:
      raise CaptureError(
        "gpp_jax.value_and_grad was called twice in one step; a pipelined "
        "step computes one loss. Combine the losses in one loss function."
      )
    if _is_graph_node(params):
      graphdef, pstate, rest = nnx.split(params, nnx.Param, ...)
      with_path, ptree = jax.tree_util.tree_flatten_with_path(pstate)
      rest_with_path, rest_tree = jax.tree_util.tree_flatten_with_path(rest)

      def rebuild(leaves, rest_leaves):
        return nnx.merge(
          graphdef, jax.tree.unflatten(ptree, leaves), jax.tree.unflatten(rest_tree, rest_leaves)
        )
    else:
      with_path, ptree = jax.tree_util.tree_flatten_with_path(params)
      rest_with_path, rest_tree = [], None

      def rebuild(leaves, rest_leaves):
        del rest_leaves
        return jax.tree.unflatten(ptree, leaves)

    leaves = [x for _, x in with_path]
    rest_leaves = [x for _, x in rest_with_path]
    npar, nrest = len(leaves), len(rest_leaves)
    paths = [layer_path(p) for p, _ in with_path]
    out_tree = []
    changed: list[int] = []  # module variables the loss gives a new value
    aux_paths: list[tuple[str, ...]] = []
    reduce: list[str | None] = [None]  # the loss itself: the mean over micro-batches

    def flat(*ls):
      model = rebuild(ls[:npar], ls[npar:])
      try:
        out = fun(model, *args, **kwargs)
      except TraceContextError as err:
        raise CaptureError(
          "the loss function changes an NNX variable that is not part of the differentiated "
          "module (an nnx.Rngs or a module passed to the loss or closed over); keep the state "
          "the loss updates in the module given to gpp_jax.value_and_grad, e.g. "
          f"nnx.Dropout(rate, rngs=rngs) inside the model. Flax said: {err}"
        ) from None
      if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
          raise CaptureError("with has_aux=True the loss function must return (loss, aux)")
        loss, aux = out
      else:
        loss, aux = out, None
      if getattr(loss, "shape", None) != ():
        raise CaptureError(
          f"the loss function must return a scalar loss (a mean over the "
          f"batch); got shape {getattr(loss, 'shape', type(loss))}"
        )
      check_loss_dtype(loss)
      with_p, tree = jax.tree_util.tree_flatten_with_path((loss, aux))
      out_tree.append(tree)
      reduce.extend(_reductions(aux, aux_reduce))
      aux_paths.extend(path_names(p[1:]) for p, _ in with_p)
      flat_out = [x for _, x in with_p]
      if nrest:
        new_rest = jax.tree.leaves(nnx.split(model, nnx.Param, ...)[2])
        changed.extend(i for i, (a, b) in enumerate(zip(new_rest, ls[npar:])) if a is not b)
        flat_out += [new_rest[i] for i in changed]
      return flat_out

    closed = jax.make_jaxpr(flat)(*leaves, *rest_leaves)
    J = closed.jaxpr
    is_tr = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    tracer_vars = [v for v, t in zip(J.constvars, is_tr) if t]
    tracers = [c for c, t in zip(closed.consts, is_tr) if t]
    const_vars = [v for v, t in zip(J.constvars, is_tr) if not t]
    consts = [c for c, t in zip(closed.consts, is_tr) if not t]
    dbg = xc.DebugInfo(
      "graph_pipeline",
      "loss",
      tuple(f"in{i}" for i in range(len(J.invars) + len(tracer_vars))),
      tuple(f"out{i}" for i in range(len(J.outvars))),
    )
    loss_jaxpr = xc.ClosedJaxpr(
      xc.Jaxpr(
        const_vars, list(J.invars) + tracer_vars, J.outvars, J.eqns, J.effects, debug_info=dbg
      ),
      consts,
    )
    nout = len(J.outvars) - len(changed)
    state = [
      StatePair(npar + i, nout + n, "/".join(path_names(rest_with_path[i][0])))
      for n, i in enumerate(changed)
    ]
    # Linen: aux leaves that are new values of step inputs the loss reads (mutable collections).
    linen_inputs = [
      (k, step_input_path(t), v.aval)
      for k, (t, v) in enumerate(zip(tracers, tracer_vars))
      if step_input_path(t) is not None
    ]
    aux_out = [(aux_paths[k], J.outvars[k].aval) for k in range(1, nout)]
    for j, k, name in pair_by_path(aux_out, [(p, a) for _, p, a in linen_inputs]):
      state.append(StatePair(npar + nrest + linen_inputs[j][0], 1 + k, name))
    outs = value_and_grad_p.bind(
      *leaves, *rest_leaves, *tracers, loss_jaxpr=loss_jaxpr, num_params=npar
    )
    reduce += [None] * (len(J.outvars) - len(reduce))  # new module state: its last value
    _STATE.recording.append(
      LossRecord(paths, npar, has_aux, state, frozenset(range(npar, npar + nrest)), tuple(reduce))
    )
    loss_aux = jax.tree.unflatten(out_tree[0], outs[:nout])
    if changed:
      new_rest = list(rest_leaves)
      for n, i in enumerate(changed):
        new_rest[i] = outs[nout + n]
      nnx.update(params, jax.tree.unflatten(rest_tree, new_rest))
    grads = jax.tree.unflatten(ptree, outs[len(J.outvars) :])
    return (loss_aux if has_aux else loss_aux[0]), grads

  return wrapped


def _check_reduce_spec(spec: Any) -> None:
  bad = [x for x in jax.tree.leaves(spec) if x not in AUX_REDUCTIONS]
  if bad:
    raise CaptureError(
      f"aux_reduce takes {', '.join(map(repr, AUX_REDUCTIONS))} per aux leaf (or a pytree "
      f"of them); got {bad[0]!r}"
    )


def _reductions(aux: Any, spec: Any) -> list[str | None]:
  """One reduction (or None: the default rule) per leaf of ``aux``, in flattening order, from
  ``aux_reduce``: a string for all, a dict naming some top-level entries of a dict aux, or a
  pytree that is a prefix of the aux."""
  n = len(jax.tree.leaves(aux))
  if spec is None:
    return [None] * n
  if isinstance(spec, str):
    return [spec] * n
  if isinstance(spec, dict) and isinstance(aux, dict):
    unknown = sorted(set(spec) - set(aux), key=str)
    if unknown:
      raise CaptureError(f"aux_reduce names {unknown}, which the aux ({sorted(aux)}) lacks")
    return [r for k in sorted(aux) for r in _reductions(aux[k], spec.get(k))]
  try:
    groups = jax.tree.map(lambda r, a: _Repeat(r, len(jax.tree.leaves(a))), spec, aux)
  except (ValueError, TypeError) as e:
    raise CaptureError(
      f"aux_reduce must be a string, a dict naming aux entries, or a pytree prefix of the aux; "
      f"it does not match the aux's structure ({e})"
    ) from None
  leaves = jax.tree.leaves(groups, is_leaf=lambda x: isinstance(x, _Repeat))
  return [g.value for g in leaves for _ in range(g.count)]


@dataclasses.dataclass(frozen=True)
class _Repeat:
  value: str
  count: int


# ------------------------------------------------------------------ NNX functionalisation


@dataclasses.dataclass
class PureStep:
  """A step function turned pure: ``pure(*leaves) -> (out leaves, new graph-state leaves)``."""

  fn: Callable
  in_tree: Any
  graph_positions: tuple[int, ...]
  graphdef: Any
  out_tree: list
  # Arguments the step takes by position (keyword arguments follow them, ``with_keywords``).
  num_positional: int = -1
  keywords: tuple[str, ...] = ()
  # The NNX objects' state as split (its Variables are the objects' own, in flattening order:
  # writing a new value into one updates the object), None without NNX objects.
  state: Any = None


def functionalize(step: Callable, args: tuple) -> tuple[PureStep, list]:
  """Turns ``step(*args)`` into a pure function of flat leaves.

  NNX modules and optimizers among ``args`` are split into a GraphDef and State (keeping
  shared references), merged back inside, and their final state is returned as outputs, the
  way ``nnx.jit`` does it.
  """
  pos = tuple(i for i, a in enumerate(args) if _is_graph_node(a) or isinstance(a, nnx.Optimizer))
  graph_objs = tuple(args[i] for i in pos)
  if graph_objs:
    graphdef, state = nnx.split(graph_objs)
  else:
    graphdef, state = None, None
  others = tuple(a for i, a in enumerate(args) if i not in pos)
  leaves, in_tree = jax.tree.flatten((state, others))
  out_tree = []

  def pure(*flat):
    if _STATE.recording is not None:  # capturing: the paths name the step's inputs (slow)
      paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((state, others))[0]]
      record_step_inputs(list(zip(paths, flat)))
    st, oth = jax.tree.unflatten(in_tree, flat)
    it = iter(oth)
    objs = nnx.merge(graphdef, st) if graph_objs else ()
    full, k = [], 0
    for i in range(len(args)):
      if i in pos:
        full.append(objs[k])
        k += 1
      else:
        full.append(next(it))
    try:
      out = step(*full)
    finally:
      clear_step_inputs()
    new_state = nnx.state(objs) if graph_objs else None
    out_flat, tree = jax.tree.flatten((out, new_state))
    out_tree.append(tree)
    return out_flat

  npos = getattr(step, "num_positional", len(args))
  names = getattr(step, "names", ())
  return PureStep(pure, in_tree, pos, graphdef, out_tree, npos, names, state), leaves


@dataclasses.dataclass(frozen=True)
class _WithKeywords:
  """``fn(*args[:n], **dict(zip(names, args[n:])))``: a step called with keyword arguments, as
  a function of positional ones (their values are step arguments like any other)."""

  fn: Callable
  num_positional: int
  names: tuple[str, ...]

  def __call__(self, *args):
    n = self.num_positional
    return self.fn(*args[:n], **dict(zip(self.names, args[n:])))


def with_keywords(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
  """The step and its arguments with keyword arguments bound by ``fn``'s signature: those it
  can take by position join the positional ones (so ``step(state, batch=b)`` is
  ``step(state, b)``), the rest follow them by name."""
  if not kwargs:
    return fn, args
  try:
    bound = inspect.signature(fn).bind(*args, **kwargs)
  except TypeError as e:
    name = getattr(fn, "__name__", "the step")
    raise TypeError(f"{name}() {e}") from None
  positional, by_name = tuple(bound.args), dict(bound.kwargs)
  if not by_name:
    return fn, positional
  names = tuple(by_name)
  return _WithKeywords(fn, len(positional), names), positional + tuple(by_name[k] for k in names)
