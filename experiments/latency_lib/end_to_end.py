"""End to end on the embedded SmolLM2-135M: prefill and decode tokens/s vs ``transformers``.

Prefill runs ``models.decode.prefill`` (chunked, jitted) on a real prompt (Austen text), timed
after a one-chunk warm-up that compiles the same step. Decode starts from a cache pre-filled
with random K/V at the context length (a 32k-token prefill would dominate the run; the
per-step cost depends only on the cache length), so decode tokens/s is the median over
``decode_steps`` steps of the one decode schedule (``models.driver.Decoder``, ReSA rectification included). The PyTorch
peer gets the same treatment: a forward on the same prompt (``logits_to_keep=1``, as ``generate``
prefills), and ``generate`` continuing from a ``DynamicCache`` pre-filled to the same length.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import data, modelzoo
from experiments.latency_lib import per_layer, random_cache
from models import decode, driver, steps



def prompt_ids(model, n: int) -> list[int]:
  text = data.austen("emma")
  ids = model.encode(text[: 6 * n])
  while len(ids) < n:
    ids = ids + ids
  return ids[:n]


def _sync(tree):
  jax.block_until_ready(tree)


def ours_prefill_s(model, ids, method, chunk: int, capacity: int) -> tuple[float, float]:
  """(warm-up call incl. compilation, timed call) seconds of the chunked prefill.

  The warm-up prefills the first ``chunk`` tokens at the same capacity, which compiles the
  very step the full prompt runs (same chunk and cache shapes) at a fraction of its cost.
  """
  prompts, lengths = np.array([ids], np.int32), np.array([len(ids)], np.int32)
  out = []
  for n in (min(chunk, len(ids)), len(ids)):
    t0 = time.perf_counter()
    res = decode.prefill(model, prompts[:, :n], np.minimum(lengths, n), method, capacity,
                         chunk)
    _sync(res)
    out.append(time.perf_counter() - t0)
    del res
  return out[0], out[1]


def ours_decode_s(model, method, context: int, n_steps: int) -> tuple[float, list[float]]:
  """(first step incl. compilation, per-step seconds) decoding past a pre-filled cache."""
  config = model.config
  capacity = method.round_capacity(context + n_steps + method.window + 1)
  caches, states = steps.init_caches(config, method, 1, capacity)
  caches = [random_cache.fill(c, jax.random.fold_in(jax.random.key(0), i), context=context)
            for i, c in enumerate(caches)]
  caches, states = steps.end_prefill(caches, states, config=config, method=method)
  loop = driver.Decoder(model, method, jnp.zeros((1, capacity), jnp.int32), caches, states)
  times = []
  for i in range(n_steps + 1):  # rectification steps (ReSA) are timed inside the step they follow
    t0 = time.perf_counter()
    nxt, _ = loop.step(np.array([context + i]), jax.random.key(i))
    nxt.block_until_ready()
    jax.block_until_ready(loop.caches)
    times.append(time.perf_counter() - t0)
  return times[0], times[1:]


# ---------------------------------------------------------------- transformers peer


def torch_model(model, name: str, threads: int):
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  if name == modelzoo.TINY:  # same shapes, random weights: exercises the path only
    from transformers import LlamaConfig, LlamaForCausalLM  # pylint: disable=g-import-not-at-top
    c = model.config
    # transformers wants hidden = heads * head_dim; tiny-random has 64 != 6 * 16.
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.num_heads * c.head_dim,
                      intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                      head_dim=c.head_dim, tie_word_embeddings=c.tie_word_embeddings)
    return LlamaForCausalLM(cfg).eval()
  from models import sources  # pylint: disable=g-import-not-at-top
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  path = sources.smollm2_path()
  return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32,
                                              gguf_file=os.path.basename(path)).eval()


def torch_prefill_s(tmodel, ids) -> float:
  import torch  # pylint: disable=g-import-not-at-top
  with torch.inference_mode():
    tmodel(input_ids=torch.tensor([ids[:32]]), use_cache=True, logits_to_keep=1)  # warm-up
    t0 = time.perf_counter()
    tmodel(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def torch_decode_s(tmodel, context: int, steps: int) -> float:
  """Seconds per token of ``generate`` continuing from a random ``DynamicCache`` of ``context``."""
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import DynamicCache  # pylint: disable=g-import-not-at-top
  c = tmodel.config
  hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

  def run(ctx, n):
    cache = DynamicCache(config=c)
    g = torch.Generator().manual_seed(0)
    for layer in range(c.num_hidden_layers):
      shape = (1, c.num_key_value_heads, ctx, hd)
      cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), layer)
    ids = torch.ones((1, ctx + 1), dtype=torch.long)
    with torch.inference_mode():
      t0 = time.perf_counter()
      tmodel.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
      return time.perf_counter() - t0
  run(16, 2)  # warm-up
  return run(context, steps) / steps


# ---------------------------------------------------------------- section


def run(s, specs: list[str], done, write_record) -> None:
  model = modelzoo.load_model(s.model)
  ms = [(spec, per_layer.make_method(spec, s, p=s.e2e_budget_p)) for spec in specs]
  tmodel = torch_model(model, s.model, s.threads) if s.transformers else None
  base = dict(section="end_to_end", model=s.model, threads=s.threads)
  for ctx in [int(x) for x in s.prefill_contexts.split(",")]:
    ids = prompt_ids(model, ctx)
    for spec, m in ms:
      key = f"e2e/prefill/{ctx}/{spec}"
      if done(key):
        continue
      cap = m.round_capacity(ctx + s.decode_steps + 8)
      first, sec = ours_prefill_s(model, ids, m, s.prefill_chunk, cap)
      write_record(dict(base, phase="prefill", context=ctx, method=spec, seconds=sec,
                        first_call_s=first, tok_s=ctx / sec), key)
    key = f"e2e/prefill/{ctx}/transformers"
    if tmodel is not None and not done(key):
      sec = torch_prefill_s(tmodel, ids)
      write_record(dict(base, phase="prefill", context=ctx, method="transformers",
                        seconds=sec, tok_s=ctx / sec), key)
  for ctx in [int(x) for x in s.decode_contexts.split(",")]:
    for spec, m in ms:
      key = f"e2e/decode/{ctx}/{spec}"
      if done(key):
        continue
      first, times = ours_decode_s(model, m, ctx, s.decode_steps)
      med = statistics.median(times)
      write_record(dict(base, phase="decode", context=ctx, method=spec, seconds=med,
                        times_s=times, first_call_s=first, tok_s=1.0 / med), key)
    key = f"e2e/decode/{ctx}/transformers"
    if tmodel is not None and not done(key):
      sec = torch_decode_s(tmodel, ctx, s.decode_steps)
      write_record(dict(base, phase="decode", context=ctx, method="transformers", seconds=sec,
                        tok_s=1.0 / sec), key)
