"""Starts a local multi-process run on loopback, one process per core set or per GPU.

  python -m gpp_jax.launch --num_processes=2 --devices_per_process=4 -- --model=mmt --steps=20

Every flag: python -m gpp_jax.launch --helpfull (the CLI is ``gpp_jax.cli.launch``).
"""

from absl import app

from gpp_jax.cli.launch import main

if __name__ == "__main__":
  app.run(main)
