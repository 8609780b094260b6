"""The model zoo by name: one ``ModelSpec`` per model, and its presets.

``MODELS`` maps "mmt", "dlrm", "candle_uno" and "gpt" to a ``ModelSpec``. A spec bundles the
config class, a constructor, a pure loss and a synthetic batch generator::

  spec = MODELS["dlrm"]
  config = spec.preset("tiny")                       # or "paper"
  model = spec.make_model(config, nnx.Rngs(0))
  batch = spec.synthetic_batch(config, 16, jax.random.key(0))
  loss = spec.loss_fn(model, batch)                  # scalar, mean over examples

``loss_fn(model, batch, dropout_key=None)`` reads only its arguments; without a key it is
the deterministic (dropout-free) forward. Models hold only ``nnx.Param`` state.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
from flax import nnx

from gpp_jax.models import candle_uno, dlrm, gpt, mmt

PRESETS = ("tiny", "paper")

Batch = dict[str, jax.Array]


class _ShapeOnlyKeys:
  """Stands in for ``nnx.Rngs`` when only parameter shapes matter.

  ``params()``, the one stream the zoo's modules draw from, folds a Python counter into a
  fixed key. ``nnx.Rngs`` would instead write a traced count into an ``nnx.Variable`` at
  every draw, and under ``nnx.eval_shape`` each such write makes JAX build a diagnostic
  message, which makes the abstract construction of the deep presets (32 transformer
  blocks) about five times slower.
  """

  def __init__(self):
    self._key = jax.random.key(0)
    self._count = 0

  def params(self) -> jax.Array:
    self._count += 1
    return jax.random.fold_in(self._key, self._count)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What the zoo knows about one model.

  Attributes:
    name: registry key.
    config_cls: the frozen config dataclass; has ``tiny()`` and ``paper()`` constructors.
    make_model: ``(config, rngs) -> nnx.Module``.
    loss_fn: ``(model, batch, dropout_key=None) -> scalar``, a mean over examples.
    forward: ``(model, batch, dropout_key=None) -> model outputs`` (logits or predictions).
    synthetic_batch: ``(config, batch_size, key) -> dict of arrays`` with a leading batch
      dimension: inputs and targets.
    layer_depth: parameter-path depth at which one layer is one transformer block or one
      dense layer (``branches/<i>/layers/<j>`` is depth 4, ``blocks/<j>`` depth 2); None
      when the full paths already are (for the layering pass's ``layer_depth``).
  """

  name: str
  config_cls: type
  make_model: Callable[[Any, nnx.Rngs], nnx.Module]
  loss_fn: Callable[..., jax.Array]
  forward: Callable[..., jax.Array]
  synthetic_batch: Callable[[Any, int, jax.Array], Batch]
  layer_depth: int | None = None

  def preset(self, name: str, **overrides: Any) -> Any:
    """The config of preset ``name`` ("tiny" or "paper"), with fields replaced by overrides."""
    if name not in PRESETS:
      raise ValueError(f"unknown preset {name!r} for model {self.name!r}; choose one of {PRESETS}")
    config = getattr(self.config_cls, name)()
    return dataclasses.replace(config, **overrides) if overrides else config

  def abstract_model(self, config: Any) -> nnx.Module:
    """The model with ``jax.ShapeDtypeStruct`` leaves instead of arrays (no allocation)."""
    try:
      # _ShapeOnlyKeys duck-types the part of nnx.Rngs the zoo's modules use.
      return nnx.eval_shape(lambda: self.make_model(config, cast(nnx.Rngs, _ShapeOnlyKeys())))
    except AttributeError:  # a module wants more of nnx.Rngs than ``params()``
      return nnx.eval_shape(lambda: self.make_model(config, nnx.Rngs(0)))

  def num_params(self, config: Any) -> int:
    """Number of parameter scalars, computed abstractly."""
    state = nnx.state(self.abstract_model(config), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


MODELS: Mapping[str, ModelSpec] = types.MappingProxyType(
  {
    "mmt": ModelSpec(
      "mmt",
      mmt.MMTConfig,
      mmt.make_model,
      mmt.loss_fn,
      mmt.forward,
      mmt.synthetic_batch,
      layer_depth=4,
    ),
    "dlrm": ModelSpec(
      "dlrm", dlrm.DLRMConfig, dlrm.make_model, dlrm.loss_fn, dlrm.forward, dlrm.synthetic_batch
    ),
    "candle_uno": ModelSpec(
      "candle_uno",
      candle_uno.CandleUnoConfig,
      candle_uno.make_model,
      candle_uno.loss_fn,
      candle_uno.forward,
      candle_uno.synthetic_batch,
    ),
    "gpt": ModelSpec(
      "gpt",
      gpt.GPTConfig,
      gpt.make_model,
      gpt.loss_fn,
      gpt.forward,
      gpt.synthetic_batch,
      layer_depth=2,
    ),
  }
)


def get_model(name: str) -> ModelSpec:
  """The spec registered as ``name``; raises with the known names otherwise."""
  try:
    return MODELS[name]
  except KeyError:
    raise ValueError(f"unknown model {name!r}; known models: {sorted(MODELS)}") from None


def get_config(name: str, preset: str = "tiny", **overrides: Any) -> Any:
  """Shorthand for ``get_model(name).preset(preset, **overrides)``."""
  return get_model(name).preset(preset, **overrides)
