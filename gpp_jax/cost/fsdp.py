"""FSDP (ZeRO-3) priced layer by layer: each layer's parameters gathered in the dtype it computes
in, one layer ahead of its compute, and its gradients reduce-scattered behind the backward
(``plan_costs``' FSDP branch; ``experiments.published`` prices ZeRO-3 with it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from gpp_jax.cost.cluster import DeviceSpec, Link

if TYPE_CHECKING:
  from gpp_jax.cost.cost_model import CostModel, LayerCosts


def fsdp_gathered_bytes(costs: LayerCosts, idx: Sequence[int]) -> np.ndarray:
  """Bytes an FSDP (ZeRO-3) gather moves for each layer at positions ``idx``: its parameters
  in the dtype its forward reads them (``param_read_bytes``; mixed precision gathers the
  half-precision copy, not the fp32 master weights it holds), and, for a layer that reads
  none of its weights whole (an embedding lookup), its ``param_bytes`` at the stage's ratio of
  read to held bytes (1 where no layer of the stage reads its weights whole)."""
  i = np.asarray(idx, dtype=int)
  held = costs.param_bytes[i]
  read = np.minimum(costs.param_read_bytes[i], held)
  dense = read > 0
  ratio = float(read[dense].sum() / held[dense].sum()) if dense.any() else 1.0
  return np.where(dense, read, held * ratio)


def fsdp_stage_times(
  cm: CostModel,
  costs: LayerCosts,
  device: DeviceSpec,
  idx: Sequence[int],
  samples: float,
  dp: int,
  link: Link,
  overlap: bool = True,
) -> tuple[float, float]:
  """(forward, backward) seconds of one micro-batch of a stage whose parameters are sharded
  over its ``dp`` devices (FSDP, ZeRO-3) with ``samples`` samples on each: the layers (in
  topological order, reversed for the backward) compute one after another while the link
  all-gathers each layer's parameters (``fsdp_gathered_bytes``) ahead of it, one layer
  prefetched, and in the backward reduce-scatters each layer's gradients once it has run
  (``overlapped_time``). The backward gathers each layer ``cm.fsdp_backward_gathers`` times
  (twice where its recomputed forward gathers and releases the parameters before the backward
  gathers them again). The first gather and the last reduce-scatter are exposed; where the
  gathers are slower than the compute, they set the pace. ``overlap=False``: nothing hidden,
  every gather and reduce-scatter added to the compute (a bound)."""
  order = sorted(int(i) for i in idx)
  tf, tb = cm.layer_times(costs, device, samples)
  gathered = fsdp_gathered_bytes(costs, order)
  comm = [cm.allgather_time(float(b), dp, link) for b in gathered]
  fc = [float(tf[i]) for i in order]
  bc = [float(tb[i]) for i in order[::-1]]
  gathers = cm.fsdp_backward_gathers
  if not overlap:
    return sum(fc) + sum(comm), sum(bc) + (gathers + 1) * sum(comm)
  back = comm[::-1]
  return overlapped_time(fc, comm), overlapped_time(bc, [gathers * c for c in back], back)


def overlapped_time(
  compute: Sequence[float], fetch: Sequence[float], drain: Sequence[float] | None = None
) -> float:
  """Seconds to run ``compute[k]`` for k = 0, 1, ... on a device whose one link moves, in
  order, each step's input (``fetch[k]``: before step k can start, issued once step k - 2
  has finished, so one step is fetched ahead) and, with ``drain``, each step's output
  after it (``drain[k]``: issued once step k has finished, behind the fetch of step k + 1).
  A two-resource flow shop: max(compute, link) step by step, plus the first fetch and the
  last drain."""
  link = 0.0  # when the link is next free
  done: list[float] = []  # when each step's compute finished
  for k, (c, f) in enumerate(zip(compute, fetch, strict=True)):
    link = max(link, done[k - 2] if k >= 2 else 0.0) + f
    done.append(max(done[-1] if done else 0.0, link) + c)
    if drain is not None and k >= 1:
      link = max(link, done[k - 1]) + drain[k - 1]
  end = done[-1] if done else 0.0
  if drain is not None and done:
    end = max(end, link) + drain[-1]
  return end
