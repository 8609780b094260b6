"""CANDLE-Uno: parallel dense feature branches, concatenated, then a dense regression head.

Computation graph (``N`` branches)::

  features_i (batch, feat_i) float32 -> branches/i: MLP (branch_layers at branch_width, ReLU)
  concat over i (batch, N * branch_width) -> head: MLP (head_layers at head_width, ReLU)
                                             -> 1 output (the response, e.g. growth)

The branches share nothing until the concatenation, which is filed under the head's first
layer (see ``merge_scope``). Parameter paths::

  branches/<i>/layers/<j>/{kernel,bias}
  head/layers/<k>/{kernel,bias}

Batch: ``features_<i>`` float32 ``(batch, feat_i)`` and ``targets`` float32 ``(batch,)``.
Loss: mean squared error, mean over examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gpp_jax.models.branch_sizes import per_branch
from gpp_jax.models.dropout import Key, subkey
from gpp_jax.models.merge_scope import merge_scope
from gpp_jax.models.mlp import MLP

# Feature sizes of the Uno benchmark's inputs (dose1, dose2, cell.rnaseq, drug1.descriptors,
# drug2.descriptors, drug1.fingerprints, drug2.fingerprints), as in FlexFlow's candle_uno.cc.
UNO_FEATURE_DIMS = (1, 1, 942, 5270, 5270, 2048, 2048)


@dataclasses.dataclass(frozen=True)
class CandleUnoConfig:
  """Sizes of a CANDLE-Uno style multi-branch regressor.

  Attributes:
    num_branches: feature branches.
    feature_dims: input width of each branch (one int for all, or one per branch).
    branch_layers: dense layers per branch.
    branch_width: width of the branch layers.
    head_layers: hidden dense layers of the head (a final 1-unit layer follows).
    head_width: width of those layers.
    dropout: dropout rate after every hidden activation (applied only with a loss key).
  """

  num_branches: int = 7
  feature_dims: int | tuple[int, ...] = UNO_FEATURE_DIMS
  branch_layers: int = 4
  branch_width: int = 4096
  head_layers: int = 4
  head_width: int = 4096
  dropout: float = 0.0

  def __post_init__(self):
    if self.num_branches < 1 or self.branch_layers < 1:
      raise ValueError(
        "CANDLE-Uno needs at least one branch of at least one layer, got "
        f"num_branches={self.num_branches}, branch_layers={self.branch_layers}"
      )
    per_branch("feature_dims", self.feature_dims, self.num_branches)
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")

  @property
  def branch_feature_dims(self) -> tuple[int, ...]:
    """Input width of each branch."""
    return per_branch("feature_dims", self.feature_dims, self.num_branches)

  @classmethod
  def tiny(cls) -> CandleUnoConfig:
    """Three branches of different input widths and two 16-unit layers, for tests."""
    return cls(
      num_branches=3,
      feature_dims=(5, 7, 3),
      branch_layers=2,
      branch_width=16,
      head_layers=2,
      head_width=16,
    )

  @classmethod
  def paper(cls) -> CandleUnoConfig:
    """GraphPipe (arXiv 2406.17145, App. A.2): 7 branches x 4 FF layers at 4096. The input
    widths (the 7 Uno inputs) and a 4-layer 4096-wide head are taken from FlexFlow's
    CANDLE-Uno example, which the paper does not restate."""
    return cls(
      num_branches=7,
      feature_dims=UNO_FEATURE_DIMS,
      branch_layers=4,
      branch_width=4096,
      head_layers=4,
      head_width=4096,
    )


class CandleUno(nnx.Module):
  """Multi-branch regressor; see the module docstring for the graph."""

  def __init__(self, config: CandleUnoConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.branches = nnx.List(
      [
        MLP(
          (f, *[config.branch_width] * config.branch_layers),
          rngs=rngs,
          activate_last=True,
          dropout_rate=config.dropout,
        )
        for f in config.branch_feature_dims
      ]
    )
    self.head = MLP(
      (config.num_branches * config.branch_width, *[config.head_width] * config.head_layers, 1),
      rngs=rngs,
      dropout_rate=config.dropout,
    )

  def branch_outputs(
    self, features: Sequence[jax.Array], *, dropout_key: Key = None
  ) -> list[jax.Array]:
    """Each branch's output ``(batch, branch_width)``, before the concatenation."""
    if len(features) != len(self.branches):
      raise ValueError(f"got {len(features)} feature arrays for {len(self.branches)} branches")
    return [
      branch(x, dropout_key=subkey(dropout_key, i))
      for i, (branch, x) in enumerate(zip(self.branches, features))
    ]

  def __call__(self, features: Sequence[jax.Array], *, dropout_key: Key = None) -> jax.Array:
    """Per-branch features -> predictions ``(batch,)``."""
    outs = self.branch_outputs(features, dropout_key=dropout_key)
    with merge_scope("head/layers/0"):
      merged = jnp.concatenate(outs, axis=-1)
    return self.head(merged, dropout_key=subkey(dropout_key, len(self.branches)))[:, 0]


def make_model(config: CandleUnoConfig, rngs: nnx.Rngs) -> CandleUno:
  """Builds a CANDLE-Uno model with parameters drawn from ``rngs``."""
  return CandleUno(config, rngs=rngs)


def features_of(batch: dict[str, jax.Array], config: CandleUnoConfig) -> list[jax.Array]:
  """The per-branch inputs ``features_0 .. features_{N-1}`` of a batch."""
  return [batch[f"features_{i}"] for i in range(config.num_branches)]


def forward(model: CandleUno, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Predictions ``(batch,)`` for a batch."""
  return model(features_of(batch, model.config), dropout_key=dropout_key)


def loss_fn(model: CandleUno, batch: dict[str, jax.Array], dropout_key: Key = None) -> jax.Array:
  """Mean squared error, mean over examples."""
  return jnp.mean((forward(model, batch, dropout_key) - batch["targets"]) ** 2)


def synthetic_batch(
  config: CandleUnoConfig, batch_size: int, key: jax.Array
) -> dict[str, jax.Array]:
  """Standard-normal features; targets a fixed smooth function of them plus noise."""
  keys = jax.random.split(key, 2 * config.num_branches + 1)
  batch, signal = {}, jnp.zeros((batch_size,))
  for i, f in enumerate(config.branch_feature_dims):
    x = jax.random.normal(keys[i], (batch_size, f), jnp.float32)
    w = jax.random.normal(keys[config.num_branches + i], (f,)) / jnp.sqrt(f)
    batch[f"features_{i}"] = x
    signal = signal + jnp.tanh(x @ w)
  noise = 0.1 * jax.random.normal(keys[-1], (batch_size,))
  batch["targets"] = (signal / jnp.sqrt(config.num_branches) + noise).astype(jnp.float32)
  return batch
