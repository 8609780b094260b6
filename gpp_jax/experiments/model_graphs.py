"""Synthetic LayerGraphs of the benchmark models, with costs computed from their shapes.

These are the same graph type the capture pass produces (see ``gpp_jax.ir.layer_graph``), built
analytically so planners can be studied at paper scale without tracing a model. All tensors
are fp32 (4 bytes). Costs are for ``batch_size`` samples. A Transformer layer's shape is a
``TransformerShape`` (``mmt``'s ``MMT_LAYER``, ``gpt``'s ``GPT_LAYER``), DLRM's a ``DLRMShape``;
``model_graph`` takes their fields by name (``model_graph("mmt", seq=64)``).

Paper presets (GraphPipe, App. A.2):
  mmt():        4 branches x 8 Transformer layers, sequence 256, hidden 1024, 16 heads,
                FFN 4096; each branch has an input projection; branches are concatenated
                and a head projects back to the hidden size.
  dlrm():       7 dense branches of 4 feed-forward layers (4096, the last projecting to the
                embedding size as in DLRM's bottom MLP) + 7 embedding-bag branches
                (dimension 64, bag 100, 1M rows); the interaction concatenates the 14 vectors
                and their pairwise dot products; then a top MLP of 4 layers at 4096 and a
                1-unit output. ``dlrm(shape=PAPER_DLRM)`` is DLRM as the GraphPipe paper
                describes it: each bag's 100 embeddings are concatenated (6400 wide), the
                dense branches end at 4096, and the interaction concatenates them (73,472
                wide); the planners' "paper" preset uses this form.
  candle_uno(): 7 branches x 4 feed-forward layers (4096), concatenation, 4 top layers at 4096
                and a 1-unit output; ``branches`` is configurable (the paper sweeps 2-16).
  gpt():        a chain: embedding, n Transformer layers, LM head.

Per-layer cost formulas (per sample; multiply by the batch):
  dense d_in -> d_out:  flops 2 d_in d_out; params 4 (d_in d_out + d_out); output 4 d_out;
                        saved 4 (d_in + d_out) (input and pre-activation).
  Transformer layer (s, h, a, f): flops 2 s (4 h^2 + 2 h f) + 4 s^2 h; params 4 (4 h^2 + 2 h f
                        + f + 9 h); output 4 s h; saved 4 (12 s h + 2 s f + 2 a s^2).
  embedding bag (rows, dim, bag): flops bag * dim; params 4 rows dim (read: 4 bag dim);
                        output 4 dim; saved 4 bag (the indices).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import networkx as nx

from gpp_jax.ir.layer_graph import LayerCost, add_edge, add_layer, new_layer_graph

F32 = 4


@dataclasses.dataclass(frozen=True)
class TransformerShape:
  """One Transformer layer: ``seq`` tokens of width ``hidden``, ``heads`` attention heads and
  a feed-forward of width ``ffn`` (None: ``4 * hidden``)."""

  seq: int
  hidden: int = 1024
  heads: int = 16
  ffn: int | None = None

  @property
  def ffn_width(self) -> int:
    return self.ffn or 4 * self.hidden


# The paper's MMT layer (App. A.2) and the GPT layer of ``gpt()``.
MMT_LAYER = TransformerShape(seq=256, hidden=1024, heads=16, ffn=4096)
GPT_LAYER = TransformerShape(seq=1024, hidden=1024, heads=16)


@dataclasses.dataclass(frozen=True)
class DLRMShape:
  """DLRM's shape (``dlrm``): ``dense_branches`` feed-forward branches of ``dense_layers``
  layers at ``hidden``, the last projecting to ``dense_out`` (0: ``embedding_dim``);
  ``sparse_branches`` embedding bags of ``rows`` rows of ``embedding_dim``, ``bag_size`` of
  them pooled per sample (``concat_bags``: concatenated instead); a top MLP of
  ``top_layers`` layers at ``hidden``."""

  dense_branches: int = 7
  dense_layers: int = 4
  hidden: int = 4096
  sparse_branches: int = 7
  embedding_dim: int = 64
  bag_size: int = 100
  rows: int = 1_000_000
  top_layers: int = 4
  concat_bags: bool = False
  dense_out: int = 0


# DLRM as the GraphPipe paper describes it (module docstring).
PAPER_DLRM = DLRMShape(concat_bags=True, dense_out=4096)


class _GraphBuilder:
  """A LayerGraph under construction, its costs for ``batch_size`` samples."""

  def __init__(self, name: str, batch_size: int):
    self.g = new_layer_graph(name, batch_size)
    self.B = batch_size

  def connect(self, name: str, inputs: Iterable[str]) -> str:
    """Edges from each of ``inputs`` to ``name``, carrying the input's activations."""
    for src in inputs:
      add_edge(self.g, src, name, self.g.nodes[src]["act_bytes"])
    return name

  def dense(
    self, name: str, d_in: int, d_out: int, inputs: Iterable[str] = (), rows: int = 1
  ) -> str:
    """A dense layer applied to ``rows`` rows of each sample."""
    B = self.B * rows
    params = F32 * (d_in * d_out + d_out)
    cost = LayerCost(
      flops=2.0 * d_in * d_out * B,
      bytes=params + F32 * (d_in + d_out) * B,
      param_bytes=params,
      act_bytes=F32 * d_out * B,
      saved_bytes=F32 * (d_in + d_out) * B,
    )
    add_layer(self.g, name, cost, rows=rows)
    return self.connect(name, inputs)

  def transformer(self, name: str, shape: TransformerShape, inputs: Iterable[str] = ()) -> str:
    """A Transformer layer of ``shape`` (the module docstring's formulas)."""
    s, h, a, f, B = shape.seq, shape.hidden, shape.heads, shape.ffn_width, self.B
    params = F32 * (4 * h * h + 2 * h * f + f + 9 * h)
    act = F32 * s * h
    cost = LayerCost(
      flops=(2.0 * s * (4 * h * h + 2 * h * f) + 4.0 * s * s * h) * B,
      bytes=params + F32 * (16 * s * h + 4 * s * f + 3 * a * s * s) * B,
      param_bytes=params,
      act_bytes=act * B,
      saved_bytes=F32 * (12 * s * h + 2 * s * f + 2 * a * s * s) * B,
    )
    add_layer(self.g, name, cost, rows=s)
    return self.connect(name, inputs)

  def concat(self, name: str, inputs: Iterable[str]) -> str:
    """The concatenation of ``inputs``' activations."""
    inputs = list(inputs)
    out = sum(self.g.nodes[i]["act_bytes"] for i in inputs)
    add_layer(self.g, name, LayerCost(flops=0.0, bytes=2.0 * out, act_bytes=out, saved_bytes=0.0))
    return self.connect(name, inputs)

  def loss(self, name: str, src: str) -> str:
    """The loss of ``src``'s outputs, one value per sample."""
    act = self.g.nodes[src]["act_bytes"]
    cost = LayerCost(flops=4.0 * act / F32, bytes=act, act_bytes=F32 * self.B, saved_bytes=act)
    add_layer(self.g, name, cost)
    return self.connect(name, [src])


