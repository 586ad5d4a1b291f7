"""Per-layer post-RoPE queries, keys and values of a text, from a dense chunked prefill.

Letters: L layers, N query heads, K kv heads, S tokens, D head dim, C chunk length.

The model runs exactly as in ``models.decode.prefill`` (dense method, chunks of ``chunk``
tokens over a cache of the whole text); the ``attend`` callback of ``llama.run_layers`` also
writes each chunk's queries into a per-layer buffer. Keys and values are read back from the
caches. A causal model's first ``s`` tokens are the same in any longer text, so one capture at
the longest context serves every shorter one (take prefixes).

Each layer attends as the model does (``models.steps.layer_method``): its sliding window
(Mistral, Phi-3, Gemma's local layers) and the attention-logit soft-cap (Gemma 2), so the
captured q/k/v are the model's own. An analysis that recomputes attention from them must apply
the same window and cap (``Captured.logits`` does); ``capture`` refuses a model that has either
unless the caller says it applies them (``windows_and_softcap=True``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import data
from models import decode, llama, steps
from pallas_kernels import soft_cap
from sparse_attn import cache as cache_lib
from sparse_attn import methods


@dataclasses.dataclass(frozen=True)
class Captured:
  """q/k/v of every layer for one text (numpy float32, batch 1 dropped).

  Attributes:
    q: ``[L, N, S, D]``; k, v: ``[L, K, S, D]`` (post-RoPE, as cached).
    tokens: ``[S]`` int32 ids.
    scale: the model's softmax scale.
    softcap: the attention-logit soft-cap (Gemma 2), None = none.
    windows: per layer, its sliding window (None = full attention), or None: no layer has one.
  """

  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  tokens: np.ndarray
  scale: float
  softcap: float | None = None
  windows: tuple[int | None, ...] | None = None

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


  def logits(self, layer: int, length: int | None = None) -> np.ndarray:
    """``[N, S, S]`` float32 attention logits of ``layer`` as the model's softmax sees them:
    ``scale * q . k``, soft-capped (``pallas_kernels.soft_cap``), ``-inf`` outside the causal
    mask and the layer's window (query ``i`` sees keys ``i - window < j <= i``)."""
    s = self.length if length is None else length
    q = self.q[layer, :, :s]
    s_ = soft_cap(jnp.einsum("nsd,ntd->nst", q, self.keys_per_query_head(layer, s)) * self.scale,
                  self.softcap)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    seen = j <= i
    window = None if self.windows is None else self.windows[layer]
    if window is not None:
      seen &= i - j < window
    return np.where(seen, np.asarray(s_, np.float32), -np.inf)


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


@functools.partial(jax.jit, static_argnames=("config", "layer_methods"),
                   donate_argnames=("bufs",))
def _chunk(params, tokens, positions, bufs, *, config, layer_methods):
  """Prefills one chunk ``[1, C]``; writes its queries into ``bufs['q'] [L, 1, N, S, D]``.
  ``layer_methods``: the (global, local) layers' methods; ``bufs['local'] [L]`` picks one."""
  scale = llama.softmax_scale(config)
  start = positions[0, 0]
  glob, loc = layer_methods

  def attend(q, k, v, inp):
    cache, qbuf, local = inp
    run = lambda m: lambda c: m.prefill(q, k, v, c, {}, positions, scale=scale)[:2]
    if loc is glob:
      out, cache = run(glob)(cache)
    else:
      out, cache = jax.lax.cond(local, run(loc), run(glob), cache)
    qbuf = jax.lax.dynamic_update_slice_in_dim(qbuf, q.astype(qbuf.dtype), start, axis=2)
    return out, (cache, qbuf, local)

  x = llama.embed(params, config, tokens)
  _, (cache, qbuf, local) = llama.run_layers(params, config, x, positions, attend,
                                             (bufs["cache"], bufs["q"], bufs["local"]))
  return {"cache": cache, "q": qbuf, "local": local}


def capture(model, tokens, chunk: int = 512, progress=None,
            windows_and_softcap: bool = False) -> Captured:
  """Runs a dense prefill of ``tokens [S]`` and returns every layer's q/k/v.

  Args:
    model: a loaded model (``config``, ``params``).
    tokens: ``[S]`` int ids.
    chunk: prefill chunk length (memory is ``O(chunk * S)`` per layer).
    progress: optional ``cli.Progress``-like object (``update()`` once per chunk).
    windows_and_softcap: the caller applies ``Captured.windows`` and ``Captured.softcap`` when
      it recomputes attention (e.g. ``Captured.logits``); required for a model with a window
      the text outgrows or a soft-cap.

  Raises:
    ValueError: a windowed or soft-capped model without ``windows_and_softcap``.
  """
  config = model.config
  tokens = np.asarray(tokens, np.int32)
  s = len(tokens)
  dense = methods.make("dense", block_size=16)
  cap = dense.round_capacity(s)
  c = min(chunk, cap)
  cap = -(-cap // c) * c  # whole chunks (the q buffer is written a chunk at a time)
  config = config.for_context(cap)  # as decode.prefill: one LongRoPE set, no idle window
  windows = [config.layer_window(i) for i in range(config.num_layers)]
  windows = tuple(windows) if any(w is not None for w in windows) else None
  if (windows is not None or config.attn_softcap is not None) and not windows_and_softcap:
    raise ValueError(
        f"{config.model_type}: sliding windows {windows} / attention soft-cap "
        f"{config.attn_softcap}: an analysis that recomputes plain softmax(q.k) over every "
        "key from the capture would not be this model's attention; pass "
        "windows_and_softcap=True where the analysis applies Captured.windows / .softcap "
        "(Captured.logits)")
  base = decode.with_model_window(dense, config, cap)  # Mistral-style: every layer
  layer_methods = tuple(steps.layer_method(base, config, local) for local in (False, True))
  # Every digest kind: the captured caches serve every selector (Quest's box, ArkVale's sphere).
  one = cache_lib.init_cache(1, config.num_kv_heads, cap, config.head_dim, 16, jnp.float32)
  stack = lambda a: jnp.repeat(a[None], config.num_layers, axis=0)
  bufs = {"cache": jax.tree.map(stack, one),
          "q": jnp.zeros((config.num_layers, 1, config.num_heads, cap, config.head_dim),
                         jnp.float32),
          "local": jnp.asarray([config.is_local(i) for i in range(config.num_layers)])}
  padded = np.zeros((cap,), np.int32)
  padded[:s] = tokens
  for start in range(0, s, c):
    idx = np.arange(start, start + c)
    pos = np.where(idx < s, idx, -1).astype(np.int32)[None]
    tok = np.where(pos >= 0, padded[start:start + c][None], 0)
    bufs = _chunk(model.params, jnp.asarray(tok), jnp.asarray(pos), bufs, config=config,
                  layer_methods=layer_methods)
    if progress is not None:
      progress.update()
  cache = bufs["cache"]
  get = lambda a: np.asarray(a[:, 0, :, :s], np.float32)
  return Captured(q=get(bufs["q"]), k=get(cache.k), v=get(cache.v), tokens=tokens,
                  scale=llama.softmax_scale(config), softcap=config.attn_softcap,
                  windows=windows)
