"""Staged program IR: the loss cut into one sub-jaxpr per stage (``passes.staging`` builds it).

Each stage's inputs are, in order, its differentiable inputs (floating parameters, then
floating activations from other stages) and its non-differentiable ones (batch data, keys,
constants, integer activations); its outputs are the values other stages read and the loss
outputs it produces.
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as xc


@dataclasses.dataclass(frozen=True)
class InputRef:
  """Where a stage input comes from.

  kind: "param" (loss invar ``index`` is a parameter), "data" (loss invar ``index`` is a
  non-parameter input: batch data, key, constant), or "act" (output var ``index`` of stage
  ``src``).
  """

  kind: str
  index: int
  src: int = -1
  diff: bool = False


@dataclasses.dataclass(frozen=True)
class OutputRef:
  """A stage output: global value id, consumer stages, and its position among the loss
  outputs (-1 if none)."""

  vid: int
  consumers: tuple[int, ...]
  loss_index: int
  diff: bool


@dataclasses.dataclass(frozen=True)
class StageProgram:
  index: int
  jaxpr: xc.ClosedJaxpr
  inputs: tuple[InputRef, ...]
  outputs: tuple[OutputRef, ...]
  num_diff: int
  num_eqns: int

  @property
  def param_inputs(self) -> tuple[int, ...]:
    """Positions (among the inputs) of the differentiable parameters."""
    return tuple(i for i, r in enumerate(self.inputs) if r.kind == "param")


@dataclasses.dataclass(frozen=True)
class StagedProgram:
  """The loss split into stages.

  Attributes:
    stages: per-stage programs.
    param_owner: for each loss invar that is a parameter, its owner stage (else -1).
    loss_outputs: for each loss jaxpr output, the (stage, output position) producing it.
    edges: stage edges (producer, consumer) that carry activations.
  """

  stages: tuple[StageProgram, ...]
  param_owner: tuple[int, ...]
  loss_outputs: tuple[tuple[int, int], ...]
  edges: tuple[tuple[int, int], ...]

  def __str__(self) -> str:
    rows = []
    for s in self.stages:
      ins = ", ".join(f"{r.kind}{'' if r.src < 0 else f'<{r.src}'}#{r.index}" for r in s.inputs)
      outs = ", ".join(f"v{o.vid}->{list(o.consumers) or 'loss'}" for o in s.outputs)
      rows.append(f"stage {s.index}: {s.num_eqns} eqns; in [{ins}]; out [{outs}]")
    return "\n".join(rows)
