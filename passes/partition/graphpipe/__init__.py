from gpp_jax.passes.partition.graphpipe._whole import SearchStats, graphpipe_plan
