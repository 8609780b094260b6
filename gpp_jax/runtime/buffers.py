"""Buffer sizes from the traced stage functions, for the lowering and the memory model: each
stage's residuals, packed parameters, gradient sums and what B keeps for W (``buffer_bytes``),
and the constants the executables close over (``constant_bytes``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from gpp_jax.passes.staging import StagedProgram, stage_functions
from gpp_jax.runtime.captured import Captured
from gpp_jax.runtime.executor import Kernels
from gpp_jax.runtime.placement import pack_limit
from gpp_jax.runtime.stage import Staged


def buffer_bytes(
  kernels: Kernels, staged: StagedProgram, split_w: bool, remat: bool
) -> list[dict[str, int]]:
  """Per stage, bytes per device of the buffers only its traced functions size: residuals
  (``res``), packed parameters (``pp``), gradient sums (``acc``) and, with W actions, what B
  keeps for W (``kept``). Traced, not compiled (``jax.eval_shape``); a stage over k devices
  holds 1/k of its residuals (they carry the batch)."""
  out = []
  for k in kernels.stages:
    st, fns = k.stage, k.fns
    avals = [v.aval for v in st.jaxpr.jaxpr.invars]
    nparam = sum(r.kind == "param" for r in st.inputs)
    nondiff = avals[st.num_diff :]
    sizes: dict[str, int] = {"acc": _tree_bytes(jax.eval_shape(fns.zeros_acc))}
    if k.row_local:  # a slice per row, each row's devices holding their own
      sizes["acc"] //= k.placement.rows
    if fns.pack_params is not None:
      pp = jax.eval_shape(fns.pack_params, avals[:nparam])
      sizes["pp"] = _tree_bytes(pp)
      outs, res = jax.eval_shape(fns.fwd, pp, avals[nparam : st.num_diff], nondiff)
      pre: tuple = (res, pp)
    else:
      outs, res = jax.eval_shape(fns.fwd, avals[: st.num_diff], nondiff)
      pre = (res,)
    width = len(k.placement.devices)
    if k.row_local:  # (the parameters, each row's residuals stacked over the rows)
      sizes["res"] = _tree_bytes(res[0]) + _tree_bytes(res[1]) // k.placement.rows
    else:
      sizes["res"] = _per_device_bytes(res, k.placement.rows, k.placement.microbatch_size)
    if split_w:
      # B's contributions per output, as the lowering groups them (a trace of the split
      # backward records its structure, so a fresh copy of the stage's functions is traced).
      cts = []
      for k_out, (o, x) in enumerate(zip(st.outputs, outs)):
        n = len(o.consumers) if o.diff else 0
        n += int(o.diff and (st.index, k_out) == staged.loss_outputs[0])
        cts.append(tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for _ in range(n)))
      fresh = stage_functions(
        st, remat=remat, pack_residuals=width == 1, pack_limit=pack_limit(k.placement.devices[0])
      )
      assert fresh.bwd_input is not None
      if fresh.pack_params is not None:  # its forward records the residuals' layout
        jax.eval_shape(fresh.fwd, pre[1], avals[nparam : st.num_diff], nondiff)
      else:
        jax.eval_shape(fresh.fwd, avals[: st.num_diff], nondiff)
      _, kept = jax.eval_shape(fresh.bwd_input, *pre, cts)
      sizes["kept"] = _per_device_bytes(kept, width, k.placement.microbatch_size)
    out.append(sizes)
  return out


def constant_bytes(staged: Staged, fused: bool, captured: Captured) -> dict[int, int]:
  """Per lane, bytes of the constants its executables close over (each jitted function keeps
  a copy on its devices): the stage programs' and the pieces of the step placed there."""
  out: dict[int, int] = {}

  def add(lane: int, consts) -> None:
    out[lane] = out.get(lane, 0) + sum(
      int(np.prod(np.shape(c), dtype=np.int64)) * np.asarray(c).dtype.itemsize
      for c in consts
      if hasattr(c, "shape")
    )

  if fused:
    add(0, captured.loss_as_traced.consts if captured.loss_as_traced is not None else [])
  else:
    for st in staged.staged.stages:
      add(st.index, st.jaxpr.consts)
  for p in staged.prog.before + staged.prog.after:
    add(0 if fused else p.home, p.jaxpr.consts)
  return out


def _per_device_bytes(tree: Any, width: int, microbatch: int) -> int:
  """Bytes per device of ``tree`` on a stage over ``width`` devices: arrays whose leading
  axis is the micro-batch are split over them, the rest replicated."""
  total = 0
  for x in jax.tree.leaves(tree):
    n = int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
    total += n // width if width > 1 and x.shape and x.shape[0] == microbatch else n
  return total


def _tree_bytes(tree: Any) -> int:
  leaves = jax.tree.leaves(tree)
  return sum(int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize for x in leaves)
