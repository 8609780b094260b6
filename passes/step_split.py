"""Step-split pass: the whole train step's ClosedJaxpr -> pipeline marker + placed pieces.

The train step is traced with the pipelined loss appearing as one marker equation (see
``gpp_jax.runtime.capture_step``). Everything else in the step (reading parameters out of the state,
the optimizer update, metrics) is split by where values live:

* Known homes: a parameter and its gradient live on the stage that owns the parameter; the loss
  lives on the stage that computes it.
* Every other equation runs on the home of its largest input with a known home; equations with
  no such input run on the home of their first consumer; what remains runs on stage 0.
* Equations are grouped into pieces by (home, level), where the level grows by one whenever a
  value crosses between homes (or into or out of the pipeline). Pieces form a DAG, ordered by
  level, so cross-stage reductions (``optax.clip_by_global_norm``'s global norm) are computed
  exactly: partial sums move between stages as small explicit transfers.
* Only the loss's ancestors run before the pipeline; the rest sits above it. Within a level,
  what another home reads is a piece of its own, dispatched before the rest of its home's work.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend import core as xc

from gpp_jax.ir.step import Piece, StepProgram
from gpp_jax.passes.capture import host_constant
from gpp_jax.passes.costs import aval_bytes

PIPE = -1  # home of the pipeline marker


def split_step(
  closed: xc.ClosedJaxpr,
  marker_index: int,
  marker_in_home: Sequence[int],
  marker_out_home: Sequence[int],
) -> StepProgram:
  """Splits the step around the marker equation: each equation gets a home stage
  (``_eqn_homes``), each step input the home of its first reader, each equation a level
  (``_eqn_levels``), and the equations of one (level, home) become a piece (``_pieces``).

  Args:
    closed: the train step's ClosedJaxpr with exactly one marker equation.
    marker_index: position of the marker in ``closed.jaxpr.eqns``.
    marker_in_home: home stage of each marker input (-1 when any stage will do).
    marker_out_home: home stage of each marker output.
  """
  J = closed.jaxpr
  eqns = list(J.eqns)
  marker = eqns[marker_index]
  producer: dict[xc.Var, int] = {}
  for k, e in enumerate(eqns):
    for o in e.outvars:
      if not isinstance(o, xc.DropVar):
        producer[o] = k
  consumers: dict[int, list[int]] = {k: [] for k in range(len(eqns))}
  for k, e in enumerate(eqns):
    for v in e.invars:
      if isinstance(v, xc.Var) and v in producer:
        consumers[producer[v]].append(k)
  home, homes = _eqn_homes(eqns, marker_index, marker_in_home, marker_out_home, consumers)
  # Step inputs: their first consumer's home (parameters: their owner).
  invar_home = []
  for v in J.invars:
    if v in home:
      invar_home.append(home[v])
      continue
    h = -1
    for k, e in enumerate(eqns):
      if k != marker_index and any(a is v for a in e.invars):
        h = homes[k]
        break
    invar_home.append(h)
    if h >= 0:
      home[v] = h
  mlevel, eqn_level, exported = _eqn_levels(eqns, marker_index, homes, producer, consumers)
  first = [False] * len(eqns)
  for k in reversed(range(len(eqns))):
    if k == marker_index:
      continue
    first[k] = exported[k] or any(
      first[c] and homes[c] == homes[k] and eqn_level[c] == eqn_level[k] for c in consumers[k]
    )
  groups: dict[tuple[int, int, int], list[int]] = {}
  for k in range(len(eqns)):
    if k != marker_index:
      groups.setdefault((eqn_level[k], 0 if first[k] else 1, homes[k]), []).append(k)
  before, after = _pieces(closed, groups, producer, consumers, mlevel)
  return StepProgram(closed, marker, before, after, tuple(invar_home))


def _eqn_homes(
  eqns: Sequence[xc.JaxprEqn],
  marker_index: int,
  marker_in_home: Sequence[int],
  marker_out_home: Sequence[int],
  consumers: dict[int, list[int]],
) -> tuple[dict[xc.Var, int], list[int]]:
  """The home stage of each value and each equation: the marker's outputs and parameter
  inputs where the pipeline puts them; forward, an equation goes with its largest input of
  known home; backward, an undecided one with its first consumer (stage 0 where none)."""
  home: dict[xc.Var, int] = {}
  marker = eqns[marker_index]
  for v, h in zip(marker.outvars, marker_out_home):
    if not isinstance(v, xc.DropVar):
      home[v] = h
  # Parameters flow into the marker: their sources live on the owner stage.
  for a, h in zip(marker.invars, marker_in_home):
    if isinstance(a, xc.Var) and h >= 0 and a not in home:
      home[a] = h
  eqn_home: list[int | None] = [None] * len(eqns)
  eqn_home[marker_index] = PIPE
  # Forward: the home of the largest input with a known home.
  for k, e in enumerate(eqns):
    if k == marker_index:
      continue
    outs_known = [home[o] for o in e.outvars if not isinstance(o, xc.DropVar) and o in home]
    # Largest first; among equals the one with more dimensions (a (1,)-shaped parameter's
    # update stays with the parameter rather than following a scalar such as a global norm).
    known = [
      (aval_bytes(v.aval), len(getattr(v.aval, "shape", ())), -home[v], home[v])
      for v in e.invars
      if isinstance(v, xc.Var) and v in home and home[v] != PIPE
    ]
    if outs_known:
      eqn_home[k] = outs_known[0]
    elif known:
      eqn_home[k] = max(known)[3]
    hk = eqn_home[k]
    if hk is not None:
      for o in e.outvars:
        if not isinstance(o, xc.DropVar):
          home.setdefault(o, hk)
  # Backward: undecided equations take their first consumer's home.
  for k in reversed(range(len(eqns))):
    if eqn_home[k] is None:
      hs = [h for h in (eqn_home[c] for c in consumers[k]) if h is not None and h != PIPE]
      hk = hs[0] if hs else 0
      eqn_home[k] = hk
      for o in eqns[k].outvars:
        if not isinstance(o, xc.DropVar):
          home.setdefault(o, hk)
  # Every equation has a home now.
  homes: list[int] = []
  for hk in eqn_home:
    assert hk is not None
    homes.append(hk)
  return home, homes


def _eqn_levels(
  eqns: Sequence[xc.JaxprEqn],
  marker_index: int,
  homes: Sequence[int],
  producer: dict[xc.Var, int],
  consumers: dict[int, list[int]],
) -> tuple[int, list[int], list[bool]]:
  """(the marker's level, each equation's level, whether another home or the pipeline reads
  each equation): one level more whenever a value crosses between homes."""
  # What the pipeline reads: the marker's ancestors. Everything else waits until after it, so
  # work that does not feed the loss fuses with what consumes it (Adam's ``b1 * mu`` with the
  # rest of the moment update) instead of being written out before the pipeline and read
  # back after it, which costs a full pass over the optimizer state.
  feeds_marker = [False] * len(eqns)
  todo = [marker_index]
  while todo:
    k = todo.pop()
    for v in eqns[k].invars:
      if isinstance(v, xc.Var) and v in producer and not feeds_marker[producer[v]]:
        feeds_marker[producer[v]] = True
        todo.append(producer[v])

  # Levels: one more whenever a value crosses between homes; the marker's level depends on its
  # ancestors only, and what does not feed it goes above it.
  def levels(floor: int) -> list[int]:
    level = [0] * len(eqns)
    for k, e in enumerate(eqns):
      level[k] = max(
        (
          level[producer[v]] + (homes[producer[v]] != homes[k])
          for v in e.invars
          if isinstance(v, xc.Var) and v in producer
        ),
        default=0,
      )
      if k != marker_index and not feeds_marker[k] and not e.effects:
        level[k] = max(level[k], floor)
    return level

  mlevel = levels(0)[marker_index]
  eqn_level = levels(mlevel + 1)
  # Within a (level, home) group, what another home or the pipeline reads comes first, as a
  # piece of its own: a cross-stage scalar such as clip_by_global_norm's norm then leaves as
  # soon as it is computed, instead of when the whole optimizer update of its home is done
  # (which would serialise the updates of all stages behind one).
  exported = [
    any(homes[c] != homes[k] or c == marker_index for c in consumers[k]) for k in range(len(eqns))
  ]
  # After the pipeline, work only its own home reads runs as late as its readers allow: at the
  # lowest level among them. Adam's ``b1 * mu`` does not wait for the global norm, but in a
  # piece of its own below the norm's level it is a pass over the optimizer state written out
  # and read back; at its reader's level it fuses into the moment update.
  for k in reversed(range(len(eqns))):
    if k == marker_index or feeds_marker[k] or exported[k] or eqns[k].effects or not consumers[k]:
      continue
    eqn_level[k] = max(eqn_level[k], min(eqn_level[c] for c in consumers[k]))
  return mlevel, eqn_level, exported


def _pieces(
  closed: xc.ClosedJaxpr,
  groups: dict[tuple[int, int, int], list[int]],
  producer: dict[xc.Var, int],
  consumers: dict[int, list[int]],
  mlevel: int,
) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
  """One piece per group of equations ((level, first, home) -> equation indices), in order:
  (those below the marker's level, those above it)."""
  J = closed.jaxpr
  eqns = J.eqns
  pieces_before: list[Piece] = []
  pieces_after: list[Piece] = []
  out_set = {v for v in J.outvars if isinstance(v, xc.Var)}
  const_val = dict(zip(J.constvars, closed.consts))
  for key in sorted(groups):
    ks = groups[key]
    inside = set(ks)
    defined = {o for k in ks for o in eqns[k].outvars if not isinstance(o, xc.DropVar)}
    ins: list[xc.Var] = []
    consts: list[xc.Var] = []
    seen: set[xc.Var] = set()
    for k in ks:
      for a in eqns[k].invars:
        if isinstance(a, xc.Var) and a not in defined and a not in seen:
          seen.add(a)
          (consts if a in const_val else ins).append(a)
    outs = [
      o
      for o in sorted(defined, key=lambda o: producer[o])
      if o in out_set or any(c not in inside for c in consumers[producer[o]])
    ]
    dbg = xc.DebugInfo(
      "graph_pipeline",
      f"step_piece_{key[2]}_{key[0]}_{key[1]}",
      tuple(f"in{i}" for i in range(len(ins))),
      tuple(f"out{i}" for i in range(len(outs))),
    )
    sub = xc.Jaxpr(
      consts,
      ins,
      outs,
      [eqns[k] for k in ks],
      frozenset().union(*[eqns[k].effects for k in ks]),
      debug_info=dbg,
    )
    piece = Piece(
      key[2],
      key[0],
      xc.ClosedJaxpr(sub, [host_constant(const_val[c]) for c in consts]),
      tuple(ins),
      tuple(outs),
    )
    # The marker reads only values of lower levels, and whatever reads the marker sits above it.
    (pieces_before if key[0] < mlevel else pieces_after).append(piece)
  return tuple(pieces_before), tuple(pieces_after)
