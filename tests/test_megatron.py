"""Megatron-LM's published GPT runs (SC'21, Table 1): the paper's formulas, the layout flag,
the JSON records, and the simulator's predictions against the published figures."""

import dataclasses
import json
import subprocess
import sys

import pytest
from harness import child_env

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.experiments.megatron import (
  TABLE_1,
  GPTCosts,
  GPTShape,
  gpt_graph,
  layout_plan,
  paper_flops,
  paper_params,
  predict_layout,
  row_cluster,
  traced_costs,
)


def _plan_cli(args: list[str]) -> subprocess.CompletedProcess:
  """``python -m gpp_jax.plan`` with ``args``, its output captured."""
  return subprocess.run(
    [sys.executable, "-m", "gpp_jax.plan", *args],
    capture_output=True,
    text=True,
    env=child_env(),
    timeout=300,
  )


def _gpt_args(layers: int, hidden: int, heads: int, batch: int, devices: int) -> list[str]:
  """``gpp_jax.plan``'s flags for a GPT of this shape (sequence 2,048, vocabulary 51,200) and
  batch on ``devices`` A100s."""
  return [
    "--model=gpt",
    f"--gpt_layers={layers}",
    f"--gpt_hidden={hidden}",
    f"--gpt_heads={heads}",
    "--seq_len=2048",
    "--vocab_size=51200",
    f"--batch_size={batch}",
    "--cluster=a100",
    f"--num_devices={devices}",
  ]


def test_parameter_count_is_the_papers_column():
  """Equation (2) gives every row's published parameter count (to its 0.1 billion)."""
  for row in TABLE_1:
    assert paper_params(row.layers, row.hidden) / 1e9 == pytest.approx(row.params_b, abs=0.051)


def test_flop_count_and_the_papers_worked_example():
  """Equation (3), and the paper's training-time example: GPT-3 (175B) on 300B tokens, 1,024
  GPUs at 140 teraFLOP/s is 34 days by equation (4), 8TP/(nX), which equation (3) approaches
  as 8 B s P for large models."""
  days = 8 * 300e9 * 175e9 / (1024 * 140e12) / 86400
  assert round(days) == 34
  big = TABLE_1[-1]
  F = paper_flops(big.batch, 2048, big.layers, big.hidden, 51200)
  P = paper_params(big.layers, big.hidden)
  assert F / (8 * big.batch * 2048 * P) == pytest.approx(1.0, rel=0.03)
  # Per layer and sequence: 72 s h^2 for forward and backward, 24 s h^2 more recomputed.
  assert paper_flops(1, 2048, 1, 4096, 0) == pytest.approx(
    96 * 2048 * 4096**2 * (1 + 2048 / (6 * 4096))
  )
  shape = GPTShape(1, 4096, 32, 2048, 51200)
  g = gpt_graph(shape, 1, costs=GPTCosts.analytic(shape))
  layer = g.nodes["layer0"]["flops"]
  assert 4 * layer == pytest.approx(96 * 2048 * 4096**2 * (1 + 2048 / (6 * 4096)))


@pytest.mark.parametrize("row", [TABLE_1[0], TABLE_1[-1]], ids=["1.7B", "1T"])
def test_the_planned_gpt_is_the_trainable_one_traced(row):
  """The GPT the planners price is ``gpp_jax.models.gpt`` traced abstractly (no parameters
  built): its parameters are the paper's equation (2) exactly, and its FLOPs the paper's
  GEMM counts within 0.5% (what the trace adds: LayerNorms, softmax, GeLU, the embedding's
  gather)."""
  shape = row.shape
  traced, paper = traced_costs(shape), GPTCosts.analytic(shape)
  assert traced.source == "traced from gpp_jax.models.gpt"
  assert traced.block_params == paper.block_params
  assert traced.embed_params == paper.embed_params
  assert traced.head_params == paper.head_params + 2 * shape.hidden  # the final LayerNorm's
  total = traced.embed_params + row.layers * traced.block_params + traced.head_params
  tied = shape.vocab * shape.hidden  # equation (2) counts the tied embedding once
  assert total - tied - 2 * shape.hidden == pytest.approx(paper_params(row.layers, row.hidden))
  assert traced.block_flops == pytest.approx(paper.block_flops, rel=5e-3)
  assert traced.block_flops > paper.block_flops
  assert traced.head_flops == pytest.approx(paper.head_flops, rel=5e-3)
  g = gpt_graph(shape, row.batch, tp=row.tp)
  assert g.graph["costs"] == traced.source
  assert g.nodes["layer3"]["flops"] == traced.block_flops * row.batch


