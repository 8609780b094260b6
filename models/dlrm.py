"""DLRM with several dense-feature branches and embedding-bag branches.

Computation graph (``D`` dense branches, ``S`` sparse branches)::

  dense_i  (batch, dense_dim_i) float32 -> dense/i: MLP (dense_layers at dense_width, ReLU)
                                           + linear projection to interaction_dim
  sparse_i (batch, bag_size) int32      -> sparse/i: embedding-bag lookup, combine the bag
                                           (sum / mean / concat), projection to
                                           interaction_dim if the sizes differ
  interaction: the D + S projected vectors z_k; features = [z_0 .. z_{D-1}] (the dense
               outputs) ++ [<z_a, z_b> for a < b]            (no parameters)
  top: MLP (top_layers at top_width, ReLU) -> 1 logit

The branches share nothing until the interaction, which is filed under the top MLP's first
layer (see ``merge_scope``). Parameter paths::

  dense/<i>/layers/<j>/{kernel,bias}     (the last layer is the projection)
  sparse/<i>/table                       (num_embeddings, embedding_dim)
  sparse/<i>/proj/{kernel,bias}          (only when the bag output size != interaction_dim)
  top/layers/<k>/{kernel,bias}

Batch: ``dense_<i>`` float32 ``(batch, dense_dim_i)``, ``sparse_<i>`` int32
``(batch, bag_size)`` with ids in ``[0, num_embeddings_i)``, ``labels`` float32 ``(batch,)``
in {0, 1}. Loss: sigmoid binary cross-entropy, mean over examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gpp_jax.models.branch_sizes import per_branch
from gpp_jax.models.dropout import Key, subkey
from gpp_jax.models.merge_scope import merge_scope
from gpp_jax.models.mlp import MLP

BAG_COMBINES = ("sum", "mean", "concat")


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
  """Sizes of a multi-branch DLRM.

  Attributes:
    num_dense_branches: dense-feature branches.
    dense_dims: input width of each dense branch (one int for all, or one per branch).
    dense_layers: hidden dense layers per dense branch (before the projection).
    dense_width: width of those layers.
    num_sparse_branches: embedding-bag branches (one table each).
    num_embeddings: rows of each table (one int for all, or one per branch).
    embedding_dim: columns of every table.
    bag_size: ids looked up per example and table.
    bag_combine: how a bag's rows become one vector: "sum", "mean" or "concat".
    interaction_dim: common size every branch is projected to before the dot products.
    top_layers: hidden dense layers of the top MLP.
    top_width: width of those layers.
    dropout: dropout rate of the MLPs (applied only when the loss is given a key).
  """

  num_dense_branches: int = 7
  dense_dims: int | tuple[int, ...] = 13
  dense_layers: int = 4
  dense_width: int = 4096
  num_sparse_branches: int = 7
  num_embeddings: int | tuple[int, ...] = 1_000_000
  embedding_dim: int = 64
  bag_size: int = 100
  bag_combine: str = "sum"
  interaction_dim: int = 64
  top_layers: int = 4
  top_width: int = 4096
  dropout: float = 0.0

  def __post_init__(self):
    if self.num_dense_branches < 1:
      raise ValueError("DLRM needs at least one dense branch (its output feeds the top MLP)")
    if self.num_dense_branches + self.num_sparse_branches < 2:
      raise ValueError("the interaction needs at least two branches")
    per_branch("dense_dims", self.dense_dims, self.num_dense_branches)
    per_branch("num_embeddings", self.num_embeddings, self.num_sparse_branches)
    if self.bag_combine not in BAG_COMBINES:
      raise ValueError(f"bag_combine={self.bag_combine!r}; choose one of {BAG_COMBINES}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")

  @property
  def branch_dense_dims(self) -> tuple[int, ...]:
    """Input width of each dense branch."""
    return per_branch("dense_dims", self.dense_dims, self.num_dense_branches)

  @property
  def branch_num_embeddings(self) -> tuple[int, ...]:
    """Table rows of each sparse branch."""
    return per_branch("num_embeddings", self.num_embeddings, self.num_sparse_branches)

  @property
  def bag_output_dim(self) -> int:
    """Size of a combined bag before any projection."""
    return self.embedding_dim * (self.bag_size if self.bag_combine == "concat" else 1)

  @property
  def num_interaction_features(self) -> int:
    """Width of the top MLP's input: dense outputs plus one dot product per branch pair."""
    n = self.num_dense_branches + self.num_sparse_branches
    return self.num_dense_branches * self.interaction_dim + n * (n - 1) // 2

  @classmethod
  def tiny(cls) -> DLRMConfig:
    """Two dense and three sparse branches of a few units each, for tests."""
    return cls(
      num_dense_branches=2,
      dense_dims=(5, 3),
      dense_layers=2,
      dense_width=16,
      num_sparse_branches=3,
      num_embeddings=(50, 20, 30),
      embedding_dim=8,
      bag_size=4,
      bag_combine="sum",
      interaction_dim=8,
      top_layers=2,
      top_width=16,
    )

  @classmethod
  def paper(cls) -> DLRMConfig:
    """GraphPipe (arXiv 2406.17145, App. A.2): 7 dense branches of 4 FF layers at 4096,
    7 embedding bags (dim 64, bag 100, 1M rows), top MLP at 4096. Not given there and chosen
    here: 13 dense inputs per branch (Criteo's dense feature count), sum-combined bags,
    interaction at the embedding size 64, 4 top layers."""
    return cls(
      num_dense_branches=7,
      dense_dims=13,
      dense_layers=4,
      dense_width=4096,
      num_sparse_branches=7,
      num_embeddings=1_000_000,
      embedding_dim=64,
      bag_size=100,
      bag_combine="sum",
      interaction_dim=64,
      top_layers=4,
      top_width=4096,
    )


