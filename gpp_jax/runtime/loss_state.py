"""State the loss function updates: Linen mutable collections and NNX variables.

A pipelined loss runs once per micro-batch and stage, so state it updates (batch statistics,
NNX ``Rngs`` counters) is carried from one micro-batch to the next inside the stage that
updates it, as a gradient-accumulation loop over the micro-batches on one device would carry
it. This module finds that state when the loss is captured:

* **NNX**: every non-``Param`` variable of the differentiated module (``BatchStat``, the
  ``RngKey``/``RngCount`` of ``nnx.Rngs`` streams, any ``nnx.Variable``) is an input of the
  loss; a variable whose value the loss changes is also an output, paired with its input.
* **Linen**: ``apply(..., mutable=["batch_stats"])`` returns the updated collection, which the
  loss returns in its aux. An aux leaf is paired with the step input it updates by their pytree
  paths: they end in the same names (``batch_stats/BatchNorm_0/mean``), with the same shape
  and dtype.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from jax.extend import core as xc

from gpp_jax.errors import CaptureError, PlanError


@dataclasses.dataclass(frozen=True)
class StatePair:
  """One piece of state the loss updates.

  Attributes:
    input: the loss input holding the value before a micro-batch (None when the loss
      overwrites the state without reading it).
    output: the loss output holding the value after it.
    name: a readable path of the state (``batch_stats/BatchNorm_0/mean``, ``bn/mean``).
  """

  input: int | None
  output: int
  name: str


class _StepInputs(threading.local):
  paths: dict[int, tuple[str, ...]] | None = None


_STEP_INPUTS = _StepInputs()


def key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_names(path) -> tuple[str, ...]:
  """Key names of a pytree path, the ``.value`` of an NNX variable dropped."""
  names = tuple(key_name(k) for k in path)
  return names[:-1] if names and names[-1] == "value" else names


def record_step_inputs(flat_with_path: Sequence[tuple[Any, Any]]) -> None:
  """Remembers the step's traced inputs and their paths (while a step is being captured)."""
  _STEP_INPUTS.paths = {id(x): path_names(p) for p, x in flat_with_path}


def clear_step_inputs() -> None:
  _STEP_INPUTS.paths = None


def step_input_path(x) -> tuple[str, ...] | None:
  """The path of ``x`` among the step's arguments, if it is one of the step's inputs."""
  paths = _STEP_INPUTS.paths
  return None if paths is None else paths.get(id(x))


def _common_suffix(a: Sequence[str], b: Sequence[str]) -> tuple[str, ...]:
  n = 0
  while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
    n += 1
  return tuple(a[len(a) - n :])


def pair_by_path(
  outputs: Sequence[tuple[tuple[str, ...], Any]],
  inputs: Sequence[tuple[tuple[str, ...], Any]],
) -> list[tuple[int, int, str]]:
  """Pairs aux outputs with the inputs they update: (input position, output position, name).

  ``outputs`` and ``inputs`` are (path names, aval). An output pairs with the input whose path
  ends in the longest run of the same names (at least two, one of them not a number: a
  collection or module name and a variable name), with the same shape and dtype; an output
  with two equally good inputs, or an input already paired, stays unpaired.
  """
  pairs, taken = [], set()
  for k, (opath, oaval) in enumerate(outputs):
    best: list[tuple[int, tuple[str, ...]]] = []
    for j, (ipath, iaval) in enumerate(inputs):
      if j in taken or (iaval.shape, iaval.dtype) != (oaval.shape, oaval.dtype):
        continue
      suf = _common_suffix(opath, ipath)
      if len(suf) < 2 or all(s.isdigit() for s in suf):
        continue
      if not best or len(suf) > len(best[0][1]):
        best = [(j, suf)]
      elif len(suf) == len(best[0][1]):
        best.append((j, suf))
    if len(best) == 1:
      j, suf = best[0]
      taken.add(j)
      pairs.append((j, k, "/".join(suf)))
  return pairs


def check_state_returned(step: xc.Jaxpr, marker: xc.JaxprEqn, state: Sequence[StatePair]) -> None:
  """Raises CaptureError for updated state that the step drops instead of returning it.

  A step that applies a Linen model with ``mutable=[...]`` and returns the updated collection
  from its loss must put it into the state it returns (``state.replace(batch_stats=...)``);
  otherwise the update would be lost silently.
  """
  used = {a for e in step.eqns if e is not marker for a in e.invars if isinstance(a, xc.Var)}
  used |= {a for a in step.outvars if isinstance(a, xc.Var)}
  dropped = [
    p.name
    for p in state
    if isinstance(marker.outvars[p.output], xc.DropVar) or marker.outvars[p.output] not in used
  ]
  if dropped:
    raise CaptureError(
      f"the loss updates the mutable state {', '.join(dropped)} (returned in its aux) but the "
      "step never returns the new value, so the update would be lost. Return it with the new "
      "state (for a Linen TrainState: state.replace(batch_stats=updates['batch_stats'])), or "
      "apply the model without mutable=[...] (e.g. train=False) if the state should not change."
    )


def state_carries(staged, state: Sequence[StatePair]) -> dict[int, list[tuple[int, int]]]:
  """Per stage, the (loss input, stage output position) pairs it carries between micro-batches.

  The stage that computes a state's new value must be the only stage reading its old value:
  micro-batch m of that stage reads what micro-batch m - 1 of the same stage left. Raises
  PlanError naming the state otherwise.
  """
  readers: dict[int, set[int]] = {}
  for st in staged.stages:
    for r in st.inputs:
      if r.kind == "data":
        readers.setdefault(r.index, set()).add(st.index)
  carries: dict[int, list[tuple[int, int]]] = {}
  for p in state:
    s, k = staged.loss_outputs[p.output]
    if p.input is None:
      continue
    other = sorted(readers.get(p.input, set()) - {s})
    if other:
      raise PlanError(
        f"the state {p.name} is updated in stage {s} but also read by "
        f"stage{'s' if len(other) > 1 else ''} {', '.join(map(str, other))}; "
        "micro-batch m must see the value micro-batch m - 1 left, so one stage must both read "
        "and update it. Keep the layers that use it in one stage (for nnx.Rngs: give each "
        "layer its own stream, as nnx.Dropout(rate, rngs=rngs) does, instead of passing one "
        "Rngs to layers of different stages)."
      )
    if s in readers.get(p.input, set()):
      carries.setdefault(s, []).append((p.input, k))
  return carries


def split_state(state: Sequence[StatePair], split) -> list[StatePair]:
  """State pairs of the captured loss -> those of the scan-split loss (``passes.scan_split``):
  indices remapped, and a state stacked along a split scan becomes one pair per slice."""
  out: list[StatePair] = []
  for p in state:
    outs = split.out_parts[p.output]
    ins = (None,) * len(outs) if p.input is None else split.parts[p.input]
    if len(ins) == len(outs):
      out.extend(
        StatePair(i, o, f"{p.name}[{n}]" if len(outs) > 1 else p.name)
        for n, (i, o) in enumerate(zip(ins, outs))
      )
    else:  # sliced input, one stacked output: every slice's reader must be its updater
      out.extend(StatePair(i, outs[0], p.name) for i in ins)
  return out
