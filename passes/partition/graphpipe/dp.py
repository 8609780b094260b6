"""The GraphPipe dynamic program for one micro-batch context: a min-max DP over the SP tree.

For a sub-problem (an SP-tree node, or the children [i, n) of a series or parallel node) in the
context of a downstream depth ``D``, the DP builds one table ``val[k, e]``: the smallest
bottleneck (largest stage TPS) over the strategies on at most ``k`` devices whose entry depth
(stages from the sub-problem's entry to the sink, ``D`` included) is at most ``e``, every stage
within device memory at its in-flight count min(depth, M). One run per micro-batch size gives
the whole depth / TPS frontier of the root, ``val[K, e]`` for every depth ``e``, where the
paper's formulation (smallest entry depth under a TPS target) needs a bisection on the target
and a re-run per depth.

Only the depths where a table improves (its breakpoints) are useful contexts: a strategy that
fits in a deeper context fits in a shallower one (memory grows with depth), so a series child
is solved in the context of each breakpoint of the part after it, not of every depth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from gpp_jax.passes.partition.graphpipe.context import MicrobatchContext
from gpp_jax.passes.partition.graphpipe.serialised import SerialisedRuns
from gpp_jax.passes.partition.graphpipe.tree import SPTreeNode

Stages = list[tuple[list[int], int]]


class InFrontEach(NamedTuple):
  """The choices ``("block", p, d)`` of ``MinMaxDP.series_blocks``, a stage of TPS ``tps[j]``
  on each device count ``slots[j]`` in front of the table ``rest``, fitting in memory at the
  depths ``ok[j]`` (``MinMaxDP.in_front_each``), offered together (``Table.offer_each``)."""

  p: int
  slots: list[int]
  tps: list[float]
  ok: np.ndarray
  rest: np.ndarray

  def at(self, k: int, e: int) -> tuple[Any, ...]:
    """The choice whose candidate is the first to attain the smallest value at cell (k, e)
    (one the offer won: some candidate is finite there)."""
    best, pick = math.inf, 0
    for j, d in enumerate(self.slots):
      if e and k >= d and self.ok[j, e]:
        v = max(self.tps[j], self.rest[k - d, e - 1])
        if v < best:
          best, pick = v, d
    return ("block", self.p, pick)


class Table:
  """A sub-problem's table: ``val[k, e]`` (monotone in k and e), and for each cell the choice
  made there (``cid`` into ``choices``) and the device split it made (``split``), kept with
  the values before closing (``raw``): the cell whose own choice attains ``val[k, e]`` is
  found from them when a strategy is read back (``cell``)."""

  __slots__ = ("choices", "cid", "raw", "split", "val")

  def __init__(self, K: int, E: int):
    self.val = np.full((K + 1, E), math.inf)
    self.cid = np.full((K + 1, E), -1, dtype=np.int64)
    self.split = np.zeros((K + 1, E), dtype=np.int64)
    self.choices: list[tuple[Any, ...] | InFrontEach] = []
    self.raw = self.val

  def offer(self, cand: np.ndarray, choice: tuple[Any, ...], split: np.ndarray | None = None):
    """Keep ``choice`` in the cells where ``cand`` is strictly better (ties: the earlier)."""
    m = cand < self.val
    if not m.any():
      return
    np.copyto(self.val, cand, where=m)
    np.copyto(self.cid, len(self.choices), where=m)
    self.choices.append(choice)
    if split is not None:
      self.split[m] = split[m]

  def offer_each(self, cands: np.ndarray, each: InFrontEach):
    """``offer`` of ``cands[i]`` with ``each``'s i-th choice for i in order, in one pass: per
    cell the first candidate attaining their minimum, where it is strictly better than the
    cell. The cells keep ``each`` as their choice, and ``cell`` finds which of its choices
    from the candidates' values there: the arg-min over the whole stack cost more than the
    rest of the offer, and few cells are ever read back."""
    if not len(cands):
      return
    best = cands.min(axis=0)
    m = best < self.val
    if not m.any():
      return
    np.copyto(self.val, best, where=m)
    np.copyto(self.cid, len(self.choices), where=m)
    self.choices.append(each)

  def close(self, cap: float = math.inf) -> Table:
    """Make ``val`` monotone (at most k devices, depth at most e): a cell takes the value of a
    cell with fewer devices or a shallower depth when that is no worse. Values above ``cap``
    become infeasible."""
    v = self.val
    v[v > cap] = math.inf
    self.raw = v
    self.val = np.minimum.accumulate(np.minimum.accumulate(v, axis=1), axis=0)
    return self

  def cell(self, k: int, e: int) -> tuple[int, int, tuple[Any, ...], int]:
    """(k', e', choice, split) of the cell that attains ``val[k, e]``: the fewest devices
    k' <= k whose best over the depths up to e attains it, at the shallowest such depth e'
    (ties go to fewer devices, then to shallower depths)."""
    v = self.val[k, e]
    if not math.isfinite(v):
      raise AssertionError("reconstructing an infeasible sub-problem")
    k2 = int(np.argmax(self.raw[: k + 1, : e + 1].min(axis=1) == v))
    e2 = int(np.argmax(self.raw[k2, : e + 1] == v))
    c = int(self.cid[k2, e2])
    if c < 0:
      raise AssertionError("reconstructing an infeasible sub-problem")
    choice = self.choices[c]
    if isinstance(choice, InFrontEach):
      choice = choice.at(k2, e2)
    return k2, e2, choice, int(self.split[k2, e2])


class MinMaxDP(SerialisedRuns):
  """One run of the min-max DP for a fixed micro-batch context (see the module docstring)."""

  def __init__(
    self,
    ctx: MicrobatchContext,
    serialise: bool = True,
    max_depth: int | None = None,
    cap: float = math.inf,
    whole_chain: Callable[[], np.ndarray] | None = None,
  ):
    self.ctx = ctx
    self.serialise = serialise
    self.cap = cap
    self.whole_chain = whole_chain
    self.K = ctx.K
    depth = ctx.K if max_depth is None else min(ctx.K, max_depth)
    self.E = depth + 1  # depth indices 0..depth
    self.memo: dict = {}
    self.memo_chain: dict = {}
    K1 = self.K + 1
    k = np.arange(K1)
    # conv gather: rows k, columns k1 -> index k - k1 (valid where k1 <= k).
    self._conv_idx = np.clip(k[:, None] - k[None, :], 0, None)
    self._conv_bad = k[None, :] > k[:, None]
    self._depths = np.arange(self.E)
    # A stage on slots[j] devices in front of a table: its rows k come from rows k - slots[j]
    # of the table, read off a copy below rows of inf (none where k < slots[j]).
    slots = np.asarray([d for d in ctx.slots if d <= self.K], dtype=np.int64)
    self._nslots = len(slots)
    pad = int(slots.max(initial=0))
    self._shift = k[None, :] - slots[:, None] + pad
    self._padded = np.full((pad + K1, self.E), math.inf)
    self._base: dict[int, Table] = {}
    self._fits: dict[tuple[float, float], np.ndarray] = {}

  # -- table algebra ---------------------------------------------------------------------
  def conv(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out[k, e] = min over k1 <= k of max(a[k1, e], b[k - k1, e]), and the arg-min k1: two
    parts side by side sharing k devices (``a`` or ``b`` may be a column, broadcast over e).

    Only the depths from the first where both parts are feasible to the last where either
    changes are computed; the tables are monotone in e, so later columns repeat the last."""
    shape = (self.K + 1, self.E)
    A, Bt = np.broadcast_to(a, shape), np.broadcast_to(b, shape)
    out = np.full(shape, math.inf)
    arg = np.zeros(shape, dtype=np.int64)
    both = np.isfinite(A).any(axis=0) & np.isfinite(Bt).any(axis=0)
    if not both.any():
      return out, arg
    lo = int(both.argmax())
    moves = np.nonzero((A[:, 1:] != A[:, :-1]).any(axis=0) | (Bt[:, 1:] != Bt[:, :-1]).any(axis=0))
    hi = max(lo, int(moves[0][-1]) + 1 if moves[0].size else 0) + 1
    g = Bt[:, lo:hi][self._conv_idx]  # (k, k1, e)
    g[self._conv_bad] = math.inf
    x = np.maximum(A[None, :, lo:hi], g)
    am = x.argmin(axis=1)
    out[:, lo:hi] = np.take_along_axis(x, am[:, None, :], axis=1)[:, 0, :]
    arg[:, lo:hi] = am
    out[:, hi:] = out[:, hi - 1 : hi]
    arg[:, hi:] = am[:, -1:]
    return out, arg

  def too_slow(self, bound: list[float]) -> bool:
    """True when a stage's transfer-free TPS on every device count is above the cap (and so,
    the bound growing with the stage, every larger stage's too)."""
    return bound[self.ctx.n_dps[self.K] - 1] > self.cap

  def fits(self, params: float, saved: float) -> np.ndarray:
    """``ok[j, e]``: does a stage on ``dps[j]`` devices fit in memory at in-flight
    min(e, M)? (Memoised: blocks share their byte totals.)"""
    key = (params, saved)
    hit = self._fits.get(key)
    if hit is not None:
      return hit
    ctx = self.ctx
    inflight = np.minimum(self._depths, ctx.M)[None, :]
    dps = np.asarray(ctx.dps, dtype=float)[:, None]
    mem = np.asarray(ctx.cm.stage_memory(params, saved, ctx.b, dps, inflight))  # type: ignore[arg-type]
    ok: np.ndarray = mem <= ctx.cluster.memory_per_device
    ok[:, 0] = False
    self._fits[key] = ok
    return ok

  def in_front(self, tps: float, ok: np.ndarray, rest: np.ndarray, d: int) -> np.ndarray:
    """A stage of ``tps`` on d devices in front of ``rest`` (its depth is rest's + 1)."""
    cand = np.full_like(rest, math.inf)
    cand[d:, 1:] = np.maximum(tps, rest[: self.K + 1 - d, :-1])
    cand[:, ~ok] = math.inf
    return cand

  def in_front_each(self, tps: list[float], ok: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """``in_front`` for the stage on each device count of ``ctx.slots`` within K (stacked):
    ``tps[j]`` its TPS, ``ok[j]`` the depths where it fits."""
    n = self._nslots
    cand = np.empty((n, self.K + 1, self.E))
    cand[:, :, 0] = math.inf
    # The TPS where the stage fits, inf where it does not: max(inf, rest) is inf.
    fit_tps = np.where(ok[:n, 1:], np.asarray(tps[:n])[:, None], math.inf)
    padded = self._padded
    padded[len(padded) - len(rest) :] = rest
    np.maximum(fit_tps[:, None, :], padded[self._shift][:, :, :-1], out=cand[:, :, 1:])
    return cand

  def base(self, D: int) -> Table:
    """The empty sub-problem in context D: bottleneck 0 at depth D, any device count."""
    t = self._base.get(D)
    if t is None:
      t = Table(self.K, self.E)
      t.val[:, D:] = 0.0
      t.cid[:, D:] = 0
      t.choices.append(("empty",))
      t = self._base[D] = t.close(self.cap)
    return t

  def breakpoints(self, v: np.ndarray) -> list[int]:
    """Depths where some row of a closed table improves on the shallower depth."""
    prev = np.concatenate([np.full((v.shape[0], 1), math.inf), v[:, :-1]], axis=1)
    return [int(e) for e in np.nonzero((v < prev).any(axis=0))[0]]

  # -- sub-problems ------------------------------------------------------------------------
  def R(self, node: SPTreeNode, D: int) -> Table:
    """The table of a whole SP-tree node in context D."""
    key = ("R", node.sig, D)
    hit = self.memo.get(key)
    if hit is not None:
      return hit
    if node.kind == "series":
      t = self.S(node, 0, D)
    elif node.kind == "parallel":
      t = Table(self.K, self.E)
      for n in (node, node.twin):
        if n is not None:
          t.offer(self.P(n, 0, D).val, ("par", n))
      t.close(self.cap)
    else:
      t = Table(self.K, self.E)
      self.series_blocks(t, node, 0, D)
      t.close(self.cap)
    self.memo[key] = t
    return t

  def block_ends(self, node: SPTreeNode, i: int) -> list[int]:
    """The ends p of the blocks [i, p) not above the cap, longest first: on equal values the
    first offer is kept, so ties go to fewer, larger stages."""
    ends = []
    for p in range(i + 1, node.n + 1):
      if self.too_slow(self.ctx.block(node, i, p)[1]):
        break
      ends.append(p)
    return ends[::-1]

  def series_blocks(self, t: Table, node: SPTreeNode, i: int, D: int):
    """Offers: children [i, p) of a series node (or a leaf) as one stage, then [p, n)."""
    ctx = self.ctx
    for p in self.block_ends(node, i):
      tps, _, params, saved = ctx.block(node, i, p)
      rest = self.S(node, p, D).val if node.kind == "series" else self.base(D).val
      ok = self.fits(params, saved)
      t.offer_each(
        self.in_front_each(tps, ok, rest),
        InFrontEach(p, ctx.slots[: self._nslots], tps, ok, rest),
      )

  def S(self, node: SPTreeNode, i: int, D: int) -> Table:
    """Children [i, n) of a series node in context D."""
    if i == node.n:
      return self.base(D)
    key = ("S", node.sig, i, D)
    hit = self.memo.get(key)
    if hit is not None:
      return hit
    t = Table(self.K, self.E)
    self.series_blocks(t, node, i, D)
    child = node.children[i]
    if child.kind != "leaf":
      rest = self.S(node, i + 1, D).val
      for e1 in self.breakpoints(rest):
        cand, arg = self.conv(self.R(child, e1).val, rest[:, e1 : e1 + 1])
        t.offer(cand, ("child", e1), arg)
    if child.kind == "parallel" and i + 1 < node.n:
      self.tail_merge(t, node, i, D)
    self.head_merge(t, node, i, D)
    if self.serialise and i + 1 < node.n and any(c.kind != "leaf" for c in node.children[i:]):
      t.offer(self.serial(node, i, D), ("serial",))
    self.memo[key] = t.close(self.cap)
    return t

  def P(self, node: SPTreeNode, i: int, D: int) -> Table:
    """Children [i, n) of a parallel node side by side in context D."""
    if i == node.n:
      return self.base(D)
    key = ("P", node.sig, i, D)
    hit = self.memo.get(key)
    if hit is not None:
      return hit
    ctx = self.ctx
    t = Table(self.K, self.E)
    if D + 1 < self.E:
      for p in self.block_ends(node, i):
        tps, _, params, saved = ctx.block(node, i, p)
        rest = self.P(node, p, D).val
        for j, d in enumerate(ctx.slots):
          if d > self.K:
            break
          if not self.fits(params, saved)[j, D + 1]:
            continue
          cand = np.full_like(rest, math.inf)
          cand[d:, D + 1 :] = np.maximum(tps[j], rest[: self.K + 1 - d, D + 1 :])
          t.offer(cand, ("block", p, d))
      child = node.children[i]
      if child.kind != "leaf":
        cand, arg = self.conv(self.R(child, D).val, self.P(node, i + 1, D).val)
        t.offer(cand, ("child",), arg)
      if self.serialise and i + 1 < node.n:
        t.offer(self.serial(node, i, D), ("serial",))
    self.memo[key] = t.close(self.cap)
    return t

  def head_merge(self, t: Table, node: SPTreeNode, i: int, D: int):
    """Offers: series children [i, p) share a stage T with branches [0, a) of the parallel
    child p right after them; the other branches [a, m) are fed by T and solved side by side
    in the context of the series children after p."""
    ctx = self.ctx
    for p in range(i + 1, node.n):
      if self.too_slow(ctx.block(node, i, p)[1]):
        break
      c = node.children[p]
      if c.kind != "parallel":
        continue
      rest = self.S(node, p + 1, D).val
      for a in range(1, c.n):
        tps, bound, params, saved = ctx.merged(node, p, a, i, p)
        if self.too_slow(bound):
          break
        for e1 in self.breakpoints(rest):
          x, arg = self.conv(rest[:, e1 : e1 + 1], self.P(c, a, e1).val)
          for j, d in enumerate(ctx.slots):
            if d > self.K:
              break
            ok = self.fits(params, saved)[j]
            split = np.zeros_like(arg)
            split[d:, 1:] = arg[: self.K + 1 - d, :-1]
            t.offer(self.in_front(tps[j], ok, x, d), ("head", p, a, e1, d), split)

  def tail_merge(self, t: Table, node: SPTreeNode, i: int, D: int):
    """Offers: branches [0, a) of the parallel child i share a stage T with the series children
    [i+1, p) after it; the other branches [a, m) feed T and are solved side by side in the
    context of T's depth."""
    ctx = self.ctx
    c = node.children[i]
    for p in range(i + 2, node.n + 1):
      if self.too_slow(ctx.block(node, i + 1, p)[1]):
        break
      rest = self.S(node, p, D).val
      for a in range(1, c.n):
        tps, bound, params, saved = ctx.merged(node, i, a, i + 1, p)
        if self.too_slow(bound):
          break
        for e1 in self.breakpoints(rest):
          DT = e1 + 1
          if DT >= self.E:
            continue
          x, arg = self.conv(rest[:, e1 : e1 + 1], self.P(c, a, DT).val)
          for j, d in enumerate(ctx.slots):
            if d > self.K:
              break
            if not self.fits(params, saved)[j, DT]:
              continue
            cand = np.full_like(x, math.inf)
            cand[d:] = np.maximum(tps[j], x[: self.K + 1 - d])
            split = np.zeros_like(arg)
            split[d:] = arg[: self.K + 1 - d]
            t.offer(cand, ("tail", p, a, e1, d), split)

  # -- reconstruction ----------------------------------------------------------------------
  def frontier(self, root: SPTreeNode) -> list[tuple[int, float]]:
    """(depth, smallest bottleneck) at every depth where the root's bottleneck improves."""
    row = self.R(root, 0).val[self.K]
    out, prev = [], math.inf
    for e in range(self.E):
      if row[e] < prev:
        out.append((e, float(row[e])))
        prev = row[e]
    return out

  def stages(self, node: SPTreeNode, k: int, e: int, D: int = 0) -> Stages:
    """The stages of the strategy behind ``R(node, D).val[k, e]``."""
    t = self.R(node, D)
    k, e, ch, _ = t.cell(k, e)
    if ch[0] == "par":
      return self._parallel(ch[1], 0, k, e, D)
    if node.kind == "series":
      return self._series(node, 0, k, e, D)
    return [(node.layers, ch[2])]

  def _series(self, node: SPTreeNode, i: int, k: int, e: int, D: int) -> Stages:
    if i == node.n:
      return []
    k, e, ch, split = self.S(node, i, D).cell(k, e)
    kind = ch[0]
    if kind == "block":
      _, p, d = ch
      return [(node.block_layers(i, p), d)] + self._series(node, p, k - d, e - 1, D)
    if kind == "child":
      e1 = ch[1]
      return self.stages(node.children[i], split, e, e1) + self._series(
        node, i + 1, k - split, e1, D
      )
    if kind == "serial":
      return self.chain_stages(node, i, k, e, D)
    if kind == "head":
      _, p, a, e1, d = ch
      c = node.children[p]
      stage = node.block_layers(i, p) + [l for ls in c.child_layers[:a] for l in ls]
      return (
        [(stage, d)]
        + self._parallel(c, a, k - d - split, e - 1, e1)
        + self._series(node, p + 1, split, e1, D)
      )
    _, p, a, e1, d = ch  # tail
    c = node.children[i]
    stage = [l for ls in c.child_layers[:a] for l in ls] + node.block_layers(i + 1, p)
    return (
      [(stage, d)]
      + self._parallel(c, a, k - d - split, e, e1 + 1)
      + self._series(node, p, split, e1, D)
    )

  def _parallel(self, node: SPTreeNode, i: int, k: int, e: int, D: int) -> Stages:
    if i == node.n:
      return []
    k, e, ch, split = self.P(node, i, D).cell(k, e)
    if ch[0] == "serial":
      return self.chain_stages(node, i, k, e, D)
    if ch[0] == "block":
      _, p, d = ch
      return [(node.block_layers(i, p), d)] + self._parallel(node, p, k - d, e, D)
    return self.stages(node.children[i], split, e, D) + self._parallel(node, i + 1, k - split, e, D)