def test_layout_gives_the_stages_and_widths_it_names():
  row = TABLE_1[6]  # 145.6B: tp 8, pp 8 on 1,536 GPUs
  rows = row_cluster(make_cluster("a100", row.gpus), row.tp)
  assert rows.num_devices == 192 and rows.devices_per_node == 1
  g = gpt_graph(row.shape, row.batch, tp=row.tp)
  plan = layout_plan(g, rows.num_devices, row.pp, 1, 2)
  assert plan.num_stages == 16 and plan.schedule == "interleaved-1f1b"
  assert [len(s.devices) for s in plan.stages] == [24] * 16  # dp = 192 / 8
  assert [s.devices[0] // 24 for s in plan.stages] == [k % 8 for k in range(16)]
  assert plan.stages_per_device == 2
  assert plan.stages[0].layers[0] == "embed" and plan.stages[-1].layers[-2:] == ("lm_head", "loss")
  assert sum(len(s.layers) for s in plan.stages) == row.layers + 3
  assert plan.num_microbatches == row.batch // 24
  with pytest.raises(ValueError, match="pp=7"):
    layout_plan(g, rows.num_devices, 7)


@pytest.mark.parametrize("row", [TABLE_1[0], TABLE_1[3]], ids=["1.7B", "18.4B"])
def test_small_rows_are_predicted_within_15_percent(row):
  got = predict_layout(row)
  assert got["tflops_per_device"] == pytest.approx(row.tflops, rel=0.15)


@pytest.mark.slow
def test_every_row_is_predicted_within_15_percent():
  for row in TABLE_1:
    got = predict_layout(row)
    assert got["tflops_per_device"] == pytest.approx(row.tflops, rel=0.15), row


def test_plan_cli_layout_writes_the_records(tmp_path):
  out = tmp_path / "rows.json"
  args = [
    *_gpt_args(40, 6144, 48, 1024, 256),
    "--layout=tp:8,pp:1",
    f"--json={out}",
  ]
  proc = _plan_cli(args)
  assert proc.returncode == 0, proc.stderr
  assert "TFLOP/s per GPU" in proc.stdout
  records = json.loads(out.read_text())
  assert isinstance(records, list) and len(records) == 1
  r = records[0]
  assert r["planner"] == "layout" and r["layout"] == "tp:8,pp:1,dp:32"
  for key in ("iteration_ms", "samples_per_s", "tflops_per_device"):
    assert isinstance(r[key], float) and r[key] > 0
  assert r["samples_per_s"] == pytest.approx(1024 / (r["iteration_ms"] / 1e3))
  assert r["fits_memory"] is True and 0 < r["peak_memory_gib"] <= r["memory_per_gpu_gib"] == 80
  assert "fits in a GPU's 80 GiB" in proc.stdout
  bad = _plan_cli([*args[:-2], "--layout=tp:8,zz:2"])
  assert bad.returncode != 0 and "expected tp:<int>,pp:<int>" in bad.stderr
  assert "Traceback" not in bad.stderr


def test_a_layout_says_whether_it_fits_and_refuses_an_interleaving_it_cannot_run():
  """The 1T row's GPT on one node in tp:8,pp:1 needs far more than a GPU holds, and says
  so; more stages per device than a pipeline rank's layers split into is a ValueError naming
  the fix, not an assertion."""

  big = dataclasses.replace(TABLE_1[-1], pp=1, gpus=8, batch=8)
  r = predict_layout(big, stages_per_device=(1,))
  assert not r["fits_memory"] and r["peak_memory_gib"] > 10 * r["memory_per_gpu_gib"]
  assert predict_layout(TABLE_1[0])["fits_memory"]
  with pytest.raises(ValueError, match=r"cannot run 3 stages per device: its 2 layers per"):
    predict_layout(dataclasses.replace(TABLE_1[-1], batch=3072), stages_per_device=(3,))
  with pytest.raises(ValueError, match="one pipeline rank does not interleave"):
    predict_layout(big, stages_per_device=(2,))


def test_a_mesh_where_no_plan_fits_records_the_mesh_beside_the_error():
  from gpp_jax.cli.plan import PlanOptions, default_gpt_mesh, plan_mesh

  big = PlanOptions(
    model="gpt", cluster="a100", num_devices=64, planners=("graphpipe",), batch_size=64,
    gpt_layers=128, gpt_hidden=25600, gpt_heads=160, seq_len=2048, vocab_size=51200,
  )  # fmt: skip
  assert default_gpt_mesh(big) == "data:8,model:8"
  assert default_gpt_mesh(dataclasses.replace(big, num_devices=36)) == "data:9,model:4"
  assert default_gpt_mesh(dataclasses.replace(big, cluster="cpu")) == "data:64,model:1"
  (r,) = plan_mesh(dataclasses.replace(big, mesh="data:8,model:8"))
  assert r["mesh"] == "data:8,model:8" and "no plan fits" in r["error"]


def test_a_gpt_shape_whose_heads_do_not_split_its_width_is_refused():
  with pytest.raises(
    ValueError, match=r"hidden size 2304 cannot have 25 attention heads.*24 or 32"
  ):
    GPTShape(24, 2304, 25)
  with pytest.raises(ValueError, match="at least 1: layers=0"):
    GPTShape(0, 2304, 24)
  assert GPTShape(24, 2304, 24).heads == 24


def test_plan_cli_plans_a_gpt_of_the_given_shape_over_rows_of_a_node(tmp_path):
  """``--model=gpt`` with the GPT's shape and neither ``--mesh`` nor ``--layout``: the
  planners plan that GPT (not the synthetic one of ``--shape``) over rows of a node's GPUs,
  and say so; a shape that cannot be is refused before planning, without a traceback."""
  out = tmp_path / "gpt.json"
  args = [
    *_gpt_args(24, 2304, 24, 512, 32),
    "--planner=graphpipe",
    f"--json={out}",
  ]
  proc = _plan_cli(args)
  assert proc.returncode == 0, proc.stderr
  assert "--mesh not given: the GPT is planned over --mesh=data:4,model:8" in proc.stdout
  (r,) = json.loads(out.read_text())
  assert r["planner"] == "graphpipe" and r["mesh"] == "data:4,model:8"
  assert r["costs"] == "traced from gpp_jax.models.gpt" and r["tflops_per_device"] > 100
  bad = _plan_cli([a.replace("heads=24", "heads=25") for a in args])
  assert bad.returncode != 0 and "cannot have 25 attention heads" in bad.stderr
  assert "Traceback" not in bad.stderr and "--mesh not given" not in bad.stdout


@pytest.mark.slow
def test_plan_cli_mesh_lets_the_planners_choose_the_stages(tmp_path):
  """``--mesh=data:R,model:t``: the planners choose stages over the R rows, each tensor
  parallel over t GPUs; one JSON record per planner."""
  out = tmp_path / "mesh.json"
  args = [
    *_gpt_args(40, 6144, 48, 512, 64),
    "--mesh=data:8,model:8",
    "--planner=graphpipe,pipedream",
    f"--json={out}",
  ]
  proc = _plan_cli(args)
  assert proc.returncode == 0, proc.stderr
  records = json.loads(out.read_text())
  assert [r["planner"] for r in records] == ["graphpipe", "pipedream"]
  for r in records:
    assert r["mesh"] == "data:8,model:8"
    assert 0 < r["tflops_per_device"] < 312 and r["iteration_ms"] > 0  # under the A100's peak
    stages = r["plan"]["stages"]
    assert sum(len(s["devices"]) for s in stages) <= 8  # rows of the first axis
  bad = _plan_cli([*args[:-3], "--mesh=data:4,model:8"])
  assert bad.returncode != 0 and "has 32 devices but --num_devices=64" in bad.stderr


def test_graphpipe_counts_devices_finer_where_its_grid_leaves_no_plan():
  """80 GPUs: the DP counts devices in slots of 4 (at most 32 slots), but batch 90 has no
  micro-batch size that 4 divides among its sweep (the powers of two 1, 2, times 5, the odd
  divisor 90 shares with 80), and a stage's devices each take whole samples: the grid leaves
  no strategy, so the search counts devices in slots of 2. Micro-batches of 10 samples (5 x 2)
  let stages of 10 devices take one sample each: faster than the powers of two alone (45
  micro-batches of 2). With 30 micro-batches given (3 samples each) it goes down to single
  devices, where PipeDream's seed (its own grid of 2) finds no plan and GraphPipe's stands."""
  from gpp_jax.experiments.megatron import MEGATRON_COST_MODEL
  from gpp_jax.passes.partition import PLANNERS
  from gpp_jax.passes.partition.problem import device_unit

  cluster = make_cluster("a100", 80)
  g = gpt_graph(GPTShape(8, 1024, 16, seq=512, vocab=8192), 90)
  assert device_unit(80, 32) == 4
  plan = PLANNERS["graphpipe"](g, cluster, 90, cost_model=MEGATRON_COST_MODEL)
  assert plan.predicted["search"]["device_unit"] == 2
  assert plan.predicted["memory_ok"] and plan.num_microbatches == 9
  twos = PLANNERS["graphpipe"](g, cluster, 90, cost_model=MEGATRON_COST_MODEL, num_microbatches=45)
  assert plan.predicted["iteration_time"] < twos.predicted["iteration_time"]
  plan = PLANNERS["graphpipe"](g, cluster, 90, cost_model=MEGATRON_COST_MODEL, num_microbatches=30)
  assert plan.predicted["search"]["device_unit"] == 1 and plan.num_microbatches == 30
  assert all(3 % len(s.devices) == 0 for s in plan.stages)


def test_overlapped_time_is_a_two_resource_flow_shop():
  from gpp_jax.cost.cost_model import overlapped_time

  assert overlapped_time([1.0] * 3, [0.1] * 3) == pytest.approx(0.1 + 3.0)  # compute-bound
  assert overlapped_time([0.1] * 3, [1.0] * 3) == pytest.approx(3.0 + 0.1)  # fetch-bound
  # One step fetched ahead: the third fetch waits for the first step to finish.
  assert overlapped_time([0.1, 0.1, 0.1], [0.0, 0.0, 0.0]) == pytest.approx(0.3)
  assert overlapped_time([2.0, 0.1, 0.1], [0.1, 0.1, 1.0]) == pytest.approx(0.1 + 2.0 + 1.0 + 0.1)
  # Drains behind the next fetch: f0 f1 d0 ... and the last drain exposed.
  assert overlapped_time([1.0, 1.0], [0.5, 0.5], [0.5, 0.5]) == pytest.approx(3.0)
  assert overlapped_time([], []) == 0.0


def test_fsdp_gathers_half_precision_weights_layer_by_layer_behind_the_compute():
  """ZeRO-3 as the jit fsdp candidate prices it: the GPT's GEMMs read 2-byte weights, so each
  layer's gather moves half its 4-byte parameters (the embedding, read by lookup, at the same
  ratio); per micro-batch the forward is about max(compute, gathers) layer by layer, between
  that and their sum; the backward also reduce-scatters; the update reduces nothing."""
  import numpy as np

  from gpp_jax.cost.cost_model import fsdp_gathered_bytes, layer_costs, plan_costs
  from gpp_jax.experiments.megatron import MEGATRON_COST_MODEL as cm
  from gpp_jax.ir.plan import Plan, Stage

  g = gpt_graph(GPTShape(4, 12288, 96), 1536)
  costs = layer_costs(g)
  idx = list(range(len(costs)))
  got = fsdp_gathered_bytes(costs, idx)
  assert np.allclose(got, costs.param_bytes / 2)
  for gpus, mb in ((384, 4), (1536, 1)):
    cluster = make_cluster("a100", gpus)
    stage = Stage(0, tuple(g.nodes), tuple(range(gpus)), mb * gpus)
    plan = Plan((stage,), (), 1536 // (mb * gpus), batch_size=1536, param_sharding="fsdp")
    pc = plan_costs(plan, g, cluster, cm)
    tf, tb = cm.layer_times(costs, cluster.device, mb)
    link = cluster.group_link(stage.devices)
    comm = [cm.allgather_time(float(b), gpus, link) for b in got]
    fwd_lo = sum(max(float(t), c) for t, c in zip(tf, comm))
    eps = 1e-9
    assert fwd_lo * (1 - eps) <= pc.forward[0] <= (float(tf.sum()) + sum(comm)) * (1 + eps)
    assert pc.backward[0] >= max(float(tb.sum()), 2 * sum(comm)) * (1 - eps)
    assert pc.backward[0] <= (float(tb.sum()) + 2 * sum(comm)) * (1 + eps)
    assert pc.update[0] == pytest.approx(
      cm.update_traffic * costs.param_bytes.sum() / gpus / cluster.device.memory_bandwidth
    )
  # At one sequence a GPU the gathers set the pace: the forward is about their sum.
  assert pc.forward[0] == pytest.approx(sum(comm), rel=0.05)


def test_zero3_with_recomputation_gathers_each_layer_twice_in_the_backward():
  """DeepSpeed's ZeRO-3 hooks gather a layer for its recomputed forward and again for its
  backward (``fsdp_backward_gathers=2``); one gather serves both by default. Where the
  gathers set the pace (a sequence a GPU) the backward is about three collectives a layer
  instead of two; where the compute is about as long (four a GPU) it hides most of it."""

  from gpp_jax.cost.cost_model import CostModel, fsdp_gathered_bytes, fsdp_stage_times, layer_costs
  from gpp_jax.experiments.megatron import MEGATRON_COST_MODEL as cm
  from gpp_jax.experiments.published import ZERO3_COST_MODEL as z3

  assert z3 == dataclasses.replace(cm, fsdp_backward_gathers=2)
  with pytest.raises(ValueError, match="fsdp_backward_gathers"):
    CostModel(fsdp_backward_gathers=3)
  g = gpt_graph(GPTShape(8, 12288, 96), 1536)
  costs = layer_costs(g)
  idx = list(range(len(costs)))
  for gpus, mb in ((1536, 1), (384, 4)):
    cluster = make_cluster("a100", gpus)
    link = cluster.group_link(tuple(range(gpus)))
    comm = sum(cm.allgather_time(float(b), gpus, link) for b in fsdp_gathered_bytes(costs, idx))
    _, tb = cm.layer_times(costs, cluster.device, mb)
    once = fsdp_stage_times(cm, costs, cluster.device, idx, mb, gpus, link)
    twice = fsdp_stage_times(z3, costs, cluster.device, idx, mb, gpus, link)
    assert twice[0] == once[0]  # the forward gathers once either way
    assert max(float(tb.sum()), 3 * comm) <= twice[1] * (1 + 1e-9)
    assert twice[1] <= (float(tb.sum()) + 3 * comm) * (1 + 1e-9)
    serial = fsdp_stage_times(z3, costs, cluster.device, idx, mb, gpus, link, overlap=False)
    assert serial[1] == pytest.approx(float(tb.sum()) + 3 * comm)
    if mb == 1:
      assert once[1] == pytest.approx(2 * comm, rel=0.1)
      assert twice[1] == pytest.approx(3 * comm, rel=0.1)
    else:  # the compute about as long as three collectives: the second gather mostly hidden
      assert once[1] < twice[1] < 1.1 * once[1]


def test_the_reproduction_plans_graphpipe_as_the_plan_cli_does_by_default(monkeypatch):
  """GraphPipe's own plan in the reproduction is planned as ``gpp_jax.plan`` plans on GPUs
  when ``--stages_per_device`` is not given (``"auto"``: v by prediction), and its row says
  which v it took."""
  from gpp_jax.experiments import published
  from gpp_jax.passes import partition

  asked = []
  planner = partition.PLANNERS["graphpipe"]

  def recording(*args, **kw):
    asked.append(kw.get("stages_per_device"))
    return planner(*args, **kw)

  monkeypatch.setitem(partition.PLANNERS, "graphpipe", recording)
  (rec,) = published.compare((TABLE_1[0],))
  assert asked == ["auto"]
  assert rec["graphpipe_stages_per_device"] == 1 and rec["graphpipe_tflops"] > 0
  assert "1 stage on 32 rows, v 1, M 1" in published.markdown([rec])
