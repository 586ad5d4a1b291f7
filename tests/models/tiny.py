"""Tiny random Hugging Face checkpoints (transformers, PyTorch CPU) for parity tests."""

from __future__ import annotations

import numpy as np

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=256)

# name -> (transformers config class name, kwargs)
CONFIGS = {
    "llama_gqa_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama_mha_untied_bias": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True,
                                                  tie_word_embeddings=False)),
    "llama3_rope": ("LlamaConfig", dict(rope_theta=50000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "linear_rope_mlp_bias": ("LlamaConfig", dict(
        num_key_value_heads=1, mlp_bias=True, head_dim=32,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "mistral_window": ("MistralConfig", dict(sliding_window=8, head_dim=16)),
}
MODEL_CLASS = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
               "MistralConfig": "MistralForCausalLM"}


def make_hf(name: str, path, seed: int = 0):
  """Saves a random model of config ``name`` into ``path``; returns the torch model."""
  import torch
  import transformers

  cls_name, kw = CONFIGS[name]
  cfg = getattr(transformers, cls_name)(**{**BASE, **kw})
  torch.manual_seed(seed)
  model = getattr(transformers, MODEL_CLASS[cls_name])(cfg).eval()
  with torch.no_grad():  # larger-than-default weights so errors are not hidden by tiny logits
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(torch.randn_like(p) * 0.1)
      else:
        p.normal_(0.0, 0.08)
  model.save_pretrained(path)
  return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  import torch

  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def rel_error(ours, ref) -> float:
  return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))
