"""``python -m gpp_jax.launch``: runs `gpp_jax.cli.launch`."""

from absl import app

from gpp_jax.cli.launch import main

if __name__ == "__main__":
  app.run(main)
