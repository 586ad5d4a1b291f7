"""Models for experiments: any name/path ``models.load`` takes, plus ``tiny-random``.

``tiny-random`` is a 2-layer random Llama with SmolLM2's real tokenizer (read from the embedded
GGUF's metadata, no weights converted), used by the ``--config.quick=True`` CI runs: it exercises
every code path of an experiment in seconds; its numbers mean nothing.
"""

from __future__ import annotations

import functools

TINY = "tiny-random"
# jax and models are imported inside the functions: ``TINY`` and the name checks of
# ``experiments.common.checks`` must not pay for them.


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
  import gguf  # pylint: disable=g-import-not-at-top
  from models import gguf_loader, sources  # pylint: disable=g-import-not-at-top
  from models import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  reader = gguf.GGUFReader(sources.smollm2_path())
  return tokenizer_lib.from_gguf_metadata(gguf_loader.read_metadata(reader))


def tiny_random(seed: int = 0):
  """The 2-layer random Llama (a ``models.loading.Model``)."""
  import jax  # pylint: disable=g-import-not-at-top
  from models import llama  # pylint: disable=g-import-not-at-top
  from models.config import ModelConfig, RopeConfig  # pylint: disable=g-import-not-at-top
  from models.loading import Model  # pylint: disable=g-import-not-at-top
  tok = smollm2_tokenizer()
  config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                       rope=RopeConfig(theta=10000.0), tie_word_embeddings=True,
                       eos_token_ids=tuple(tok.eos_ids))
  params = llama.init_params(config, jax.random.key(seed))
  return Model(config, params, tok, TINY)


def load_model(name: str, mesh=None):
  """``tiny-random`` or anything ``models.load`` accepts (a registered name or an HF dir);
  with a device ``mesh``, its parameters placed there (``models.shard``)."""
  import models  # pylint: disable=g-import-not-at-top
  model = tiny_random() if name == TINY else models.load(name)
  return model if mesh is None else models.shard(model, mesh)


def rope_inv_freq(model) -> tuple:
  """The model's ``[D/2]`` RoPE inverse frequencies (scaling applied), for methods that model
  RoPE (``experiments.common.specs.build``)."""
  from models import rope  # pylint: disable=g-import-not-at-top
  return tuple(float(f) for f in rope.inverse_frequencies(model.config.rope,
                                                           model.config.head_dim))
