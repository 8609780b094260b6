"""Training set-up for the model-zoo models: model, optimizer, step function, data."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx

import gpp_jax


@dataclasses.dataclass
class ZooRun:
  spec: Any
  config: Any
  model: nnx.Module
  optimizer: nnx.Optimizer
  train_step: Callable
  seed: int

  def batches(self, batch_size: int, count: int) -> list[dict]:
    """``count`` distinct synthetic batches (host arrays), cycled by the training loop."""
    keys = jax.random.split(jax.random.key(self.seed + 1), count)
    return [jax.tree.map(np.asarray, self.spec.synthetic_batch(self.config, batch_size, k))
            for k in keys]


def setup(model_name: str, preset: str = "tiny", *, seed: int = 0, learning_rate: float = 1e-3,
          clip_norm: float = 1.0, **overrides) -> ZooRun:
  """A zoo model with AdamW (and global-norm clipping) and an NNX-style train step.

  The step is written the way the NNX docs write one, with ``gpp_jax.value_and_grad``; undecorated
  it runs on one device, decorated with ``graph_pipeline`` it runs pipelined.
  """
  from gpp_jax.models.registry import get_model

  spec = get_model(model_name)
  config = spec.preset(preset, **overrides)
  model = spec.make_model(config, nnx.Rngs(seed))
  chain = [optax.clip_by_global_norm(clip_norm)] if clip_norm > 0 else []
  optimizer = nnx.Optimizer(model, optax.chain(*chain, optax.adamw(learning_rate)), wrt=nnx.Param)

  def train_step(model, optimizer, batch):
    loss, grads = gpp_jax.value_and_grad(lambda m: spec.loss_fn(m, batch))(model)
    optimizer.update(model, grads)
    return loss

  return ZooRun(spec, config, model, optimizer, train_step, seed)
