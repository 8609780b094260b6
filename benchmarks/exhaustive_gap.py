"""How far GraphPipe's plans are from the optimum, on graphs small enough to search exhaustively.

For five families of small LayerGraphs (seeded), on 4 CPU-preset devices with 2 GB/s links
and a mini-batch of 64, runs the exhaustive planner (every convex partition, device count and
micro-batch size, simulated) and GraphPipe, and prints GraphPipe's simulated iteration time
over the optimum per graph and per family, with PipeDream's for comparison.

  python benchmarks/exhaustive_gap.py
  python benchmarks/exhaustive_gap.py --seeds=24 --families=sp,dag
"""

from __future__ import annotations

import time

from absl import app, flags

from gpp_jax.cost.cluster import Link, cpu_cluster
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.passes.partition import PLANNERS

FAMILIES = {
  "chain": lambda s: mg.random_branches(
    s, branches=1, max_branch_layers=6, fork=False, batch_size=64
  ),
  "identical": lambda s: mg.random_branches(
    s, branches=2 + s % 2, identical=True, fork=False, batch_size=64
  ),
  "branches": lambda s: mg.random_branches(
    s, branches=2 + s % 2, max_branch_layers=3, batch_size=64
  ),
  "sp": lambda s: mg.random_sp_dag(s, num_layers=6, batch_size=64),
  "dag": lambda s: mg.random_dag(s, num_layers=6, edge_prob=0.4, batch_size=64),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("families", list(FAMILIES), "graph families")
flags.DEFINE_integer("seeds", 12, "graphs per family (seeds 0..n-1)")
flags.DEFINE_float("within", 0.05, "report how many graphs are within this of the optimum")


def main(argv):
  del argv
  cluster = cpu_cluster(4).replace(intra_link=Link(20e-6, 2e9))
  print(
    f"{'family':10s} {'graphs':>6s} {'GP worst':>9s} {'GP mean':>8s} "
    f"{'GP > ' + format(1 + FLAGS.within, '.2f'):>10s} {'PD worst':>9s} {'GP s':>6s} "
    f"{'exh s':>6s}"
  )
  for fam in FLAGS.families:
    gp_r, pd_r, t_gp, t_ex = [], [], 0.0, 0.0
    for seed in range(FLAGS.seeds):
      g = FAMILIES[fam](seed)
      if g.number_of_nodes() > 8:
        continue
      t = time.perf_counter()
      opt = PLANNERS["exhaustive"](g, cluster, 64).predicted["iteration_time"]
      t_ex += time.perf_counter() - t
      t = time.perf_counter()
      gp = PLANNERS["graphpipe"](g, cluster, 64).predicted["iteration_time"]
      t_gp += time.perf_counter() - t
      pd = PLANNERS["pipedream"](g, cluster, 64).predicted["iteration_time"]
      gp_r.append(gp / opt)
      pd_r.append(pd / opt)
    over = sum(r > 1 + FLAGS.within for r in gp_r)
    print(
      f"{fam:10s} {len(gp_r):6d} {max(gp_r):9.3f} {sum(gp_r) / len(gp_r):8.3f} "
      f"{over:10d} {max(pd_r):9.3f} {t_gp:6.1f} {t_ex:6.1f}"
    )


if __name__ == "__main__":
  app.run(main)
