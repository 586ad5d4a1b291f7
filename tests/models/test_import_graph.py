"""The ``models`` and ``experiments`` packages' modules import each other without cycles
(function-level imports included): a cycle makes import order matter and hides which module owns
what."""

import ast
import pathlib

import experiments
import models

PKG = pathlib.Path(models.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
  """Sibling modules of ``models`` that ``path`` imports anywhere in its body."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "models":
        found |= {a.name for a in node.names}
      elif node.module.startswith("models."):
        found.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("models.")}
  return found


def _graph() -> dict[str, set[str]]:
  mods = {p.stem: p for p in PKG.glob("*.py") if p.stem != "__init__"}
  return {m: _imports(p) & set(mods) - {m} for m, p in mods.items()}


def _cycle(graph):
  """One import cycle as a list of modules, or None."""
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        return stack[stack.index(n):] + [n]
      if n not in state and (c := visit(n)):
        return c
    state[m] = "done"
    stack.pop()
    return None

  for m in sorted(graph):
    if m not in state and (c := visit(m)):
      return c
  return None


def test_models_modules_import_without_cycles():
  assert _cycle(_graph()) is None, f"import cycle: {' -> '.join(_cycle(_graph()))}"


def test_sources_is_a_leaf_and_loading_builds_on_it():
  g = _graph()
  assert g["sources"] == set()
  assert "sources" in g["loading"]


def test_cycle_finder_sees_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _dotted_graph(package) -> dict[str, set[str]]:
  """Dotted module -> the modules of ``package`` (subpackages included) it imports anywhere in
  its body; ``from pkg import name`` counts ``pkg.name`` when that is a module, else ``pkg``."""
  root = pathlib.Path(package.__file__).parent
  name = package.__name__
  mods = {}
  for path in root.rglob("*.py"):
    parts = path.relative_to(root.parent).with_suffix("").parts
    mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  graph = {}
  for mod, path in mods.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                  for a in node.names}
      elif isinstance(node, ast.Import):
        found |= {a.name for a in node.names}
    graph[mod] = {m for m in found if m in mods and m != mod and m.split(".")[0] == name}
  return graph


def test_experiments_modules_import_without_cycles():
  """E.g. ``experiments.tasks.ruler`` imports ``ruler_qa`` / ``ruler_words``, which take what
  they share with it from ``ruler_built``, never from ``ruler``."""
  g = _dotted_graph(experiments)
  assert {"experiments.tasks.ruler_qa", "experiments.tasks.ruler_words"} <= g[
      "experiments.tasks.ruler"]
  assert _cycle(g) is None, f"import cycle: {' -> '.join(_cycle(g))}"
