"""The ``transformers`` side of the named-shape benchmark: ``LlamaForCausalLM`` (SDPA attention)
built from the same ``config.json`` with its own random weights, on the same device.

Letters: B batch, L layers, K kv heads, T context, D head dim.

Decode is ``generate`` (greedy, ``max_new_tokens = min_new_tokens = n``) continuing from a
``DynamicCache`` holding random K/V of ``T`` tokens per layer, the cache ``generate`` uses by
default (it grows by concatenation every step); prefill is one forward of ``B x T`` random ids
with ``use_cache=True, logits_to_keep=1`` (what ``generate`` runs to prefill). Each is timed
after a short warm-up call, with ``torch.cuda.synchronize`` around the clock on a GPU. Memory is
checked first, as ours is (``fits``), and a CUDA out-of-memory error becomes a skip record.
"""

from __future__ import annotations

import gc
import statistics
import time

from experiments.common import heap
from experiments.latency_lib import shapes, traffic

MARGIN = 0.05


def _torch():
  import torch  # pylint: disable=g-import-not-at-top
  return torch


def device_info(device: str) -> dict:
  """Backend, device name, torch/transformers versions and the device's memory (bytes)."""
  torch = _torch()
  import transformers  # pylint: disable=g-import-not-at-top
  info = dict(torch=torch.__version__, transformers=transformers.__version__)
  if device == "cuda":
    props = torch.cuda.get_device_properties(0)
    return dict(info, backend="gpu", device=props.name, device_bytes=props.total_memory)
  return dict(info, backend="cpu", device="cpu", device_bytes=None)


def free_bytes(device: str) -> int:
  if device == "cuda":
    return int(_torch().cuda.mem_get_info()[0])
  return heap.available_bytes()


def fits(need: int, device: str) -> str | None:
  """None when ``need`` bytes fit now, else the reason for a skip."""
  free = free_bytes(device)
  want = need + (1 << 30) + MARGIN * free
  if want <= free:
    return None
  return (f"memory: needs ~{want / 2**30:.1f} GiB (cache and activations "
          f"{need / 2**30:.1f} GiB + margin), {free / 2**30:.1f} GiB free")


def build(s, device: str):
  """``AutoModelForCausalLM`` of the config's shape, random weights, initialised on ``device``."""
  torch = _torch()
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(s.seed)
  cfg = transformers.AutoConfig.for_model(**shapes.hf_config(s.shape))
  with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=getattr(torch, s.shape_dtype), attn_implementation="sdpa")
  return model.eval()


def _sync(device: str):
  if device == "cuda":
    _torch().cuda.synchronize()


def _kv_bytes(c, batch: int, tokens: int, itemsize: int) -> int:
  return 2 * c.num_hidden_layers * batch * c.num_key_value_heads * tokens * c.head_dim * itemsize


def decode_part(model, device: str, *, batch: int, context: int, n_steps: int,
                repeats: int) -> dict:
  """ms per step of ``generate`` past a random ``DynamicCache`` of ``context`` tokens."""
  torch = _torch()
  from transformers import DynamicCache  # pylint: disable=g-import-not-at-top
  c = model.config
  dt = next(model.parameters()).dtype
  item = torch.empty((), dtype=dt).element_size()
  # The cache, and one layer's copy while torch.cat grows it.
  reason = fits(_kv_bytes(c, batch, context + n_steps, item) * (1 + 1 / c.num_hidden_layers),
                device)
  if reason:
    return dict(skip=reason)

  def run(ctx: int, n: int) -> float:
    cache = DynamicCache(config=c)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (batch, c.num_key_value_heads, ctx, c.head_dim)
    for layer in range(c.num_hidden_layers):
      cache.update(torch.randn(shape, generator=g, device=device, dtype=dt),
                   torch.randn(shape, generator=g, device=device, dtype=dt), layer)
    ids = torch.ones((batch, ctx + 1), dtype=torch.long, device=device)
    with torch.inference_mode():
      _sync(device)
      t0 = time.perf_counter()
      model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                     max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
      _sync(device)
      sec = time.perf_counter() - t0
    del cache, ids
    gc.collect()
    return sec / n

  t0 = time.perf_counter()
  run(16, 2)  # warm-up
  first = time.perf_counter() - t0
  times = [run(context, n_steps) for _ in range(repeats)]
  return dict(step_ms=statistics.median(times) * 1e3, times_ms=[t * 1e3 for t in times],
              first_call_s=first, steps=n_steps)


def prefill_part(model, device: str, *, batch: int, context: int) -> dict:
  """Seconds of one forward over ``batch x context`` random ids (``logits_to_keep=1``)."""
  torch = _torch()
  c = model.config
  item = next(model.parameters()).element_size()
  # The cache, plus a few [B, T, F] MLP activations alive at once.
  act = 4 * batch * context * max(c.intermediate_size, c.hidden_size) * item
  reason = fits(_kv_bytes(c, batch, context, item) + act, device)
  if reason:
    return dict(skip=reason)
  g = torch.Generator(device=device).manual_seed(0)
  ids = torch.randint(0, c.vocab_size, (batch, context), generator=g, device=device)

  def run(n: int) -> float:
    with torch.inference_mode():
      _sync(device)
      t0 = time.perf_counter()
      out = model(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1)
      _sync(device)
      sec = time.perf_counter() - t0
    del out
    gc.collect()
    return sec

  first = run(min(context, 128))
  return dict(seconds=run(context), first_call_s=first)


def run_parts(s, parts: list[dict], emit) -> None:
  """As ``shape_ours.run_parts``, for the ``transformers`` peer (``method`` is ignored)."""
  torch = _torch()
  torch.set_num_threads(s.threads)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  info = device_info(device)
  peak, source = traffic.peak_gbs_for(info["device"], s.peak_bandwidth_gbs)
  config = shapes.model_config(s.shape, s.shape_dtype)
  t0 = time.perf_counter()
  model = build(s, device)
  _sync(device)
  init_s = time.perf_counter() - t0
  for part in parts:
    emit("start", part)
    b, ctx = part["batch"], part["context"]
    rec = dict(part, engine="transformers", impl="sdpa", peak_gbs=peak or None,
               peak_source=source, model_init_s=init_s, **info)
    try:
      if part["phase"] == "decode":
        got = decode_part(model, device, batch=b, context=ctx, n_steps=s.shape_decode_steps,
                          repeats=s.shape_repeats)
        weights = shapes.weight_bytes(config, b)["total"]
        kv = shapes.kv_bytes(None, config, context=ctx, batch=b)
        rec.update(weight_bytes=weights, kv_bytes=kv)
        if "step_ms" in got:
          got.update(tok_s=b / got["step_ms"] * 1e3,
                     **shapes.bound(got["step_ms"] / 1e3, weights, kv, peak))
      else:
        got = prefill_part(model, device, batch=b, context=ctx)
        if "seconds" in got:
          got.update(tok_s=b * ctx / got["seconds"],
                     bound_flag="prefill: compute-bound, no bandwidth bound")
      skip = got.pop("skip", None)
      rec.update(got, status="skipped" if skip else "ok", reason=skip)
    except torch.cuda.OutOfMemoryError as e:
      rec.update(status="skipped", reason=f"memory: {e}"[:2000])
    except Exception as e:  # pylint: disable=broad-except (one part's failure is its record)
      rec.update(status="error", reason=f"{type(e).__name__}: {e}"[:2000])
    gc.collect()
    if device == "cuda":
      torch.cuda.empty_cache()
    emit("record", rec)
