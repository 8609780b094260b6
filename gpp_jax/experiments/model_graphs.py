"""Synthetic LayerGraphs of the benchmark models, with costs computed from their shapes.

These are the same graph type the capture pass produces (see ``gpp_jax.ir.layer_graph``), built
analytically so planners can be studied at paper scale without tracing a model. All tensors
are fp32 (4 bytes). Costs are for ``batch_size`` samples.

Paper presets (GraphPipe, App. A.2):
  mmt():        4 branches x 8 Transformer layers, sequence 256, hidden 1024, 16 heads,
                FFN 4096; each branch has an input projection; branches are concatenated
                and a head projects back to the hidden size.
  dlrm():       7 dense branches of 4 feed-forward layers (4096, the last projecting to the
                embedding size as in DLRM's bottom MLP) + 7 embedding-bag branches
                (dimension 64, bag 100, 1M rows); the interaction concatenates the 14 vectors
                and their pairwise dot products; then a top MLP of 4 layers at 4096 and a
                1-unit output. ``dlrm(concat_bags=True, dense_out=4096)`` is DLRM as the
                GraphPipe paper describes it: each bag's 100 embeddings are concatenated (6400
                wide), the dense branches end at 4096, and the interaction concatenates them
                (73,472 wide); the planners' "paper" preset uses this form.
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

import inspect
from collections.abc import Callable

import networkx as nx

from gpp_jax.ir.layer_graph import add_edge, add_layer, new_layer_graph

F32 = 4


def _dense(
  g: nx.DiGraph, name: str, d_in: int, d_out: int, B: int, inputs=(), rows: int = 1
) -> str:
  """A dense layer; ``B`` counts its rows (samples x ``rows`` per sample)."""
  params = F32 * (d_in * d_out + d_out)
  add_layer(
    g,
    name,
    rows=rows,
    flops=2.0 * d_in * d_out * B,
    bytes=params + F32 * (d_in + d_out) * B,
    param_bytes=params,
    act_bytes=F32 * d_out * B,
    saved_bytes=F32 * (d_in + d_out) * B,
  )
  for src in inputs:
    add_edge(g, src, name, g.nodes[src]["act_bytes"])
  return name


def _transformer(
  g: nx.DiGraph, name: str, s: int, h: int, a: int, f: int, B: int, inputs=()
) -> str:
  params = F32 * (4 * h * h + 2 * h * f + f + 9 * h)
  act = F32 * s * h
  add_layer(
    g,
    name,
    rows=s,
    flops=(2.0 * s * (4 * h * h + 2 * h * f) + 4.0 * s * s * h) * B,
    bytes=params + F32 * (16 * s * h + 4 * s * f + 3 * a * s * s) * B,
    param_bytes=params,
    act_bytes=act * B,
    saved_bytes=F32 * (12 * s * h + 2 * s * f + 2 * a * s * s) * B,
  )
  for src in inputs:
    add_edge(g, src, name, g.nodes[src]["act_bytes"])
  return name


def _concat(g: nx.DiGraph, name: str, inputs, B: int) -> str:
  out = sum(g.nodes[i]["act_bytes"] for i in inputs)
  add_layer(g, name, flops=0.0, bytes=2.0 * out, param_bytes=0.0, act_bytes=out, saved_bytes=0.0)
  for src in inputs:
    add_edge(g, src, name, g.nodes[src]["act_bytes"])
  return name


def _loss(g: nx.DiGraph, name: str, src: str, B: int) -> str:
  add_layer(
    g,
    name,
    flops=4.0 * g.nodes[src]["act_bytes"] / F32,
    bytes=g.nodes[src]["act_bytes"],
    param_bytes=0.0,
    act_bytes=F32 * B,
    saved_bytes=g.nodes[src]["act_bytes"],
  )
  add_edge(g, src, name, g.nodes[src]["act_bytes"])
  return name


def mmt(
  batch_size: int = 32,
  branches: int = 4,
  layers: int = 8,
  seq: int = 256,
  hidden: int = 1024,
  heads: int = 16,
  ffn: int = 4096,
) -> nx.DiGraph:
  """Multi-modal Transformer: ``branches`` towers of ``layers`` Transformer layers."""
  B = batch_size
  g = new_layer_graph(f"mmt{branches}x{layers}", B)
  tails = []
  for br in range(branches):
    prev = _dense(g, f"b{br}.in_proj", hidden, hidden, B * seq, rows=seq)
    for l in range(layers):
      prev = _transformer(g, f"b{br}.layer{l}", seq, hidden, heads, ffn, B, [prev])
    tails.append(prev)
  cat = _concat(g, "concat", tails, B)
  head = _dense(g, "head", branches * hidden, hidden, B * seq, [cat], rows=seq)
  _loss(g, "loss", head, B)
  return g


def dlrm(
  batch_size: int = 128,
  dense_branches: int = 7,
  dense_layers: int = 4,
  hidden: int = 4096,
  sparse_branches: int = 7,
  embedding_dim: int = 64,
  bag_size: int = 100,
  rows: int = 1_000_000,
  top_layers: int = 4,
  concat_bags: bool = False,
  dense_out: int = 0,
) -> nx.DiGraph:
  """DLRM with dense feed-forward branches and embedding-bag branches.

  Each dense branch has ``dense_layers`` layers at ``hidden`` whose last one projects to
  ``dense_out`` (0: ``embedding_dim``, DLRM's bottom MLP ending at the embedding size). An
  embedding bag pools its ``bag_size`` vectors to one (``concat_bags=False``) or concatenates
  them (``bag_size * embedding_dim`` wide). With pooled bags and ``dense_out`` at the embedding
  size the interaction concatenates the branch outputs with their pairwise dot products;
  otherwise it concatenates the branch outputs. The top MLP has ``top_layers`` layers at
  ``hidden`` and a 1-unit output.
  """
  B = batch_size
  d_dense = dense_out or embedding_dim
  bag_width = bag_size * embedding_dim if concat_bags else embedding_dim
  g = new_layer_graph(f"dlrm{dense_branches}+{sparse_branches}", B)
  tails = []
  for br in range(dense_branches):
    prev = None
    for l in range(dense_layers):
      d_out = d_dense if l == dense_layers - 1 else hidden
      prev = _dense(g, f"dense{br}.fc{l}", hidden, d_out, B, [prev] if prev else [])
    assert prev is not None  # dense_layers >= 1
    tails.append(prev)
  for br in range(sparse_branches):
    name = f"sparse{br}.emb"
    params = F32 * rows * embedding_dim
    add_layer(
      g,
      name,
      flops=float(bag_size * embedding_dim * B),
      bytes=F32 * (bag_size * embedding_dim + bag_width) * B,
      param_bytes=params,
      param_read_bytes=0.0,
      act_bytes=F32 * bag_width * B,
      saved_bytes=F32 * bag_size * B,
    )
    tails.append(name)
  n = len(tails)
  if not concat_bags and d_dense == embedding_dim:
    width = n * embedding_dim + n * (n - 1) // 2
    add_layer(
      g,
      "interaction",
      flops=float(n * n * embedding_dim * B),
      bytes=F32 * (n * embedding_dim + width) * B,
      param_bytes=0.0,
      act_bytes=F32 * width * B,
      saved_bytes=F32 * n * embedding_dim * B,
    )
  else:
    width = dense_branches * d_dense + sparse_branches * bag_width
    add_layer(
      g,
      "interaction",
      flops=float(width * B),
      bytes=F32 * 2 * width * B,
      param_bytes=0.0,
      act_bytes=F32 * width * B,
      saved_bytes=0.0,
    )
  for src in tails:
    add_edge(g, src, "interaction", g.nodes[src]["act_bytes"])
  prev = "interaction"
  for l in range(top_layers):
    prev = _dense(g, f"top.fc{l}", width if l == 0 else hidden, hidden, B, [prev])
  out = _dense(g, "top.out", hidden, 1, B, [prev])
  _loss(g, "loss", out, B)
  return g


def candle_uno(
  batch_size: int = 128, branches: int = 7, layers: int = 4, hidden: int = 4096, top_layers: int = 4
) -> nx.DiGraph:
  """CANDLE-Uno: ``branches`` feature towers of ``layers`` dense layers, then a top MLP."""
  if branches < 1:
    raise ValueError(f"CANDLE-Uno needs at least one branch, got {branches}")
  B = batch_size
  g = new_layer_graph(f"candle_uno{branches}", B)
  tails = []
  for br in range(branches):
    prev = None
    for l in range(layers):
      prev = _dense(g, f"tower{br}.fc{l}", hidden, hidden, B, [prev] if prev else [])
    tails.append(prev)
  prev = _concat(g, "concat", tails, B)
  for l in range(top_layers):
    prev = _dense(g, f"top.fc{l}", branches * hidden if l == 0 else hidden, hidden, B, [prev])
  out = _dense(g, "top.out", hidden, 1, B, [prev])
  _loss(g, "loss", out, B)
  return g


def gpt(
  batch_size: int = 32,
  layers: int = 24,
  seq: int = 1024,
  hidden: int = 1024,
  heads: int = 16,
  ffn: int | None = None,
  vocab: int = 50257,
) -> nx.DiGraph:
  """GPT-style chain: token embedding, ``layers`` Transformer layers, LM head."""
  B = batch_size
  ffn = ffn or 4 * hidden
  g = new_layer_graph(f"gpt{layers}", B)
  params = F32 * vocab * hidden
  add_layer(
    g,
    "embed",
    flops=float(seq * hidden * B),
    bytes=F32 * 2 * seq * hidden * B,
    param_bytes=params,
    param_read_bytes=0.0,
    act_bytes=F32 * seq * hidden * B,
    saved_bytes=F32 * seq * B,
  )
  prev = "embed"
  for l in range(layers):
    prev = _transformer(g, f"layer{l}", seq, hidden, heads, ffn, B, [prev])
  head = _dense(g, "lm_head", hidden, vocab, B * seq, [prev], rows=seq)
  g.nodes[head]["act_bytes"] = F32 * seq * B  # the loss reads logits in place; pass labels' size
  g.nodes[head]["saved_bytes"] = F32 * seq * (hidden + vocab) * B
  _loss(g, "loss", head, B)
  return g


def chain(batch_size: int = 8, layers: int = 8, hidden: int = 1024) -> nx.DiGraph:
  """A small MLP chain (uniform dense layers), for tests and examples."""
  B = batch_size
  g = new_layer_graph(f"chain{layers}", B)
  prev = None
  for l in range(layers):
    prev = _dense(g, f"fc{l}", hidden, hidden, B, [prev] if prev else [])
  return g


PRESETS: dict[str, Callable[..., nx.DiGraph]] = {
  "mmt": mmt,
  "dlrm": dlrm,
  "candle_uno": candle_uno,
  "gpt": gpt,
  "chain": chain,
}


def shape_arguments(name: str) -> list[str]:
  """The shape arguments a preset takes (``batch_size`` first)."""
  return list(inspect.signature(PRESETS[name]).parameters)


def model_graph(name: str, **shape) -> nx.DiGraph:
  """A preset by name, with shape overrides (``model_graph("candle_uno", branches=16)``)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model graph {name!r}; choose one of {sorted(PRESETS)}")
  unknown = sorted(set(shape) - set(shape_arguments(name)))
  if unknown:
    raise ValueError(
      f"model graph {name!r} has no shape argument {', '.join(map(repr, unknown))}; "
      f"its shape arguments are {shape_arguments(name)}"
    )
  return PRESETS[name](**shape)


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
    params = F32 * w * hidden
    add_layer(
      g,
      f"l{i}",
      flops=2.0 * w * hidden * B,
      bytes=params + F32 * (w + hidden) * B,
      param_bytes=params,
      act_bytes=F32 * hidden * B,
      saved_bytes=F32 * (w + hidden) * B,
    )
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
    params = F32 * w * hidden
    add_layer(
      g,
      f"l{i}",
      flops=2.0 * w * hidden * B,
      bytes=params + F32 * (w + hidden) * B,
      param_bytes=params,
      act_bytes=F32 * hidden * B,
      saved_bytes=F32 * (w + hidden) * B,
    )

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
    params = F32 * w * hidden
    add_layer(
      g,
      name,
      flops=2.0 * w * hidden * B,
      bytes=params + F32 * (w + hidden) * B,
      param_bytes=params,
      act_bytes=F32 * hidden * B,
      saved_bytes=F32 * (w + hidden) * B,
    )
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
