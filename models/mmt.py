"""Multi-modal transformer (MMT): parallel transformer-encoder branches, one per modality.

Computation graph (``N`` branches)::

  features_i (batch, seq_i, feat_i) -> branches/i: input projection + positions
                                         -> L pre-LN transformer blocks -> LayerNorm
                                         -> mean over the sequence      (batch, hidden)
  concat over i (batch, N * hidden) -> head: MLP -> logits (batch, num_classes)

The branches share nothing and meet only at the concatenation, so their parameters live
under ``branches/<i>/...`` and every equation of branch ``i`` reads only ``features_<i>``
and parameters under ``branches/<i>``. The concatenation is filed under the head's first
layer (see ``merge_scope``). Parameter paths::

  branches/<i>/input/{kernel,bias,position}
  branches/<i>/layers/<j>/{norm1,attn/qkv,attn/out,norm2,ffn/up,ffn/down}/...
  branches/<i>/norm/{scale,bias}
  head/layers/<k>/{kernel,bias}

Partition specs over a mesh axis "model" (metadata only): the blocks of every branch are
Megatron-style (``attn/qkv``, ``ffn/up`` column-parallel, ``attn/out``, ``ffn/down``
row-parallel; see ``transformer``); input embeddings, LayerNorms and the head replicated.

Batch: ``features_<i>`` float32 ``(batch, seq_i, feat_i)`` and ``labels`` int32 ``(batch,)``.
Loss: softmax cross-entropy, mean over examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gpp_jax.models.branch_sizes import per_branch
from gpp_jax.models.dropout import Key, dropout, subkey
from gpp_jax.models.merge_scope import merge_scope
from gpp_jax.models.mlp import MLP
from gpp_jax.models.transformer import TransformerBlock, TransformerConfig


@dataclasses.dataclass(frozen=True)
class MMTConfig:
  """Sizes of a multi-modal transformer.

  Attributes:
    num_branches: number of modalities (parallel encoder branches).
    feature_dims: input feature size of each modality (one int for all, or one per branch).
    seq_lens: sequence length of each modality (one int for all, or one per branch).
    hidden: model width of every branch.
    num_layers: transformer blocks per branch.
    num_heads: attention heads (must divide ``hidden``).
    ffn: FFN inner width.
    head_dims: hidden widths of the classification MLP after the concatenation.
    num_classes: output classes.
    dropout: dropout rate (applied only when the loss is given a key).
  """

  num_branches: int = 4
  feature_dims: int | tuple[int, ...] = 1024
  seq_lens: int | tuple[int, ...] = 256
  hidden: int = 1024
  num_layers: int = 8
  num_heads: int = 16
  ffn: int = 4096
  head_dims: tuple[int, ...] = (1024,)
  num_classes: int = 1000
  dropout: float = 0.0

  def __post_init__(self):
    if self.num_branches < 1:
      raise ValueError(f"num_branches must be >= 1, got {self.num_branches}")
    per_branch("feature_dims", self.feature_dims, self.num_branches)
    per_branch("seq_lens", self.seq_lens, self.num_branches)
    if self.hidden % self.num_heads:
      raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")

  @property
  def branch_feature_dims(self) -> tuple[int, ...]:
    """Input feature size of each branch."""
    return per_branch("feature_dims", self.feature_dims, self.num_branches)

  @property
  def branch_seq_lens(self) -> tuple[int, ...]:
    """Sequence length of each branch."""
    return per_branch("seq_lens", self.seq_lens, self.num_branches)

  @classmethod
  def tiny(cls) -> MMTConfig:
    """Three one-layer branches of different feature sizes and lengths, for tests."""
    return cls(
      num_branches=3,
      feature_dims=(6, 10, 4),
      seq_lens=(8, 5, 8),
      hidden=16,
      num_layers=1,
      num_heads=2,
      ffn=32,
      head_dims=(16,),
      num_classes=5,
    )

  @classmethod
  def paper(cls) -> MMTConfig:
    """GraphPipe (arXiv 2406.17145, App. A.2): 4 branches x 8 layers, seq 256, hidden and
    embedding 1024, 16 heads, FFN 4096. Head width and class count are not given there;
    one 1024-wide hidden layer and 1000 classes are our choice."""
    return cls(
      num_branches=4,
      feature_dims=1024,
      seq_lens=256,
      hidden=1024,
      num_layers=8,
      num_heads=16,
      ffn=4096,
      head_dims=(1024,),
      num_classes=1000,
    )


class InputEmbedding(nnx.Module):
  """Projects one modality's features to ``hidden`` and adds learned positions."""

  def __init__(self, feature_dim: int, seq_len: int, hidden: int, *, rngs: nnx.Rngs):
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (feature_dim, hidden)))
    self.bias = nnx.Param(jnp.zeros((hidden,)))
    self.position = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (seq_len, hidden)))

  def __call__(self, x: jax.Array) -> jax.Array:
    seq = self.position.shape[0]
    if x.shape[1] != seq:
      raise ValueError(
        f"input has sequence length {x.shape[1]}, the branch was built for "
        f"{seq}; set MMTConfig.seq_lens to match the data"
      )
    return x @ self.kernel[...] + self.bias[...] + self.position[...]


