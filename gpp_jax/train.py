"""Trains a model-zoo model with a graph pipeline on synthetic data.

  python -m gpp_jax.train --model=mmt --planner=graphpipe --num_devices=8 \\
      --num_microbatches=8 --memory_limit=310KiB --steps=200

Every flag and what the run writes: python -m gpp_jax.train --helpfull (the CLI is
``gpp_jax.cli.train``).
"""

from absl import app

from gpp_jax.cli.train import main

if __name__ == "__main__":
  app.run(main)