class EmbeddingBag(nnx.Module):
  """One table: looks up a bag of ids per example and combines the rows."""

  def __init__(self, num_embeddings: int, config: DLRMConfig, *, rngs: nnx.Rngs):
    self.combine = config.bag_combine
    dim = config.embedding_dim
    self.table = nnx.Param(
      jax.random.uniform(rngs.params(), (num_embeddings, dim), minval=-1.0, maxval=1.0)
      / jnp.sqrt(dim)
    )
    self.proj: nnx.Linear | None
    if config.bag_output_dim != config.interaction_dim:
      self.proj = nnx.Linear(config.bag_output_dim, config.interaction_dim, rngs=rngs)
    else:
      self.proj = None

  def __call__(self, ids: jax.Array) -> jax.Array:
    """``(batch, bag)`` int ids -> ``(batch, interaction_dim)``."""
    rows = jnp.take(self.table[...], ids, axis=0)  # (batch, bag, dim)
    if self.combine == "sum":
      out = rows.sum(axis=1)
    elif self.combine == "mean":
      out = rows.mean(axis=1)
    else:
      out = rows.reshape(rows.shape[0], -1)
    return out if self.proj is None else self.proj(out)


def interaction(dense: Sequence[jax.Array], sparse: Sequence[jax.Array]) -> jax.Array:
  """DLRM's feature interaction: the dense outputs concatenated with all pairwise dots.

  Every input is ``(batch, d)`` with a common ``d``; the result is
  ``(batch, len(dense) * d + n * (n - 1) / 2)`` with ``n = len(dense) + len(sparse)``.
  """
  z = jnp.stack([*dense, *sparse], axis=1)  # (batch, n, d)
  dots = jnp.einsum("bnd,bmd->bnm", z, z)
  a, b = np.triu_indices(z.shape[1], k=1)  # static pair indices
  return jnp.concatenate([*dense, dots[:, a, b]], axis=-1)


