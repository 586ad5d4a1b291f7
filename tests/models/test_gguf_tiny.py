"""GGUF loading end to end on tiny written files: Q/K unpermute, Qwen2 naming, the cache."""

import numpy as np
import pytest

import models
from models import loading, rope
from tests.models import gguf_writer, tiny

VOCAB = dict(vocab_size=300)


TOKENS = np.random.default_rng(0).integers(0, 300, (1, 20))
NAMES = ("llama_gqa_tied", "qwen2", "qwen3", "llama3_rope")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("SPARSE_ATTN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """``name -> (path, transformers' logits of TOKENS)``: the 300-token-vocabulary checkpoints
  (read only; each test writes its own GGUF), all made in one child process."""
  root = tmp_path_factory.mktemp("hf")
  refs = tiny.references([(n, root / n, {"f32": tiny.logits(TOKENS)}, VOCAB) for n in NAMES])
  return {n: (str(root / n), r["f32"]) for n, r in zip(NAMES, refs)}


@pytest.mark.parametrize("name, arch", [("llama_gqa_tied", "llama"), ("qwen2", "qwen2"),
                                        ("qwen3", "qwen3"), ("llama3_rope", "llama")])
def test_gguf_logits_match_transformers(name, arch, hf, tmp_path):
  ref, want = hf[name]
  gguf_writer.write_gguf(ref, tmp_path / "m.gguf", arch)
  model = models.load(str(tmp_path / "m.gguf"))
  assert model.config.model_type == arch
  assert model.config.tie_word_embeddings == (name == "llama_gqa_tied")
  assert tiny.rel_error(model.forward(TOKENS), want) <= 1e-4
  assert model.tokenizer.encode(" t<|endoftext|>") == [256, 257]
  assert (model.config.rope.freq_factors is not None) == (name == "llama3_rope")
  again = models.load(str(tmp_path / "m.gguf"))  # from the converted cache: the same model
  assert again.config == model.config


def test_rope_freqs_equal_llama3_scaling(hf, tmp_path):
  """llama.cpp's ``rope_freqs`` divisors and our llama3 scaling give the same frequencies."""
  ref, _ = hf["llama3_rope"]
  gguf_writer.write_gguf(ref, tmp_path / "m.gguf")
  config = models.load(str(tmp_path / "m.gguf")).config
  hf = models.load(ref).config
  assert hf.rope.rope_type == "llama3" and config.rope.rope_type == "default"
  d = config.head_dim
  np.testing.assert_allclose(rope.inverse_frequencies(config.rope, d),
                             rope.inverse_frequencies(hf.rope, d), rtol=1e-6)


def test_q8_dequantized_close(hf, tmp_path):
  ref, want = hf["llama_gqa_tied"]
  gguf_writer.write_gguf(ref, tmp_path / "m.gguf", q8_mlp=True)
  model = models.load(str(tmp_path / "m.gguf"))
  assert tiny.rel_error(model.forward(TOKENS), want) <= 2e-2


def test_corrupt_or_partial_cache_is_rebuilt(hf, tmp_path):
  ref, _ = hf["llama_gqa_tied"]
  gguf_writer.write_gguf(ref, tmp_path / "m.gguf")
  first = models.load(str(tmp_path / "m.gguf"))
  (entry,) = (tmp_path / "cache").iterdir()
  files = sorted((p for p in (entry / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
  blob = bytearray(files[-1].read_bytes())  # flip bytes in the largest params file
  mid = len(blob) // 2
  blob[mid:mid + 32] = bytes(255 - b for b in blob[mid:mid + 32])
  files[-1].write_bytes(bytes(blob))
  assert loading._read_entry(str(entry)) is None and not entry.exists()
  again = models.load(str(tmp_path / "m.gguf"))  # rebuilt from the GGUF
  np.testing.assert_array_equal(np.asarray(again.params["embed"]),
                                np.asarray(first.params["embed"]))
  assert loading._read_entry(str(entry)) is not None
  (entry / "manifest.json").unlink()  # partial entry (no manifest) -> removed
  assert loading._read_entry(str(entry)) is None and not entry.exists()
  models.load(str(tmp_path / "m.gguf"))
  assert loading._read_entry(str(entry)) is not None
