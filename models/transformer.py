"""Pre-LN transformer block (multi-head self-attention + FFN), shared by MMT and GPT.

Module tree of one block, as parameter paths relative to the block::

  norm1/{scale,bias}  attn/qkv/{kernel,bias}  attn/out/{kernel,bias}
  norm2/{scale,bias}  ffn/up/{kernel,bias}    ffn/down/{kernel,bias}

The attention is written out (one fused QKV projection, scaled dot products, softmax,
output projection) rather than taken from ``nnx.MultiHeadAttention`` so that it keeps no
RNG streams or caches and dropout takes an explicit key.

Megatron-style partition specs over a mesh axis "model" (metadata only, see ``partitioned``):
``attn/qkv`` and ``ffn/up`` are column-parallel (kernel ``(None, "model")``, bias
``("model",)``), ``attn/out`` and ``ffn/down`` row-parallel (kernel ``("model", None)``, bias
replicated), the LayerNorms replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gpp_jax.models.dropout import Key, dropout, subkey

# Megatron-style tensor parallelism over the mesh axis "model".
COLUMN = (None, "model")  # kernel (in, out): the output features split
ROW = ("model", None)  # kernel (in, out): the input features split
SPLIT_BIAS = ("model",)  # the bias of a column-parallel layer
REPLICATED = (None,)  # the bias of a row-parallel layer


def partitioned(spec: tuple[str | None, ...]) -> dict[str, Any]:
  """Variable metadata for the partition spec ``spec``, as metadata only: the value is not
  placed (``eager_sharding=False``), so the model builds the same with or without a mesh."""
  return {"out_sharding": spec, "eager_sharding": False}


def linear(in_features: int, out_features: int, *, rngs: nnx.Rngs, column: bool) -> nnx.Linear:
  """``nnx.Linear`` with its default initialisers (the same draws), annotated
  column-parallel (``column``) or row-parallel over "model"."""
  return nnx.Linear(
    in_features,
    out_features,
    rngs=rngs,
    kernel_metadata=partitioned(COLUMN if column else ROW),
    bias_metadata=partitioned(SPLIT_BIAS if column else REPLICATED),
  )


class SelfAttention(nnx.Module):
  """Multi-head self-attention over ``(batch, seq, hidden)``, optionally causal."""

  def __init__(
    self,
    hidden: int,
    num_heads: int,
    *,
    rngs: nnx.Rngs,
    causal: bool = False,
    dropout_rate: float = 0.0,
  ):
    if hidden % num_heads:
      raise ValueError(
        f"hidden={hidden} is not divisible by num_heads={num_heads}; "
        "choose a head count that divides the hidden size"
      )
    self.num_heads = num_heads
    self.causal = causal
    self.dropout_rate = dropout_rate
    # qkv's output features are (3, heads, head_dim) flattened, so a column split over
    # "model" gives each device a contiguous block of them (whole heads only when "model" is
    # 1); the values are the same, GSPMD reshards what the attention needs.
    self.qkv = linear(hidden, 3 * hidden, rngs=rngs, column=True)
    self.out = linear(hidden, hidden, rngs=rngs, column=False)

  def __call__(self, x: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    b, s, h = x.shape
    d = h // self.num_heads
    qkv = self.qkv(x).reshape(b, s, 3, self.num_heads, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each (b, s, heads, d)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if self.causal:
      mask = jnp.tril(jnp.ones((s, s), dtype=bool))
      scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = dropout(jax.nn.softmax(scores, axis=-1), self.dropout_rate, subkey(dropout_key, 0))
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h)
    return dropout(self.out(ctx), self.dropout_rate, subkey(dropout_key, 1))


class FeedForward(nnx.Module):
  """Position-wise FFN ``hidden -> ffn (GELU) -> hidden``."""

  def __init__(self, hidden: int, ffn: int, *, rngs: nnx.Rngs, dropout_rate: float = 0.0):
    self.dropout_rate = dropout_rate
    self.up = linear(hidden, ffn, rngs=rngs, column=True)
    self.down = linear(ffn, hidden, rngs=rngs, column=False)

  def __call__(self, x: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    return dropout(self.down(jax.nn.gelu(self.up(x))), self.dropout_rate, dropout_key)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """One block's shape: width ``hidden``, ``num_heads`` attention heads (causal or not), an
  FFN of width ``ffn``, and its dropout rate."""

  hidden: int
  num_heads: int
  ffn: int
  causal: bool = False
  dropout_rate: float = 0.0


class TransformerBlock(nnx.Module):
  """Pre-LN block: ``x + attn(norm1(x))`` then ``x + ffn(norm2(x))``."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    c = config
    self.norm1 = nnx.LayerNorm(c.hidden, rngs=rngs)
    self.attn = SelfAttention(
      c.hidden, c.num_heads, rngs=rngs, causal=c.causal, dropout_rate=c.dropout_rate
    )
    self.norm2 = nnx.LayerNorm(c.hidden, rngs=rngs)
    self.ffn = FeedForward(c.hidden, c.ffn, rngs=rngs, dropout_rate=c.dropout_rate)

  def __call__(self, x: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    x = x + self.attn(self.norm1(x), dropout_key=subkey(dropout_key, 0))
    return x + self.ffn(self.norm2(x), dropout_key=subkey(dropout_key, 1))
