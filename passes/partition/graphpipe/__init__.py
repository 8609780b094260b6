"""GraphPipe planner: LayerGraph + Cluster -> Plan whose stages form a DAG.

Modules: ``tree`` (the SP tree), ``context`` (per micro-batch size costs), ``dp`` (the min-max
dynamic program and its tables), ``serialised`` (serialised runs), ``search`` (micro-batch
sweep, frontier candidates, seeds, polish and ``graphpipe_plan``).

The search follows GraphPipe (Jeon et al., ASPLOS'25), Alg. 1 and 2:

1. Series-parallel decomposition of the layer graph (``passes/series_parallel.py``).
2. The paper's DP, for a target time per sample ``t`` (TPS), finds the smallest entry depth
   (the "minimal source in-flight" value that upstream memory depends on) of a strategy whose
   stages all have TPS <= t within device memory, and a binary search on ``t`` finds the
   smallest feasible TPS. Here the same recurrence is turned around: for every
   (SP sub-problem, downstream context depth) the DP builds a table over (devices k, entry
   depth e) of the smallest bottleneck TPS of a strategy on at most k devices whose entry
   depth is at most e (a min-max DP), so one run per micro-batch size gives the whole depth /
   TPS frontier, with no bisection and no re-run per depth. Sub-problems are:
     * a single stage: the whole sub-problem, or a contiguous run of children of one series or
       parallel node, data parallel over d devices (d divides the micro-batch);
     * a series split: the downstream part is solved first (in-flight counts go sink to
       source), then the upstream part with the downstream entry depth as its context;
     * a parallel split: branches solved independently with the same context, devices split
       between them; the entry depth is the max over branches.
   Tables are memoised on (sub-problem signature, context), so identical branches (the seven
   CANDLE-Uno towers) are solved once; a series child is solved only in the contexts where the
   part after it improves (its frontier's breakpoints).
3. The micro-batch size is uniform across stages and swept over powers of two dividing the
   batch (the paper's default configuration: same micro-batch everywhere, synchronous 1F1B).

Extensions beyond the paper's recurrence (each keeps stages convex and the stage graph a DAG):
  * head and tail merges: in a series node, a stage may hold some branches of a parallel child
    together with the series children right before it (the fork; the other branches are fed
    by the stage) or right after it (the join; the other branches feed the stage); without
    them the fork and the join always cost a stage of their own;
  * serialised runs: the children [i, n) of a series or parallel node may be solved as one
    sequential pipeline over their layers in SP order (a topological order), i.e. the DP may
    apply the SP-ization rule by choice and add ordering edges between branches. Stages can
    then cut across branch boundaries to balance work; at the root this is a PipeDream-style
    chain over the SP order (which may order branches differently from PipeDream's
    topological order);
  * depth frontier: the smallest TPS t* and, for each shallower depth, the smallest TPS reaching
    it (read off the root's table; a deeper point counts only where it is 0.5% faster); the
    plan at t* and the best frontier points by the estimate (M + depth - 1) * TPS * b per
    micro-batch size are simulated with the plan's schedule and the fastest plan within memory
    wins; a micro-batch size whose bound B * TPS is 25% above the best simulated time is
    skipped, and the DP drops stages whose TPS is above that bound (``MinMaxDP.cap``);
  * two branch orders: a parallel node's children are tried lightest first (equal branches
    adjacent; merges take the light ones) and in topological order;
  * a no-replication variant: the TPS objective spreads a stage's gradient all-reduce over
    the iteration although it runs after the stage's last backward, which favours data
    parallelism; at the two best micro-batch sizes the search is repeated with one device
    per stage (then polished), so deeper all-pipeline plans compete in the simulator too.

  * chain seeds: the chain DP's optima over the topological order (PipeDream's DP, as stage
    DAGs without ordering edges) join the simulated candidates, since a chain of stages is a
    stage DAG too;
  * polish: the best plan of each of the best micro-batch sizes is improved by local search
    on the simulated time (``refine.polish``: device counts, layer moves, splits, merges);
    the sequential planners get the same polish, restricted to chains.
  * polished chain plans and seed plans: PipeDream's polished plan (``chain_plans``) and any
    finished plans passed as ``seed_plans`` join the candidates after the polish, so the plan
    returned is never slower than them (``predicted["seed"]`` names the planner when one
    wins); ``predicted["search"]`` times the DP, the seeds and the polish apart.
  * ``min_stages`` (the planning problem's fewest stages): the DP's tables do not count
    stages, so every strategy it yields is simulated as before, but only plans of at least
    that many stages are candidates (the frontier's deeper points, the no-replication
    variant, the chain seeds of that many stages and more); the polish never merges below
    it, and the search returns its best such plan, or ``PlanError`` where none fits.

Choices the paper leaves open, made here (see BUILD_NOTES.md, "Planners"):
  * TPS of a stage = combine(compute, transfers) / b + (all-reduce + optimizer) / B, with
    ``CostModel.tps_formula`` "sum" by default; transfers priced on the slowest link of the
    cluster (placement is decided after the search);
  * in-flight count of a stage = min(L(s), M), L = longest path to a sink in stages;
  * device counts per stage: any divisor of the micro-batch (``powers_of_two=True``
    restricts them to powers of two); the DP may leave devices idle once the bottleneck cannot
    improve, so afterwards the polish (a local search against the simulator, which
    PipeDream and Piper get too) hands them to the stages that gain most; devices no stage
    can use stay idle and are listed in ``predicted["idle_devices"]``, and why in
    ``predicted["idle_reason"]`` (``passes.partition.idle``);
  * stages get contiguous device ranges, kept inside a node where they fit
    (``plan_assembly.place_stages``).
"""

from gpp_jax.passes.partition.graphpipe.search import SearchStats, graphpipe_plan

__all__ = ["SearchStats", "graphpipe_plan"]
