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
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import tracers

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
  written: list[Any] | None = None  # the values the last call wrote to the Variables
  fast_write: bool = False  # whether the Variables take the direct write (``write_values``)


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
      done, out = self._steady(e, full, self.pipeline.run_compiled)
      if done:
        return out
    return self._full_call(full)

  @staticmethod
  def _steady(e: _Entry, full: tuple, run: Any) -> tuple[bool, Any]:
    """The call by the entry: the Variables' values read, ``run(compiled, flat)`` for the
    flat outputs, the new state written to them. (False, None) where the arguments no longer
    match the entry (another structure, shape or dtype)."""
    others = tuple(a for i, a in enumerate(full) if i not in e.positions)
    leaves, tree = jax.tree.flatten(others)
    if tree != e.others_tree:
      return False, None
    values = [v.get_raw_value() for v in e.variables]
    n = len(values)
    # Values this object wrote last call have the shapes checked then; only what the user
    # replaced since (a checkpoint restore, say) and the other arguments are checked.
    unchanged = e.written is not None and all(a is b for a, b in zip(values, e.written))
    flat = values + leaves
    avals = e.avals
    if not all(_aval(x) == avals[k] for k, x in enumerate(flat) if not unchanged or k >= n):
      return False, None
    outs = run(e.compiled, flat)
    new = outs[e.nout :]
    write_values(e.variables, new, e.fast_write)
    e.written = new
    return True, e.out_def.unflatten(outs[: e.nout])

  def _full_call(self, full: tuple):
    """The pipeline's own path; afterwards, the entry later calls take when they can."""
    pipeline = self.pipeline
    pure, leaves = functionalize(pipeline.fn, full)
    c = pipeline.compiled_for(full, pure, leaves, lambda: self.seconds_outside(full, pure, leaves))
    outs = pipeline.run_compiled(c, leaves)
    out, new_state = jax.tree.unflatten(c.out_tree, outs)
    positions = pure.graph_positions
    if positions:
      nnx.update(tuple(full[i] for i in positions), new_state)
    self._entry = _make_entry(full, len(self.cached_args), positions, leaves, c, c.out_tree)
    return out

  def seconds_outside(self, full: tuple, pure: Any, leaves: list) -> float | None:
    """Host seconds per call of this step's steady path outside the program, on the
    arguments ``full`` (bound and per call; ``pure``, ``leaves``: ``functionalize``'s of
    them): the Variables read, the other arguments flattened and checked, the new state
    written (the values read, so nothing changes), with the program left out. None where the
    path would not be taken (``_make_entry``)."""
    out_tree = jax.tree.structure(((), pure.state))  # no outputs of the step's own, the state
    e = _make_entry(full, len(self.cached_args), pure.graph_positions, leaves, None, out_tree)
    if e is None:
      return None
    nvars = len(e.variables)
    return median_seconds(lambda: self._steady(e, full, lambda _, flat: flat[:nvars]))


OUTSIDE_REPEATS = 21  # calls timed for ``seconds_outside``, the median taken


def median_seconds(call: Any, repeats: int = OUTSIDE_REPEATS) -> float:
  """The median seconds of ``repeats`` calls of ``call`` (after one to warm up)."""
  call()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    call()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _make_entry(full, bound, positions, leaves, c, out_tree) -> _Entry | None:
  """The entry later calls with arguments ``full`` (the first ``bound`` of them bound) take:
  the NNX objects at ``positions`` split once, their Variables kept; ``c`` the compiled step
  and ``out_tree`` its outputs' tree (the step's own, then the new state). None where the
  direct path does not apply: no NNX object, one among the per-call arguments, a state whose
  structure or leaves differ from the step's arguments, or values that are not arrays."""
  if not positions or any(i >= bound for i in positions):
    return None  # nothing to cache, or NNX objects among the per-call arguments
  _, state = nnx.split(tuple(full[i] for i in positions))
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  others = tuple(a for i, a in enumerate(full) if i not in positions)
  other_leaves, others_tree = jax.tree.flatten(others)
  out_def, state_def = out_tree.children()
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
    fast_write=all(writable_directly(v) for v in variables),
  )


def writable_directly(v) -> bool:
  """Whether ``v`` is a plain (not hijax) NNX Variable whose value lives in ``_raw_value``
  and whose trace context is known: the layout ``nnx.cached_partial``'s own update writes."""
  state = getattr(v, "_trace_state", None)
  return (
    not getattr(v, "hijax", True)
    and hasattr(state, "_jax_trace")
    and any("_raw_value" in getattr(c, "__slots__", ()) for c in type(v).__mro__)
    and hasattr(tracers, "current_jax_trace")
  )


def write_values(variables: Sequence[Any], values: Sequence[Any], fast: bool) -> None:
  """``v.set_raw_value(x)`` for each pair. ``set_raw_value`` checks the trace context twice
  per Variable (8 us each on a CPU core: milliseconds a step for a few hundred Variables);
  the fast way checks it once per Variable and writes the value as Flax's cached jit does."""
  if not fast:
    for v, x in zip(variables, values):
      v.set_raw_value(x)
    return
  trace = tracers.current_jax_trace()
  for v in variables:
    if v._trace_state._jax_trace != trace:
      v.set_raw_value(None)  # raises Flax's own error: mutated from another trace level
  for v, x in zip(variables, values):
    object.__setattr__(v, "_raw_value", x)