def mmt(
  batch_size: int = 32,
  branches: int = 4,
  layers: int = 8,
  transformer: TransformerShape = MMT_LAYER,
) -> nx.DiGraph:
  """Multi-modal Transformer: ``branches`` towers of ``layers`` Transformer layers."""
  t = transformer
  b = _GraphBuilder(f"mmt{branches}x{layers}", batch_size)
  tails = []
  for br in range(branches):
    prev = b.dense(f"b{br}.in_proj", t.hidden, t.hidden, rows=t.seq)
    for l in range(layers):
      prev = b.transformer(f"b{br}.layer{l}", t, [prev])
    tails.append(prev)
  cat = b.concat("concat", tails)
  head = b.dense("head", branches * t.hidden, t.hidden, [cat], rows=t.seq)
  b.loss("loss", head)
  return b.g


def dlrm(batch_size: int = 128, shape: DLRMShape = DLRMShape()) -> nx.DiGraph:
  """DLRM with dense feed-forward branches and embedding-bag branches (``DLRMShape``).

  Each dense branch has ``dense_layers`` layers at ``hidden`` whose last one projects to
  ``dense_out`` (0: ``embedding_dim``, DLRM's bottom MLP ending at the embedding size). An
  embedding bag pools its ``bag_size`` vectors to one (``concat_bags=False``) or concatenates
  them (``bag_size * embedding_dim`` wide). With pooled bags and ``dense_out`` at the embedding
  size the interaction concatenates the branch outputs with their pairwise dot products;
  otherwise it concatenates the branch outputs. The top MLP has ``top_layers`` layers at
  ``hidden`` and a 1-unit output.
  """
  d = shape
  B = batch_size
  d_dense = d.dense_out or d.embedding_dim
  bag_width = d.bag_size * d.embedding_dim if d.concat_bags else d.embedding_dim
  b = _GraphBuilder(f"dlrm{d.dense_branches}+{d.sparse_branches}", B)
  g = b.g
  tails = []
  for br in range(d.dense_branches):
    prev = None
    for l in range(d.dense_layers):
      d_out = d_dense if l == d.dense_layers - 1 else d.hidden
      prev = b.dense(f"dense{br}.fc{l}", d.hidden, d_out, [prev] if prev else [])
    assert prev is not None  # dense_layers >= 1
    tails.append(prev)
  for br in range(d.sparse_branches):
    name = f"sparse{br}.emb"
    cost = LayerCost(
      flops=float(d.bag_size * d.embedding_dim * B),
      bytes=F32 * (d.bag_size * d.embedding_dim + bag_width) * B,
      param_bytes=F32 * d.rows * d.embedding_dim,
      act_bytes=F32 * bag_width * B,
      saved_bytes=F32 * d.bag_size * B,
    )
    add_layer(g, name, cost, param_read_bytes=0.0)
    tails.append(name)
  n = len(tails)
  if not d.concat_bags and d_dense == d.embedding_dim:
    width = n * d.embedding_dim + n * (n - 1) // 2
    cost = LayerCost(
      flops=float(n * n * d.embedding_dim * B),
      bytes=F32 * (n * d.embedding_dim + width) * B,
      param_bytes=0.0,
      act_bytes=F32 * width * B,
      saved_bytes=F32 * n * d.embedding_dim * B,
    )
  else:
    width = d.dense_branches * d_dense + d.sparse_branches * bag_width
    cost = LayerCost(
      flops=float(width * B),
      bytes=F32 * 2 * width * B,
      param_bytes=0.0,
      act_bytes=F32 * width * B,
      saved_bytes=0.0,
    )
  add_layer(g, "interaction", cost)
  prev = b.connect("interaction", tails)
  for l in range(d.top_layers):
    prev = b.dense(f"top.fc{l}", width if l == 0 else d.hidden, d.hidden, [prev])
  out = b.dense("top.out", d.hidden, 1, [prev])
  b.loss("loss", out)
  return g


