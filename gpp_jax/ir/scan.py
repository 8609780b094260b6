"""Scan split IR: how the loss's inputs and outputs map to those of the loss with its scans
over layers split into one slice per layer (``passes.scan_split`` builds it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScanSplit:
  """How the inputs and outputs of the split loss relate to the captured loss's.

  Attributes:
    num_params: parameters of the captured loss (its first inputs).
    parts: for each captured input, the split loss's inputs holding it: one (not stacked) or
      one per slice along its leading axis (stacked parameters, and state the loss carries from
      micro-batch to micro-batch that is stacked along the same scan).
    out_parts: for each captured output, the split loss's outputs holding it (one per slice
      for the new value of a split state).
  """

  num_params: int
  parts: tuple[tuple[int, ...], ...]
  out_parts: tuple[tuple[int, ...], ...] = ()

  @property
  def stacked(self) -> dict[int, tuple[int, ...]]:
    """Captured input -> its slices' inputs, for the inputs that were split."""
    return {i: p for i, p in enumerate(self.parts) if len(p) > 1}

  @property
  def num_split_params(self) -> int:
    return sum(len(p) for p in self.parts[: self.num_params])

  @property
  def param_split(self) -> ScanSplit:
    """The same split restricted to the parameters."""
    return ScanSplit(self.num_params, self.parts[: self.num_params])
