"""Dropout driven by an explicit PRNG key.

The models keep no ``nnx.Rngs`` and mutate no state in the forward pass: the caller passes a
key (or None for the deterministic forward), and each dropout site derives its own key with
``jax.random.fold_in``. The forward is therefore a pure function of (parameters, batch, key),
which is what a pipeline that traces the loss and replays it per micro-batch needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Key = jax.Array | None


def subkey(key: Key, index: int) -> Key:
  """The key of sub-site ``index`` of ``key``; None stays None (no dropout)."""
  return None if key is None else jax.random.fold_in(key, index)


def dropout(x: jax.Array, rate: float, key: Key) -> jax.Array:
  """Inverted dropout: zeroes a fraction ``rate`` of ``x`` and rescales the rest.

  Identity when ``rate == 0`` or ``key is None`` (the deterministic forward).
  """
  if key is None or rate == 0.0:
    return x
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate must lie in [0, 1), got {rate}")
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
