"""The package's import graph: no cycles, and no module both an IR and a program."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source folder -> installed package name (pyproject's package-dir mapping).
PACKAGES = {"gpp_jax": "gpp_jax", "passes": "gpp_jax.passes", "models": "gpp_jax.models"}


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for folder, package in PACKAGES.items():
    for path in sorted((ROOT / folder).rglob("*.py")):
      parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      name = ".".join([package, *parts])
      if name.startswith("gpp_jax.passes") and folder == "gpp_jax":
        continue
      out[name] = path
  return out


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
  while node in parents:
    node = parents[node]
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      return True
  return False


def import_graph() -> nx.DiGraph:
  """Module -> module it imports (anywhere in the file, except under ``TYPE_CHECKING``)."""
  modules = _modules()
  g = nx.DiGraph()
  g.add_nodes_from(modules)
  for name, path in modules.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        targets = [
          f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
          for a in node.names
        ]
      else:
        continue
      if _type_checking_only(node, parents):
        continue
      for t in targets:
        while t and t not in modules:
          t = t.rpartition(".")[0]
        if t and t != name:
          g.add_edge(name, t)
  return g


def test_the_import_graph_has_no_cycles():
  g = import_graph()
  assert len(g) > 50, sorted(g)  # the walk found the package
  cycles = sorted(sorted(c) for c in nx.simple_cycles(g))
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def test_library_modules_do_not_import_the_programs():
  g = import_graph()
  programs = {
    m
    for m in g
    if m.startswith("gpp_jax.cli")
    or m.startswith("gpp_jax.experiments")
    or m in ("gpp_jax.train", "gpp_jax.plan", "gpp_jax.launch")
  }
  library = {
    m
    for m in g
    if m.startswith(
      ("gpp_jax.ir", "gpp_jax.runtime", "gpp_jax.cost", "gpp_jax.passes", "gpp_jax.models")
    )
  }
  bad = sorted((u, v) for u, v in g.edges if u in library and v in programs)
  assert not bad, bad


def _under(module: str, *packages: str) -> bool:
  return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_cost_model_imports_neither_the_passes_nor_the_runtime():
  """The cost model and the simulator time what they are given: building a plan's schedule
  and lowering a schedule into a program are passes (``passes.simulation`` builds them and
  calls the simulator), and the runtime runs what they predict. No module under
  ``gpp_jax.cost`` imports either, at the top or inside a function (``import_graph``)."""
  g = import_graph()
  cost = [m for m in g if _under(m, "gpp_jax.cost")]
  assert "gpp_jax.cost.simulator" in cost, sorted(g)
  bad = sorted(
    (u, v) for u in cost for v in g.successors(u) if _under(v, "gpp_jax.passes", "gpp_jax.runtime")
  )
  assert not bad, bad


def test_ir_modules_are_not_programs():
  for name, path in _modules().items():
    if name.startswith("gpp_jax.ir"):
      assert "__main__" not in path.read_text(), f"{name} runs as a program"