def candle_uno(
  batch_size: int = 128, branches: int = 7, layers: int = 4, hidden: int = 4096, top_layers: int = 4
) -> nx.DiGraph:
  """CANDLE-Uno: ``branches`` feature towers of ``layers`` dense layers, then a top MLP."""
  if branches < 1:
    raise ValueError(f"CANDLE-Uno needs at least one branch, got {branches}")
  b = _GraphBuilder(f"candle_uno{branches}", batch_size)
  tails = []
  for br in range(branches):
    prev = None
    for l in range(layers):
      prev = b.dense(f"tower{br}.fc{l}", hidden, hidden, [prev] if prev else [])
    assert prev is not None  # layers >= 1
    tails.append(prev)
  prev = b.concat("concat", tails)
  for l in range(top_layers):
    prev = b.dense(f"top.fc{l}", branches * hidden if l == 0 else hidden, hidden, [prev])
  out = b.dense("top.out", hidden, 1, [prev])
  b.loss("loss", out)
  return b.g


def gpt(
  batch_size: int = 32,
  layers: int = 24,
  transformer: TransformerShape = GPT_LAYER,
  vocab: int = 50257,
) -> nx.DiGraph:
  """GPT-style chain: token embedding, ``layers`` Transformer layers, LM head."""
  B = batch_size
  seq, hidden = transformer.seq, transformer.hidden
  b = _GraphBuilder(f"gpt{layers}", B)
  g = b.g
  cost = LayerCost(
    flops=float(seq * hidden * B),
    bytes=F32 * 2 * seq * hidden * B,
    param_bytes=F32 * vocab * hidden,
    act_bytes=F32 * seq * hidden * B,
    saved_bytes=F32 * seq * B,
  )
  add_layer(g, "embed", cost, param_read_bytes=0.0)
  prev = "embed"
  for l in range(layers):
    prev = b.transformer(f"layer{l}", transformer, [prev])
  head = b.dense("lm_head", hidden, vocab, [prev], rows=seq)
  g.nodes[head]["act_bytes"] = F32 * seq * B  # the loss reads logits in place; pass labels' size
  g.nodes[head]["saved_bytes"] = F32 * seq * (hidden + vocab) * B
  b.loss("loss", head)
  return g


