"""Step program IR: the train step around the pipeline (``passes.step_split`` builds it): the
pieces of the step that run before and after the pipelined value-and-grad, each on one stage's
devices."""

from __future__ import annotations

import dataclasses

from jax.extend import core as xc


@dataclasses.dataclass(frozen=True)
class Piece:
  """A group of step equations that run together on one stage's devices."""

  home: int
  level: int
  jaxpr: xc.ClosedJaxpr
  inputs: tuple[xc.Var, ...]
  outputs: tuple[xc.Var, ...]


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """The train step around the pipeline.

  Attributes:
    jaxpr: the whole step's ClosedJaxpr (its invars are the flattened step arguments).
    marker: the marker equation (the pipelined value-and-grad).
    before, after: pieces that run before / after the pipeline, in a valid order.
    invar_home: home stage of each step input (-1: not placed, e.g. batch data or unused).
  """

  jaxpr: xc.ClosedJaxpr
  marker: xc.JaxprEqn
  before: tuple[Piece, ...]
  after: tuple[Piece, ...]
  invar_home: tuple[int, ...]
