"""The GraphPipe dynamic program for one micro-batch context and one TPS target.

``DPSearch.R`` is the smallest entry depth of an SP sub-tree on ``k`` devices with every stage
within the target, in the context of downstream depth ``D``; ``S`` and ``P`` walk the children
of series and parallel nodes; ``stages`` reconstructs the stages of an optimum.
"""

from __future__ import annotations

from typing import Any

from gpp_jax.passes.partition.graphpipe.context import MicrobatchContext
from gpp_jax.passes.partition.graphpipe.serialised import SerialisedRuns
from gpp_jax.passes.partition.graphpipe.tree import (
  INF,
  SPTreeNode,
  attach_value,
  par_value,
  seq_value,
)


class DPSearch(SerialisedRuns):
  """One DP run for a fixed micro-batch context and TPS target."""

  def __init__(self, ctx: MicrobatchContext, t_max: float, serialise: bool = True):
    self.ctx = ctx
    self.t = t_max * (1 + 1e-12)
    self.memo_r: dict = {}
    self.memo_s: dict = {}
    self.memo_p: dict = {}
    self.memo_chain: dict = {}
    self.serialise = serialise

  def best_block(self, node: SPTreeNode, i: int, p: int, k: int, rest_fn, parallel: bool, D: int):
    """Smallest feasible d for block [i, p): returns (entry, d) or (INF, None)."""
    ctx = self.ctx
    tps, _, params, saved = ctx.block(node, i, p)
    for j, d in enumerate(ctx.dps):
      if d > k:
        break
      if tps[j] > self.t:
        continue
      rest = rest_fn(k - d)
      if rest >= INF:
        return INF, None
      depth = D + 1 if parallel else int(rest) + 1
      if ctx.mem(params, saved, d, depth) > ctx.cluster.memory_per_device:
        continue
      frac = 0.5 * tps[j] / self.t
      return (par_value(D + 1 + frac, rest) if parallel else seq_value(rest, frac)), d
    return INF, None

  def block_too_slow(self, node: SPTreeNode, i: int, p: int, k: int) -> bool:
    """True when no d <= k brings the block's transfer-free TPS under the target."""
    j = self.ctx.n_dps[k]
    return j == 0 or self.ctx.block(node, i, p)[1][j - 1] > self.t

  def R(self, node: SPTreeNode, k: int, D: int) -> float:
    key = (node.sig, k, D)
    hit = self.memo_r.get(key)
    if hit is not None:
      return hit[0]
    val: tuple[float, tuple[Any, ...] | None]
    if k <= 0:
      val = (INF, None)
    elif node.kind == "leaf":
      e, d = self.best_block(node, 0, 1, k, lambda _: D, False, D)
      val = (e, ("block", 1, d))
    elif node.kind == "series":
      val = (self.S(node, 0, k, D), None)
    else:
      val = (self.P(node, 0, k, D), None)
      if node.twin is not None:
        e = self.P(node.twin, 0, k, D)
        if e < val[0]:
          val = (e, ("twin",))
    self.memo_r[key] = val
    return val[0]

  def children_split(self, node: SPTreeNode, i: int, k: int, D: int, parallel: bool):
    """Best (value, choice) of children [i, n) of a series (``parallel=False``) or parallel
    node where the first stage is a block [i, p) of children or child i is solved on its own."""
    rest_of = self.P if parallel else self.S
    best: float = INF
    choice: tuple[Any, ...] | None = None
    for p in range(i + 1, node.n + 1):
      if self.block_too_slow(node, i, p, k):
        break
      e, d = self.best_block(node, i, p, k, lambda kk, p=p: rest_of(node, p, kk, D), parallel, D)
      if e < best:
        best, choice = e, ("block", p, d)
    child = node.children[i]
    if child.kind != "leaf":
      for k1 in range(1, k + 1):
        rest = rest_of(node, i + 1, k - k1, D)
        if rest >= INF:
          break
        if parallel:
          e = par_value(self.R(child, k1, D), rest)
        else:
          e = attach_value(self.R(child, k1, int(rest)), rest)
        if e < best:
          best, choice = e, ("child", k1)
    return best, choice

  def S(self, node: SPTreeNode, i: int, k: int, D: int) -> float:
    if i == node.n:
      return D
    if k <= 0:
      return INF
    key = (node.sig, i, k, D)
    hit = self.memo_s.get(key)
    if hit is not None:
      return hit[0]
    best, choice = self.children_split(node, i, k, D, parallel=False)
    child = node.children[i]
    if child.kind == "parallel" and i + 1 < node.n:
      e, ch = self.tail_merge(node, i, k, D)
      if e < best:
        best, choice = e, ch
    e, ch = self.head_merge(node, i, k, D)
    if e < best:
      best, choice = e, ch
    if self.serialise and i + 1 < node.n and any(c.kind != "leaf" for c in node.children[i:]):
      e = self.serial(node, i, k, D)
      if e < best:
        best, choice = e, ("serial",)
    self.memo_s[key] = (best, choice)
    return best

  def head_merge(self, node: SPTreeNode, i: int, k: int, D: int):
    """Stages where the series children [i, p) share a stage T with branches [0, a) of the
    parallel child p right after them; the other branches [a, m) are fed by T and solved as a
    parallel sub-problem in the context of the series children after p."""
    ctx = self.ctx
    best: float = INF
    choice: tuple[Any, ...] | None = None
    for p in range(i + 1, node.n):
      if self.block_too_slow(node, i, p, k):
        break
      c = node.children[p]
      if c.kind != "parallel":
        continue
      for a in range(1, c.n):
        tps, bound, params, saved = ctx.merged(node, p, a, i, p)
        if ctx.n_dps[k] == 0 or bound[ctx.n_dps[k] - 1] > self.t:
          break
        for k3 in range(0, k) if p + 1 < node.n else (0,):
          rest = self.S(node, p + 1, k3, D)
          if rest >= INF:
            continue
          for j, d in enumerate(ctx.dps):
            if d > k - k3 - 1:
              break
            if tps[j] > self.t:
              continue
            e = self.P(c, a, k - k3 - d, int(rest))
            if e >= INF:
              break
            after = par_value(e, rest)
            if ctx.mem(params, saved, d, int(after) + 1) > ctx.cluster.memory_per_device:
              continue
            v = seq_value(after, 0.5 * tps[j] / self.t)
            if v < best:
              best, choice = v, ("head", p, a, k3, d)
            break
    return best, choice

  def tail_merge(self, node: SPTreeNode, i: int, k: int, D: int):
    """Stages where branches [0, a) of the parallel child i share a stage T with the series
    children [i+1, p) after it; the other branches [a, m) feed T and are solved as a parallel
    sub-problem whose context is T's depth."""
    ctx = self.ctx
    c = node.children[i]
    best: float = INF
    choice: tuple[Any, ...] | None = None
    for p in range(i + 2, node.n + 1):
      if self.block_too_slow(node, i + 1, p, k):
        break
      for a in range(1, c.n):
        tps, bound, params, saved = ctx.merged(node, i, a, i + 1, p)
        if ctx.n_dps[k] == 0 or bound[ctx.n_dps[k] - 1] > self.t:
          break
        for k3 in range(0, k) if p < node.n else (0,):
          rest = self.S(node, p, k3, D)
          if rest >= INF:
            continue
          DT = int(rest) + 1
          for j, d in enumerate(ctx.dps):
            if d > k - k3 - 1:
              break
            if tps[j] > self.t or ctx.mem(params, saved, d, DT) > ctx.cluster.memory_per_device:
              continue
            e = self.P(c, a, k - k3 - d, DT)
            v = par_value(seq_value(rest, 0.5 * tps[j] / self.t), e)
            if v < best:
              best, choice = v, ("tail", p, a, k3, d)
            break
    return best, choice

  def P(self, node: SPTreeNode, i: int, k: int, D: int) -> float:
    if i == node.n:
      return D
    if k <= 0:
      return INF
    key = (node.sig, i, k, D)
    hit = self.memo_p.get(key)
    if hit is not None:
      return hit[0]
    best, choice = self.children_split(node, i, k, D, parallel=True)
    if self.serialise and i + 1 < node.n:
      e = self.serial(node, i, k, D)
      if e < best:
        best, choice = e, ("serial",)
    self.memo_p[key] = (best, choice)
    return best

  # -- reconstruction -------------------------------------------------------------------
  def stages(self, node: SPTreeNode, k: int, D: int) -> list[tuple[list[int], int]]:
    if self.R(node, k, D) >= INF:
      raise AssertionError("reconstructing an infeasible sub-problem")
    if node.kind == "leaf":
      return [(node.layers, self.memo_r[(node.sig, k, D)][1][2])]
    if node.kind == "series":
      return self._series(node, 0, k, D)
    if self.memo_r[(node.sig, k, D)][1] == ("twin",):
      assert node.twin is not None  # R chose the twin, so there is one
      return self._parallel(node.twin, 0, k, D)
    return self._parallel(node, 0, k, D)

  def _series(self, node: SPTreeNode, i: int, k: int, D: int):
    if i == node.n:
      return []
    _, choice = self.memo_s[(node.sig, i, k, D)]
    if choice[0] == "block":
      _, p, d = choice
      return [(node.block_layers(i, p), d)] + self._series(node, p, k - d, D)
    if choice[0] == "serial":
      return self.chain_stages(node, i, k, D)
    if choice[0] == "head":
      _, p, a, k3, d = choice
      c = node.children[p]
      rest = int(self.S(node, p + 1, k3, D))
      stage = node.block_layers(i, p) + [l for ls in c.child_layers[:a] for l in ls]
      return (
        [(stage, d)] + self._parallel(c, a, k - k3 - d, rest) + self._series(node, p + 1, k3, D)
      )
    if choice[0] == "tail":
      _, p, a, k3, d = choice
      c = node.children[i]
      DT = int(self.S(node, p, k3, D)) + 1
      stage = [l for ls in c.child_layers[:a] for l in ls] + node.block_layers(i + 1, p)
      return [(stage, d)] + self._parallel(c, a, k - k3 - d, DT) + self._series(node, p, k3, D)
    k1 = choice[1]
    rest = int(self.S(node, i + 1, k - k1, D))
    return self.stages(node.children[i], k1, rest) + self._series(node, i + 1, k - k1, D)

  def _parallel(self, node: SPTreeNode, i: int, k: int, D: int):
    if i == node.n:
      return []
    _, choice = self.memo_p[(node.sig, i, k, D)]
    if choice[0] == "serial":
      return self.chain_stages(node, i, k, D)
    if choice[0] == "block":
      _, p, d = choice
      return [(node.block_layers(i, p), d)] + self._parallel(node, p, k - d, D)
    k1 = choice[1]
    return self.stages(node.children[i], k1, D) + self._parallel(node, i + 1, k - k1, D)
