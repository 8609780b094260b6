"""Training set-up for the model-zoo models: model, optimizer, step function, data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import gpp_jax

# Medium sizes for measured runs on CPUs: the paper presets narrowed until a step of batch 256
# takes 50-500 ms on one core (``setup(name, "paper", **MEDIUM[name])``).
MEDIUM: dict[str, dict[str, Any]] = {
  "candle_uno": dict(branch_width=512, head_width=512),
  "mmt": dict(
    hidden=128, num_layers=2, num_heads=4, ffn=256, seq_lens=16, feature_dims=128, head_dims=(128,)
  ),
  "dlrm": dict(
    dense_width=512, top_width=512, num_embeddings=20_000, bag_size=16, interaction_dim=32
  ),
}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW at ``learning_rate``, after global-norm gradient clipping at ``clip_norm`` (0: no
  clipping)."""

  learning_rate: float = 1e-3
  clip_norm: float = 1.0


@dataclasses.dataclass
class ZooRun:
  spec: Any
  config: Any
  model: nnx.Module
  optimizer: nnx.Optimizer
  train_step: Callable
  seed: int
  dtype: Any = None

  def batches(self, batch_size: int, count: int) -> list[dict]:
    """``count`` distinct synthetic batches (host arrays), cycled by the training loop; float
    features are cast to the run's ``dtype`` when it has one."""
    keys = jax.random.split(jax.random.key(self.seed + 1), count)

    def host(x):
      # A copy: np.asarray of a CPU device array is a view that keeps the device buffer (on
      # the first device) alive for as long as the batch lives.
      x = np.array(x)
      return x.astype(self.dtype) if self.dtype and np.issubdtype(x.dtype, np.floating) else x

    return [jax.tree.map(host, self.spec.synthetic_batch(self.config, batch_size, k)) for k in keys]


def setup(
  model_name: str,
  preset: str = "tiny",
  *,
  seed: int = 0,
  optimizer: OptimizerConfig = OptimizerConfig(),
  dtype: Any = None,
  **overrides,
) -> ZooRun:
  """A zoo model (its ``preset`` config with ``overrides``) with AdamW (and global-norm
  clipping: ``optimizer``) and an NNX-style train step.

  The step is written the way the NNX docs write one, with ``gpp_jax.value_and_grad``; undecorated
  it runs on one device, decorated with ``graph_pipeline`` it runs pipelined. ``dtype`` (e.g.
  ``"float64"``, which needs ``jax_enable_x64``) casts the parameters and the float features.
  """
  from gpp_jax.models.registry import get_model

  if dtype is not None:
    dtype = np.dtype(dtype)
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
      raise ValueError(
        f"dtype={dtype} needs 64-bit JAX: set jax.config.update("
        "'jax_enable_x64', True) (or JAX_ENABLE_X64=1) before creating arrays"
      )
  spec = get_model(model_name)
  config = spec.preset(preset, **overrides)
  model = spec.make_model(config, nnx.Rngs(seed))
  if dtype is not None:
    params = nnx.state(model, nnx.Param)
    nnx.update(
      model,
      jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
      ),
    )
  clip = [optax.clip_by_global_norm(optimizer.clip_norm)] if optimizer.clip_norm > 0 else []
  tx = optax.chain(*clip, optax.adamw(optimizer.learning_rate))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def train_step(model, optimizer, batch):
    loss, grads = gpp_jax.value_and_grad(lambda m: spec.loss_fn(m, batch))(model)
    optimizer.update(model, grads)
    return loss

  return ZooRun(spec, config, model, opt, train_step, seed, dtype)
