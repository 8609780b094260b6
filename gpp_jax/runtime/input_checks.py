"""Checks of what a user hands ``graph_pipeline``: its settings, the step's arguments from call
to call, and the primitives of the loss. Each raises before anything is compiled, naming the
input and the fix."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as xc

from gpp_jax.errors import BatchError, CaptureError


def check_num_microbatches(n: Any) -> int:
  """``num_microbatches`` as an int: a whole number >= 1 (2.5 or True are refused)."""
  if isinstance(n, bool) or not isinstance(n, numbers.Integral):
    raise ValueError(
      f"num_microbatches must be a whole number of micro-batches (an int >= 1); got {n!r} "
      f"of type {type(n).__name__}"
    )
  if n < 1:
    raise ValueError(f"num_microbatches must be >= 1, got {n}")
  return int(n)


def check_positive(name: str, value: Any) -> float:
  """A setting that must be a number > 0 (``timeout_s``, ``layer_depth``)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
    raise ValueError(f"{name} must be a number > 0; got {value!r}")
  return float(value)


def check_devices(devices: Iterable[Any] | None) -> tuple[Any, ...]:
  """``devices`` as a tuple of distinct JAX devices (default: ``jax.devices()``)."""
  if devices is None:
    return tuple(jax.devices())
  if isinstance(devices, jax.Device):
    devices = [devices]
  devs = tuple(devices)
  if not devs:
    raise ValueError("devices= is empty; pass the devices to run on, e.g. jax.devices()[:4]")
  for i, d in enumerate(devs):
    if not isinstance(d, jax.Device):
      raise ValueError(
        f"devices= takes JAX devices; entry {i} is {d!r} ({type(d).__name__}). Pass "
        f"jax.devices()[:{len(devs)}] (or [jax.devices()[i] for i in your indices]); "
        "device indices belong in a plan, where they count positions in devices="
      )
  seen: dict[Any, int] = {}
  for i, d in enumerate(devs):
    if d in seen:
      raise ValueError(
        f"devices= names {d} twice (entries {seen[d]} and {i}); two stages would share it "
        "without running concurrently. Pass each device once"
      )
    seen[d] = i
  return devs


# ---------------------------------------------------------------------------- the loss

_IMPURE_PRIMITIVES = ("callback", "debug_print")


def _subjaxprs(eqn) -> list[xc.Jaxpr]:
  out = []
  for p in eqn.params.values():
    for v in p if isinstance(p, (list, tuple)) else (p,):
      if isinstance(v, xc.ClosedJaxpr):
        out.append(v.jaxpr)
      elif isinstance(v, xc.Jaxpr):
        out.append(v)
  return out


def _impure(eqn) -> str | None:
  """The name of the first callback or effectful primitive in ``eqn`` or its sub-jaxprs."""
  if eqn.effects or any(k in eqn.primitive.name for k in _IMPURE_PRIMITIVES):
    return eqn.primitive.name
  for sub in _subjaxprs(eqn):
    for e in sub.eqns:
      name = _impure(e)
      if name is not None:
        return name
  return None


def check_loss_is_pure(loss: xc.ClosedJaxpr, eqn_layer: Sequence[str]) -> None:
  """Raises CaptureError naming the layer and source line of the first callback, print or
  other side effect in the loss: a pipelined loss is differentiated and re-run per stage,
  which neither a callback (no derivative) nor a side effect survives."""
  from jax._src import source_info_util  # the user's line, as JAX's own errors print it

  for e, layer in zip(loss.jaxpr.eqns, eqn_layer):
    name = _impure(e)
    if name is None:
      continue
    where = source_info_util.summarize(e.source_info)
    raise CaptureError(
      f"unsupported primitive {name} in layer {layer!r} of the loss (at {where}): callbacks "
      "have no derivative and side effects would run once per stage and micro-batch, so a "
      "pipelined loss function must be pure. Remove debug prints and callbacks from the "
      "loss (return values as aux instead; a host computation belongs outside the loss "
      "function, or give it a jax.custom_vjp)"
    )


def check_loss_dtype(loss: Any) -> None:
  """Raises CaptureError for a loss that is not floating point (nothing could train)."""
  dtype = getattr(loss, "dtype", None)
  if dtype is not None and not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
    raise CaptureError(
      f"the loss function returns a loss of dtype {dtype}; gradients of an integer or "
      "boolean loss are zero (jax.grad refuses it), so nothing would train. Return a "
      "floating-point loss, e.g. a mean of float per-example losses"
    )


# ---------------------------------------------------------------------------- calls


def argument_signature(args: Sequence[Any], skip: Iterable[int]) -> dict[str, Any]:
  """``{argument path: (shape, dtype)}`` of the step arguments outside ``skip`` (NNX objects),
  to say later what changed between two calls."""
  skip = set(skip)
  out: dict[str, Any] = {}
  for i, a in enumerate(args):
    if i in skip:
      continue
    for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
      dtype = getattr(x, "dtype", None) or np.result_type(x)
      out[f"argument {i}{jax.tree_util.keystr(path)}"] = (tuple(np.shape(x)), str(dtype))
  return out


def differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
  """What differs between two ``argument_signature``s, in words."""
  out = [f"{k} is new" for k in now if k not in before]
  out += [f"{k} is missing" for k in before if k not in now]
  out += [
    f"{k} has shape {now[k][0]} {now[k][1]}, before {before[k][0]} {before[k][1]}"
    for k in now
    if k in before and now[k] != before[k]
  ]
  return out


def changed_arguments_error(diff: Sequence[str], err: BaseException) -> BatchError:
  """The error for a call whose arguments differ from an earlier call's and on which the step
  fails to trace: what changed, then the step's own error (kept as the cause)."""
  shown = "; ".join(diff[:6]) + ("; ..." if len(diff) > 6 else "")
  return BatchError(
    f"this call's arguments differ from an earlier call's ({shown}), and the step fails on "
    f"them: {type(err).__name__}: {err}. The model and its parameters were built for the "
    "earlier arguments; pass batches of the same structure and feature sizes (only the "
    "number of examples may change)"
  )
