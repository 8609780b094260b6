"""Cluster IR and cost model."""

import math

import numpy as np
import pytest

from gpp_jax.cost.cluster import (
  CPU,
  H100_PEAK_FLOPS,
  Cluster,
  DeviceSpec,
  GiB,
  Link,
  as_cluster,
  cpu_cluster,
  cuda_cluster,
  v100_cluster,
)
from gpp_jax.cost.cost_model import CostModel, layer_costs, plan_costs, stage_edge_bytes
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.ir.layer_graph import LayerCost, add_edge, add_layer, new_layer_graph
from gpp_jax.ir.plan import Plan, Stage


def test_v100_preset_is_the_papers_cluster():
  c = v100_cluster(8)
  assert c.num_devices == 8 and len(c.devices) == 8
  assert c.devices_per_node == 4 and c.num_nodes == 2
  assert c.memory_per_device == 16 * GiB
  assert c.inter_link.beta == pytest.approx(100e9 / 8)  # 100 Gb/s
  assert c.link(0, 3) is c.intra_link and c.link(3, 4) is c.inter_link
  assert c.link_between([0, 1], [2, 3]) is c.intra_link
  assert c.link_between([2, 3], [4]) is c.inter_link
  assert c.group_link(range(4, 8)) is c.intra_link
  small = v100_cluster(4)
  assert small.slowest_link() is small.intra_link
  assert c.slowest_link() is c.inter_link


def test_cuda_preset_is_h100s_on_nvlink():
  c = cuda_cluster(4, dtype="bfloat16")
  assert c.num_devices == 4 and c.inter_link is None and c.num_nodes == 1
  assert c.device.peak_flops == pytest.approx(989.4e12)
  assert c.device.memory_bandwidth == pytest.approx(3.35e12)
  assert c.intra_link.beta == pytest.approx(450e9) and c.intra_link.name == "nvlink4"
  assert 50 * GiB < c.memory_per_device < 80e9
  # float32 matmuls run on TF32 tensor cores at JAX's default precision: half the bf16 peak.
  assert cuda_cluster(1).device.peak_flops == pytest.approx(H100_PEAK_FLOPS["bfloat16"] / 2)
  assert cuda_cluster(2, link="pcie").intra_link.beta < c.intra_link.beta / 5
  big = cuda_cluster(16)
  assert big.num_nodes == 2 and big.link(7, 8) is big.inter_link
  assert big.link(0, 7) is big.intra_link
  with pytest.raises(ValueError, match="no H100 peak for dtype 'int8'"):
    cuda_cluster(1, dtype="int8")
  with pytest.raises(ValueError, match="'nvlink' or 'pcie'"):
    cuda_cluster(1, link="ethernet")


def test_cluster_presets_by_name():
  from gpp_jax.cost.cluster import make_cluster

  assert make_cluster("cuda", 2, dtype="bfloat16").device.peak_flops == H100_PEAK_FLOPS["bfloat16"]
  assert make_cluster("cpu", 3) == cpu_cluster(3)
  assert make_cluster("a100", 16).device.peak_flops == 312e12  # Selene's DGX A100s
  assert make_cluster("h100", 16).devices_per_node == 8
  with pytest.raises(ValueError, match=r"unknown cluster 'b200'; choose one of \['cpu', 'cuda'"):
    make_cluster("b200", 1)


@pytest.mark.parametrize("cluster", [v100_cluster(16), cpu_cluster(8), cuda_cluster(16)])
def test_cluster_json_round_trip(cluster):
  back = Cluster.from_json(cluster.to_json())
  assert back == cluster
  assert "GiB" in str(cluster) and cluster.device.name in str(cluster)


def test_cluster_rejects_half_a_second_level():
  with pytest.raises(ValueError, match="both inter_link and devices_per_node"):
    Cluster(4, CPU, GiB, Link(0, 1e9), inter_link=Link(0, 1e9))
  with pytest.raises(ValueError, match="at least one device"):
    cpu_cluster(0)


