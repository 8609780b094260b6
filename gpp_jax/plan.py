"""Plans a model's pipeline on a cluster preset without running it: each planner's plan,
its predicted iteration time, throughput and memory, side by side.

  python -m gpp_jax.plan --model=dlrm --cluster=v100 --num_devices=32 --planner=graphpipe,pipedream
  python -m gpp_jax.plan --model=gpt --gpt_layers=80 --gpt_hidden=12288 --gpt_heads=96 \\
      --seq_len=2048 --vocab_size=51200 --batch_size=2304 --cluster=a100 --num_devices=1536

Every flag: python -m gpp_jax.plan --helpfull (the CLI is ``gpp_jax.cli.plan``).
"""

from gpp_jax.cli.plan import run

if __name__ == "__main__":
  run()
