"""Serialised runs: children of a series or parallel node solved as one sequential pipeline over
their layers in SP order (a topological order). The DP thereby applies the SP-ization rule by
choice; stages may cut across branch boundaries to balance work."""

from __future__ import annotations

import math

import numpy as np

from gpp_jax.passes.partition.graphpipe.context import MicrobatchContext
from gpp_jax.passes.partition.graphpipe.tree import INF, SPTreeNode, seq_value


class SerialisedRuns:
  """The serialised option of ``DPSearch`` (a mixin: it reads the search's ``ctx``, target
  ``t`` and ``memo_chain``)."""

  ctx: MicrobatchContext
  t: float
  memo_chain: dict

  def chain(self, node: SPTreeNode, D: int) -> np.ndarray:
    """Serialised option: ``f[j, k]`` = smallest entry depth of a sequential pipeline over
    ``node``'s layers j.. (SP order) on at most k devices, every stage within the TPS target
    and memory, in context depth D (INF if none)."""
    key = (node.sig, D)
    f = self.memo_chain.get(key)
    if f is not None:
      return f
    ctx = self.ctx
    rc = ctx.linear(node)
    L, K, M = rc.n, ctx.K, ctx.M
    cap = ctx.cluster.memory_per_device
    tps_all, static, saved, per_dev = ctx.linear_stacks(node)
    nd = len(ctx.dps)
    f = np.full((L + 1, K + 1), math.inf)
    f[L, :] = D
    for j in range(L - 1, -1, -1):
      tps = tps_all[:, j, j + 1 :]  # (nd, L - j)
      fast = tps <= self.t
      if not fast.any():
        continue
      F3 = np.full((nd, L - j, K + 1), math.inf)
      for di, d in enumerate(ctx.dps):
        if d <= K:
          F3[di, :, d:] = f[j + 1 :, : K + 1 - d]
      fin = np.isfinite(F3) & fast[:, :, None]
      G = np.where(fin, F3, 0.0)
      base = np.floor(G)
      depth = base + 1
      val = depth + np.maximum(G - base, 0.5 * tps[:, :, None] / self.t)
      mem = static[j, j + 1 :][None, :, None] + saved[j, j + 1 :][None, :, None] * per_dev[
        :, None, None
      ] * np.minimum(depth, M)
      ok = fin & (mem <= cap)
      f[j] = np.minimum.accumulate(np.where(ok, val, math.inf).min(axis=(0, 1)))
    self.memo_chain[key] = f
    return f

  def serial(self, node: SPTreeNode, i: int, k: int, D: int) -> float:
    """Entry depth of serialising children [i, n) of ``node`` into one sequential pipeline."""
    start = sum(len(ls) for ls in node.child_layers[:i])
    v = self.chain(node, D)[start, k]
    return INF if not math.isfinite(v) else float(v)

  def chain_stages(self, node: SPTreeNode, i: int, k: int, D: int):
    ctx = self.ctx
    rc = ctx.linear(node)
    f = self.chain(node, D)
    j = sum(len(ls) for ls in node.child_layers[:i])
    out = []
    while j < rc.n:
      target = f[j, k]
      while k > 0 and f[j, k - 1] <= target:
        k -= 1
      step = None
      for d in ctx.dps:
        if d > k:
          break
        for j2 in range(j + 1, rc.n + 1):
          sub = f[j2, k - d]
          if not math.isfinite(sub):
            continue
          t2 = rc.tps(d)[j, j2]
          val = seq_value(float(sub), 0.5 * t2 / self.t)
          if (
            val <= target * (1 + 1e-12)
            and t2 <= self.t
            and ctx.mem(float(rc.params[j, j2]), float(rc.saved[j, j2]), d, int(sub) + 1)
            <= ctx.cluster.memory_per_device
          ):
            step = (j2, d)
            break
        if step:
          break
      if step is None:
        raise AssertionError("lost the serialised optimum")
      j2, d = step
      out.append(([node.layers[x] for x in range(j, j2)], d))
      j, k = j2, k - d
    return out
