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


def _restack(
  groups: Sequence[Sequence[int]],
  values: Sequence[Any],
  home_of: Sequence[int],
  placements: Sequence[StagePlacement],
  local: Sequence[bool],
) -> list[Any]:
  """Each group of ``values`` (slices of one stacked array) stacked again on the stage
  ``home_of[first slice]``; a group of one is passed through."""
  out: list[Any] = []
  for ks in groups:
    if len(ks) == 1:
      out.append(values[ks[0]])
      continue
    home = home_of[ks[0]]
    parts = [transfer(values[k], placements[home].replicated) for k in ks]
    if local[home]:
      out.append(_stack(parts))
    else:
      v0 = values[ks[0]]
      aval = jax.core.ShapedArray((len(ks),) + tuple(v0.shape), v0.dtype)
      out.append(placeholder(aval, placements[home].replicated))
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
  return _restack(split.parts, grads, param_owner, placements, local)


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
  return _restack(split.out_parts, outs, output_stage, placements, local)
