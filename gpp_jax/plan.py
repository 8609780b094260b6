"""``python -m gpp_jax.plan``: runs the planning CLI, `gpp_jax.cli.plan`."""

from gpp_jax.cli.plan import run

if __name__ == "__main__":
  run()
