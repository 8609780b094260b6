"""Test configuration: 8 forced CPU devices, set before JAX initialises its backend."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_platforms", "cpu")


def pytest_collection_modifyitems(config, items):
  """Tests marked ``fuzz`` run only when asked for by ``-m`` (``pytest -m fuzz``)."""
  import pytest

  if "fuzz" in (config.option.markexpr or ""):
    return
  skip = pytest.mark.skip(reason="fuzz examples run on demand: pytest -m fuzz")
  for item in items:
    if "fuzz" in item.keywords:
      item.add_marker(skip)
