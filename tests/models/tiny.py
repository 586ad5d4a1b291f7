"""Tiny random Hugging Face checkpoints (transformers, PyTorch CPU) for parity tests.

Every PyTorch call runs in a child process (``tests.isolated``); the tests see paths and arrays.
"""

from __future__ import annotations

import numpy as np

from tests import isolated

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=256)

# Phi3Config's default ids exceed the tiny vocab; no EOS, so transformers' min_new_tokens never
# suppresses a token the greedy comparison expects.
PHI3_IDS = dict(bos_token_id=1, eos_token_id=None, pad_token_id=0)
LONGROPE_ORIGINAL = 16  # phi3_longrope switches to its long factors past 16 positions
GEMMA_WINDOW = 8  # the local layers' window of the tiny Gemmas
# Gemma: no EOS (as PHI3_IDS); soft-caps small enough to bend these weights' logits (the
# checkpoints' 50 / 30 would leave tanh linear here); query_pre_attn_scalar != head_dim.
GEMMA = dict(bos_token_id=2, eos_token_id=None, pad_token_id=0, head_dim=16,
             query_pre_attn_scalar=4, sliding_window=GEMMA_WINDOW)

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
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3_bias_tied": ("Qwen3Config", dict(head_dim=16, num_key_value_heads=1,
                                            attention_bias=True, tie_word_embeddings=True)),
    "phi3_window": ("Phi3Config", dict(sliding_window=8, **PHI3_IDS)),
    "phi3_longrope": ("Phi3Config", dict(
        max_position_embeddings=256, original_max_position_embeddings=LONGROPE_ORIGINAL,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + 0.2 * i for i in range(8)],
                          long_factor=[1.5 + 0.7 * i for i in range(8)]), **PHI3_IDS)),
    # layers: local, global
    "gemma2": ("Gemma2Config", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
                                    **GEMMA)),
    # layers: local, local, global; linear RoPE on global layers, base 100 on local ones
    "gemma3_text": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, sliding_window_pattern=3, rope_theta=1e4, rope_local_base_freq=100.0,
        rope_scaling=dict(rope_type="linear", factor=2.0), final_logit_softcapping=1.5,
        **GEMMA)),
}
# The families each new model_type brings (tests parametrize over them).
NEW_FAMILIES = ("qwen3", "qwen3_bias_tied", "phi3_window", "phi3_longrope")
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
MODEL_CLASS = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
               "MistralConfig": "MistralForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
               "Phi3Config": "Phi3ForCausalLM", "Gemma2Config": "Gemma2ForCausalLM",
               "Gemma3TextConfig": "Gemma3ForCausalLM"}


def make_hf(name: str, path, seed: int = 0, max_shard_size=None, **overrides) -> str:
  """Saves a random transformers model of config ``name`` (``BASE`` and the config's own
  keys, updated by ``overrides``)
  into ``path`` (in a child process, ``tests.isolated``); returns the path. ``max_shard_size``
  (e.g. ``"20KB"``) saves it sharded, with ``model.safetensors.index.json``."""
  isolated.reference(_make_hf, name, str(path), seed, overrides, max_shard_size)
  return str(path)


def make_many(specs) -> list[str]:
  """``make_hf`` of each ``(name, path, overrides)`` in ``specs``, all in one child process
  (one PyTorch start); returns the paths."""
  isolated.reference(_make_many, [(n, str(p), dict(o)) for n, p, o in specs])
  return [str(p) for _, p, _ in specs]


def logits(tokens, dtype: str = "float32") -> tuple:
  """A ``references`` request: transformers' logits ``[B, S, V]`` (float32) of ``tokens``, run
  in ``dtype`` (as ``hf_logits``)."""
  return ("logits", np.asarray(tokens), dtype)


def greedy(prompt, new: int) -> tuple:
  """A ``references`` request: transformers' greedy continuation of ``prompt [1, S]`` (as
  ``hf_greedy``)."""
  return ("greedy", np.asarray(prompt), new)


