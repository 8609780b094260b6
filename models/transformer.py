"""Pre-LN transformer block (multi-head self-attention + FFN), shared by MMT and GPT.

Module tree of one block, as parameter paths relative to the block::

  norm1/{scale,bias}  attn/qkv/{kernel,bias}  attn/out/{kernel,bias}
  norm2/{scale,bias}  ffn/up/{kernel,bias}    ffn/down/{kernel,bias}

The attention is written out (one fused QKV projection, scaled dot products, softmax,
output projection) rather than taken from ``nnx.MultiHeadAttention`` so that it keeps no
RNG streams or caches and dropout takes an explicit key.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from gpp_jax.models.dropout import Key, dropout, subkey


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
    self.qkv = nnx.Linear(hidden, 3 * hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, hidden, rngs=rngs)

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
    self.up = nnx.Linear(hidden, ffn, rngs=rngs)
    self.down = nnx.Linear(ffn, hidden, rngs=rngs)

  def __call__(self, x: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    return dropout(self.down(jax.nn.gelu(self.up(x))), self.dropout_rate, dropout_key)


class TransformerBlock(nnx.Module):
  """Pre-LN block: ``x + attn(norm1(x))`` then ``x + ffn(norm2(x))``."""

  def __init__(
    self,
    hidden: int,
    num_heads: int,
    ffn: int,
    *,
    rngs: nnx.Rngs,
    causal: bool = False,
    dropout_rate: float = 0.0,
  ):
    self.norm1 = nnx.LayerNorm(hidden, rngs=rngs)
    self.attn = SelfAttention(
      hidden, num_heads, rngs=rngs, causal=causal, dropout_rate=dropout_rate
    )
    self.norm2 = nnx.LayerNorm(hidden, rngs=rngs)
    self.ffn = FeedForward(hidden, ffn, rngs=rngs, dropout_rate=dropout_rate)

  def __call__(self, x: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    x = x + self.attn(self.norm1(x), dropout_key=subkey(dropout_key, 0))
    return x + self.ffn(self.norm2(x), dropout_key=subkey(dropout_key, 1))
