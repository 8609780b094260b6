"""The decorator's settings (``Options``), which every phase of the compile chain reads
(``runtime.compile``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpp_jax.cost.host import HostCosts
from gpp_jax.runtime.sharding import MeshLayout


@dataclasses.dataclass(frozen=True)
class Options:
  """The decorator's settings (``graph_pipeline``'s arguments)."""

  num_microbatches: int
  devices: tuple[Any, ...]
  planner: Any = "balanced"
  schedule: str | None = None
  batch_argnums: tuple[int, ...] | None = None
  remat: bool = False
  layer_depth: int | None = None
  cluster: Any = None
  measure: bool = False
  planner_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  timeout_s: float = 300.0
  calibrate: bool = False
  fuse: bool = True
  name: str = "step"
  memory_limit: int | None = None  # bytes per device; None: the device's, else the cluster's
  # The fewest stages the plan may have: the planner's own search keeps to plans of at least
  # this many (``PlanningProblem.min_stages``), and one-stage candidates do not compete.
  min_stages: int = 1
  donate_argnums: tuple[int, ...] = ()  # arguments whose arrays the fused step may consume
  # devices -> their host's HostCosts (``runtime.host.measure_host``), measured when calibrating
  host_probe: Callable[[Sequence[Any]], HostCosts] | None = None
  # The user's mesh (``runtime.sharding.MeshLayout``); None: ``devices`` as a one-axis mesh.
  # With a mesh, ``devices`` holds one device per row of its first axis: the planners count
  # rows, and a plan's device indices are row indices.
  layout: MeshLayout | None = None

  @property
  def mesh_layout(self) -> MeshLayout:
    return self.layout if self.layout is not None else MeshLayout.flat(self.devices)

  def batch_positions(self, nargs: int, positional: int | None = None) -> tuple[int, ...]:
    """Positions of the batch among ``nargs`` step arguments, of which the first
    ``positional`` are given by position (default: the last of those)."""
    npos = nargs if positional is None or positional < 0 else positional
    if self.batch_argnums is None:
      return (npos - 1,)
    for a in self.batch_argnums:
      if not -npos <= a < npos:
        raise ValueError(
          f"batch_argnums {self.batch_argnums} out of range for {npos} positional arguments"
        )
    return tuple(a % npos for a in self.batch_argnums)
