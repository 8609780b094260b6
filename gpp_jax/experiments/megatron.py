"""Megatron-LM's GPT runs on Selene (Narayanan et al., SC'21, Table 1), as the simulator sees them.

A GPT of any size as a layer graph (``gpt_graph``: no parameters are built), a plan of the
paper's layout (``layout_plan``: tensor parallel t inside a node, p pipeline stages, data
parallel over the rest), and the paper's FLOP count (``paper_flops``, its equation 3), so that a
predicted iteration time becomes the figure the paper reports, teraFLOP/s per GPU.

How the layout is priced (``cost.cost_model``, the same code that prices every plan):
- The plan's devices are *rows*: the t GPUs of one tensor-parallel group (``row_cluster``). A
  row's device is one GPU; each Transformer layer computes 1/t of its work on each GPU and
  all-reduces over NVLink (two all-reduces of the layer's output per forward, four per
  backward with the recomputed forward: graph["tensor_parallel"]); each GPU holds 1/t of the
  parameters (graph["param_shards"]).
- Activations are recomputed (the paper's FLOP count assumes it): a backward costs three
  forwards (``CostModel.backward_factor``), and a stage stashes only its layers' inputs.
- Pipeline transfers use the scatter/gather optimisation: each of a row's t GPUs sends 1/t of
  an activation over its own InfiniBand adapter (the edge bytes are divided by t).
- Data-parallel gradients (fp32, 4 bytes a parameter) are all-reduced once per step over the
  stage's rows, each GPU its 1/t over its own adapter, after the last backward.
- Mixed precision: activations in 2 bytes, weights read in 2 bytes, parameters with their
  gradients and Adam moments held in 4 bytes each.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import networkx as nx

from gpp_jax.cost.cluster import Cluster, make_cluster
from gpp_jax.cost.cost_model import CostModel
from gpp_jax.ir.layer_graph import LayerCost, add_edge, add_layer, new_layer_graph
from gpp_jax.ir.plan import Plan, Stage

ACT_BYTES = 2  # float16 / bfloat16 activations
PARAM_BYTES = 4  # fp32 master weights, fp32 gradients (and each Adam moment)
WEIGHT_READ_BYTES = 2  # the half-precision copy the GEMMs read
# Recomputed activations: a backward runs the forward again, then its two GEMMs per forward one.
MEGATRON_COST_MODEL = CostModel(
  backward_factor=3.0, gradient_factor=1.0, optimizer_state_factor=2.0
)


SEQ_LEN, VOCAB = 2048, 51200


@dataclasses.dataclass(frozen=True)
class GPTShape:
  """A GPT's shape: ``layers`` Transformer layers of width ``hidden`` with ``heads`` heads
  (and a 4h MLP), sequences of ``seq`` tokens, a vocabulary of ``vocab``."""

  layers: int
  hidden: int
  heads: int
  seq: int = SEQ_LEN
  vocab: int = VOCAB

  def __post_init__(self):
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    small = [f"{k}={v}" for k, v in values.items() if v < 1]
    if small:
      raise ValueError(f"a GPT's sizes must be at least 1: {', '.join(small)}")
    if self.hidden % self.heads:
      raise ValueError(
        f"a GPT of hidden size {self.hidden} cannot have {self.heads} attention heads: the "
        f"heads split the hidden size evenly (e.g. {_dividing_heads(self.hidden, self.heads)})"
      )


def _dividing_heads(hidden: int, heads: int) -> str:
  """The head counts nearest ``heads`` that divide ``hidden``, for an error message."""
  below = next(h for h in range(heads, 0, -1) if hidden % h == 0)
  above = next((h for h in range(heads, hidden + 1) if hidden % h == 0), None)
  return f"{below} or {above}" if above is not None and above != below else str(below)


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of the paper's Table 1 (sequence ``seq``, vocabulary ``vocab``): a GPT run in
  the layout tp x pp (data parallel over the rest of the ``gpus``) at mini-batch ``batch``."""

  params_b: float  # billions of parameters, as published
  heads: int
  hidden: int
  layers: int
  tp: int
  pp: int
  gpus: int
  batch: int
  tflops: float  # achieved teraFLOP/s per GPU, as published
  seq: int = SEQ_LEN
  vocab: int = VOCAB

  @property
  def shape(self) -> GPTShape:
    return GPTShape(self.layers, self.hidden, self.heads, self.seq, self.vocab)


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21, Table 1 (weak scaling on Selene; vocabulary 51,200, sequence 2,048;
# the interleaved schedule with the scatter/gather optimisation; activations recomputed).
TABLE_1 = (
  Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
  Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
  Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
  Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
  Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
  Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
  Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
  Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
  Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
  Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
# The four rows the GPU efficiency model's level was set on (docs/results/megatron.md), no other.
FITTED_ON: tuple[float, ...] = (1.7, 18.4, 145.6, 1008.0)


def paper_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
  """FLOPs per iteration by the paper's equation (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)),
  the GEMMs of the forward, the backward and the recomputed forward."""
  B, s, l, h, V = batch, seq, layers, hidden, vocab
  return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def paper_params(layers: int, hidden: int, seq: int = SEQ_LEN, vocab: int = VOCAB) -> float:
  """Parameters by the paper's equation (2): 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
  l, h = layers, hidden
  return 12.0 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


@dataclasses.dataclass(frozen=True)
class GPTCosts:
  """What a GPT's parts compute and hold, per sequence: forward FLOPs and parameters of the
  embedding (tokens and positions), of one Transformer block, and of the head (the final
  LayerNorm and the output projection tied to the token embedding, whose copy the last stage
  holds), the loss's softmax cross-entropy apart. ``source`` says where they came from."""

  embed_flops: float
  block_flops: float
  head_flops: float
  embed_params: float
  block_params: float
  head_params: float
  source: str

  @classmethod
  def analytic(cls, shape: GPTShape) -> GPTCosts:
    """The paper's counts: a block's GEMMs 24 s h^2 + 4 s^2 h, 12 h^2 + 13 h parameters; the
    head's GEMM 2 s h V."""
    s, h, V = shape.seq, shape.hidden, shape.vocab
    return cls(
      embed_flops=float(s * h),
      block_flops=24.0 * s * h * h + 4.0 * s * s * h,
      head_flops=2.0 * s * h * V,
      embed_params=float((V + s) * h),
      block_params=float(12 * h * h + 13 * h),
      head_params=float(V * h),
      source="the paper's equations",
    )


def loss_flops(shape: GPTShape) -> float:
  """The softmax cross-entropy over one sequence's logits, as priced: 4 s V."""
  return 4.0 * shape.seq * shape.vocab


@functools.lru_cache(maxsize=64)
def traced_costs(shape: GPTShape) -> GPTCosts:
  """``GPTCosts`` of the trainable GPT (``gpp_jax.models.gpt``: tied embeddings, a 4h MLP) of
  ``shape``, from its traced step: the model built abstractly (``nnx.eval_shape``: no
  parameters allocated) with two blocks, its training step traced for one sequence and layered
  by the same capture pass ``graph_pipeline`` runs, each layer's FLOPs the layering's count of
  its equations. The blocks are identical, so a model of ``shape.layers`` blocks is this one
  with the block repeated (tracing all of them takes minutes at 128 blocks of width 25,600
  and gives the same block)."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from gpp_jax.models import gpt
  from gpp_jax.runtime.capture_step import functionalize, value_and_grad
  from gpp_jax.runtime.captured import capture
  from gpp_jax.runtime.options import Options

  config = gpt.GPTConfig(
    vocab_size=shape.vocab,
    seq_len=shape.seq,
    hidden=shape.hidden,
    num_layers=2,
    num_heads=shape.heads,
    ffn=4 * shape.hidden,
    tie_embeddings=True,
  )

  def build():
    model = gpt.make_model(config, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(1e-4), wrt=nnx.Param)

  def step(model, optimizer, batch):
    loss, grads = value_and_grad(gpt.loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

  model, optimizer = nnx.eval_shape(build)
  tokens = jax.ShapeDtypeStruct((1, shape.seq), jnp.int32)
  args = (model, optimizer, {"tokens": tokens, "targets": tokens})
  pure, leaves = functionalize(step, args)
  opts = Options(num_microbatches=1, devices=(jax.devices()[0],), layer_depth=2, name="gpt")
  g = capture(pure, args, leaves, opts).layering.graph
  params: dict[str, float] = {}
  for path, x in jax.tree.leaves_with_path(nnx.state(model, nnx.Param)):
    top = path[0].key if path[0].key != "blocks" else f"blocks/{path[1].key}"
    params[top] = params.get(top, 0.0) + float(x.size)
  head = [n for n in g if n not in ("embed", "blocks/0", "blocks/1")]  # norm, embed#2 (tied)
  return GPTCosts(
    embed_flops=float(g.nodes["embed"]["flops"]),
    block_flops=float(g.nodes["blocks/0"]["flops"]),
    head_flops=sum(float(g.nodes[n]["flops"]) for n in head) - loss_flops(shape),
    embed_params=params["embed"],
    block_params=params["blocks/0"],
    head_params=params["norm"] + shape.vocab * shape.hidden,
    source="traced from gpp_jax.models.gpt",
  )


def gpt_graph(
  shape: GPTShape, batch_size: int, tp: int = 1, costs: GPTCosts | None = None
) -> nx.DiGraph:
  """The layer graph of a GPT of ``shape`` (embedding, ``layers`` Transformer layers with a 4h
  MLP, the LM head tied to the embedding, the loss) for ``batch_size`` sequences, priced as
  Megatron-LM runs it with tensor parallelism ``tp`` (module docstring). What each part
  computes and holds is ``costs``, by default the trainable GPT's (``traced_costs``); how it
  runs (half-precision activations, recomputation, tensor parallelism) is Megatron-LM's."""
  costs = traced_costs(shape) if costs is None else costs
  B, s, h, V = batch_size, shape.seq, shape.hidden, shape.vocab
  layers = shape.layers
  g = new_layer_graph(f"gpt{layers}x{h}", B)
  g.graph["costs"] = costs.source
  act = ACT_BYTES * s * h  # one sequence's hidden states
  embed_params = PARAM_BYTES * costs.embed_params  # token and position embeddings
  embed = LayerCost(
    flops=float(costs.embed_flops * B),
    bytes=float(2 * act * B),
    param_bytes=float(embed_params),
    act_bytes=float(act * B),
    saved_bytes=float(ACT_BYTES * s * B),
  )
  add_layer(g, "embed", embed, param_read_bytes=0.0)
  tensor_parallel: dict[str, tuple[int, float, float]] = {}
  shards: dict[str, tuple[float, float, float]] = {}
  prev = "embed"
  layer_params = costs.block_params
  for i in range(layers):
    name = f"layer{i}"
    cost = LayerCost(
      flops=float(costs.block_flops * B),
      bytes=float(WEIGHT_READ_BYTES * layer_params + 16 * act * B),
      param_bytes=float(PARAM_BYTES * layer_params),
      act_bytes=float(act * B),
      saved_bytes=float(act * B),  # recomputed: only the layer's input is kept
    )
    add_layer(
      g,
      name,
      cost,
      rows=s,
      width=float(h),
      param_read_bytes=float(WEIGHT_READ_BYTES * layer_params),
    )
    add_edge(g, prev, name, act * B / tp)  # scatter/gather: 1/t of it over each adapter
    tensor_parallel[name] = (tp, 2.0 * act, 4.0 * act)
    shards[name] = (PARAM_BYTES * layer_params, PARAM_BYTES * layer_params / tp, 0.0)
    prev = name
  head = LayerCost(
    flops=float(costs.head_flops * B),
    bytes=float(WEIGHT_READ_BYTES * costs.head_params + ACT_BYTES * s * (h + V) * B),
    param_bytes=float(PARAM_BYTES * costs.head_params),  # the tied embedding's copy
    act_bytes=float(ACT_BYTES * s * B),
    saved_bytes=float(act * B),
  )
  add_layer(
    g,
    "lm_head",
    head,
    rows=s,
    width=float(h),
    param_read_bytes=float(WEIGHT_READ_BYTES * costs.head_params),
  )
  add_edge(g, prev, "lm_head", act * B / tp)
  tensor_parallel["lm_head"] = (tp, 0.0, float(act))
  tensor_parallel["embed"] = (tp, float(act), 0.0)
  for name in ("embed", "lm_head"):
    p = g.nodes[name]["param_bytes"]
    shards[name] = (p, p / tp, 0.0)
  loss = LayerCost(
    flops=float(loss_flops(shape) * B / tp),
    bytes=float(ACT_BYTES * s * V * B / tp),
    act_bytes=float(4 * B),
    saved_bytes=0.0,
  )
  add_layer(g, "loss", loss)
  add_edge(g, "lm_head", "loss", ACT_BYTES * s * B)
  if tp > 1:
    g.graph["tensor_parallel"] = tensor_parallel
    g.graph["param_shards"] = shards
    # Rows of tp GPUs, as a ("data", "model") mesh: a stage may narrow "model" to a divisor
    # of tp (``Stage.inner``, chosen by the planners: ``passes.partition.stage_shapes``).
    g.graph["mesh"] = {"axes": ("data", "model"), "inner": (tp,), "divides": ()}
  return g


def row_cluster(cluster: Cluster, tp: int) -> Cluster:
  """``cluster`` as a planner of rows sees it: one device per tensor-parallel group of ``tp``
  GPUs (a GPU's speed; the layers divide their work over the group themselves), rows of one
  node on NVLink, rows of different nodes on each GPU's own InfiniBand adapter."""
  if cluster.num_devices % tp:
    raise ValueError(f"{cluster.num_devices} GPUs do not split into groups of tp={tp}")
  per_node = cluster.devices_per_node or cluster.num_devices
  if per_node % tp:
    raise ValueError(f"tp={tp} does not divide the {per_node} GPUs of a node")
  return dataclasses.replace(
    cluster,
    num_devices=cluster.num_devices // tp,
    devices_per_node=per_node // tp if cluster.inter_link is not None else None,
    name=f"{cluster.name} (rows of tp={tp})",
  )


def layout_plan(
  graph: nx.DiGraph, num_rows: int, pp: int, microbatch: int = 1, stages_per_device: int = 1
) -> Plan:
  """The paper's layout for ``graph``'s mini-batch (its ``batch_size``): the chain cut into
  ``pp * stages_per_device`` stages of equal Transformer layers (the embedding with the first,
  the head and the loss with the last), stage k on the ``dp = num_rows / pp`` rows of pipeline
  rank k mod pp (Megatron's interleaving for more than one stage per device),
  ``batch / (dp * microbatch)`` micro-batches."""
  batch_size = graph.graph["batch_size"]
  if num_rows % pp:
    raise ValueError(f"{num_rows} rows do not split into pp={pp} pipeline ranks")
  dp = num_rows // pp
  if batch_size % (dp * microbatch):
    raise ValueError(
      f"batch {batch_size} does not split into {dp} data-parallel replicas of micro-batches "
      f"of {microbatch}"
    )
  body = [l for l in graph if l.startswith("layer")]
  body.sort(key=lambda l: int(l[len("layer") :]))
  S = pp * stages_per_device
  if len(body) < S:
    raise ValueError(f"{len(body)} layers do not fill {S} stages")
  cuts = [round(k * len(body) / S) for k in range(S + 1)]
  stages = []
  for k in range(S):
    layers = body[cuts[k] : cuts[k + 1]]
    if k == 0:
      layers = ["embed", *layers]
    if k == S - 1:
      layers = [*layers, "lm_head", "loss"]
    rank = k % pp
    stages.append(
      Stage(k, tuple(layers), tuple(range(rank * dp, (rank + 1) * dp)), microbatch * dp)
    )
  M = batch_size // (dp * microbatch)
  schedule = "interleaved-1f1b" if stages_per_device > 1 else "1f1b"
  return Plan(
    tuple(stages),
    tuple((k, k + 1) for k in range(S - 1)),
    M,
    schedule=schedule,
    planner="layout",
    batch_size=batch_size,
  )


def predict_layout(
  row: Row,
  cluster_name: str = "a100",
  microbatch: int = 1,
  stages_per_device: Sequence[int] = (1, 2, 4),
) -> dict[str, Any]:
  """The simulated iteration of ``row``'s layout (its GPT: ``Row.shape``) on ``cluster_name``,
  micro-batches of ``microbatch`` sequences: the best of
  ``stages_per_device`` (those that divide the layers of a pipeline rank), as a record with
  ``iteration_ms``, ``samples_per_s``, ``tflops_per_device`` (the paper's FLOPs per iteration
  / time / GPUs), ``iteration_ms_by_v`` (every v simulated), the modelled peak memory per GPU
  against a GPU's (``peak_memory_gib``, ``memory_per_gpu_gib``, ``fits_memory``) and the plan.
  ValueError where no v of ``stages_per_device`` applies."""
  from gpp_jax.passes.simulation import simulate

  cluster = make_cluster(cluster_name, row.gpus)
  rows = row_cluster(cluster, row.tp)
  graph = gpt_graph(row.shape, row.batch, row.tp)
  best: dict[str, Any] | None = None
  by_v: dict[int, float] = {}
  per_rank = row.layers // row.pp
  usable = [v for v in stages_per_device if v == 1 or (row.pp > 1 and per_rank % v == 0)]
  if not usable:
    why = (
      "one pipeline rank does not interleave"
      if row.pp == 1
      else f"its {per_rank} layers per pipeline rank do not split into that many"
    )
    raise ValueError(
      f"tp:{row.tp},pp:{row.pp} cannot run {' or '.join(map(str, stages_per_device))} stages "
      f"per device: {why}; pass --stages_per_device=1 or auto"
    )
  for v in usable:
    plan = layout_plan(graph, rows.num_devices, row.pp, microbatch, v)
    res = simulate(plan, graph, rows, cost_model=MEGATRON_COST_MODEL, timeline=False)
    T = res.iteration_time
    by_v[v] = T * 1e3
    rec = {
      "planner": "layout",
      "layout": f"tp:{row.tp},pp:{row.pp},dp:{rows.num_devices // row.pp}",
      "stages_per_device": v,
      "microbatch": microbatch,
      "num_microbatches": plan.num_microbatches,
      "iteration_ms": T * 1e3,
      "samples_per_s": row.batch / T,
      "tflops_per_device": paper_flops(row.batch, row.seq, row.layers, row.hidden, row.vocab)
      / T
      / row.gpus
      / 1e12,
      "peak_memory_gib": max(res.peak_memory.values(), default=0.0) / 2**30,
      "memory_per_gpu_gib": rows.memory_per_device / 2**30,
      "fits_memory": max(res.peak_memory.values(), default=0.0) <= rows.memory_per_device,
      "costs": graph.graph["costs"],
      "plan": plan,
    }
    if best is None or rec["iteration_ms"] < best["iteration_ms"]:
      best = rec
  assert best is not None  # usable is not empty
  best["iteration_ms_by_v"] = by_v
  return best