class DLRM(nnx.Module):
  """Multi-branch DLRM; see the module docstring for the graph."""

  def __init__(self, config: DLRMConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.dense = nnx.List(
      [
        MLP(
          (d, *[config.dense_width] * config.dense_layers, config.interaction_dim),
          rngs=rngs,
          dropout_rate=config.dropout,
        )
        for d in config.branch_dense_dims
      ]
    )
    self.sparse = nnx.List(
      [EmbeddingBag(n, config, rngs=rngs) for n in config.branch_num_embeddings]
    )
    self.top = MLP(
      (config.num_interaction_features, *[config.top_width] * config.top_layers, 1),
      rngs=rngs,
      dropout_rate=config.dropout,
    )

  def branch_outputs(
    self, dense: Sequence[jax.Array], sparse: Sequence[jax.Array], *, dropout_key: Key = None
  ) -> tuple[list[jax.Array], list[jax.Array]]:
    """The projected outputs of the dense and the sparse branches, before the interaction."""
    if len(dense) != len(self.dense) or len(sparse) != len(self.sparse):
      raise ValueError(
        f"got {len(dense)} dense and {len(sparse)} sparse inputs for "
        f"{len(self.dense)} dense and {len(self.sparse)} sparse branches"
      )
    d = [
      m(x, dropout_key=subkey(dropout_key, i)) for i, (m, x) in enumerate(zip(self.dense, dense))
    ]
    s = [m(ids) for m, ids in zip(self.sparse, sparse)]
    return d, s

  def __call__(
    self, dense: Sequence[jax.Array], sparse: Sequence[jax.Array], *, dropout_key: Key = None
  ) -> jax.Array:
    """Dense features and id bags -> click logits ``(batch,)``."""
    d, s = self.branch_outputs(dense, sparse, dropout_key=dropout_key)
    with merge_scope("top/layers/0"):
      features = interaction(d, s)
    return self.top(features, dropout_key=subkey(dropout_key, len(self.dense)))[:, 0]


def make_model(config: DLRMConfig, rngs: nnx.Rngs) -> DLRM:
  """Builds a DLRM with parameters drawn from ``rngs``."""
  return DLRM(config, rngs=rngs)


def inputs_of(
  batch: dict[str, jax.Array], config: DLRMConfig
) -> tuple[list[jax.Array], list[jax.Array]]:
  """The dense inputs ``dense_<i>`` and the id bags ``sparse_<i>`` of a batch."""
  return (
    [batch[f"dense_{i}"] for i in range(config.num_dense_branches)],
    [batch[f"sparse_{i}"] for i in range(config.num_sparse_branches)],
  )


def forward(model: DLRM, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Click logits ``(batch,)`` for a batch."""
  dense, sparse = inputs_of(batch, model.config)
  return model(dense, sparse, dropout_key=dropout_key)


def loss_fn(model: DLRM, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Sigmoid binary cross-entropy, mean over examples."""
  logits = forward(model, batch, dropout_key)
  return optax.sigmoid_binary_cross_entropy(logits, batch["labels"]).mean()


def synthetic_batch(config: DLRMConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
  """Non-negative dense features (log1p of |3 N(0,1)|, like log-transformed counts),
  uniform ids per table, Bernoulli(0.5) click labels."""
  nd, ns = config.num_dense_branches, config.num_sparse_branches
  keys = jax.random.split(key, nd + ns + 1)
  batch = {}
  for i, d in enumerate(config.branch_dense_dims):
    batch[f"dense_{i}"] = jnp.log1p(jnp.abs(jax.random.normal(keys[i], (batch_size, d)) * 3.0))
  for i, n in enumerate(config.branch_num_embeddings):
    batch[f"sparse_{i}"] = jax.random.randint(
      keys[nd + i], (batch_size, config.bag_size), 0, n, dtype=jnp.int32
    )
  batch["labels"] = jax.random.bernoulli(keys[-1], 0.5, (batch_size,)).astype(jnp.float32)
  return batch
