"""``python -m gpp_jax.train``: runs `gpp_jax.cli.train`."""

from absl import app

from gpp_jax.cli.train import main

if __name__ == "__main__":
  app.run(main)
