"""Comments, docstrings and markdown name only what is in the repository: no DESIGN document
(``DESIGN.md`` and its numbered invariants are not in this repository; the contracts are in
``docs/architecture.md``), and every
dotted name under ``sparse_attn``/``experiments``/``models``/``pallas_kernels``/``configs``
(``experiments.common.specs.build``) and every path below them (``experiments/tasks/ruler.py``)
resolves to a module, a package or a name one defines. ``results/`` (records) is not read."""

import ast
import functools
import io
import os
import pathlib
import re
import subprocess
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("sparse_attn", "experiments", "models", "pallas_kernels", "configs")
DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
PATH = re.compile(r"(?<![\w./-])((?:%s|tests|docs)/[\w./-]*\w\.(?:py|md))" % "|".join(PACKAGES))
PLACEHOLDERS = ("NAME", "PART")  # configs/NAME.py, experiments.NAME: a name the reader fills in
DESIGN = re.compile(r"\bDESIGN\b")
SELF = "tests/test_doc_references.py"  # names missing things on purpose
# Known and left to the section's owner: (file, reference). An entry that no longer occurs is
# harmless; remove it once fixed.
KNOWN: set[tuple[str, str]] = set()  # (file, reference) pairs allowed to dangle: none


@functools.lru_cache(maxsize=None)
def _defined(path: pathlib.Path) -> frozenset:
  """The names a module defines at its top level (functions, classes, assignments, imports,
  those under a top-level ``if``/``try`` included)."""
  names = set()
  for node in ast.parse(path.read_text(encoding="utf-8")).body:
    for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else (node,):
      if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(sub.name)
      elif isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        for target in sub.targets if isinstance(sub, ast.Assign) else (sub.target,):
          names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
      elif isinstance(sub, (ast.Import, ast.ImportFrom)):
        names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
  return frozenset(names)


def resolves(dotted: str) -> bool:
  """``a.b.c``: each part a package or module below the last, until one is a name that module
  defines (what follows is that object's attribute, not checked)."""
  first, *rest = dotted.split(".")
  here = ROOT / first
  for part in rest:
    if part in PLACEHOLDERS or part.startswith("__"):
      return True
    if (here / part / "__init__.py").is_file():
      here = here / part
    elif (here / f"{part}.py").is_file():
      here = here / f"{part}.py"
    else:
      module = here / "__init__.py" if here.is_dir() else here
      return module.is_file() and part in _defined(module)
  return True


def _python_prose(text: str) -> list[tuple[int, str, bool]]:
  """``(line, text, prose)`` of a module's comments and string literals; ``prose``: a comment
  or a docstring (a string standing as a statement), not a value the code uses."""
  out, toks = [], list(tokenize.generate_tokens(io.StringIO(text).readline))
  starts = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT)
  for i, tok in enumerate(toks):
    if tok.type not in (tokenize.COMMENT, tokenize.STRING):
      continue
    bare = (tok.type == tokenize.COMMENT or (i == 0 or toks[i - 1].type in starts) and
            toks[i + 1].type in (tokenize.NEWLINE, tokenize.ENDMARKER))
    out += [(tok.start[0] + k, line, bare) for k, line in enumerate(tok.string.splitlines())]
  return out


def _files() -> list[str]:
  listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                           "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()
  return sorted(f for f in listed
                if not f.startswith("results/") and f != SELF and (ROOT / f).is_file())


def unresolved(path: str) -> list[str]:
  """``"path:line: reference"`` for each reference in ``path`` that names nothing."""
  text = (ROOT / path).read_text(encoding="utf-8")
  lines = (_python_prose(text) if path.endswith(".py") else
           [(n, line, True) for n, line in enumerate(text.splitlines(), 1)])
  bad = []
  for n, line, prose in lines:
    refs = DESIGN.findall(line)
    refs += [d for d in DOTTED.findall(line) if not resolves(d)]
    if prose:  # a path in a value may be a test's input that must not exist
      refs += [p for p in PATH.findall(line)
               if not (ROOT / p).exists() and not any(h in p for h in PLACEHOLDERS)]
    bad += [f"{path}:{n}: {r}" for r in refs if (path, r) not in KNOWN]
  return bad


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout's file list")
def test_prose_names_only_what_exists():
  bad = [b for f in _files() for b in unresolved(f)]
  assert not bad, "references to nothing:\n" + "\n".join(bad)


def test_the_checker_sees_a_missing_module_and_accepts_real_names():
  assert resolves("experiments.common.specs.build") and resolves("sparse_attn.methods.make")
  assert resolves("experiments.NAME") and resolves("models.__file__")
  assert not resolves("experiments.tasks.specs") and not resolves("sparse_attn.nowhere")
  assert not resolves("experiments.common.specs.no_such_function")
  assert os.path.isfile(ROOT / "docs" / "architecture.md")