def test_as_cluster_accepts_counts():
  assert as_cluster(3).num_devices == 3
  c = v100_cluster(2)
  assert as_cluster(c) is c
  with pytest.raises(TypeError, match="v100_cluster"):
    as_cluster("8")


def test_efficiency_curve_interpolates_in_log_space_and_clamps():
  d = DeviceSpec("x", 1e12, 1e11, efficiency=((1, 0.2), (16, 0.6)))
  assert d.efficiency_at(0.5) == 0.2 and d.efficiency_at(64) == 0.6
  assert d.efficiency_at(4) == pytest.approx(0.4)  # halfway in log2
  xs = [d.efficiency_at(s) for s in (1, 2, 3, 5, 8, 16)]
  assert xs == sorted(xs)
  with pytest.raises(ValueError, match="increase"):
    DeviceSpec("y", 1e12, 1e11, efficiency=((4, 0.5), (2, 0.6)))


def _one_layer(flops, nbytes, params, **extra):
  g = new_layer_graph("one", 8)
  add_layer(
    g, "a", LayerCost(flops=flops, bytes=nbytes, param_bytes=params, act_bytes=64.0), **extra
  )
  return g


def test_roofline_picks_the_slower_of_compute_and_memory():
  dev = DeviceSpec("d", peak_flops=1e12, memory_bandwidth=1e11)
  cm = CostModel()
  compute_bound = layer_costs(_one_layer(8e9, 8e3, 0.0))
  tf, tb = cm.layer_times(compute_bound, dev, 8)
  assert tf[0] == pytest.approx(8e9 / 1e12)
  assert tb[0] == pytest.approx(2 * tf[0])  # backward defaults to 2x
  memory_bound = layer_costs(_one_layer(8e3, 8e9, 0.0))
  tf, _ = cm.layer_times(memory_bound, dev, 8)
  assert tf[0] == pytest.approx(8e9 / 1e11)


def test_weights_are_read_once_per_micro_batch():
  dev = DeviceSpec("d", peak_flops=1e15, memory_bandwidth=1e9)
  cm = CostModel()
  c = layer_costs(_one_layer(1.0, 1e6 + 8e3, 1e6))  # 1 MB weights + 1 KB/sample
  t1 = cm.layer_times(c, dev, 1)[0][0]
  t8 = cm.layer_times(c, dev, 8)[0][0]
  assert t1 == pytest.approx((1e6 + 1e3) / 1e9)
  assert t8 == pytest.approx((1e6 + 8e3) / 1e9)
  # A sparse gather (bytes < params) does not read the whole table.
  sparse = layer_costs(_one_layer(1.0, 8e3, 1e9))
  assert cm.layer_times(sparse, dev, 8)[0][0] == pytest.approx(8e3 / 1e9)


def test_measured_times_replace_the_roofline_and_scale_with_efficiency():
  dev = DeviceSpec("d", 1e12, 1e11, efficiency=((1, 0.5), (8, 1.0)))
  c = layer_costs(_one_layer(1e12, 1.0, 0.0, time_f=0.08, time_b=0.2))
  tf, tb = CostModel().layer_times(c, dev, 8)
  assert (tf[0], tb[0]) == pytest.approx((0.08, 0.2))
  tf1, _ = CostModel().layer_times(c, dev, 1)
  assert tf1[0] == pytest.approx(0.08 / 8 * 1.0 / 0.5)  # small batch: half as efficient


def test_kernel_overhead_is_added_per_pass_to_estimated_times_only():
  dev = DeviceSpec("d", 1e12, 1e11, kernel_overhead=1e-3)
  tf, tb = CostModel().layer_times(layer_costs(_one_layer(0.0, 0.0, 0.0)), dev, 4)
  assert (tf[0], tb[0]) == pytest.approx((1e-3, 1e-3))
  # A measured time already holds the launch: it is taken as measured.
  measured = layer_costs(_one_layer(0.0, 0.0, 0.0, time_f=2e-3, time_b=5e-3))
  tf, tb = CostModel().layer_times(measured, dev, 8)
  assert (tf[0], tb[0]) == pytest.approx((2e-3, 5e-3))


