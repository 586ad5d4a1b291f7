"""Dense prefill throughput: ours vs ``transformers`` (PyTorch CPU) on the same weights.

Ours is the research path, ``models.decode.prefill`` (chunked, jitted, the dense method writing
the cache as it goes); the peer is one ``transformers`` forward over the prompt with
``logits_to_keep=1`` (what ``generate`` runs to prefill), built from *our* parameters
(``torch_from_params``), so both run the same f32 weights and the comparison holds for any model
``models.load`` reads (SmolLM2, Qwen2.5). Both are timed round-robin (``timing.interleaved``)
after a full-length warm-up, and every record carries the ratio from that one run.

``prefill_layers`` > 0 keeps only the first layers of both models (a faster run of the same
per-layer work; the embedding and LM head are a rounding error with ``logits_to_keep=1``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from experiments.common import modelzoo
from experiments.latency_lib import end_to_end, settings, timing
from models import decode, llama
from sparse_attn import methods


def load(name: str):
  """``modelzoo.load_model(name)``; ``tiny-random`` with ``hidden = heads * head_dim`` (which
  ``transformers`` requires; its own tiny model has 64 != 6 * 16)."""
  model = modelzoo.load_model(name)
  if name != modelzoo.TINY:
    return model
  c = model.config
  config = c.replace(hidden_size=c.num_heads * c.head_dim)
  return dataclasses.replace(model, config=config,
                             params=llama.init_params(config, jax.random.key(0)))


def truncate_layers(model, num_layers: int):
  """``model`` with only its first ``num_layers`` layers (0 = all)."""
  if not num_layers or num_layers >= model.config.num_layers:
    return model
  params = dict(model.params)
  params["layers"] = jax.tree.map(lambda a: a[:num_layers], params["layers"])
  return dataclasses.replace(model, config=model.config.replace(num_layers=num_layers),
                             params=params)


# ours name -> transformers name, per layer; kernels are [in, out], torch Linear is [out, in].
_LAYER_TORCH_NAMES = {
    "attn_norm/scale": "input_layernorm.weight", "mlp_norm/scale": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def torch_state_dict(model) -> dict:
  """Our parameters under ``transformers``' names (f32 torch tensors)."""
  import torch  # pylint: disable=g-import-not-at-top
  t = lambda a: torch.from_numpy(np.array(a, np.float32))
  p = model.params
  out = {"model.embed_tokens.weight": t(p["embed"]), "model.norm.weight": t(p["final_norm"]["scale"])}
  if "lm_head" in p:
    out["lm_head.weight"] = t(p["lm_head"]).T.contiguous()
  for i in range(model.config.num_layers):
    layer = jax.tree.map(lambda a, i=i: a[i], p["layers"])
    pre = f"model.layers.{i}."
    for ours, theirs in _LAYER_TORCH_NAMES.items():
      if "/" in ours:
        mod, leaf = ours.split("/")
        out[pre + theirs] = t(layer[mod][leaf])
        continue
      out[pre + theirs + ".weight"] = t(layer[ours]["kernel"]).T.contiguous()
      if "bias" in layer[ours]:
        out[pre + theirs + ".bias"] = t(layer[ours]["bias"])
  return out


def torch_from_params(model, threads: int):
  """A ``transformers`` causal LM (f32, eval) holding ``model``'s weights."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  cfg = model.config.to_hf_config()
  hf_config = transformers.AutoConfig.for_model(**cfg)
  tmodel = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
  missing, unexpected = tmodel.load_state_dict(torch_state_dict(model), strict=False)
  missing = [k for k in missing if not (cfg["tie_word_embeddings"] and k == "lm_head.weight")]
  if missing or unexpected:
    raise ValueError(f"weight names do not map: missing {missing}, unexpected {unexpected}")
  if cfg["tie_word_embeddings"]:
    tmodel.tie_weights()
  return tmodel.eval()


def candidates(model, tmodel, ids: list[int], chunk: int) -> list[timing.Candidate]:
  """Ours (``decode.prefill``, dense) and the ``transformers`` forward on the same prompt."""
  import torch  # pylint: disable=g-import-not-at-top
  dense = methods.make("dense")
  n = len(ids)
  capacity = dense.round_capacity(n)
  prompts, lengths = np.array([ids], np.int32), np.array([n], np.int32)

  def ours():
    return decode.prefill(model, prompts, lengths, dense, capacity, chunk)[0]

  tokens = torch.tensor([ids])

  def theirs():
    with torch.inference_mode():
      tmodel(input_ids=tokens, use_cache=True, logits_to_keep=1)

  return [timing.Candidate("ours", ours), timing.Candidate("transformers", theirs)]


def run(s, done, write_record) -> None:
  """Measures every (model, context) of the ``prefill`` section; one record each."""
  for name in settings.split_list(s.prefill_models):
    keys = {ctx: f"prefill/{name}/{ctx}" for ctx in settings.ints(s.prefill_lengths)}
    if all(done(k) for k in keys.values()):
      continue
    model = truncate_layers(load(name), s.prefill_layers)
    tmodel = torch_from_params(model, s.threads)
    for ctx, key in keys.items():
      if done(key):
        continue
      cands = candidates(model, tmodel, end_to_end.prompt_ids(model, ctx), s.prefill_chunk)
      timing.interleaved(cands, s.warmup, s.prefill_repeats)
      ours, theirs = cands[0].median_s, cands[1].median_s
      write_record(dict(section="prefill", model=name, layers=model.config.num_layers,
                        context=ctx, chunk=s.prefill_chunk, threads=s.threads,
                        ours_s=ours, transformers_s=theirs, ours_tok_s=ctx / ours,
                        transformers_tok_s=ctx / theirs, ratio=theirs / ours,
                        ours_times_s=cands[0].times, transformers_times_s=cands[1].times,
                        ours_first_s=cands[0].first_s), key)
