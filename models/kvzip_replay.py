"""KVzip's context reconstruction (arXiv 2505.23416) between the prefill and ``end_prefill``.

Letters: B batch, S replay tokens.

``models.decode.prefill`` calls ``replay`` for a method with a ``replay`` phase
(``sparse_attn.compression.kvzip``): for each chunk of ``method.chunk_size`` prompt tokens, the
request to repeat it (the first chunk: ``FIRST``; later ones: ``LATER`` + the previous chunk's
last ``PREVIOUS`` tokens), the chat template's assistant header (``chat_suffix``; ``"\\n"``
without a template) and the chunk itself run through every layer at the positions after the
row's prompt (``steps.replay_step``), each layer's state told the chunk's ``[start, end)``
(``state["span"]``). The cache is not written: the replays only leave their scores. As
kvpress's ``KVzipPress.prepare`` and the authors' ``prepare``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models import steps

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS = 8


def chat_suffix(tokenizer) -> str:
  """The chat template's text after a user message (kvpress splits a dummy turn), or ``"\\n"``."""
  if not getattr(tokenizer, "chat_template", None):
    return "\n"
  dummy = "dummy context"
  sep = "\n" + "#" * len(dummy)
  return tokenizer.apply_chat_template([{"role": "user", "content": dummy + sep}],
                                       add_generation_prompt=True).split(sep)[1]


def replay_tokens(tokenizer, prompt, chunk: int):
  """``[(start, end, ids)]``: each chunk of ``prompt`` and its replay's token ids."""
  enc = lambda text: list(tokenizer.encode(text, add_bos=False))
  suffix = enc(chat_suffix(tokenizer))
  out = []
  for start in range(0, len(prompt), chunk):
    piece = list(prompt[start:start + chunk])
    ask = enc(FIRST) if start == 0 else enc(LATER) + list(prompt[max(start - PREVIOUS, 0):start])
    out.append((start, start + len(piece), ask + suffix + piece))
  return out


def replay(model, prompts, lengths, caches, states, method, config):
  """Runs every replay of right-padded ``prompts [B, S]`` (``lengths [B]``) -> ``(caches,
  states)`` with the method's scores recorded."""
  rows = [replay_tokens(model.tokenizer, prompts[b, :lengths[b]], method.chunk_size)
          for b in range(len(lengths))]
  for c in range(max(len(r) for r in rows)):
    got = [r[c] if c < len(r) else (0, 0, []) for r in rows]
    s = max(len(ids) for _, _, ids in got)
    tok = np.zeros((len(rows), s), np.int32)
    pos = np.full((len(rows), s), -1, np.int32)
    for b, (_, _, ids) in enumerate(got):
      tok[b, :len(ids)] = ids
      pos[b, :len(ids)] = lengths[b] + np.arange(len(ids))
    span = np.asarray([[a, e] for a, e, _ in got], np.int32)
    # one device copy per layer: each layer's state is donated to its call
    states = [dict(st, span=jnp.asarray(span)) for st in states]
    _, caches, states = steps.replay_step(model.decode_params, jnp.asarray(tok), jnp.asarray(pos),
                                          caches, states, config=config, method=method)
  return caches, states
