"""RoPE's configuration (``RopeConfig``) and its reading from / writing to a Hugging Face
``config.json`` (``rope_theta``, ``rope_scaling`` / ``rope_parameters``: default, linear, llama3,
LongRoPE / su). ``models.config`` re-exports ``RopeConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding parameters (``rope_type`` in default | linear | llama3 | longrope).

  Attributes:
    theta: the base; ``factor`` / ``low_freq_factor`` / ``high_freq_factor`` /
      ``original_max_position_embeddings``: linear and llama3 scaling (and LongRoPE's switch).
    short_factor, long_factor: LongRoPE's per-frequency divisors ``[D/2]`` (Phi-3 ``su``).
    attention_factor: LongRoPE's multiplier of ``cos``/``sin`` (so of q and k).
    freq_factors: per-frequency divisors ``[D/2]`` applied after the scaling (llama.cpp's
      ``rope_freqs`` tensor of Llama-3.x GGUF files), or None.
    longrope_long: LongRoPE's factor set: None picks it per call by the call's largest
      position (transformers' forward); True / False fix the long / short set (a decode run,
      ``for_context``). Not part of a checkpoint's config.
  """

  theta: float = 10000.0
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  short_factor: tuple[float, ...] | None = None
  long_factor: tuple[float, ...] | None = None
  attention_factor: float = 1.0
  freq_factors: tuple[float, ...] | None = None
  longrope_long: bool | None = None

  def for_context(self, capacity: int) -> "RopeConfig":
    """This rope for a decode run whose cache holds up to ``capacity`` positions: LongRoPE's
    long factors throughout when ``capacity`` exceeds ``original_max_position_embeddings``,
    else the short ones (other scalings are returned as they are).

    Why one set per run: keys are cached post-RoPE, so every step must rotate alike. This
    equals transformers' forward over the run's whole sequence, and its ``generate`` once the
    context has crossed the boundary (``Phi3ForCausalLM.prepare_inputs_for_generation`` then
    re-encodes the whole cache with the long factors); the tokens transformers emits before
    that crossing used the short factors, where a run of this capacity uses the long ones.
    """
    if self.rope_type != "longrope" or self.longrope_long is not None:
      return self
    return dataclasses.replace(
        self, longrope_long=capacity > self.original_max_position_embeddings)


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
  """``rope_parameters`` of one ``RopeConfig`` (``to_hf_config``)."""
  out: dict[str, Any] = {"rope_theta": rope.theta, "rope_type": rope.rope_type}
  if rope.rope_type != "default":
    out["factor"] = rope.factor
  if rope.rope_type == "llama3":
    out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
               original_max_position_embeddings=rope.original_max_position_embeddings)
  if rope.rope_type == "longrope":
    out.update(short_factor=list(rope.short_factor), long_factor=list(rope.long_factor),
               attention_factor=rope.attention_factor,
               original_max_position_embeddings=rope.original_max_position_embeddings)
  if rope.freq_factors is not None:
    out["freq_factors"] = list(rope.freq_factors)
  return out


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
  """Reads ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``.

  LongRoPE (``longrope``, Phi-3's older names ``su`` / ``yarn``) takes ``factor`` as
  ``max_position_embeddings / original_max_position_embeddings`` unless given, and
  ``attention_factor = sqrt(1 + log(factor) / log(original))`` for ``factor > 1`` (1 otherwise),
  as transformers' ``_compute_longrope_parameters`` does.
  ``freq_factors`` is this port's own key (a GGUF's ``rope_freqs``, kept in converted caches).
  """
  params = dict(cfg.get("rope_parameters") or {})
  scaling = cfg.get("rope_scaling")
  if scaling:
    params.update(scaling)
  theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
  rope_type = params.pop("rope_type", params.pop("type", "default"))
  if rope_type in ("su", "yarn") and cfg.get("model_type") == "phi3":
    rope_type = "longrope"  # transformers' Phi3Config maps both to longrope
  if float(params.pop("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
  freq_factors = params.pop("freq_factors", None)
  known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
  if rope_type == "longrope":
    known |= {"short_factor", "long_factor", "attention_factor"}
  extra = sorted(set(params) - known)
  if extra:
    raise ValueError(f"rope options {extra} are not supported (rope_type={rope_type!r})")
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
  kw: dict[str, Any] = {}
  if rope_type == "longrope":
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 2048))
    factor = float(params.get("factor") or cfg.get("max_position_embeddings", 2048) / original)
    attention = params.get("attention_factor")
    if attention is None:
      attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    kw = dict(factor=factor, original_max_position_embeddings=original,
              attention_factor=float(attention),
              short_factor=tuple(float(f) for f in params["short_factor"]),
              long_factor=tuple(float(f) for f in params["long_factor"]))
  elif rope_type != "default":
    kw = {k: (int(params[k]) if k.startswith("original") else float(params[k]))
          for k in known if k in params}
  if freq_factors is not None:
    kw["freq_factors"] = tuple(float(f) for f in freq_factors)
  return RopeConfig(theta=theta, rope_type=rope_type, **kw)
