"""The user's mesh and the model's own partition specs.

A pipeline over a mesh ``("data", "model")`` of shape (rows, k) gives each stage whole rows of
the first axis; every other axis stays whole inside the stage. Inside a stage the model's
partition specs hold over the stage's sub-mesh, which has the user's axis names: a spec naming
"model" is tensor parallel, a spec naming the first axis shards the parameter over the stage's
rows (FSDP inside the stage), and GSPMD inserts the collectives.

Where a leaf's spec comes from, first found wins:
  1. NNX: the Variable's sharding metadata (``nnx.with_partitioning``; ``nnx.Optimizer``
     copies it onto the optimizer state of the parameter);
  2. Linen: an ``nn.Partitioned`` box (``nn.with_partitioning``), or an
     ``nn.LogicallyPartitioned`` one (``nn.with_logical_partitioning``) mapped to mesh axes by
     its own rules or those of ``nn.logical_axis_rules`` active when the step is first called
     (optax keeps the boxes on the optimizer state);
  3. an array already sharded by a ``NamedSharding`` over a mesh with the same axis names (a
     model created under ``jax.set_mesh(mesh)``);
  4. none: the leaf is replicated over its stage's devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import meta
from jax.extend import core as xc
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gpp_jax.errors import PlanError, counted
from gpp_jax.ir.plan import Plan

Spec = PartitionSpec | None


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """The user's mesh as the pipeline reads it: rows of the first axis (what stages take) and
  the shape and names of the rest (kept whole in every stage)."""

  rows: tuple[tuple[Any, ...], ...]  # each row's devices, in the mesh's order
  axis_names: tuple[str, ...]
  inner_shape: tuple[int, ...]  # the sizes of the axes after the first

  @staticmethod
  def of(mesh: Mesh) -> MeshLayout:
    devs = np.asarray(mesh.devices)
    names = tuple(str(n) for n in mesh.axis_names)
    rows = tuple(tuple(row) for row in devs.reshape(devs.shape[0], -1))
    return MeshLayout(rows, names, tuple(int(n) for n in devs.shape[1:]))

  @staticmethod
  def flat(devices: Sequence[Any]) -> MeshLayout:
    """``devices=`` alone: a one-axis mesh ``("data",)``, one device a row."""
    return MeshLayout(tuple((d,) for d in devices), ("data",), ())

  @property
  def batch_axis(self) -> str:
    return self.axis_names[0]

  @property
  def row_size(self) -> int:
    return math.prod(self.inner_shape)

  @property
  def representatives(self) -> tuple[Any, ...]:
    """One device per row (what the planners count and calibrate on)."""
    return tuple(r[0] for r in self.rows)

  def axis_size(self, name: str, rows: int, inner: tuple[int, ...] | None = None) -> int:
    """The size of axis ``name`` inside a stage of ``rows`` rows that gives the axes after the
    first the sizes ``inner`` (``Stage.inner``; None: the mesh's)."""
    first = rows * self.narrowing(inner)
    if name == self.batch_axis:
      return first
    return (inner or self.inner_shape)[self.axis_names.index(name) - 1]

  def narrowing(self, inner: tuple[int, ...] | None) -> int:
    """How many rows of its own first axis a mesh row becomes in a stage with ``inner``."""
    if inner is None:
      return 1
    return self.row_size // math.prod(inner)

  def check_inner(self, stage: int, inner: tuple[int, ...] | None) -> None:
    """PlanError unless ``inner`` (stage ``stage``'s ``Stage.inner``) gives each axis after the
    first a size that divides the mesh's."""
    if inner is None:
      return
    if len(inner) != len(self.inner_shape) or any(
      n < 1 or m % n for n, m in zip(inner, self.inner_shape)
    ):
      raise PlanError(
        f"stage {stage} gives the mesh's axes {list(self.axis_names[1:])} the sizes "
        f"{list(inner)}, but each must divide the mesh's own {list(self.inner_shape)} (the "
        f"mesh is {self}); give one size per axis after {self.batch_axis!r} that divides it, "
        "or leave the stage's inner shape out"
      )

  def stage_devices(
    self, rows: Sequence[int], inner: tuple[int, ...] | None = None
  ) -> tuple[list[Any], tuple[int, ...]]:
    """The devices of a stage on mesh rows ``rows``, in the order of its sub-mesh, and the
    sizes of its axes after the first. Narrowed (``inner``), each mesh row splits into rows of
    its own: the devices of one of them are neighbours along every axis of the mesh row, so a
    tensor-parallel group stays inside the row (a node, on a cluster)."""
    devs = np.array([self.rows[r] for r in rows], dtype=object)
    if inner is None or tuple(inner) == self.inner_shape:
      return list(devs.reshape(-1)), self.inner_shape
    k = len(self.inner_shape)
    split: list[int] = []
    for n, m in zip(inner, self.inner_shape):
      split += [m // n, n]
    blocks = devs.reshape((len(rows), *split))
    # (rows, a1/b1, b1, a2/b2, b2, ...) -> (rows, a1/b1, a2/b2, ..., b1, b2, ...)
    order = [0, *(1 + 2 * i for i in range(k)), *(2 + 2 * i for i in range(k))]
    return list(blocks.transpose(order).reshape(-1)), tuple(inner)

  def __str__(self) -> str:
    sizes = (len(self.rows), *self.inner_shape)
    return ",".join(f"{n}:{s}" for n, s in zip(self.axis_names, sizes))


def parse_mesh(text: str, devices: Sequence[Any] | None = None) -> Mesh:
  """``"data:4,model:2"`` -> a Mesh of those axes over the first 4 x 2 of ``devices``
  (default ``jax.devices()``)."""
  devices = list(jax.devices() if devices is None else devices)
  names, sizes = [], []
  for part in text.split(","):
    name, sep, size = part.strip().partition(":")
    if not sep or not name or not size.strip().isdigit() or int(size) < 1:
      raise ValueError(
        f"--mesh={text!r}: each axis is NAME:SIZE, comma separated, e.g. data:4,model:2"
      )
    names.append(name.strip())
    sizes.append(int(size))
  if len(set(names)) != len(names):
    raise ValueError(f"--mesh={text!r} names an axis twice")
  n = math.prod(sizes)
  if n > len(devices):
    raise ValueError(
      f"--mesh={text!r} needs {n} devices but {len(devices)} are available; make the axes "
      f"multiply to at most {len(devices)}"
    )
  return Mesh(np.array(devices[:n], dtype=object).reshape(sizes), tuple(names))


# ---------------------------------------------------------------------------- specs of leaves


def _as_spec(names: Any) -> PartitionSpec | None:
  if names is None:
    return None
  if isinstance(names, PartitionSpec):
    return names
  if isinstance(names, NamedSharding):
    return names.spec
  if isinstance(names, str):
    return PartitionSpec(names)
  return PartitionSpec(*names)


def _variable_spec(v: nnx.Variable) -> PartitionSpec | None:
  md = v.get_metadata()
  for key in ("out_sharding", "sharding", "sharding_names"):
    if md.get(key) is not None:
      spec = _as_spec(md[key])
      rules = md.get("sharding_rules")
      return _logical(spec, rules) if rules else spec
  return None


def _logical(spec: PartitionSpec | None, rules: Any) -> PartitionSpec | None:
  if spec is None:
    return None
  return PartitionSpec(*nn_logical_to_mesh(tuple(spec), rules))


def nn_logical_to_mesh(names: tuple, rules: Any) -> tuple:
  import flax.linen as nn

  return tuple(nn.logical_to_mesh_axes(names, rules) or ())


def _box_spec(box: meta.AxisMetadata) -> PartitionSpec | None:
  import flax.linen as nn

  if isinstance(box, nn.LogicallyPartitioned):
    rules = box.rules if box.rules is not None else nn.get_logical_axis_rules()
    return PartitionSpec(*nn_logical_to_mesh(tuple(box.names), rules))
  if isinstance(box, nn.Partitioned):
    return PartitionSpec(*box.names)
  return None


def _is_box(x: Any) -> bool:
  return isinstance(x, (nnx.Variable, meta.AxisMetadata))


def _array_spec(x: Any, axis_names: tuple[str, ...]) -> PartitionSpec | None:
  s = getattr(x, "sharding", None)
  if isinstance(s, NamedSharding) and set(s.mesh.axis_names) <= set(axis_names):
    return s.spec if any(p is not None for p in s.spec) else None
  return None


def tree_specs(tree: Any, axis_names: tuple[str, ...]) -> list[Spec]:
  """One spec (or None) per leaf of ``jax.tree.leaves(tree)``, from the boxes and Variables
  that hold the leaves (module docstring)."""
  out: list[Spec] = []
  for node in jax.tree.leaves(tree, is_leaf=_is_box):
    if isinstance(node, nnx.Variable):
      spec = _variable_spec(node)
      inner = jax.tree.leaves(node)
    elif isinstance(node, meta.AxisMetadata):
      spec = _box_spec(node)
      inner = jax.tree.leaves(node)
    else:
      spec, inner = None, [node]
    for x in inner:
      out.append(spec if spec is not None else _array_spec(x, axis_names))
  return out


def entry_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes one entry of a PartitionSpec names: none, one, or a tuple of them."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


# ---------------------------------------------------------------------------- checks


def check_specs(
  specs: Sequence[Spec],
  shapes: Sequence[tuple[int, ...] | None],
  names: Sequence[str],
  layout: MeshLayout,
  stage_shapes: Sequence[tuple[int, tuple[int, ...] | None]],
) -> None:
  """Raises PlanError for a spec the stages cannot hold: an axis the mesh lacks, or a
  dimension the axis does not divide in a stage of one of ``stage_shapes`` (each stage's rows
  and ``Stage.inner``). The message names the leaf and the fix."""
  for spec, shape, name in zip(specs, shapes, names):
    if spec is None or shape is None:
      continue
    if len(spec) > len(shape):
      raise PlanError(
        f"the partition spec {spec} of {name} has {len(spec)} entries but the array has "
        f"shape {shape}; give one entry per dimension at most"
      )
    for dim, entry in enumerate(spec):
      axes = entry_axes(entry)
      for a in axes:
        if a not in layout.axis_names:
          raise PlanError(
            f"the partition spec {spec} of {name} names the axis {a!r}, which the mesh "
            f"({layout}) does not have; add {a!r} to the mesh (e.g. mesh=jax.make_mesh(..., "
            f"{(*layout.axis_names, a)!r})) or map it to one of {list(layout.axis_names)} "
            "(nn.logical_axis_rules for logical names)"
          )
      for rows, inner in sorted(set(stage_shapes), key=str):
        k = math.prod(layout.axis_size(a, rows, inner) for a in axes)
        if shape[dim] % k:
          where = f"a stage of {counted(rows, 'row')}" if layout.batch_axis in axes else "the mesh"
          if inner is not None:
            where += f" with inner shape {'x'.join(map(str, inner))}"
          raise PlanError(
            f"the partition spec {spec} of {name} splits dimension {dim} (size {shape[dim]}) "
            f"over {'x'.join(axes)} = {k} devices in {where}, which does not divide it; "
            f"choose an axis size (or stage width) that divides {shape[dim]}, or leave that "
            "dimension unsharded"
          )


def mesh_facts(
  specs: Sequence[Spec], shapes: Sequence[tuple[int, ...] | None], layout: MeshLayout
) -> dict[str, Any]:
  """The layer graph's ``mesh`` attribute: what the planners and the cost model need of the
  mesh to choose and price each stage's inner shape (``Stage.inner``) without the model's
  arrays: the axis names, the sizes of the axes after the first, and every (dimension size,
  axes) a spec shards, which the stage's axis sizes must divide."""
  divides = set()
  for spec, shape in zip(specs, shapes):
    if spec is None or shape is None:
      continue
    for dim, entry in enumerate(spec):
      axes = entry_axes(entry)
      if axes and dim < len(shape):
        divides.add((int(shape[dim]), tuple(axes)))
  return {
    "axes": layout.axis_names,
    "inner": layout.inner_shape,
    "divides": tuple(sorted(divides)),
  }


def check_rows(layout: MeshLayout, num_stages: int) -> None:
  """``num_stages``: the stages that need rows of their own (stages sharing devices count
  once)."""
  if num_stages > len(layout.rows):
    raise PlanError(
      f"the plan has {num_stages} stages on devices of their own but the mesh's first axis "
      f"{layout.batch_axis!r} has {len(layout.rows)} rows, and each stage takes whole rows; "
      f"give the first axis at least {num_stages} rows (e.g. move devices from the other "
      "axes into it) or plan fewer stages"
    )


def fsdp_spec(shape: tuple[int, ...], axes: tuple[str, ...], size: int) -> PartitionSpec | None:
  """FSDP's spec for an array over ``size`` devices (the product of ``axes``): its largest
  dimension that ``size`` divides is sharded over them (None where none is: a scalar, a
  small bias)."""
  if size <= 1:
    return None
  best = None
  for d, n in enumerate(shape):
    if n % size == 0 and (best is None or n > shape[best]):
      best = d
  if best is None:
    return None
  return PartitionSpec(*([None] * best), axes[0] if len(axes) == 1 else axes)


def fsdp_specs(
  avals: Sequence[Any], skip: set[int], layout: MeshLayout, stage_rows: Sequence[int]
) -> tuple[Spec, ...]:
  """``fsdp_spec`` for every floating-point array among ``avals`` not in ``skip`` (the batch),
  over all axes of the mesh; the dimension must divide over every stage's devices."""
  size = math.lcm(*(r * layout.row_size for r in stage_rows))
  out: list[Spec] = []
  for i, a in enumerate(avals):
    floating = hasattr(a, "dtype") and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
    ok = i not in skip and floating and len(getattr(a, "shape", ())) >= 1
    out.append(fsdp_spec(tuple(a.shape), layout.axis_names, size) if ok else None)
  return tuple(out)


def step_leaf_specs(pure: Any, args: Sequence[Any], layout: MeshLayout) -> tuple[Spec, ...]:
  """One spec (or None) per flat step argument, in ``runtime.capture_step.functionalize``'s
  order: the NNX objects' state first, then the other arguments."""
  pos = pure.graph_positions
  state = nnx.split(tuple(args[i] for i in pos))[1] if pos else None
  others = tuple(a for i, a in enumerate(args) if i not in pos)
  return tuple(tree_specs((state, others), layout.axis_names))


def leaf_names(pure: Any, args: Sequence[Any]) -> list[str]:
  """Readable paths of the flat step arguments (for error messages)."""
  pos = pure.graph_positions
  state = nnx.split(tuple(args[i] for i in pos))[1] if pos else None
  others = tuple(a for i, a in enumerate(args) if i not in pos)
  paths = jax.tree_util.tree_flatten_with_path((state, others))[0]
  out = []
  for p, _ in paths:
    name = jax.tree_util.keystr(p[1:], simple=True, separator="/")
    out.append(name.removesuffix("/value") or "the argument")
  return out


# ---------------------------------------------------------------------------- a captured step
# ``captured`` below is a ``runtime.captured.Captured``: the traced step, its loss after the
# scan split, its layers and its arguments' specs.


def plan_leaf_specs(captured: Any, plan: Plan, layout: MeshLayout) -> tuple[Any, ...]:
  """Per flat step argument, its partition spec under ``plan.param_sharding`` (checked
  against the mesh and every stage's width)."""
  invars = captured.step.jaxpr.invars
  rows = [len(s.devices) for s in plan.stages]
  for s in plan.stages:
    layout.check_inner(s.index, s.inner)
  batch = set(captured.batch_leaves)
  if plan.param_sharding == "replicated":
    return (None,) * len(invars)
  if plan.param_sharding == "fsdp":
    return fsdp_specs([v.aval for v in invars], batch, layout, rows)
  if plan.param_sharding != "model":
    raise PlanError(
      f"param_sharding={plan.param_sharding!r} is none of 'model', 'replicated', 'fsdp'"
    )
  if any(captured.leaf_specs):
    shapes = [None if i in batch else tuple(v.aval.shape) for i, v in enumerate(invars)]
    widths = [(len(s.devices), s.inner) for s in plan.stages]
    check_specs(captured.leaf_specs, shapes, captured.leaf_names, layout, widths)
  return captured.leaf_specs


def stage_param_specs(captured: Any, staged: Any, leaf_specs: Sequence[Any]) -> list[list[Any]]:
  """Per stage, the partition spec of each of its parameters (None: replicated): the spec of
  the step argument the marker differentiates, without its leading entry for a slice of a
  stacked (scanned) parameter. A parameter the step computes before the loss is replicated."""
  if not any(leaf_specs):
    return [[None] * len(st.param_inputs) for st in staged.stages]
  by_input = loss_input_specs(captured, leaf_specs)
  return [[by_input.get(st.inputs[p].index) for p in st.param_inputs] for st in staged.stages]


def loss_input_specs(captured: Any, leaf_specs: Sequence[Any]) -> dict[int, Any]:
  """Input of the (scan-split) loss -> the partition spec of the step argument it is (a
  slice of a stacked parameter: the spec without its leading entry)."""
  J = captured.step.jaxpr
  leaf_of = {v: i for i, v in enumerate(J.invars)}
  marker = captured.marker
  by_input: dict[int, Any] = {}
  for j, ks in enumerate(captured.scan_split.parts):
    i = leaf_of.get(marker.invars[j]) if isinstance(marker.invars[j], xc.Var) else None
    spec = None if i is None else leaf_specs[i]
    if spec is not None and len(ks) > 1:
      spec = PartitionSpec(*tuple(spec)[1:])
    for k in ks:
      by_input[k] = spec
  return by_input


def _sharded_params(captured: Any) -> Iterator[tuple[str, PartitionSpec, Any]]:
  """(layer, spec, aval) of each parameter input of the captured loss that has a spec."""
  layers = captured.layering.param_layer
  invars = captured.loss.jaxpr.invars
  for k, spec in loss_input_specs(captured, captured.leaf_specs).items():
    layer = layers[k] if k < len(layers) else None
    if spec is not None and layer is not None:
      yield layer, spec, invars[k].aval


def param_shards(captured: Any, layout: MeshLayout) -> dict[str, tuple[float, float, float]]:
  """Per layer with sharded parameters, for the cost model's memory of a stage that holds
  them by the model's specs: (their bytes, their bytes per device not counting a split over
  the stage's rows, the bytes per device that the stage's rows split further)."""
  out: dict[str, list[float]] = {}
  for layer, spec, aval in _sharded_params(captured):
    nbytes = float(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
    axes = [a for e in spec for a in entry_axes(e)]
    inner = float(np.prod([layout.axis_size(a, 1) for a in axes if a != layout.batch_axis]))
    entry = out.setdefault(layer, [0.0, 0.0, 0.0])
    entry[0] += nbytes
    entry[2 if layout.batch_axis in axes else 1] += nbytes / inner
  return {l: (a, b, c) for l, (a, b, c) in out.items()}


def tensor_parallel(captured: Any, layout: MeshLayout) -> dict[str, tuple[int, float, float]]:
  """Per layer whose parameters the model's specs shard over the axes after the first:
  (the number of devices its largest parameter is split over, the bytes per sample of its
  output all-reduced in the forward when a parameter is split along its first dimension, a
  row-parallel kernel or a vocabulary-parallel embedding; the bytes per sample of its input
  cotangent all-reduced in the backward when one is split along its last dimension, a
  column-parallel kernel). Megatron's collectives, as the cost model charges them."""
  g = captured.layering.graph
  B = float(g.graph.get("batch_size") or captured.microbatch_size)
  out: dict[str, list[Any]] = {}
  for layer, spec, aval in _sharded_params(captured):
    if layer not in g:
      continue
    for dim, e in enumerate(spec):
      inner = [a for a in entry_axes(e) if a != layout.batch_axis]
      if not inner or aval.ndim < 2:
        continue
      n = int(np.prod([layout.axis_size(a, 1) for a in inner]))
      entry = out.setdefault(layer, [1, False, False])
      entry[0] = max(entry[0], n)
      entry[1 if dim == 0 else 2] = True
  result = {}
  for layer, (n, row, col) in out.items():
    if n <= 1:
      continue
    out_b = max((d["bytes"] for _, _, d in g.out_edges(layer, data=True)), default=0.0)
    in_b = max((d["bytes"] for _, _, d in g.in_edges(layer, data=True)), default=0.0)
    result[layer] = (n, out_b / B if row else 0.0, in_b / B if col else 0.0)
  return result
