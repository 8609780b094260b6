"""Stages that narrow the user's mesh (``Stage.inner``): less tensor parallelism, more data
parallelism on the same devices, chosen per stage by the planners.

The numerical check is exact against the plain one-device step (``test_sharded_mesh``'s
harness) and asserts the shards it expects.
"""

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_sharded_mesh import OUT, Chain, D, H, batch, make_chain, nnx_step, run_nnx, shards

import gpp_jax
from gpp_jax.cost.cluster import a100_cluster
from gpp_jax.cost.cost_model import plan_costs
from gpp_jax.errors import PlanError
from gpp_jax.experiments.megatron import MEGATRON_COST_MODEL, GPTShape, gpt_graph, row_cluster
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.passes.partition import get_planner
from gpp_jax.passes.partition.stage_shapes import inner_shapes, shape_fits
from gpp_jax.runtime.sharding import MeshLayout


def test_a_narrowed_stage_runs_its_rows_as_more_data_parallelism_exact_nnx():
  """data:4,model:2; stage 1 gives "model" the size 1: its 2 rows x 2 devices run as 4 rows
  of 1. Its kernels are whole on each device, its head kernel (spec over the first axis) is
  split 4 ways, and stage 0 keeps tensor parallelism 2. Exact against one device."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  plan = gpp_jax.manual_plan(
    {"a": 0, "b": 0, "c": 1, "head": 1}, devices={0: [0, 1], 1: [2, 3]}, inner={1: (1,)}
  )
  _, model, opt, pp = run_nnx(make_chain(), optax.adam(1e-2), plan, mesh)
  rows = np.asarray(mesh.devices)
  stage0 = {d.id for d in rows[:2].flat}
  stage1 = {d.id for d in rows[2:].flat}
  assert shards(model.a.up.kernel[...]) == ((D, H // 2), stage0)
  assert shards(model.c.up.kernel[...]) == ((D, H), stage1)
  assert shards(model.c.down.kernel[...]) == ((H, D), stage1)
  assert shards(model.head.kernel[...]) == ((D // 4, OUT), stage1)
  assert dict(model.c.up.kernel[...].sharding.mesh.shape) == {"data": 4, "model": 1}
  assert shards(opt.opt_state[0].mu.head.kernel[...]) == ((D // 4, OUT), stage1)
  assert pp.plan.stages[1].inner == (1,) and pp.plan.stages[0].inner is None
  assert " inner" in str(pp.plan)


def test_stage_devices_keep_a_narrowed_tensor_parallel_group_inside_its_row():
  devs = list(range(16))
  layout = MeshLayout.of(jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("d", "m")))
  ids = {d: i for i, d in enumerate(jax.devices()[:8])}
  flat, inner = layout.stage_devices([1], (2,))
  assert inner == (2,) and [ids[d] for d in flat] == [4, 5, 6, 7]  # rows (4,5) and (6,7)
  flat, inner = layout.stage_devices([0, 1], None)
  assert inner == (4,) and [ids[d] for d in flat] == devs[:8]
  # Two axes after the first: each narrowed group is a block of neighbours.
  mesh3 = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 4), ("d", "a", "b"))
  flat, inner = MeshLayout.of(mesh3).stage_devices([0], (1, 2))
  got = np.array([ids[d] for d in flat]).reshape(-1, 1, 2)
  assert inner == (1, 2) and got.tolist() == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]


def test_shapes_the_mesh_allows_and_what_divides_them():
  mesh = {"axes": ("data", "model"), "inner": (4,), "divides": ((8, ("data",)),)}
  assert inner_shapes(mesh) == [(1,), (2,)]
  assert shape_fits(mesh, rows=2, inner=(2,), microbatch=8)  # 4 rows: 8 % 4, spec 8 % 4
  assert not shape_fits(mesh, rows=2, inner=(1,), microbatch=4)  # 8 rows split 4 samples
  assert not shape_fits(mesh, rows=4, inner=(1,), microbatch=16)  # a spec dim 8 over 16 rows


def test_a_stage_inner_shape_that_does_not_divide_the_mesh_names_the_fix():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  model = Chain(nnx.Rngs(0))
  before = nnx.state(model, nnx.Param)
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  plan = gpp_jax.manual_plan({"a": 0, "b": 0, "c": 1, "head": 1}, inner={1: (3,)})
  pp = gpp_jax.graph_pipeline(nnx_step, num_microbatches=2, mesh=mesh, planner=plan)
  with pytest.raises(PlanError, match=r"stage 1 gives the mesh's axes \['model'\] the sizes"):
    pp(model, opt, batch())
  after = nnx.state(model, nnx.Param)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_plan_json_round_trips_a_stage_inner_shape():
  plan = Plan(
    stages=(Stage(0, ("a",), (0,), inner=(2,)), Stage(1, ("b",), (1,))),
    edges=((0, 1),),
    num_microbatches=2,
  )
  back = Plan.from_json(plan.to_json())
  assert back.stages[0].inner == (2,) and back.stages[1].inner is None
  assert "inner" not in json.loads(plan.to_json())["stages"][1]
  # A plan without narrowed stages hashes as before the field existed.
  plain = plan.replace(stages=(Stage(0, ("a",), (0,)), Stage(1, ("b",), (1,))))
  assert "inner" not in plain.to_json()


def _gpt(hidden, heads, tp, batch_size=64, layers=4):
  return gpt_graph(GPTShape(layers, hidden, heads, seq=512, vocab=4096), batch_size, tp=tp)


def test_cost_model_prices_a_narrowed_stage_as_less_tensor_and_more_data_parallelism():
  """A GPT over rows of tp=4 GPUs: a stage narrowed to tp=1 is priced as the same layers data
  parallel over 4x the rows without tensor parallelism, and holds 4x the parameters."""
  cluster = row_cluster(a100_cluster(16), 4)
  g4, g1 = _gpt(1024, 16, 4), _gpt(1024, 16, 1)
  layers = tuple(l for l in g4.nodes if l.startswith("layer"))  # the Transformer layers
  wide = Plan((Stage(0, layers, (0, 1)),), (), 4, batch_size=64)
  narrow = wide.replace(stages=(Stage(0, layers, (0, 1), inner=(1,)),))
  flat = Plan((Stage(0, layers, tuple(range(8))),), (), 4, batch_size=64)
  pw = plan_costs(wide, g4, cluster, cost_model=MEGATRON_COST_MODEL)
  pn = plan_costs(narrow, g4, cluster, cost_model=MEGATRON_COST_MODEL)
  pf = plan_costs(flat, g1, row_cluster(a100_cluster(16), 1), cost_model=MEGATRON_COST_MODEL)
  assert pn.forward[0] == pytest.approx(pf.forward[0], rel=1e-9)
  assert pn.backward[0] == pytest.approx(pf.backward[0], rel=1e-9)
  assert pn.param_bytes[0] == pytest.approx(4 * pw.param_bytes[0], rel=1e-6)
  assert pn.forward[0] != pytest.approx(pw.forward[0], rel=1e-3)


def test_planners_narrow_stages_where_all_reduces_cost_more_than_the_split_saves():
  """A small GPT over rows of 8 GPUs: its layers are too small for 8-way tensor parallelism,
  and every planner's plan narrows its stages; ``stage_shapes=False`` keeps the mesh's shape
  and is predicted slower. A large GPT keeps tp=8 (its parameters need the split)."""
  small = _gpt(256, 8, 8)
  cluster = row_cluster(a100_cluster(32), 8)
  for name in ("graphpipe", "pipedream"):
    planner = get_planner(name)
    shaped = planner(small, cluster, 64, cost_model=MEGATRON_COST_MODEL)
    kept = planner(small, cluster, 64, cost_model=MEGATRON_COST_MODEL, stage_shapes=False)
    assert all(s.inner is None for s in kept.stages)
    assert any(s.inner is not None and s.inner[0] < 8 for s in shaped.stages), str(shaped)
    assert shaped.predicted["iteration_time"] < kept.predicted["iteration_time"]
  big = _gpt(12288, 96, 8)
  plan = get_planner("pipedream")(big, cluster, 64, cost_model=MEGATRON_COST_MODEL)
  assert all(s.inner is None for s in plan.stages), str(plan)


def test_a_planners_narrowed_plan_on_a_mesh_runs_exact():
  """PipeDream's pipeline over data:4,model:2 for the test chain, with shapes chosen by
  prediction (its head stage narrows "model", which the head's specs do not use), runs exact,
  and each parameter is split as its stage's inner shape says."""
  _, model, _, pp = run_nnx(
    make_chain(), optax.adam(1e-2), "pipedream", "data:4,model:2", min_stages=2
  )
  plan = pp.plan
  assert plan.num_stages >= 2 and any(s.inner == (1,) for s in plan.stages), str(plan)
  stage_of = {l: s for s in plan.stages for l in s.layers}
  for name in ("a", "b", "c"):
    inner = stage_of[f"{name}/up"].inner
    tp = 2 if inner is None else inner[0]
    assert shards(getattr(model, name).up.kernel[...])[0] == (D, H // tp)
  assert model.a.up.kernel[...].sharding.spec == P(None, "model")
