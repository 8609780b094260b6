"""Stacked parameters split by ``passes.scan_split``: slicing them for the pipeline and
stacking their gradients again.

A stacked parameter (all layers of a scan in one array) lives on the stage that owns its first
slice, where the optimizer updates it. Each step slices it there and sends every slice to the
stage owning that layer; the slices' gradients come back and are stacked on the home stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gpp_jax.passes.scan_split import ScanSplit
from gpp_jax.runtime.driver import placeholder
from gpp_jax.runtime.placement import StagePlacement, transfer


@jax.jit
def _unstack(x):
  return list(x)


@jax.jit
def _stack(xs):
  return jnp.stack(xs)


def param_homes(split: ScanSplit, param_owner: Sequence[int]) -> list[int]:
  """The home stage of each captured parameter: its owner, or its first slice's owner."""
  return [param_owner[p[0]] for p in split.parts]


def slice_params(
  split: ScanSplit,
  params: Sequence[Any],
  param_owner: Sequence[int],
  placements: Sequence[StagePlacement],
  local: Sequence[bool],
) -> list[Any]:
  """Captured parameters (each on its home) -> the split loss's parameters, each slice on
  the stage that owns it."""
  out: list[Any] = []
  for x, ks in zip(params, split.parts):
    if len(ks) == 1:
      out.append(x)
      continue
    home = param_owner[ks[0]]
    if local[home]:
      parts = _unstack(x)
    else:
      aval = jax.core.ShapedArray(tuple(x.shape[1:]), x.dtype)
      parts = [placeholder(aval, placements[home].replicated) for _ in ks]
    out.extend(transfer(p, placements[param_owner[k]].replicated) for p, k in zip(parts, ks))
  return out


def stack_grads(
  split: ScanSplit,
  grads: Sequence[Any],
  param_owner: Sequence[int],
  placements: Sequence[StagePlacement],
  local: Sequence[bool],
) -> list[Any]:
  """The split loss's parameter gradients -> one gradient per captured parameter, on its
  home (stacked slices for a stacked parameter)."""
  out: list[Any] = []
  for ks in split.parts:
    if len(ks) == 1:
      out.append(grads[ks[0]])
      continue
    home = param_owner[ks[0]]
    parts = [transfer(grads[k], placements[home].replicated) for k in ks]
    if local[home]:
      out.append(_stack(parts))
    else:
      g0 = grads[ks[0]]
      aval = jax.core.ShapedArray((len(ks),) + tuple(g0.shape), g0.dtype)
      out.append(placeholder(aval, placements[home].replicated))
  return out


def slice_data(split: ScanSplit, data: Sequence[Any]) -> list[Any]:
  """The captured loss's other inputs -> the split loss's: state stacked along a split scan
  is sliced where it is (the runner puts every slice on the stage that reads it)."""
  out: list[Any] = []
  for x, ks in zip(data, split.parts[split.num_params :]):
    out.extend([x] if len(ks) == 1 else _unstack(x))
  return out


def stack_outputs(
  split: ScanSplit,
  outs: Sequence[Any],
  output_stage: Sequence[int],
  placements: Sequence[StagePlacement],
  local: Sequence[bool],
) -> list[Any]:
  """The split loss's outputs -> the captured loss's: the slices of a split state's new value
  are stacked on the stage that computes the first slice."""
  result: list[Any] = []
  for ks in split.out_parts:
    if len(ks) == 1:
      result.append(outs[ks[0]])
      continue
    home = output_stage[ks[0]]
    parts = [transfer(outs[k], placements[home].replicated) for k in ks]
    if local[home]:
      result.append(_stack(parts))
    else:
      o0 = outs[ks[0]]
      aval = jax.core.ShapedArray((len(ks),) + tuple(o0.shape), o0.dtype)
      result.append(placeholder(aval, placements[home].replicated))
  return result
