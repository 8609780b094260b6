"""Where a stage's values live: one device, or a sub-mesh with the batch axis sharded."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from gpp_jax.errors import PlanError


@dataclasses.dataclass(frozen=True)
class StagePlacement:
  """Placement of one stage.

  A stage on one device keeps everything there. A stage on k devices runs as one SPMD
  computation over a 1-D mesh ``("data",)``: parameters and scalars are replicated, arrays whose
  leading dimension is the micro-batch size are sharded along it, and XLA reduces the parameter
  gradients across the k devices inside the stage's backward.
  """
  devices: tuple[Any, ...]
  microbatch_size: int

  @functools.cached_property
  def mesh(self) -> Mesh:
    return Mesh(np.array(self.devices), ("data",))

  @functools.cached_property
  def replicated(self) -> jax.sharding.Sharding:
    if len(self.devices) == 1:
      return SingleDeviceSharding(self.devices[0])
    return NamedSharding(self.mesh, PartitionSpec())

  @functools.cached_property
  def batched(self) -> jax.sharding.Sharding:
    if len(self.devices) == 1:
      return self.replicated
    return NamedSharding(self.mesh, PartitionSpec("data"))

  def for_array(self, x) -> jax.sharding.Sharding:
    """The sharding an incoming array gets: batch-sharded if it carries the micro-batch axis."""
    shape = np.shape(x) if not hasattr(x, "shape") else x.shape
    if len(self.devices) > 1 and len(shape) >= 1 and shape[0] == self.microbatch_size:
      return self.batched
    return self.replicated

  def put(self, x):
    return transfer(x, self.for_array(x))

  def __str__(self) -> str:
    return ", ".join(str(d) for d in self.devices)


def _is_remote(x) -> bool:
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def transfer(x, sharding: jax.sharding.Sharding):
  """``jax.device_put(x, sharding)``, also between processes.

  In a multi-process run every process calls this for every transfer, in the same order:
  source and destination local is a local copy; a local source and a remote destination is the
  send and a remote source with a local destination the receive of JAX's cross-host transfer;
  when neither end is local, nothing moves and a placeholder stands for the result.
  """
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x  # already there: the common case for state and parameters between steps
  if jax.process_count() > 1 and not any(d.process_index == jax.process_index()
                                         for d in sharding.device_set):
    if _is_remote(x) or not isinstance(x, jax.Array):
      aval = jax.typeof(x) if isinstance(x, jax.Array) else jax.typeof(np.asarray(x))
      return jax.make_array_from_single_device_arrays(tuple(aval.shape), sharding, [],
                                                      dtype=aval.dtype)
  return jax.device_put(x, sharding)


def stage_placements(device_groups: Sequence[Sequence[Any]], microbatch_size: int) -> list[StagePlacement]:
  """Placements for each stage's device group; checks the micro-batch splits across it."""
  out = []
  for s, devs in enumerate(device_groups):
    k = len(devs)
    if k > 1 and microbatch_size % k:
      raise PlanError(f"stage {s} spans {k} devices but a micro-batch has {microbatch_size} "
                      f"examples, which do not split {k} ways; use a stage width that divides "
                      f"{microbatch_size} or fewer micro-batches")
    out.append(StagePlacement(tuple(devs), microbatch_size))
  return out
