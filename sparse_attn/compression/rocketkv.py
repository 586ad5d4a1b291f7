"""RocketKV (Behnam et al., ICML 2025, arXiv 2502.14051): two-stage KV-cache compression.

Stage 1, SnapKV++ (Sec. 4.1): permanent eviction of the prompt by SnapKV's votes with the
authors' changes, GQA-aware (the votes of a group's query heads are summed, one kept set per kv
head: SnapKV's group mean here ranks alike) and max pooling of a wide kernel; this class *is*
``snapkv.SnapKV`` with RocketKV's defaults: ``window_size=32``, ``kernel=63``,
``pooling="max"`` (``pipeline/inf_stream_llm/infllm_utils.py`` lines 141-142 and
``attention/rocket.py`` lines 161-186 of github NVlabs/RocketKV). The paper's adaptive pooling
size is the authors' kernel of 63 on every task they run.

Stage 2, hybrid sparse attention (Sec. 4.2): every decode step attends the ``topk`` tokens of
each kv head chosen by ``selectors.hybrid.HybridSparse`` over the kept (and the generated)
tokens, with the sparse kernel (``kernels.sparse_decode``).

One knob, the paper's token budget as a fraction ``b`` of the context (``budget=b``), splits
into the two stages as the authors' ``compress`` does (``infllm_utils.py`` lines 143-156), with
``C = 1 / b``:

* ``r = min(0.2 + 0.06 log2 C, 0.8)``; stage 1 keeps ``C^-r = b^r`` of the prompt
  (``ratio = 1 - b^r``);
* stage 2 attends ``token_budget / 2`` tokens (``topk = (b / 2) / b^r`` of the kept cache; the
  other half of the budget pays for reading the reduced keys), with ``c = max(1, b^r / b)``.

Differences: the authors' capacity is computed from the longest sequence and subtracts the
generation length from the prompt budget; here the fractions apply to each row's own length
and generated tokens are kept beside the prompt's. ``budget=1`` is dense (``ratio=0``, every
token attended), where the authors' split would still halve it.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from sparse_attn import kernels
from sparse_attn.budget import Budget, parse_budget
from sparse_attn.compression import layout
from sparse_attn.compression.snapkv import SnapKV
from sparse_attn.selectors.hybrid import HybridSparse
from sparse_attn.spec import check_options


def stages(budget: float) -> dict:
  """``ratio``, ``topk``, ``c`` of RocketKV at the token budget ``budget`` (a fraction)."""
  if budget >= 1.0:
    return dict(ratio=0.0, topk=1.0, c=1.0)
  r = min(0.2 + 0.06 * math.log2(1.0 / budget), 0.8)
  keep = budget ** r
  return dict(ratio=round(1.0 - keep, 9), topk=min(1.0, budget / 2 / keep),
              c=max(1.0, keep / budget))


@dataclasses.dataclass(frozen=True)
class RocketKV(SnapKV):
  """SnapKV++ eviction, then hybrid sparse attention (see the module docstring).

  Attributes (besides SnapKV's ``ratio``, ``window_size``, ``kernel``, ``pooling``):
    topk: stage 2's budget, a fraction of the kept cache (or a token count).
    c: stage 2's compression ratio of the approximate keys.
  """

  window_size: int = 32
  kernel: int = 63
  pooling: str = "max"
  topk: float | int = 0.5
  c: float = 1.0

  name = "rocketkv"
  SPARSE_DECODE = True

  def __post_init__(self):
    super().__post_init__()
    if self.head_budget != "uniform" or self.phase != "prefill":
      raise ValueError(f"{self.spec}: RocketKV compresses the prompt once per kv head "
                       "(head_budget='uniform', phase='prefill')")
    self.stage2  # validates topk and c  # pylint: disable=pointless-statement

  @property
  def stage2(self) -> HybridSparse:
    """The decode selector: ``topk`` tokens per kv head at compression ratio ``c``."""
    return HybridSparse(budget=self.topk, c=self.c, block_size=self.block_size)

  def attended_tokens(self, context: int, num_layers: int | None = None) -> dict:
    """Tokens a decode step reads per kv head at a prompt of ``context`` tokens: stage 2's
    top-k over the ``prompt_keep`` tokens stage 1 keeps (``Budget.accounting``; ``kept`` adds
    the cache size it selects from). The harness's share of the context read is then the
    paper's token budget, not the size of the evicted cache. Every layer is sparse
    (``num_layers``: ``Budget.over_layers`` with no full layer)."""
    kept = int(self.prompt_keep(int(context)))
    acc = dict(self.stage2.budget.accounting(kept, 1), context=int(context), kept=kept)
    return acc if num_layers is None else Budget.over_layers(acc, num_layers, 0)

  def decode(self, q, k, v, cache, state, positions, *, scale=None):
    """Appends the new token after the kept ones and attends the stage-2 selection.

    ``q [B, N, 1, D]``, ``k, v [B, K, 1, D]``, ``positions [B, 1]`` (-1: padding) ->
    ``(out [B, N, 1, D], cache, state)``.
    """
    if q.shape[2] != 1:
      raise ValueError(f"{self.spec} decodes 1 query per step, got {q.shape[2]}")
    cache = layout.of(cache).append(cache, k, v, positions, impl=self.impl,
                                    interpret=self.interpret)
    q0 = q[:, :, 0]
    sel = self.stage2.select(q0, cache)
    out, _ = kernels.sparse_decode(q0, cache, sel, scale, impl=self.impl,
                                   interpret=self.interpret, softcap=self.softcap,
                                   positions=positions[:, 0])
    state = dict(state, next_pos=jnp.maximum(state["next_pos"], positions[:, 0] + 1))
    return out[:, :, None].astype(q.dtype), cache, state


def build(spec, parts, options):
  """``methods.make("rocketkv", budget=0.1)``: the stages from the token budget (``stages``);
  ``ratio``, ``topk``, ``c`` and SnapKV's options may be given to override them."""
  (name, inline), rest = parts[0], parts[1:]
  if rest:
    raise ValueError(f"{name!r} takes no enhancers, got {[n for n, _ in rest]} in {spec!r}")
  opts = {**inline, **options}
  b = parse_budget(opts.pop("budget", 0.1))
  if isinstance(b, int):
    raise ValueError(f"{name}: give the token budget as a fraction of the context, got {b}")
  valid = {f.name for f in dataclasses.fields(RocketKV)} - {"spec"}
  check_options(name, opts, valid | {"budget"})
  return RocketKV(spec=spec, **{**stages(b), **opts})