class EncoderBranch(nnx.Module):
  """One modality: input embedding, ``num_layers`` blocks, final LayerNorm, mean pool."""

  def __init__(self, feature_dim: int, seq_len: int, config: MMTConfig, *, rngs: nnx.Rngs):
    self.dropout_rate = config.dropout
    self.input = InputEmbedding(feature_dim, seq_len, config.hidden, rngs=rngs)
    block = TransformerConfig(
      config.hidden, config.num_heads, config.ffn, dropout_rate=config.dropout
    )
    self.layers = nnx.List([TransformerBlock(block, rngs=rngs) for _ in range(config.num_layers)])
    self.norm = nnx.LayerNorm(config.hidden, rngs=rngs)

  def __call__(self, x: jax.Array, *, dropout_key: Key = None) -> jax.Array:
    """``(batch, seq, feat)`` -> pooled ``(batch, hidden)``."""
    x = dropout(self.input(x), self.dropout_rate, subkey(dropout_key, 0))
    for j, layer in enumerate(self.layers):
      x = layer(x, dropout_key=subkey(dropout_key, 1 + j))
    return jnp.mean(self.norm(x), axis=1)


class MMT(nnx.Module):
  """Multi-modal transformer classifier; see the module docstring for the graph."""

  def __init__(self, config: MMTConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.branches = nnx.List(
      [
        EncoderBranch(f, s, config, rngs=rngs)
        for f, s in zip(config.branch_feature_dims, config.branch_seq_lens)
      ]
    )
    self.head = MLP(
      (config.num_branches * config.hidden, *config.head_dims, config.num_classes),
      rngs=rngs,
      activation=jax.nn.gelu,
      dropout_rate=config.dropout,
    )

  def branch_outputs(
    self, features: Sequence[jax.Array], *, dropout_key: Key = None
  ) -> list[jax.Array]:
    """Each branch's pooled output ``(batch, hidden)``, before the concatenation."""
    if len(features) != len(self.branches):
      raise ValueError(f"got {len(features)} feature arrays for {len(self.branches)} branches")
    return [
      branch(x, dropout_key=subkey(dropout_key, i))
      for i, (branch, x) in enumerate(zip(self.branches, features))
    ]

  def __call__(self, features: Sequence[jax.Array], *, dropout_key: Key = None) -> jax.Array:
    """Per-modality features -> logits ``(batch, num_classes)``."""
    pooled = self.branch_outputs(features, dropout_key=dropout_key)
    with merge_scope("head/layers/0"):
      merged = jnp.concatenate(pooled, axis=-1)
    return self.head(merged, dropout_key=subkey(dropout_key, len(self.branches)))


def make_model(config: MMTConfig, rngs: nnx.Rngs) -> MMT:
  """Builds an MMT with parameters drawn from ``rngs``."""
  return MMT(config, rngs=rngs)


def features_of(batch: dict[str, jax.Array], config: MMTConfig) -> list[jax.Array]:
  """The per-branch inputs ``features_0 .. features_{N-1}`` of a batch."""
  return [batch[f"features_{i}"] for i in range(config.num_branches)]


def forward(model: MMT, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Logits ``(batch, num_classes)`` for a batch."""
  return model(features_of(batch, model.config), dropout_key=dropout_key)


def loss_fn(model: MMT, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Softmax cross-entropy, mean over examples. Dropout only when ``dropout_key`` is given."""
  logits = forward(model, batch, dropout_key)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def synthetic_batch(config: MMTConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
  """Standard-normal features per modality and uniform class labels."""
  keys = jax.random.split(key, config.num_branches + 1)
  batch = {
    f"features_{i}": jax.random.normal(keys[i], (batch_size, s, f), jnp.float32)
    for i, (f, s) in enumerate(zip(config.branch_feature_dims, config.branch_seq_lens))
  }
  batch["labels"] = jax.random.randint(
    keys[-1], (batch_size,), 0, config.num_classes, dtype=jnp.int32
  )
  return batch