def test_ring_allreduce_and_memory_terms():
  cm = CostModel()
  link = Link(alpha=1e-5, beta=1e10)
  assert cm.allreduce_time(1e9, 1, link) == 0.0
  assert cm.allreduce_time(1e9, 4, link) == pytest.approx(6e-5 + 1.5 * 1e9 / 1e10)
  assert cm.static_memory(100.0) == 400.0  # weights, grads, Adam m and v
  assert CostModel(optimizer_state_factor=0.0).static_memory(100.0) == 200.0
  # Activations: saved bytes per sample x micro-batch x in-flight / data-parallel degree.
  assert cm.stage_memory(100.0, 10.0, 8, 2, 3) == 400.0 + 10.0 * 8 / 2 * 3
  assert cm.combine(2.0, 1.0) == 3.0 and CostModel(tps_formula="max").combine(2.0, 1.0) == 2.0
  with pytest.raises(ValueError, match="tps_formula"):
    CostModel(tps_formula="avg")


def test_plan_costs_prices_edges_on_the_link_between_stage_devices():
  g = new_layer_graph("two", 4)
  add_layer(g, "a", LayerCost(flops=4e9, bytes=4e3, param_bytes=1e3, act_bytes=4e6))
  add_layer(g, "b", LayerCost(flops=4e9, bytes=4e3, param_bytes=1e3, act_bytes=4e6))
  add_layer(g, "c", LayerCost(flops=4e9, bytes=4e3, param_bytes=1e3, act_bytes=4e6))
  add_edge(g, "a", "b", 4e6)
  add_edge(g, "a", "c", 4e6)  # read by two layers of the same stage: sent once
  add_edge(g, "b", "c", 4e6)
  cl = v100_cluster(8)
  plan = Plan(
    stages=(Stage(0, ("a",), (3,)), Stage(1, ("b", "c"), (4, 5))),
    edges=((0, 1),),
    num_microbatches=2,
    batch_size=4,
  )
  pc = plan_costs(plan, g, cl)
  # Micro-batch 2 samples: 1e6 bytes per sample * 2 over the inter-node link.
  ib = cl.inter_link
  assert pc.activation_transfer[(0, 1)] == pytest.approx(ib.alpha + 2e6 / ib.beta)
  assert pc.microbatch == (2.0, 2.0)
  assert pc.static_memory[1] == pytest.approx(CostModel().static_memory(2e3))
  costs = layer_costs(g)
  assert stage_edge_bytes(costs, [0, 1, 1]) == {(0, 1): 1e6}
  # Stage 1 is data parallel over 2 devices: each runs 1 sample of the micro-batch.
  tf1, _ = CostModel().stage_time(costs, [1, 2], cl.device, 2, 2)
  tf1_alone, _ = CostModel().stage_time(costs, [1, 2], cl.device, 1, 1)
  assert tf1 == pytest.approx(tf1_alone)


def test_link_between_is_the_slowest_link_of_the_nodes_spanned():
  """``link_between`` reads the lowest and highest device; it must name the link the set of
  nodes the devices span calls for (one node: intra, more or none: inter)."""
  import random

  rng = random.Random(0)
  for cl in (v100_cluster(8), v100_cluster(32), cpu_cluster(4)):
    for _ in range(2000):
      src = rng.sample(range(cl.num_devices), rng.randint(0, 3))
      dst = rng.sample(range(cl.num_devices), rng.randint(0, 3))
      nodes = {cl.node_of(d) for d in src + dst}
      one = cl.inter_link is None or len(nodes) == 1
      assert cl.link_between(src, dst) is (cl.intra_link if one else cl.inter_link)


