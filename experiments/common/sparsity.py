"""How much of the context a method reads, in words a reader can check against the budget.

``attended(method, context)`` is the share of the prompt one decode step attends per head at
the first answer token (selection: forced sinks + local window + blocks chosen by score,
``Method.attended_tokens``; compression: the kept fraction ``1 - ratio``; dense: everything).
``dense_warning`` says when a sparse method attends the whole prompt (a prompt shorter than
its forced entries, or a budget that covers the rest, makes it dense, and its text then equals
dense's by construction). ``cache_share`` is the KV cache's share of the bytes one decode step
reads: the most a sparse method can save at that length.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Attended:
  """Tokens of a ``context``-token prompt one decode step reads per head.

  Attributes:
    tokens: tokens attended (kept, for compression) per head.
    context: the prompt's tokens.
    detail: how the count is made (``"68 forced + 144 chosen"``, ``"kept 1 - ratio 0.5"``).
    forced: tokens attended whatever the budget (selection: sinks + local window;
      compression: 0), or None where unknown.
  """

  tokens: int
  context: int
  detail: str
  forced: int | None = None

  @property
  def share(self) -> float:
    return self.tokens / max(self.context, 1)

  def describe(self) -> str:
    return f"{self.tokens}/{self.context} tokens ({100 * self.share:.1f}%)" + (
        f": {self.detail}" if self.detail else "")


def attended(method, context: int, num_layers: int | None = None) -> Attended:
  """The ``Attended`` of ``method`` at a ``context``-token prompt; with the model's
  ``num_layers``, the mean over its layers where some attend everything (``dense_layers``,
  TidalDecode's full-attention layers)."""
  if method.is_dense:
    return Attended(context, context, "dense")
  acc = method.attended_tokens(context, num_layers)
  if acc is not None:
    what = "sinks, local window" + (f", {acc['outliers']} in outlier blocks"
                                    if acc.get("outliers") else "")  # ShadowKV's
    detail = f"{acc['forced']} forced ({what}) + {acc['chosen']} chosen"
    if acc.get("full_layers"):
      return Attended(round(acc["layer_mean"]), context,
                      f"{acc['full_layers']} of {acc['layers']} layers dense, the others "
                      f"{acc['total']}: {detail}", int(acc["forced"]))
    return Attended(int(acc["total"]), context, detail, int(acc["forced"]))
  ratio = getattr(method, "ratio", None)
  if ratio is not None:
    keep = getattr(method, "prompt_keep", None)  # ceil((1 - ratio) L), as the cache keeps
    kept = min(context, int(keep(context)) if keep else round((1.0 - ratio) * context))
    return Attended(kept, context, f"kept after compression (ratio {ratio:g})", 0)
  return Attended(context, context, "unknown: counted as dense")


def dense_warning(name: str, att: Attended) -> str | None:
  """A warning line when a non-dense ``name`` attends every token of the prompt, else None."""
  if att.detail == "dense" or att.tokens < att.context:
    return None
  head = (f"warning: {name} attends all {att.context} tokens of this prompt ({att.detail}): it "
          "is dense here, so its text equals dense's; ")
  if att.forced is not None and att.forced < att.context:
    return head + (f"its budget covers all {att.context - att.forced} tokens it chooses from: "
                   "give a smaller budget (a fraction such as 0.1, or fewer tokens)")
  return head + "give a longer prompt (the default passage has ~1,270 tokens)"


def cache_share(model, context: int) -> float:
  """The KV cache's share of the bytes one decode step reads at ``context`` tokens (the rest
  are the weights; same dtype for both): the most attending fewer tokens can save."""
  import jax  # pylint: disable=g-import-not-at-top

  c = model.config
  cache = 2 * c.num_layers * c.num_kv_heads * c.head_dim * context  # K and V, every layer
  weights = sum(x.size for x in jax.tree.leaves(model.params))
  return cache / (cache + weights)