def chain(batch_size: int = 8, layers: int = 8, hidden: int = 1024) -> nx.DiGraph:
  """A small MLP chain (uniform dense layers), for tests and examples."""
  b = _GraphBuilder(f"chain{layers}", batch_size)
  prev = None
  for l in range(layers):
    prev = b.dense(f"fc{l}", hidden, hidden, [prev] if prev else [])
  return b.g


PRESETS: dict[str, Callable[..., nx.DiGraph]] = {
  "mmt": mmt,
  "dlrm": dlrm,
  "candle_uno": candle_uno,
  "gpt": gpt,
  "chain": chain,
}


def _shape_parameters(name: str) -> dict[str, Any]:
  """A preset's shape dataclass parameters (``mmt``'s ``transformer``, ``dlrm``'s ``shape``)
  with their defaults."""
  params = inspect.signature(PRESETS[name]).parameters.values()
  return {
    p.name: p.default
    for p in params
    if dataclasses.is_dataclass(p.default) and not isinstance(p.default, type)
  }


def shape_arguments(name: str) -> list[str]:
  """The shape arguments a preset takes (``batch_size`` first), a shape dataclass's fields
  (``TransformerShape``, ``DLRMShape``) in place of the parameter that takes it."""
  nested = _shape_parameters(name)
  out = []
  for p in inspect.signature(PRESETS[name]).parameters:
    out += [f.name for f in dataclasses.fields(nested[p])] if p in nested else [p]
  return out


def model_graph(name: str, **shape) -> nx.DiGraph:
  """A preset by name, with shape overrides (``model_graph("candle_uno", branches=16)``); a
  shape dataclass's fields are given by name too (``model_graph("mmt", seq=64)``)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model graph {name!r}; choose one of {sorted(PRESETS)}")
  unknown = sorted(set(shape) - set(shape_arguments(name)))
  if unknown:
    raise ValueError(
      f"model graph {name!r} has no shape argument {', '.join(map(repr, unknown))}; "
      f"its shape arguments are {shape_arguments(name)}"
    )
  args = dict(shape)
  for param, default in _shape_parameters(name).items():
    fields = {f.name for f in dataclasses.fields(default)}
    given = {k: args.pop(k) for k in list(args) if k in fields}
    if given:
      args[param] = dataclasses.replace(default, **given)
  return PRESETS[name](**args)


def _random_layer_cost(w: int, hidden: int, B: int) -> LayerCost:
  """A dense layer's cost, ``w`` inputs to ``hidden`` outputs, for ``B`` samples."""
  params = F32 * w * hidden
  return LayerCost(
    flops=2.0 * w * hidden * B,
    bytes=params + F32 * (w + hidden) * B,
    param_bytes=params,
    act_bytes=F32 * hidden * B,
    saved_bytes=F32 * (w + hidden) * B,
  )


