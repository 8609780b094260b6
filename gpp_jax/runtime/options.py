"""The decorator's settings: as the user gives them (``PipelineKeywords``, ``graph_pipeline``'s
keywords) and resolved (``Options``), which every phase of the compile chain reads
(``runtime.compile``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpp_jax.cost.host import HostCosts
from gpp_jax.runtime.input_checks import check_devices, check_num_microbatches, check_positive
from gpp_jax.runtime.memory import parse_bytes
from gpp_jax.runtime.sharding import MeshLayout, parse_mesh

if TYPE_CHECKING:
  from jax.sharding import Mesh

  from gpp_jax.ir.plan import Plan
  from gpp_jax.passes.partition.manual import ManualPlan


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineKeywords:
  """``graph_pipeline``'s keywords as the user gives them (their meanings: its docstring);
  ``options`` resolves them into the ``Options`` the compile chain reads."""

  num_microbatches: int
  devices: Sequence[Any] | None = None
  planner: str | Plan | ManualPlan | Callable = "balanced"
  schedule: str | None = None
  batch_argnums: int | Sequence[int] | None = None
  remat: bool = False
  layer_depth: int | None = None
  cluster: Any = None
  measure: bool = False
  planner_options: Mapping[str, Any] | None = None
  timeout_s: float = 300.0
  calibrate: bool = False
  fuse: bool = True
  memory_limit: int | str | None = None
  min_stages: int = 1
  donate_argnums: int | Sequence[int] = ()
  mesh: Mesh | str | None = None  # a string such as "data:4,model:2"

  def options(
    self, name: str, host_probe: Callable[[Sequence[Any]], HostCosts] | None = None
  ) -> Options:
    """These keywords checked and resolved (the mesh into its layout and its rows' devices,
    argument positions into tuples, the memory limit into bytes), for the step ``name``
    whose host ``host_probe`` measures."""
    devices, layout = self.devices, None
    if self.mesh is not None:
      mesh = self.mesh
      if isinstance(mesh, str):
        mesh = parse_mesh(mesh, devices)
      elif devices is not None:
        raise ValueError(
          "graph_pipeline takes devices= or mesh=, not both: a mesh names its devices (pass "
          "mesh=jax.make_mesh(shape, names, devices=your_devices))"
        )
      layout = MeshLayout.of(mesh)
      devices = layout.representatives
    batch, donate = self.batch_argnums, self.donate_argnums
    batch_argnums = None if batch is None else (batch,) if isinstance(batch, int) else tuple(batch)
    return Options(
      num_microbatches=check_num_microbatches(self.num_microbatches),
      devices=check_devices(devices),
      planner=self.planner,
      schedule=self.schedule,
      batch_argnums=batch_argnums,
      remat=self.remat,
      layer_depth=None
      if self.layer_depth is None
      else int(check_positive("layer_depth", self.layer_depth)),
      cluster=self.cluster,
      measure=self.measure,
      planner_options=dict(self.planner_options or {}),
      timeout_s=check_positive("timeout_s", self.timeout_s),
      calibrate=self.calibrate,
      fuse=self.fuse,
      name=name,
      memory_limit=None if self.memory_limit is None else parse_bytes(self.memory_limit),
      min_stages=int(self.min_stages),
      donate_argnums=(donate,) if isinstance(donate, int) else tuple(int(a) for a in donate),
      host_probe=host_probe,
      layout=layout,
    )
