"""A pipelined step with some arguments bound and their NNX graph traversal done once.

Every call of a ``GraphPipeline`` splits its NNX arguments into a graph definition and state
(``nnx.split``) and writes the new state back (``nnx.update``): a walk over every object and
Variable, milliseconds of host time per step for a few hundred Variables, on the same core as
the computation when a process has one. ``CachedStep`` does that walk on the first call, keeps
the Variables in flattening order, and afterwards reads and writes their values directly, the
way ``nnx.cached_partial`` serves ``nnx.jit``. The contract is the same: the bound objects keep
their structure (no Variables or submodules added or removed); their values may change
between calls (a checkpoint restore, say). A call whose unbound arguments have another
structure or shape, or whose Variables changed shape or dtype, goes the full way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from gpp_jax.runtime.capture_step import functionalize


@dataclasses.dataclass
class _Entry:
  """What the first call found: enough to rebuild the flat step arguments from the Variables."""

  positions: tuple[int, ...]  # positions of the NNX objects among the step arguments
  variables: list[Any]  # their Variables, in the order their state flattens
  others_tree: Any  # tree of the other step arguments
  avals: list[tuple[tuple[int, ...], Any]]  # (shape, dtype) of every flat argument
  compiled: Any
  out_def: Any  # tree of the step's own outputs (the new state follows them)
  nout: int


def _aval(x) -> tuple[tuple[int, ...], Any]:
  return tuple(np.shape(x)), getattr(x, "dtype", None) or np.result_type(x)


class CachedStep:
  """``pipeline(*cached_args, *args)`` with the NNX traversal of ``cached_args`` cached.

  Made by ``GraphPipeline.cached_partial``.
  """

  def __init__(self, pipeline, cached_args: Sequence[Any]):
    self.pipeline = pipeline
    self.cached_args = tuple(cached_args)
    self._entry: _Entry | None = None

  def __call__(self, *args):
    full = self.cached_args + args
    e = self._entry
    if e is not None:
      others = tuple(a for i, a in enumerate(full) if i not in e.positions)
      leaves, tree = jax.tree.flatten(others)
      if tree == e.others_tree:
        flat = [v.get_raw_value() for v in e.variables] + leaves
        if all(_aval(x) == a for x, a in zip(flat, e.avals)):
          outs = self.pipeline.run_compiled(e.compiled, flat)
          for v, x in zip(e.variables, outs[e.nout :]):
            v.set_raw_value(x)
          return e.out_def.unflatten(outs[: e.nout])
    return self._full_call(full)

  def _full_call(self, full: tuple):
    """The pipeline's own path; afterwards, the entry later calls take when they can."""
    pipeline = self.pipeline
    pure, leaves = functionalize(pipeline.fn, full)
    c = pipeline.compiled_for(full, pure, leaves)
    outs = pipeline.run_compiled(c, leaves)
    out, new_state = jax.tree.unflatten(c.out_tree, outs)
    positions = pure.graph_positions
    if positions:
      nnx.update(tuple(full[i] for i in positions), new_state)
    self._entry = self._make_entry(full, positions, leaves, c)
    return out

  def _make_entry(self, full, positions, leaves, c) -> _Entry | None:
    if not positions or any(i >= len(self.cached_args) for i in positions):
      return None  # nothing to cache, or NNX objects among the per-call arguments
    _, state = nnx.split(tuple(full[i] for i in positions))
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    others = tuple(a for i, a in enumerate(full) if i not in positions)
    other_leaves, others_tree = jax.tree.flatten(others)
    out_def, state_def = c.out_tree.children()
    if (
      len(variables) + len(other_leaves) != len(leaves)
      or not all(isinstance(v, nnx.Variable) for v in variables)
      # Arrays held directly (not array references, which are written in place).
      or not all(isinstance(v.get_raw_value(), jax.Array) for v in variables)
      or state_def != jax.tree.structure(state)
    ):
      return None
    flat = [v.get_raw_value() for v in variables] + other_leaves
    return _Entry(
      positions=tuple(positions),
      variables=variables,
      others_tree=others_tree,
      avals=[_aval(x) for x in flat],
      compiled=c,
      out_def=out_def,
      nout=out_def.num_leaves,
    )