def random_dag(
  seed: int, num_layers: int = 6, edge_prob: float = 0.4, batch_size: int = 8, hidden: int = 512
) -> nx.DiGraph:
  """A random layer DAG with dense-layer-like costs (for tests): layer i may feed any later
  layer with probability ``edge_prob``; widths vary so layers differ in cost."""
  import random

  rng = random.Random(seed)
  B = batch_size
  g = new_layer_graph(f"random{seed}", B)
  for i in range(num_layers):
    w = hidden * rng.choice((1, 2, 3, 4))
    add_layer(g, f"l{i}", _random_layer_cost(w, hidden, B))
  for i in range(num_layers):
    for j in range(i + 1, num_layers):
      if rng.random() < edge_prob:
        add_edge(g, f"l{i}", f"l{j}", g.nodes[f"l{i}"]["act_bytes"])
  return g


def random_sp_dag(
  seed: int, num_layers: int = 6, batch_size: int = 8, hidden: int = 512
) -> nx.DiGraph:
  """A random series-parallel layer DAG (for tests): the layers are split recursively into
  series parts (every sink of a part feeds every source of the next) or parallel parts."""
  import random

  rng = random.Random(seed)
  B = batch_size
  g = new_layer_graph(f"random_sp{seed}", B)
  for i in range(num_layers):
    w = hidden * rng.choice((1, 2, 3, 4))
    add_layer(g, f"l{i}", _random_layer_cost(w, hidden, B))

  def build(names: list[str]) -> tuple[list[str], list[str]]:
    """Wires ``names`` into an SP graph; returns its (sources, sinks)."""
    if len(names) == 1:
      return names, names
    cut = rng.randint(1, len(names) - 1)
    left, right = build(names[:cut]), build(names[cut:])
    if rng.random() < 0.5:
      for u in left[1]:
        for v in right[0]:
          add_edge(g, u, v, g.nodes[u]["act_bytes"])
      return left[0], right[1]
    return left[0] + right[0], left[1] + right[1]

  build([f"l{i}" for i in range(num_layers)])
  return g


def random_branches(
  seed: int,
  branches: int = 2,
  max_branch_layers: int = 2,
  batch_size: int = 8,
  hidden: int = 512,
  fork: bool | None = None,
  join: bool = True,
  identical: bool = False,
) -> nx.DiGraph:
  """A small multi-branch graph (for tests), shaped like the benchmark models: an optional
  fork layer, ``branches`` chains of 1..max_branch_layers layers with random widths, and a
  join layer. ``identical``: every branch has the same length and widths (like the towers of
  CANDLE-Uno or MMT)."""
  import random

  rng = random.Random(seed)
  B = batch_size
  g = new_layer_graph(f"random_branches{seed}", B)
  shape = [rng.choice((1, 2, 3, 4)) for _ in range(rng.randint(1, max_branch_layers))]

  def layer(name: str, inputs, width: int | None = None) -> str:
    w = hidden * (width or rng.choice((1, 2, 3, 4)))
    add_layer(g, name, _random_layer_cost(w, hidden, B))
    for src in inputs:
      add_edge(g, src, name, g.nodes[src]["act_bytes"])
    return name

  fork = rng.random() < 0.5 if fork is None else fork
  head = [layer("fork", [])] if fork else []
  tails = []
  for br in range(branches):
    prev = head
    widths = shape if identical else [None] * rng.randint(1, max_branch_layers)
    for l, w in enumerate(widths):
      prev = [layer(f"b{br}.l{l}", prev, w)]
    tails.extend(prev)
  if join:
    layer("join", tails)
  return g
