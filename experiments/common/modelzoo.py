"""Models for experiments: any name/path ``models.load`` takes, plus ``tiny-random`` and
``random:SHAPE``.

``tiny-random`` is a 2-layer random Llama with SmolLM2's real tokenizer (read from the embedded
GGUF's metadata, no weights converted), used by the ``--config.quick=True`` CI runs: it exercises
every code path of an experiment in seconds; its numbers mean nothing.

``random:SHAPE`` (``random:llama-3.1-8b``; the shapes of ``models.shapes``) is a
model of that checkpoint's shape with random weights and a real tokenizer: SmolLM2's, whose ids
fit any of those vocabularies. ``random:SHAPE:DIR`` reads the tokenizer from ``DIR``
(``tokenizer.json``, as ``TextTokenizer.save`` writes it), where the SmolLM2 GGUF is not
installed (a GPU machine). What it costs to run is real; its accuracies mean nothing.
"""

from __future__ import annotations

import functools

TINY = "tiny-random"
RANDOM = "random:"
# jax and models are imported inside the functions: ``TINY`` and the name checks of
# ``experiments.common.checks`` must not pay for them.


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
  from models import gguf_file, sources  # pylint: disable=g-import-not-at-top
  from models import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  return tokenizer_lib.from_gguf_metadata(gguf_file.read_metadata(sources.smollm2_path()))


def tiny_random(seed: int = 0, random_norms: bool = False):
  """The 2-layer random Llama (a ``models.loading.Model``); ``random_norms``: its RMSNorm scales
  drawn from U(0.5, 1.5) instead of ones (a trained model's are not uniform: its attention
  inputs' norms then differ by token, which KVzip+ reads)."""
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
  if random_norms:
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.uniform(next(keys), x.shape, x.dtype, 0.5, 1.5)
        if "norm" in jax.tree_util.keystr(path) else x, params)
  return Model(config, params, tok, TINY)


def parse_random(name: str) -> tuple[str, str | None] | None:
  """``(shape, tokenizer dir or None)`` of a ``random:SHAPE[:DIR]`` name; None for other names.

  Raises:
    ValueError: an unknown shape (the message lists the known ones).
  """
  if not name.startswith(RANDOM):
    return None
  shape, _, tok_dir = name[len(RANDOM):].partition(":")
  from models import shapes  # pylint: disable=g-import-not-at-top (no jax)
  if shape not in shapes.SHAPES:
    raise ValueError(f"model {name!r}: unknown shape {shape!r}; known: "
                     f"{', '.join(RANDOM + s for s in sorted(shapes.SHAPES))}")
  return shape, tok_dir or None


def random_shape(name: str, dtype: str = "bfloat16", seed: int = 0):
  """The ``random:SHAPE[:DIR]`` model (a ``models.loading.Model``, decode layout) in ``dtype``."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from models import shapes  # pylint: disable=g-import-not-at-top
  from models import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  shape, tok_dir = parse_random(name)
  tok = tokenizer_lib.from_hf_dir(tok_dir) if tok_dir else smollm2_tokenizer()
  config = shapes.model_config(shape, dtype)
  if tok.vocab_size > config.vocab_size:
    raise ValueError(f"the tokenizer's {tok.vocab_size} ids do not fit {shape}'s vocabulary "
                     f"of {config.vocab_size}")
  config = dataclasses.replace(config, eos_token_ids=tuple(tok.eos_ids))
  return dataclasses.replace(shapes.random_model(config, seed), tokenizer=tok, name=name)


def load_model(name: str, mesh=None, dtype: str = ""):
  """``tiny-random``, ``random:SHAPE[:DIR]`` or anything ``models.load`` accepts (a registered
  name or an HF dir); with a device ``mesh``, its parameters placed there (``models.shard``).

  ``dtype``: parameters and compute (``"bfloat16"`` on a GPU); empty: the loader's default
  (float32; ``random:`` shapes bfloat16).
  """
  import models  # pylint: disable=g-import-not-at-top
  if name == TINY:
    model = tiny_random()
  elif parse_random(name):
    model = random_shape(name, dtype or "bfloat16")
  else:
    model = models.load(name, **({"dtype": dtype} if dtype else {}))
  return model if mesh is None else models.shard(model, mesh)


def rope_inv_freq(model) -> tuple:
  """The model's ``[D/2]`` RoPE inverse frequencies (scaling applied), for methods that model
  RoPE (``experiments.common.specs.build``)."""
  from models import rope  # pylint: disable=g-import-not-at-top
  return rope.model_inv_freq(model.config)
