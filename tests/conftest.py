"""Test configuration: 8 forced CPU devices, set before JAX initialises its backend, XLA's
quick compiles, and one XLA compilation cache for the run.

Compiling is most of the suite's time: the tests compile hundreds of tiny programs (every
stage of every plan, eager initialisers, references) and run each a few times. XLA's CPU
backend optimisation (LLVM's passes) makes them no faster to run at these sizes but doubles the
time to compile them, so the tests compile with ``--xla_backend_optimization_level=0``. Both
sides of every comparison (the pipelined step and its one-device reference) compile with it.
Subprocesses the tests start get these flags through ``XLA_FLAGS`` too (``harness.child_env``
keeps them where a test lets the subprocess choose its own device count).

Many tests compile the same programs (a zoo model's layers, timed for calibration; the same
tiny model under several plans; the training program in a subprocess): JAX's persistent
compilation cache, in a folder shared by the run's pytest-xdist workers and the subprocesses
the tests start, compiles each once. The folder is new for each run (no earlier run's
programs are reused) unless ``JAX_COMPILATION_CACHE_DIR`` names one.
"""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pytest-xdist's workers inherit the variable from the run's first process, which owns it.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
_CACHE = os.path.join(tempfile.gettempdir(), f"gpp-jax-tests-xla-cache-{os.getpid()}")
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  # Every program, however quick to compile: the tests' models are tiny.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the environment it reads)

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


def pytest_sessionfinish(session, exitstatus):
  """The run's compilation cache goes with the run."""
  if _OWN_CACHE:
    shutil.rmtree(_CACHE, ignore_errors=True)
