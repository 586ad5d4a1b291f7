"""Per-layer post-RoPE queries, keys and values of a text, from a dense chunked prefill.

Letters: L layers, N query heads, K kv heads, S tokens, D head dim, C chunk length.

The model runs exactly as in ``models.decode.prefill`` (dense method, chunks of ``chunk``
tokens over a cache of the whole text); the ``attend`` callback of ``llama.run_layers`` also
writes each chunk's queries into a per-layer buffer. Keys and values are read back from the
caches. A causal model's first ``s`` tokens are the same in any longer text, so one capture at
the longest context serves every shorter one (take prefixes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import data
from models import llama
from sparse_attn import cache as cache_lib
from sparse_attn import methods


@dataclasses.dataclass(frozen=True)
class Captured:
  """q/k/v of every layer for one text (numpy float32, batch 1 dropped).

  Attributes:
    q: ``[L, N, S, D]``; k, v: ``[L, K, S, D]`` (post-RoPE, as cached).
    tokens: ``[S]`` int32 ids.
    scale: the model's softmax scale.
  """

  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  tokens: np.ndarray
  scale: float

  @property
  def num_layers(self) -> int:
    return self.q.shape[0]

  @property
  def length(self) -> int:
    return self.q.shape[2]

  @property
  def group(self) -> int:
    return self.q.shape[1] // self.k.shape[1]

  def keys_per_query_head(self, layer: int, length: int | None = None) -> np.ndarray:
    """``[N, S, D]`` keys of ``layer`` repeated over each kv group (query head h -> h // G)."""
    s = self.length if length is None else length
    return np.repeat(self.k[layer, :, :s], self.group, axis=0)


def text_tokens(model, source: str, n: int, skip_chars: int = 0) -> np.ndarray:
  """The first ``n`` tokens of a long real text (``data.long_text(source)``) after a char offset.

  Only a prefix of the text is tokenized (about 8 chars per token is read, doubled on a miss).
  """
  text = data.long_text(source)[skip_chars:]
  chars = max(64, 8 * n)
  while True:
    ids = model.encode(text[:chars])
    if len(ids) >= n or chars >= len(text):
      break
    chars *= 2
  if len(ids) < n:
    raise ValueError(f"text {source!r} has only {len(ids)} tokens after {skip_chars} chars, "
                     f"{n} needed")
  return np.asarray(ids[:n], np.int32)


@functools.partial(jax.jit, static_argnames=("config", "method"), donate_argnames=("bufs",))
def _chunk(params, tokens, positions, bufs, *, config, method):
  """Prefills one chunk ``[1, C]``; writes its queries into ``bufs['q'] [L, 1, N, S, D]``."""
  scale = llama.softmax_scale(config)
  start = positions[0, 0]

  def attend(q, k, v, inp):
    cache, qbuf = inp
    out, cache, _ = method.prefill(q, k, v, cache, {}, positions, scale=scale)
    qbuf = jax.lax.dynamic_update_slice_in_dim(qbuf, q.astype(qbuf.dtype), start, axis=2)
    return out, (cache, qbuf)

  x = llama.embed(params, config, tokens)
  _, (cache, qbuf) = llama.run_layers(params, config, x, positions, attend,
                                      (bufs["cache"], bufs["q"]))
  return {"cache": cache, "q": qbuf}


def capture(model, tokens, chunk: int = 512, progress=None) -> Captured:
  """Runs a dense prefill of ``tokens [S]`` and returns every layer's q/k/v.

  Args:
    model: a loaded model (``config``, ``params``).
    tokens: ``[S]`` int ids.
    chunk: prefill chunk length (memory is ``O(chunk * S)`` per layer).
    progress: optional ``cli.Progress``-like object (``update()`` once per chunk).
  """
  config = model.config
  tokens = np.asarray(tokens, np.int32)
  s = len(tokens)
  dense = methods.make("dense", block_size=16)
  cap = dense.round_capacity(s)
  c = min(chunk, cap)
  cap = -(-cap // c) * c  # whole chunks (the q buffer is written a chunk at a time)
  # Every digest kind: the captured caches serve every selector (Quest's box, ArkVale's sphere).
  one = cache_lib.init_cache(1, config.num_kv_heads, cap, config.head_dim, 16, jnp.float32)
  stack = lambda a: jnp.repeat(a[None], config.num_layers, axis=0)
  bufs = {"cache": jax.tree.map(stack, one),
          "q": jnp.zeros((config.num_layers, 1, config.num_heads, cap, config.head_dim),
                         jnp.float32)}
  padded = np.zeros((cap,), np.int32)
  padded[:s] = tokens
  for start in range(0, s, c):
    idx = np.arange(start, start + c)
    pos = np.where(idx < s, idx, -1).astype(np.int32)[None]
    tok = np.where(pos >= 0, padded[start:start + c][None], 0)
    bufs = _chunk(model.params, jnp.asarray(tok), jnp.asarray(pos), bufs, config=config,
                  method=dense)
    if progress is not None:
      progress.update()
  cache = bufs["cache"]
  get = lambda a: np.asarray(a[:, 0, :, :s], np.float32)
  return Captured(q=get(bufs["q"]), k=get(cache.k), v=get(cache.v), tokens=tokens,
                  scale=llama.softmax_scale(config))
