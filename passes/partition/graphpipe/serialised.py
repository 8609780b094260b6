"""Serialised runs: children of a series or parallel node solved as one sequential pipeline over
their layers in SP order (a topological order). The DP thereby applies the SP-ization rule by
choice; stages may cut across branch boundaries to balance work."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gpp_jax.passes.partition.graphpipe.context import MicrobatchContext
from gpp_jax.passes.partition.graphpipe.tree import SPTreeNode


class SerialisedRuns:
  """The serialised option of ``MinMaxDP`` (a mixin: it reads the DP's ``ctx``, device count
  ``K``, depth count ``E``, TPS ``cap``, ``memo_chain`` and ``whole_chain``, PipeDream's
  chain DP table for the context where the search shares it, else None)."""

  ctx: MicrobatchContext
  K: int
  E: int
  cap: float
  memo_chain: dict
  whole_chain: Callable[[], np.ndarray] | None

  def chain(self, node: SPTreeNode, D: int) -> np.ndarray:
    """``f[j, k, e]`` = smallest bottleneck of a sequential pipeline over ``node``'s layers j..
    (SP order) on at most k devices with entry depth at most e, every stage within memory, in
    context depth D (inf if none)."""
    key = (node.sig, D)
    f = self.memo_chain.get(key)
    if f is not None:
      return f
    ctx = self.ctx
    K, E = self.K, self.E
    L = ctx.linear(node).n
    if D == 0 and self.whole_chain is not None and node.layers == list(range(len(ctx.costs))):
      f = self.memo_chain[key] = self.chain_of_table(self.whole_chain())
      return f
    f = self.shifted_chain(node, D)
    if f is not None:
      self.memo_chain[key] = f
      return f
    tps_all, static, saved, per_dev = ctx.linear_stacks(node)
    inflight = np.minimum(np.arange(E), ctx.M)
    mem_cap = ctx.cluster.memory_per_device
    widths = [(di, s) for di, s in enumerate(ctx.slots) if s <= K]
    n_used = self.chain_widths(node, D)[: len(widths)]  # (widths, L)
    counts = n_used.tolist()
    longest = n_used.max(axis=0, initial=0).tolist()
    # Per device count, a stage's stashed bytes per in-flight micro-batch.
    per_mb = saved[None, :, :] * per_dev[:, None, None]  # (nd, L + 1, L + 1)
    f = np.full((L + 1, K + 1, E), math.inf)
    f[L, :, D:] = 0.0
    lo = D + 1
    for j in range(L - 1, -1, -1):
      # Entry depths D + 1 .. D + (L - j) are all a chain from j can have; deeper ones repeat.
      top = min(E - 1, D + L - j)
      w = longest[j]
      if not w or lo > top:
        continue
      hi = j + 1 + w
      # memory of stage [j, j2) on d devices at depths lo .. top: (nd, w, top - lo + 1); the
      # stage's TPS where it fits, inf elsewhere (max(that, rest) is inf where it does not).
      mem = (
        static[j, j + 1 : hi][None, :, None]
        + per_mb[:, j, j + 1 : hi, None] * inflight[None, None, lo : top + 1]
      )
      fits = np.where(mem <= mem_cap, tps_all[:, j, j + 1 : hi, None], math.inf)
      best = f[j]  # written in place: the rows of f below j are final
      for di, d in widths:
        n = counts[di][j]
        if not n:
          continue
        rest = f[j + 1 : j + 1 + n, : K + 1 - d, lo - 1 : top]  # (n, K + 1 - d, top - lo + 1)
        cand = np.maximum(fits[di, :n, None, :], rest)
        np.minimum(best[d:, lo : top + 1], cand.min(axis=0), out=best[d:, lo : top + 1])
      np.minimum.accumulate(best, axis=0, out=best)
      np.minimum.accumulate(best, axis=1, out=best)
      best[:, top + 1 :] = best[:, top : top + 1]
      best[best > self.cap] = math.inf
    self.memo_chain[key] = f
    return f

  def shifted_chain(self, node: SPTreeNode, D: int) -> np.ndarray | None:
    """``chain(node, D)`` as the chain of ``node`` in the deepest context D' < D already
    computed, moved D - D' depths deeper, where that is exact; else None.

    The context enters the chain only through the in-flight count of each stage, min(e, M) at
    its depth e, and so through which stages fit in memory. Memory grows with the in-flight
    count (float sums and products of non-negative numbers keep their order), so where every
    stage that can matter (within the cap and the stages ``chain_widths`` looks at) fits at
    depth D' + 1 exactly when it fits at the deepest depth E - 1, it fits the same at every
    depth from D' + 1 on: the chain in context D then looks at the same stages, their values
    the same at depth e as in context D' at e - (D - D'), and ``f[j, k, e]`` is the chain of
    D' at e - (D - D') (inf above that, where the depth is below D). The memory is summed as
    ``chain`` sums it, so the test is the very comparison ``chain`` would make. DP runs ask
    for a node's chain in several contexts, and memory seldom tells the depths apart."""
    shallower = [d for sig, d in self.memo_chain if sig == node.sig and d < D]
    if not shallower:
      return None
    D0 = max(shallower)
    ctx = self.ctx
    rc = ctx.linear(node)
    L = rc.n
    tps_all, static, saved, per_dev = ctx.linear_stacks(node)
    j2 = np.arange(L + 1)
    fast = np.stack([rc.bound(d) for d in ctx.dps]).min(axis=0)[:L] <= self.cap
    hi = j2[:L] + 1 + (fast & (j2[None, :] > j2[:L, None])).sum(axis=1)
    looked_at = (
      (tps_all[:, :L, :] <= self.cap) & (j2[None, :] > j2[:L, None]) & (j2[None, :] < hi[:, None])
    )
    per_mb = saved[None, :L, :] * per_dev[:, None, None]
    mem_cap = ctx.cluster.memory_per_device
    first = static[None, :L, :] + per_mb * min(D0 + 1, ctx.M) <= mem_cap
    last = static[None, :L, :] + per_mb * min(self.E - 1, ctx.M) <= mem_cap
    if (looked_at & (first != last)).any():
      return None
    g = self.memo_chain[(node.sig, D0)]
    f = np.full_like(g, math.inf)
    f[:, :, D - D0 :] = g[:, :, : self.E - (D - D0)]
    return f

  def chain_of_table(self, A: np.ndarray) -> np.ndarray:
    """The chain of every layer in the LayerGraph's order in context depth 0, read off
    PipeDream's table ``A[j, k, s]`` of that chain (``pipedream.chain_dp``: the smallest
    bottleneck with exactly s stages on at most k slots, a stage s-th from the end holding
    min(s, M) micro-batches, as one at depth s does here) over the same stages, device
    counts and unit: ``f[j, k, e]`` is its minimum over s <= e, inf above the cap. The
    values are maxima of the same stage TPS, so the table is the one ``chain`` computes."""
    at_most = np.minimum.accumulate(A, axis=2)
    f = at_most[:, :, np.minimum(np.arange(self.E), A.shape[2] - 1)]
    f[f > self.cap] = math.inf
    return f

  def chain_widths(self, node: SPTreeNode, D: int) -> np.ndarray:
    """``n[di, j]``: how many stages [j, j + 1), ..., [j, j + n) the chain of ``node`` in
    context D looks at for device count ``ctx.dps[di]``: those up to the last one that is
    within the cap where it fits in memory at some depth (0: none).

    Stages [j, j2) whose transfer-free TPS is above the cap on every device count are never
    used; that bound grows with j2, so each j needs only the j2 below a limit. A stage above
    the cap, or out of memory at every depth, only gives values that end up inf, and memory
    grows with the depth (the in-flight count min(e, M) does), so a stage fits at some depth
    of the chain exactly where it fits at its shallowest, D + 1."""
    ctx = self.ctx
    rc = ctx.linear(node)
    L = rc.n
    tps_all, static, saved, per_dev = ctx.linear_stacks(node)
    j2 = np.arange(L + 1)
    after = j2[None, :] > j2[:L, None]  # (L, L + 1): stages [j, j2) with j2 > j
    fast = (np.stack([rc.bound(d) for d in ctx.dps]).min(axis=0)[:L] <= self.cap) & after
    hi = j2[:L] + 1 + fast.sum(axis=1)  # stages [j, j2) for j2 < hi
    shallow = min(D + 1, ctx.M)
    mem = static[None, :L, :] + saved[None, :L, :] * per_dev[:, None, None] * shallow
    used = (
      (np.where(mem <= ctx.cluster.memory_per_device, tps_all[:, :L, :], math.inf) <= self.cap)
      & after
      & (j2[None, :] < hi[:, None])
    )  # (nd, L, L + 1)
    last = np.where(used, j2, 0).max(axis=2)  # the last j2 used, 0 for none
    return np.where(last > 0, last - j2[:L], 0)

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
