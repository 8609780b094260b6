"""GraphPipe against a certified lower bound at 8 devices and 8-10 layers.

``passes/partition/lower_bound.py`` bounds the simulated iteration time of every plan from below
with a MILP (HiGHS through ``scipy.optimize.milp``; identical layers aggregated, groups as ordered
slots of one device count each). On seeded graph families of 8-10 layers on 8 CPU-preset devices
with 2 GB/s links and a mini-batch of 64 (past what ``benchmarks/exhaustive_gap.py`` can enumerate),
this prints GraphPipe's simulated iteration time over the bound, with and without the polish
(``polish_plans=False, chain_plans=False``: the search alone), and PipeDream's for comparison. A
ratio of 1.10 means the plan is at most 10% slower than the best plan (the true gap to the optimum
is smaller: the bound leaves out most transfers, and the fill and the convexity of all stages but
the sink's). The last columns give GraphPipe's ratio to the bound without the sink stage's fill and
drain (``fill=False``), computed in the same run.

With ``--paper_models`` it bounds the paper's models at their paper shapes on V100s instead
(``--devices``, default 32 there; the default mini-batch): per micro-batch size, the bound
without and with the sink stage's fill, drain and convexity, GraphPipe's best plan at that size,
PipeDream as published and the time a given gain over it needs (``--gain``, the paper's 1.25x).
Where the bound at a size is above that time, no plan at that size reaches the gain under the
simulator's rules. ``--split_backward`` bounds without the drain term, which holds for
schedules that split the backward (zero-bubble) too.

  python benchmarks/milp_gap.py
  python benchmarks/milp_gap.py --seeds=4 --families=sp
  python benchmarks/milp_gap.py --paper_models=mmt --time_limit=60
"""

from __future__ import annotations

import time

from absl import app, flags

from gpp_jax.cost.cluster import Link, cpu_cluster, v100_cluster
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.experiments.planner_runs import build_graph, default_batch_size, run_planner
from gpp_jax.passes.partition import PLANNERS
from gpp_jax.passes.partition.lower_bound import iteration_lower_bound

FAMILIES = {
  "identical": lambda s: mg.random_branches(
    s, branches=2 + s % 2, max_branch_layers=4, identical=True, batch_size=64
  ),
  "branches": lambda s: mg.random_branches(s, branches=3, max_branch_layers=3, batch_size=64),
  "sp": lambda s: mg.random_sp_dag(s, num_layers=8 + s % 3, batch_size=64),
  "dag": lambda s: mg.random_dag(s, num_layers=8 + s % 3, edge_prob=0.3, batch_size=64),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("families", list(FAMILIES), "graph families")
flags.DEFINE_integer("seeds", 6, "graphs per family (the first seeds whose graph has 8-10 layers)")
flags.DEFINE_integer("devices", None, "devices (default 8, or 32 with --paper_models)")
flags.DEFINE_list("paper_models", [], "paper models to bound at paper shapes on V100s instead")
flags.DEFINE_float("gain", 1.25, "with --paper_models: the gain over PipeDream as published")
flags.DEFINE_float("time_limit", 60.0, "seconds per program before its dual bound is taken")
flags.DEFINE_bool(
  "split_backward", False, "with --paper_models: no drain term (valid for zero-bubble schedules)"
)


def paper(model: str, devices: int) -> None:
  """The per-size bounds of one paper model against GraphPipe's plan and the target."""
  batch = default_batch_size(model, devices)
  g = build_graph(model, "paper", batch)
  cluster = v100_cluster(devices)
  gp = run_planner("graphpipe", g, cluster, batch, keep_plan=True)
  pd = run_planner("pipedream-published", g, cluster, batch)
  need = pd["iteration_time"] / FLAGS.gain
  print(
    f"{model} x{devices}, batch {batch}: GraphPipe {gp['iteration_time']:.4f} s (micro-batch "
    f"{gp['microbatch']}), PipeDream as published {pd['iteration_time']:.4f} s "
    f"({pd['iteration_time'] / gp['iteration_time']:.3f}x); {FLAGS.gain}x needs <= {need:.4f} s"
  )
  print(
    f"{'micro-batch':>11s} {'bound, no fill':>14s} {'with fill':>9s} {'solved':>6s} "
    f"{'solve s':>7s} {'GraphPipe':>9s} {'gain ruled out':>14s}"
  )
  for b in sorted(gp["plan"].predicted["search"]["microbatch_sizes"]):
    limit = FLAGS.time_limit
    plain = iteration_lower_bound(g, cluster, batch, sizes=[b], fill=False, time_limit=limit)
    t = time.perf_counter()
    tight = iteration_lower_bound(
      g, cluster, batch, sizes=[b], time_limit=limit, split_backward=FLAGS.split_backward
    )
    t = time.perf_counter() - t
    at_b = run_planner("graphpipe", g, cluster, batch, num_microbatches=batch // b)
    print(
      f"{b:11d} {plain.seconds:14.4f} {tight.seconds:9.4f} {'yes' if tight.optimal else 'no':>6s} "
      f"{t:7.1f} {at_b.get('iteration_time', float('nan')):9.4f} "
      f"{'yes' if tight.seconds > need else 'no':>14s}",
      flush=True,
    )


def main(argv):
  del argv
  if FLAGS.paper_models:
    for model in FLAGS.paper_models:
      paper(model, FLAGS.devices or 32)
    return
  cluster = cpu_cluster(FLAGS.devices or 8).replace(intra_link=Link(20e-6, 2e9))
  print(
    f"{'family':10s} {'graphs':>6s} {'layers':>6s} {'GP/LB worst':>11s} {'mean':>6s} "
    f"{'no polish worst':>15s} {'mean':>6s} {'PD/LB worst':>11s} {'LB s':>6s} {'optimal':>7s} "
    f"{'GP/LB no fill worst':>19s} {'mean':>6s}"
  )
  for fam in FLAGS.families:
    gp_r, raw_r, pd_r, plain_r, t_lb, n_l, opt = [], [], [], [], 0.0, [], True
    graphs = (FAMILIES[fam](seed) for seed in range(50 * FLAGS.seeds))
    for g in [g for g in graphs if 8 <= g.number_of_nodes() <= 10][: FLAGS.seeds]:
      n_l.append(g.number_of_nodes())
      t = time.perf_counter()
      lb = iteration_lower_bound(g, cluster, 64)
      t_lb += time.perf_counter() - t
      opt = opt and lb.optimal
      plain = iteration_lower_bound(g, cluster, 64, fill=False)
      gp = PLANNERS["graphpipe"](g, cluster, 64).predicted["iteration_time"]
      raw = PLANNERS["graphpipe"](g, cluster, 64, polish_plans=False, chain_plans=False).predicted[
        "iteration_time"
      ]
      pd = PLANNERS["pipedream"](g, cluster, 64).predicted["iteration_time"]
      gp_r.append(gp / lb.seconds)
      raw_r.append(raw / lb.seconds)
      pd_r.append(pd / lb.seconds)
      plain_r.append(gp / plain.seconds)
    print(
      f"{fam:10s} {len(gp_r):6d} {min(n_l):3d}-{max(n_l):<2d} {max(gp_r):11.3f} "
      f"{sum(gp_r) / len(gp_r):6.3f} {max(raw_r):15.3f} {sum(raw_r) / len(raw_r):6.3f} "
      f"{max(pd_r):11.3f} {t_lb:6.1f} {'yes' if opt else 'no':>7s} "
      f"{max(plain_r):19.3f} {sum(plain_r) / len(plain_r):6.3f}",
      flush=True,
    )


if __name__ == "__main__":
  app.run(main)
