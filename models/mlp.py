"""A stack of dense layers: the feature branches and heads of DLRM, CANDLE-Uno and MMT.

Each dense layer is its own ``nnx.Linear`` in ``layers``, so the parameters of layer ``j`` sit
at ``.../layers/j/kernel`` and ``.../layers/j/bias`` and the layering pass sees one layer per
dense layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from flax import nnx

from gpp_jax.models.dropout import Key, dropout, subkey


class MLP(nnx.Module):
  """Dense layers ``dims[0] -> dims[1] -> ... -> dims[-1]``.

  The activation follows every layer except the last, and also the last when
  ``activate_last``. Dropout (rate ``dropout_rate``) follows every activation, with the key
  of layer ``j`` derived as ``fold_in(key, j)``.
  """

  def __init__(
    self,
    dims: Sequence[int],
    *,
    rngs: nnx.Rngs,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
    activate_last: bool = False,
    dropout_rate: float = 0.0,
  ):
    if len(dims) < 2:
      raise ValueError(f"an MLP needs an input and at least one output width, got dims={dims}")
    self.dims = tuple(int(d) for d in dims)
    self.activation = activation
    self.activate_last = activate_last
    self.dropout_rate = dropout_rate
    self.layers = nnx.List(
      [nnx.Linear(a, b, rngs=rngs) for a, b in zip(self.dims[:-1], self.dims[1:])]
    )

  def __call__(self, x: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    last = len(self.layers) - 1
    for j, layer in enumerate(self.layers):
      x = layer(x)
      if j < last or self.activate_last:
        x = dropout(self.activation(x), self.dropout_rate, subkey(dropout_key, j))
    return x