def references(specs) -> list[dict]:
  """Checkpoints and their transformers references, all in one child process (one PyTorch
  start, each checkpoint loaded once per dtype).

  Args:
    specs: ``(name, path, requests, options)`` each: ``make_hf(name, path, **options)``, then
      ``requests``, a dict ``key -> logits(...) | greedy(...)``, computed on that checkpoint.

  Returns:
    Per spec, ``key -> array | token list`` (what ``hf_logits`` / ``hf_greedy`` return).
  """
  return isolated.reference(_references, [(n, str(p), dict(r), dict(o)) for n, p, r, o in specs])


def loaded(name: str, tmp_path_factory):
  """``(name, path, model)``: the tiny random ``name`` checkpoint saved by transformers in a
  fresh temporary folder, and ours loaded from it (a module-scoped fixture's value)."""
  import models  # pylint: disable=g-import-not-at-top (jax only where a test loads one)
  path = make_hf(name, tmp_path_factory.mktemp(name))
  return name, path, models.load(path)


def random_tokens(b: int, n: int, seed: int = 3) -> np.ndarray:
  """``[b, n]`` token ids of the tiny vocabulary."""
  return np.random.default_rng(seed).integers(0, BASE["vocab_size"], (b, n))


def hf_logits(path, tokens: np.ndarray, dtype: str = "float32") -> np.ndarray:
  """transformers' logits ``[B, S, V]`` (as float32) of the model saved at ``path``, run in
  ``dtype``."""
  return isolated.reference(_hf_logits, str(path), np.asarray(tokens), dtype)


def hf_greedy(path, prompt: np.ndarray, new: int) -> list[int]:
  """transformers' ``generate`` greedy continuation (``new`` tokens) of ``prompt [1, S]``."""
  return isolated.reference(_hf_greedy, str(path), np.asarray(prompt), new)


def _make_hf(name, path, seed, overrides, max_shard_size=None):
  import torch
  import transformers

  cls_name, kw = CONFIGS[name]
  cfg = getattr(transformers, cls_name)(**{**BASE, **kw, **overrides})
  torch.manual_seed(seed)
  model = getattr(transformers, MODEL_CLASS[cls_name])(cfg).eval()
  with torch.no_grad():  # larger-than-default weights so errors are not hidden by tiny logits
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(torch.randn_like(p) * 0.1)
      else:
        p.normal_(0.0, 0.08)
  model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))


def _make_many(specs):
  for name, path, overrides in specs:
    _make_hf(name, path, 0, overrides)


def _references(specs):
  out = []
  for name, path, requests, options in specs:
    options = dict(options)
    seed, shards = options.pop("seed", 0), options.pop("max_shard_size", None)
    _make_hf(name, path, seed, options, shards)
    held = {}  # dtype -> the loaded model
    got = {}
    for key, (kind, x, arg) in requests.items():
      if kind == "logits":
        if arg not in held:
          held[arg] = _load(path, arg)
        got[key] = _hf_logits(path, x, arg, held[arg])
      else:
        if "float32" not in held:
          held["float32"] = _load(path)
        got[key] = _hf_greedy(path, x, arg, held["float32"])
    out.append(got)
  return out


def _load(path, dtype="float32"):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=getattr(torch, dtype)).eval()


def _hf_logits(path, tokens, dtype="float32", model=None):
  import torch
  model = model if model is not None else _load(path, dtype)
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _hf_greedy(path, prompt, new, model=None):
  import torch
  model = model if model is not None else _load(path)
  with torch.no_grad():
    out = model.generate(torch.as_tensor(prompt), max_new_tokens=new, do_sample=False,
                               min_new_tokens=new, pad_token_id=0)
  return out[0, prompt.shape[1]:].tolist()


def rel_error(ours, ref) -> float:
  return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))