def test_plan_costs_remembered_in_the_layer_costs_are_a_fresh_pricing():
  """``plan_costs`` keeps per-stage terms, stage times and edge bytes in the LayerCosts it is
  given; pricing plans that share stages with one LayerCosts must give, to the last bit, what
  a fresh LayerCosts gives each."""
  g = mg.candle_uno(batch_size=16, branches=3, layers=2, hidden=64, top_layers=1)
  layers = list(layer_costs(g).layers)
  cl = v100_cluster(8)
  shared = layer_costs(g)
  for cut in (2, 4, 2, 6, 4):
    for mb, dp in ((4, 1), (8, 2), (4, 1)):
      plan = Plan(
        stages=(
          Stage(0, tuple(layers[:cut]), tuple(range(dp)), microbatch_size=mb),
          Stage(1, tuple(layers[cut:]), (dp + 2,)),
        ),
        edges=((0, 1),),
        num_microbatches=16 // mb,
        batch_size=16,
      )
      assert plan_costs(plan, g, cl, costs=shared) == plan_costs(plan, g, cl, costs=layer_costs(g))


def test_model_graph_costs_follow_the_shapes():
  g = mg.candle_uno(batch_size=4, branches=3, layers=2, hidden=64, top_layers=1)
  assert g.number_of_nodes() == 3 * 2 + 1 + 1 + 1 + 1
  d = g.nodes["tower0.fc1"]
  assert d["flops"] == 2 * 64 * 64 * 4
  assert d["param_bytes"] == 4 * (64 * 64 + 64)
  assert g.nodes["top.fc0"]["param_bytes"] == 4 * (3 * 64 * 64 + 64)
  assert g.edges["tower0.fc1", "concat"]["bytes"] == 4 * 64 * 4
  m = mg.mmt(batch_size=2)
  assert m.number_of_nodes() == 4 * 9 + 3
  h, f, s = 1024, 4096, 256
  assert m.nodes["b0.layer0"]["param_bytes"] == 4 * (4 * h * h + 2 * h * f + f + 9 * h)
  assert m.nodes["b0.layer0"]["flops"] == 2 * (2 * s * (4 * h * h + 2 * h * f) + 4 * s * s * h)
  d = mg.dlrm(batch_size=2)
  assert sum(1 for n in d if n.startswith("sparse")) == 7
  assert d.nodes["sparse0.emb"]["param_bytes"] == 4 * 1_000_000 * 64
  assert mg.model_graph("candle_uno", branches=16).number_of_nodes() == 16 * 4 + 7
  with pytest.raises(ValueError, match="unknown model graph"):
    mg.model_graph("resnet")
  assert math.isclose(
    float(np.sum(layer_costs(m).param_bytes)), sum(m.nodes[n]["param_bytes"] for n in m)
  )


def test_efficiency_is_keyed_on_rows_not_samples():
  """A layer whose products see 64 rows per sample runs at one sample as efficiently as a
  one-row layer at 64 samples; a layer without ``rows`` keys the curve on samples."""
  dev = DeviceSpec("d", 1e12, 1e15, efficiency=((1, 0.25), (64, 1.0)))
  cm = CostModel()
  t_seq = cm.layer_times(layer_costs(_one_layer(8e9, 1.0, 0.0, rows=64)), dev, 1)[0][0]
  t_flat = cm.layer_times(layer_costs(_one_layer(8e9, 1.0, 0.0)), dev, 1)[0][0]
  assert t_seq == pytest.approx(1e9 / 1e12)  # one sample of 64 rows: full efficiency
  assert t_flat == pytest.approx(4 * t_seq)  # one sample of one row: a quarter of peak
  with pytest.raises(ValueError, match="'rows'"):
    layer_costs(_one_layer(8e9, 1.0, 0.0, rows=0))
