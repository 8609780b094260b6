"""Multi-process set-up (public name of `gpp_jax.runtime.processes`)."""

from gpp_jax.runtime.processes import initialize, initialize_from_env

__all__ = ["initialize", "initialize_from_env"]
