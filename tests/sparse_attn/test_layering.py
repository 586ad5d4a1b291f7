"""The kernel dispatch sits below the enhancers: ``sparse_attn.kernels`` never imports them."""

import ast
import pathlib

import sparse_attn


def test_kernels_do_not_reach_up_into_the_enhancers():
  tree = ast.parse((pathlib.Path(sparse_attn.__file__).parent / "kernels.py").read_text())
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      imported |= {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
      imported |= {a.name for a in node.names}
  assert not any(".enhancers" in m or m.startswith("sparse_attn.enhancers") for m in imported), (
      sorted(imported))
