"""Serialised runs: children of a series or parallel node solved as one sequential pipeline over
their layers in SP order (a topological order). The DP thereby applies the SP-ization rule by
choice; stages may cut across branch boundaries to balance work."""

from __future__ import annotations

import math

import numpy as np

from gpp_jax.passes.partition.graphpipe.context import MicrobatchContext
from gpp_jax.passes.partition.graphpipe.tree import SPTreeNode


class SerialisedRuns:
  """The serialised option of ``MinMaxDP`` (a mixin: it reads the DP's ``ctx``, device count
  ``K``, depth count ``E``, TPS ``cap`` and ``memo_chain``)."""

  ctx: MicrobatchContext
  K: int
  E: int
  cap: float
  memo_chain: dict

  def chain(self, node: SPTreeNode, D: int) -> np.ndarray:
    """``f[j, k, e]`` = smallest bottleneck of a sequential pipeline over ``node``'s layers j..
    (SP order) on at most k devices with entry depth at most e, every stage within memory, in
    context depth D (inf if none)."""
    key = (node.sig, D)
    f = self.memo_chain.get(key)
    if f is not None:
      return f
    ctx = self.ctx
    K, E, M = self.K, self.E, ctx.M
    rc = ctx.linear(node)
    L = rc.n
    mem_cap = ctx.cluster.memory_per_device
    tps_all, static, saved, per_dev = ctx.linear_stacks(node)
    inflight = np.minimum(np.arange(E), M)
    # Stages [j, j2) whose transfer-free TPS is above the cap on every device count are never
    # used; that bound grows with j2, so each j needs only the j2 below a limit.
    fast = np.stack([rc.bound(d) for d in ctx.dps]).min(axis=0) <= self.cap
    f = np.full((L + 1, K + 1, E), math.inf)
    f[L, :, D:] = 0.0
    for j in range(L - 1, -1, -1):
      hi = j + 1 + int(fast[j, j + 1 :].sum())  # stages [j, j2) for j2 < hi
      # Entry depths D + 1 .. D + (L - j) are all a chain from j can have; deeper ones repeat.
      lo, top = D + 1, min(E - 1, D + L - j)
      if hi == j + 1 or lo > top:
        continue
      tps = tps_all[:, j, j + 1 : hi]  # (nd, w)
      # memory of stage [j, j2) on d devices at depths lo .. top: (nd, w, top - lo + 1)
      mem = (
        static[j, j + 1 : hi][None, :, None]
        + saved[j, j + 1 : hi][None, :, None]
        * per_dev[:, None, None]
        * inflight[None, None, lo : top + 1]
      )
      # TPS of the stage where it fits, inf elsewhere: max(that, rest) is inf where it does
      # not fit. A stage above the cap or out of memory at every depth only gives values
      # that end up inf, so each d takes the stages up to the last other one.
      fits = np.where(mem <= mem_cap, tps[:, :, None], math.inf)
      used = np.any(fits <= self.cap, axis=2)  # (nd, w)
      # Per d, how many stages up to the last one used (0: none).
      last = np.where(used.any(axis=1), used.shape[1] - used[:, ::-1].argmax(axis=1), 0)
      best = np.full((K + 1, E), math.inf)
      for di, (d, n) in enumerate(zip(ctx.slots, last.tolist())):
        if d > K:
          break
        if not n:
          continue
        rest = f[j + 1 : j + 1 + n, : K + 1 - d, lo - 1 : top]  # (n, K + 1 - d, top - lo + 1)
        cand = np.maximum(fits[di, :n, None, :], rest)
        np.minimum(best[d:, lo : top + 1], cand.min(axis=0), out=best[d:, lo : top + 1])
      np.minimum.accumulate(best, axis=0, out=best)
      np.minimum.accumulate(best, axis=1, out=best)
      best[:, top + 1 :] = best[:, top : top + 1]
      best[best > self.cap] = math.inf
      f[j] = best
    self.memo_chain[key] = f
    return f

  def serial(self, node: SPTreeNode, i: int, D: int) -> np.ndarray:
    """Table of serialising children [i, n) of ``node`` into one sequential pipeline."""
    start = sum(len(ls) for ls in node.child_layers[:i])
    return self.chain(node, D)[start]

  def chain_stages(
    self, node: SPTreeNode, i: int, k: int, e: int, D: int
  ) -> list[tuple[list[int], int]]:
    """The stages behind ``serial(node, i, D)[k, e]`` (device counts in slots)."""
    ctx = self.ctx
    rc = ctx.linear(node)
    f = self.chain(node, D)
    j = sum(len(ls) for ls in node.child_layers[:i])
    out = []
    while j < rc.n:
      target = f[j, k, e] * (1 + 1e-12)
      step = None
      for d, s in zip(ctx.dps, ctx.slots):
        if s > k:
          break
        t2 = rc.tps(d)[j, j + 1 :]
        for j2 in range(j + 1, rc.n + 1):
          if t2[j2 - j - 1] > target or f[j2, k - s, e - 1] > target:
            continue
          mem = ctx.mem(float(rc.params[j, j2]), float(rc.saved[j, j2]), d, e)
          if mem <= ctx.cluster.memory_per_device:
            step = (j2, s)
            break
        if step:
          break
      if step is None:
        raise AssertionError("lost the serialised optimum")
      j2, d = step
      out.append(([node.layers[x] for x in range(j, j2)], d))
      j, k, e = j2, k - d, e - 1
    return out
