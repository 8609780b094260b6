"""Small jitted array operations the executor's rules call on the devices: folding a
micro-batch index into a key, cutting a batch into its micro-batches, reshaping, summing,
averaging, adding, concatenating, stacking and unstacking."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _fold(key, m):
  return jax.random.fold_in(key, m)


@functools.partial(jax.jit, static_argnums=1)
def _split_on_device(x, M):
  return jnp.split(x, M)


def _split_batch(x, M: int) -> list[Any]:
  """A batch array cut into M contiguous micro-batches: a device array on its device (no round
  trip through the host), host data on the host."""
  if isinstance(x, jax.Array) and x.is_fully_addressable and len(x.sharding.device_set) == 1:
    return list(_split_on_device(x, M))
  return np.split(np.asarray(jax.device_get(x)), M)


@functools.partial(jax.jit, static_argnums=1)
def _reshape(x, shape):
  return x.reshape(shape)


@jax.jit
def _mean(xs):
  return sum(xs[1:], xs[0]) / len(xs)


@jax.jit
def _sum(xs):
  return sum(xs[1:], xs[0])


@jax.jit
def _concat(xs):
  return jnp.concatenate(xs, axis=0)


@jax.jit
def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


@jax.jit
def _unstack(x):
  return list(x)


@jax.jit
def _stack(xs):
  return jnp.stack(xs)
