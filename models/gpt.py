"""GPT-style decoder: the sequential (single-chain) transformer baseline.

Computation graph::

  tokens (batch, seq) int32 -> embed: token rows + learned positions
                            -> blocks/0 .. blocks/L-1: causal pre-LN transformer blocks
                            -> norm: LayerNorm
                            -> head: linear to vocab logits, or, with ``tie_embeddings``,
                               the transposed token embedding (no ``head`` parameters)

Parameter paths::

  embed/{tokens,positions}
  blocks/<j>/{norm1,attn/qkv,attn/out,norm2,ffn/up,ffn/down}/...
  norm/{scale,bias}
  head/kernel                           (absent when tie_embeddings)

With tied embeddings, ``embed/tokens`` is read by the first and the last layer; the layering
pass then keeps it on one owner and files the output projection in a sibling layer.

Partition specs over a mesh axis "model" (metadata only): ``embed/tokens`` vocab-parallel
``("model", None)``, ``head/kernel`` column-parallel over the vocabulary ``(None, "model")``,
the blocks Megatron-style (see ``transformer``); positions and LayerNorms replicated.

Batch: ``tokens`` int32 ``(batch, seq_len)`` and ``targets`` int32 ``(batch, seq_len)``, the
next token at every position. Loss: token cross-entropy, mean over positions and examples.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gpp_jax.models.dropout import Key, dropout, subkey
from gpp_jax.models.transformer import COLUMN, TransformerBlock, TransformerConfig, partitioned


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Sizes of a GPT-style decoder.

  Attributes:
    vocab_size: token vocabulary.
    seq_len: context length (the number of learned positions).
    hidden: model width.
    num_layers: transformer blocks.
    num_heads: attention heads (must divide ``hidden``).
    ffn: FFN inner width.
    tie_embeddings: the output head reuses the token embedding matrix.
    dropout: dropout rate (applied only when the loss is given a key).
  """

  vocab_size: int = 50304
  seq_len: int = 256
  hidden: int = 1024
  num_layers: int = 32
  num_heads: int = 16
  ffn: int = 4096
  tie_embeddings: bool = False
  dropout: float = 0.0

  def __post_init__(self):
    if self.hidden % self.num_heads:
      raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
    if self.num_layers < 1 or self.seq_len < 1 or self.vocab_size < 2:
      raise ValueError("GPTConfig needs num_layers >= 1, seq_len >= 1 and vocab_size >= 2")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")

  @classmethod
  def tiny(cls) -> GPTConfig:
    """Two 32-wide blocks over a 64-token vocabulary, for tests."""
    return cls(vocab_size=64, seq_len=16, hidden=32, num_layers=2, num_heads=4, ffn=64)

  @classmethod
  def paper(cls) -> GPTConfig:
    """The sequential transformer of GraphPipe (arXiv 2406.17145, App. A.3), "same config as
    MMT" as one chain: 32 layers (4 x 8), seq 256, hidden 1024, 16 heads, FFN 4096. The
    vocabulary (GPT-2's 50257 padded to 50304) is our choice."""
    return cls(vocab_size=50304, seq_len=256, hidden=1024, num_layers=32, num_heads=16, ffn=4096)


VOCAB = ("model", None)  # the token embedding's rows (the vocabulary) split over "model"


class Embedding(nnx.Module):
  """Token rows plus learned positions."""

  def __init__(self, vocab_size: int, seq_len: int, hidden: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    # Vocab-parallel: each device of "model" holds a block of the vocabulary's rows.
    self.tokens = nnx.Param(init(rngs.params(), (vocab_size, hidden)), **partitioned(VOCAB))
    self.positions = nnx.Param(init(rngs.params(), (seq_len, hidden)))

  def __call__(self, ids: jax.Array) -> jax.Array:
    seq = ids.shape[1]
    if seq > self.positions.shape[0]:
      raise ValueError(
        f"sequence length {seq} exceeds the {self.positions.shape[0]} learned "
        "positions; raise GPTConfig.seq_len"
      )
    return jnp.take(self.tokens[...], ids, axis=0) + self.positions[...][:seq]

  def attend(self, x: jax.Array) -> jax.Array:
    """Logits against the token rows: ``x @ tokens.T`` (the tied output head)."""
    return x @ self.tokens[...].T


class GPT(nnx.Module):
  """Causal language model; see the module docstring for the graph."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = Embedding(config.vocab_size, config.seq_len, config.hidden, rngs=rngs)
    self.blocks = nnx.List(
      [
        TransformerBlock(
          TransformerConfig(
            config.hidden, config.num_heads, config.ffn, causal=True, dropout_rate=config.dropout
          ),
          rngs=rngs,
        )
        for _ in range(config.num_layers)
      ]
    )
    self.norm = nnx.LayerNorm(config.hidden, rngs=rngs)
    if config.tie_embeddings:
      self.head = None
    else:
      self.head = nnx.Linear(
        config.hidden,
        config.vocab_size,
        use_bias=False,
        rngs=rngs,
        kernel_init=nnx.initializers.normal(0.02),
        kernel_metadata=partitioned(COLUMN),  # the vocabulary's logits split over "model"
      )

  def __call__(self, tokens: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    """``(batch, seq)`` token ids -> logits ``(batch, seq, vocab)``."""
    x = dropout(self.embed(tokens), self.config.dropout, subkey(dropout_key, 0))
    for j, block in enumerate(self.blocks):
      x = block(x, dropout_key=subkey(dropout_key, 1 + j))
    x = self.norm(x)
    return self.embed.attend(x) if self.head is None else self.head(x)


def make_model(config: GPTConfig, rngs: nnx.Rngs) -> GPT:
  """Builds a GPT with parameters drawn from ``rngs``."""
  return GPT(config, rngs=rngs)


def forward(model: GPT, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Logits ``(batch, seq, vocab)`` for a batch."""
  return model(batch["tokens"], dropout_key=dropout_key)


def loss_fn(model: GPT, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Next-token cross-entropy, mean over positions and examples."""
  logits = forward(model, batch, dropout_key)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def synthetic_batch(config: GPTConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
  """Uniform random token streams, split into inputs and next-token targets."""
  stream = jax.random.randint(
    key, (batch_size, config.seq_len + 1), 0, config.vocab_size, dtype=jnp.int32
  )
  return {"tokens": stream[:, :-1], "targets": stream[:, 1:]}
