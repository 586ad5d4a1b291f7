"""experiments/ is layered: ``common`` (shared utilities) imports nothing of the experiments
above it, and the experiments' modules never import the registry that names them (only the
drivers do: entry, reproduce, report, merge and the claims report)."""

import ast
import pathlib

import experiments

ROOT = pathlib.Path(experiments.__file__).parent
ABOVE_COMMON = ("experiments.tasks", "experiments.analysis", "experiments.claims",
                "experiments.latency_lib", "experiments.registry", "experiments.entry")


def _imports(path: pathlib.Path) -> set[str]:
  """Every module a file imports (function-level imports included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.ImportFrom) and node.module:
      out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
  return out


def _reaching(folder: str, banned) -> dict[str, list[str]]:
  found = {}
  for path in sorted((ROOT / folder).glob("*.py")):
    bad = sorted(m for m in _imports(path) if m.startswith(banned))
    if bad:
      found[path.name] = bad
  return found


def test_common_does_not_import_the_experiments_above_it():
  assert _reaching("common", ABOVE_COMMON) == {}


def test_experiment_modules_do_not_import_the_registry():
  """Runners, renderers and measures are named by the registry, never the reverse (the
  claims report, which reads the registry, is the one exception)."""
  for folder in ("tasks", "analysis", "latency_lib", "claims"):
    found = _reaching(folder, ("experiments.registry", "experiments.entry"))
    found.pop("report.py" if folder == "claims" else "", None)
    assert found == {}, folder
