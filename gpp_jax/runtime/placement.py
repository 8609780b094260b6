"""Where a stage's values live: one device, or a sub-mesh with the batch axis sharded."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from gpp_jax.errors import PlanError

# Packing a stage's parameters, residuals and gradient sums into one buffer per dtype saves the
# host a dispatch per array but copies the arrays. An array is worth packing while its copy costs
# the device less than its dispatch costs the host (some microseconds): up to tens of KiB at a
# CPU core's copy bandwidth, tens of MiB at a GPU's.
PACK_LIMIT_BYTES = {"cpu": 64 << 10, "gpu": 16 << 20, "tpu": 16 << 20}


def pack_limit(device) -> int:
  """Largest array (bytes) a single-device stage on ``device`` packs; larger ones stay apart."""
  return PACK_LIMIT_BYTES.get(device.platform, PACK_LIMIT_BYTES["gpu"])


@dataclasses.dataclass(frozen=True)
class StagePlacement:
  """Placement of one stage.

  A stage on one device keeps everything there. A stage on several runs as one SPMD
  computation over its sub-mesh: whole rows of the first axis of the user's mesh (default a
  1-D mesh ``("data",)``, one device a row), every other axis whole. Arrays whose leading
  dimension is the micro-batch size are sharded along the first axis; a parameter (and its
  optimizer state and gradient sum) by its partition spec (``runtime.sharding``), else
  replicated; GSPMD inserts the collectives.
  """

  devices: tuple[Any, ...]  # the sub-mesh's devices, row by row
  microbatch_size: int
  inner_shape: tuple[int, ...] = ()  # the sizes of the axes after the first
  axis_names: tuple[str, ...] = ("data",)

  @property
  def rows(self) -> int:
    """Rows of the first axis (what a micro-batch is split over)."""
    return len(self.devices) // max(1, int(np.prod(self.inner_shape, dtype=np.int64)))

  @functools.cached_property
  def mesh(self) -> Mesh:
    devs = np.array(self.devices, dtype=object).reshape((self.rows, *self.inner_shape))
    auto = (jax.sharding.AxisType.Auto,) * len(self.axis_names)
    return Mesh(devs, self.axis_names, axis_types=auto)

  @functools.cached_property
  def replicated(self) -> jax.sharding.Sharding:
    if len(self.devices) == 1:
      return SingleDeviceSharding(self.devices[0])
    return NamedSharding(self.mesh, PartitionSpec())

  @functools.cached_property
  def batched(self) -> jax.sharding.Sharding:
    if len(self.devices) == 1:
      return self.replicated
    return NamedSharding(self.mesh, PartitionSpec(self.axis_names[0]))

  @functools.cached_property
  def stacked(self) -> jax.sharding.Sharding:
    """For micro-batches stacked along a leading axis: each split over the rows."""
    if len(self.devices) == 1:
      return self.replicated
    return NamedSharding(self.mesh, PartitionSpec(None, self.axis_names[0]))

  def sharded(self, spec: PartitionSpec | None, ndim: int) -> jax.sharding.Sharding:
    """Where a parameter (or its optimizer state, its gradient sum) with ``spec`` lives."""
    if spec is None or len(self.devices) == 1 or all(p is None for p in spec):
      return self.replicated
    return NamedSharding(self.mesh, PartitionSpec(*tuple(spec)[:ndim]))

  def for_array(self, x) -> jax.sharding.Sharding:
    """The sharding an incoming array gets: batch-sharded if it carries the micro-batch axis."""
    shape = np.shape(x) if not hasattr(x, "shape") else x.shape
    if self.rows > 1 and len(shape) >= 1 and shape[0] == self.microbatch_size:
      return self.batched
    return self.replicated

  def put(self, x):
    return transfer(x, self.for_array(x))

  def __str__(self) -> str:
    return ", ".join(str(d) for d in self.devices)


def _is_remote(x) -> bool:
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def _already_there(x, sharding) -> bool:
  """Whether ``x`` already has ``sharding``, decided the same way on every process.

  Real arrays and the placeholders other processes hold for them may differ in details such as
  the memory kind, so the test uses only the devices, and for multi-device shardings it holds
  in a single process only (a placeholder's partitioning is not known to match).
  """
  if not isinstance(x, jax.Array) or x.sharding.device_set != sharding.device_set:
    return False
  if not x.committed:  # JAX moves an uncommitted array where it likes: commit it (no copy)
    return False
  if len(sharding.device_set) == 1:
    return True
  return jax.process_count() == 1 and x.sharding.is_equivalent_to(sharding, x.ndim)


@dataclasses.dataclass(frozen=True)
class LocalCopy:
  """A value each process holds its own copy of: what the user passes to a step.

  In a multi-process run every process passes the same values, possibly on its own local
  devices; such a value is never sent between processes. The process that runs its home places
  its own copy there, the others stand in a placeholder.
  """

  value: Any


def _placeholder_for(x, sharding):
  aval = jax.typeof(x) if isinstance(x, jax.Array) else jax.typeof(np.asarray(x))
  return jax.make_array_from_single_device_arrays(tuple(aval.shape), sharding, [], dtype=aval.dtype)


def _has_local(sharding) -> bool:
  return any(d.process_index == jax.process_index() for d in sharding.device_set)


def spans_processes(sharding) -> bool:
  """Whether ``sharding``'s devices belong to more than one process."""
  return len({d.process_index for d in sharding.device_set}) > 1


def _from_host(x, sharding):
  """A value every process holds alike (host data, or an array on its own devices), put on a
  sharding whose devices may belong to several processes: each process fills its own."""
  host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_input(x, sharding: jax.sharding.Sharding):
  """Places a step argument on its home (see LocalCopy for the multi-process rule)."""
  if _already_there(x, sharding):
    return x
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if spans_processes(sharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.sharding.device_set == sharding.device_set:
        return x  # what this stage returned last step: already across its processes
      return _across_processes(x, sharding)
    return _from_host(x, sharding)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    # What a previous step returned, left where the step computed it (its update may run on
    # another stage than the one that reads it): every process holds it or its placeholder
    # alike, so moving it is a matched send and receive like any other cross-process edge.
    return transfer(x, sharding)
  return jax.device_put(x, sharding) if _has_local(sharding) else _placeholder_for(x, sharding)


def transfer(x, sharding: jax.sharding.Sharding):
  """``jax.device_put(x, sharding)``, also between processes.

  In a multi-process run every process calls this for every transfer, in the same order:
  source and destination local is a local copy; a local source and a remote destination is the
  send and a remote source with a local destination the receive of JAX's cross-host transfer;
  when neither end is local, nothing moves and a placeholder stands for the result. JAX's
  cross-host transfer moves an array between single devices only, so a transfer between
  processes with several devices on either side goes device by device (``_across_processes``).
  """
  if jax.process_count() == 1:
    x, put = _in_one_process(x, sharding)
    return jax.device_put(x, sharding) if put else x
  if isinstance(x, LocalCopy):
    return place_input(x.value, sharding)
  if _unchanged(x, sharding):
    return x
  if not isinstance(x, jax.Array):
    if spans_processes(sharding):
      return _from_host(x, sharding)
    return jax.device_put(x, sharding) if _has_local(sharding) else _placeholder_for(x, sharding)
  if _crosses_processes(x.sharding, sharding) and (
    len(x.sharding.device_set) > 1 or len(sharding.device_set) > 1
  ):
    return _across_processes(x, sharding)
  # The remaining puts are issued even onto the same devices: skipping them by device set
  # (``_already_there``) broke JAX's cross-host transfers (measured with jax 0.10.2: "Async
  # transfer object was deleted before transfers completed").
  if not _has_local(sharding) and _is_remote(x):
    return _placeholder_for(x, sharding)
  out = jax.device_put(x, sharding)
  if _is_remote(x) or not _has_local(sharding):
    # A receive or a send: JAX's transfer objects hang off both arrays and must outlive the
    # transfer, so both are kept until two steps later even if the pipeline drops them sooner.
    _IN_FLIGHT[-1].append((x, out))
  return out


def transfer_all(xs: Sequence[Any], sharding: jax.sharding.Sharding) -> list[Any]:
  """``[transfer(x, sharding) for x in xs]`` in one process, the puts that move something
  issued as one ``jax.device_put`` of the list: JAX then prepares and dispatches them
  together, a third of the host time of putting them one by one (50 scalars between two
  forced CPU devices: 5-7 ms against 15-16 ms)."""
  assert jax.process_count() == 1, "transfer_all is for one process; use transfer"
  out, moving = [], []
  for k, x in enumerate(xs):
    x, put = _in_one_process(x, sharding)
    out.append(x)
    if put:
      moving.append(k)
  if moving:
    for k, y in zip(moving, jax.device_put([out[k] for k in moving], sharding)):
      out[k] = y
  return out


def _in_one_process(x, sharding) -> tuple[Any, bool]:
  """``transfer`` in one process up to its put: (what goes to ``sharding``, whether it still
  needs a ``jax.device_put``)."""
  if isinstance(x, LocalCopy):
    return place_input(x.value, sharding), False
  if _unchanged(x, sharding) or _already_there(x, sharding):
    return x, False  # the common case for state and parameters between steps
  return (_gathered(x) if _needs_gather(x, sharding) else x), True


def _crosses_processes(src, dst) -> bool:
  """Whether moving from sharding ``src`` to ``dst`` involves more than one process."""
  procs = {d.process_index for d in src.device_set} | {d.process_index for d in dst.device_set}
  return len(procs) > 1


def _unchanged(x, sharding) -> bool:
  """Whether ``jax.device_put(x, sharding)`` would return ``x`` itself: a committed array
  already on exactly this sharding (JAX's own first test, for the default copy semantics). Such
  a put moves nothing and touches no transfer state, so skipping it changes nothing but the
  tens of microseconds of host time the call costs (thousands per step with several
  processes, where the looser ``_already_there`` does not apply)."""
  return isinstance(x, jax.Array) and x.committed and x.sharding == sharding


def _rows(index, n: int) -> tuple[int, int]:
  """The leading-axis range ``[start, stop)`` of a shard index (placements shard only axis 0)."""
  if not index:
    return 0, n
  first = index[0]
  if isinstance(first, slice):
    start, stop, _ = first.indices(n)
    return start, stop
  return int(first), int(first) + 1


@functools.cache
def _slice_rows_fn(start: int, stop: int):
  return jax.jit(lambda a: a[start:stop])


@functools.cache
def _concat_fn():
  return jax.jit(lambda *parts: jax.numpy.concatenate(parts, axis=0))


def _across_processes(x, sharding):
  """``x`` resharded onto ``sharding`` when either spans processes (a stage wider than one
  process). JAX's cross-host ``device_put`` moves an array between equally many devices only, so
  each destination device gets its rows from source devices one to one, and each process then
  assembles its own shards; every process walks the devices in the same order and issues the
  same puts. Shardings split the leading axis or replicate (``StagePlacement``)."""
  shape, me = tuple(x.shape), jax.process_index()
  n = shape[0] if shape else 1
  src_map = x.sharding.devices_indices_map(shape)
  local = {s.device: s.data for s in x.addressable_shards}
  dst_map = sharding.devices_indices_map(shape)
  mine = {}
  for d in sorted(dst_map, key=lambda d: d.id):
    lo, hi = _rows(dst_map[d], n)
    parts = []
    while lo < hi:
      # The source shards holding row ``lo``: prefer one on d's process, then the lowest id.
      holders = [sd for sd, idx in src_map.items() if _rows(idx, n)[0] <= lo < _rows(idx, n)[1]]
      sd = min(holders, key=lambda h: (h.process_index != d.process_index, h.id))
      s_lo, s_hi = _rows(src_map[sd], n)
      take = min(hi, s_hi)
      if not shape:
        piece_shape: tuple[int, ...] = ()
      else:
        piece_shape = (take - lo, *shape[1:])
      if sd.process_index == me:
        piece = local[sd]
        if shape and (lo, take) != (s_lo, s_hi):
          piece = _slice_rows_fn(lo - s_lo, take - s_lo)(piece)
      else:
        piece = jax.make_array_from_single_device_arrays(
          piece_shape, SingleDeviceSharding(sd), [], dtype=x.dtype
        )
      parts.append(transfer(piece, SingleDeviceSharding(d)))
      lo = take
    if d.process_index == me:
      mine[d] = parts[0] if len(parts) == 1 else _concat_fn()(*parts)
  if not mine:
    return _placeholder_for(x, sharding)
  return jax.make_array_from_single_device_arrays(
    shape, sharding, [mine[d] for d in sorted(mine, key=lambda d: d.id)]
  )


def _needs_gather(x, sharding) -> bool:
  """Whether ``device_put(x, sharding)`` would need a piece of ``x`` that no device holds whole.

  Such a put (a batch-sharded activation between stages of different widths, say) goes through
  host memory in newer JAX (0.12 fetches the value to the host, which ``transfer_guard`` rejects);
  gathering it on its own devices first keeps the copy device to device in every version.
  """
  if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
    return False
  if x.sharding.is_fully_replicated or len(x.sharding.device_set) == 1:
    return False
  have = {_index_key(i) for i in x.sharding.devices_indices_map(x.shape).values()}
  return any(_index_key(i) not in have for i in sharding.devices_indices_map(x.shape).values())


def _index_key(index) -> tuple:
  return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


@functools.cache
def _replicate_fn(src: NamedSharding):
  return jax.jit(lambda a: a, out_shardings=NamedSharding(src.mesh, PartitionSpec()))


def _gathered(x):
  """``x`` whole on one of its own devices (an all-gather inside its mesh, no host copy)."""
  return _replicate_fn(x.sharding)(x).addressable_shards[0].data


_IN_FLIGHT: list[list] = [[], []]


def new_send_epoch() -> None:
  """Starts a new step's list of cross-process transfers and releases the step before last's.

  A step's transfers have completed when both ends finished that step; a process cannot be
  more than one step ahead of its peers, so two steps back is safe.
  """
  _IN_FLIGHT.pop(0)
  _IN_FLIGHT.append([])


def stage_placements(
  device_groups: Sequence[Sequence[Any]],
  microbatch_size: int | Sequence[int],
  inner_shape: tuple[int, ...] = (),
  axis_names: tuple[str, ...] = ("data",),
  inner_shapes: Sequence[tuple[int, ...]] | None = None,
) -> list[StagePlacement]:
  """Placements for each stage's devices (row by row: ``rows x prod(inner_shape)`` of them);
  checks the micro-batch splits across the rows.

  ``microbatch_size``: one size for all stages, or one per stage (per-stage sizes).
  ``inner_shape``: the sizes of the axes after the first, for every stage; ``inner_shapes``:
  one such tuple per stage instead (stages that narrow the mesh, ``Stage.inner``).
  """
  sizes = (
    [microbatch_size] * len(device_groups)
    if isinstance(microbatch_size, int)
    else list(microbatch_size)
  )
  shapes = (
    [tuple(inner_shape)] * len(device_groups)
    if inner_shapes is None
    else [tuple(s) for s in inner_shapes]
  )
  out = []
  for s, (devs, b, shape) in enumerate(zip(device_groups, sizes, shapes)):
    inner = int(np.prod(shape, dtype=np.int64))
    k = len(devs) // inner
    what = "devices" if inner == 1 else f"rows of the mesh's {axis_names[0]!r} axis"
    if k > 1 and b % k:
      raise PlanError(
        f"stage {s} spans {k} {what} but a micro-batch has {b} "
        f"examples, which do not split {k} ways; use a stage width that divides "
        f"{b} or a micro-batch size divisible by {k}"
      )
    out.append(StagePlacement(tuple(devs), b, shape, tuple(axis_names)))
  return out
