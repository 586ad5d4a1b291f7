"""``experiments.ea_needle_diagnosis``: does Expected Attention's score see the needle?

Letters: L layers, N query heads, K kv heads, G group, S context tokens, Q question tokens.

Issue 40, item 5. For one needle prompt (``experiments.tasks.ruler``) the whole prompt is
prefilled densely once (``capture``): its post-RoPE q/k/v serve both sides.

* **(a) EA's score.** Per layer, the paper's method (``expected-attention:eps=0``, built as
  the needle experiments build it) prefills the context's q/k/v with its own ``prefill``
  (which records the un-rotated queries past the sinks, ``observe``) and scores the keys with
  its own ``scores`` (``(a_hat + eps) ||v||``, Eq. 7-9, the ranking) and
  ``statistics`` + ``expected_attention`` (``a_hat``, Eq. 8, without the value norm). Its kept
  set is its own ``prefill_keep`` (Ada-KV, and the uniform-budget variant). Nothing of the
  formula is re-implemented here.
* **(b) the truth.** The dense attention of the question's queries (every token after the
  context) to each context key, averaged over the question's tokens and the kv head's query
  heads.
* **Counterfactual.** The same EA score with the statistics of the question's own queries
  (``observe`` on them): what EA would rank with a perfect estimate of the question's query
  distribution, so the Gaussian summary itself is tested apart from the prompt-query estimate.

Per (layer, kv head): Spearman rho of (a) and (b) over the context keys past the sinks, rho
of each with the key position (a positional trend), and the share of (b)'s mass on the
needle's tokens that each kept set holds (EA Ada-KV / uniform, EA with the question's
statistics, the oracle top-50% of (b), the most recent 50%).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from scipy import stats

from experiments.common import capture as capture_lib
from experiments.analysis import kept_tokens
from experiments.common import cli, modelzoo, render, specs
from experiments.common.results import ResultWriter
from experiments.tasks import accuracy, decoding, ruler
from sparse_attn.compression import HeadBudget
from sparse_attn.compression import expected_attention as ea

NAME = "ea_needle_diagnosis"
KEYED = ("depths",)
KEEPS = ("ea", "ea_uniform", "ea_question_stats", "oracle", "recent")


def spearman(x, y) -> float:
  """Spearman rho of two 1-d arrays (nan when either is constant)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if np.ptp(x) == 0 or np.ptp(y) == 0:
    return float("nan")
  return float(stats.spearmanr(x, y).statistic)


def question_attention_per_key(q, k, scale: float, num_context: int) -> np.ndarray:
  """``[L, K, S]`` dense attention of the question's queries to each context key.

  Args:
    q: ``[L, N, S_all, D]`` post-RoPE queries of the whole prompt; queries at
      ``>= num_context`` are the question's.
    k: ``[L, K, S_all, D]`` post-RoPE keys.
    scale: softmax scale.
    num_context: ``S``, the context tokens.

  The softmax runs causally over every key a question token sees (the question's own
  included), as the model attends; the context part is averaged over the question's tokens and
  each kv head's ``G`` query heads.
  """
  num_layers, n, s_all, _ = q.shape
  kv = k.shape[1]
  t = np.arange(num_context, s_all)
  out = np.zeros((num_layers, kv, num_context))
  for layer in range(num_layers):
    keys = np.repeat(k[layer], n // kv, axis=0)  # [N, S_all, D]
    logits = scale * np.einsum("nqd,nsd->nqs", q[layer, :, num_context:], keys,
                               dtype=np.float64)
    logits = np.where(np.arange(s_all)[None, None] <= t[None, :, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[layer] = p[..., :num_context].mean(1).reshape(kv, n // kv, num_context).mean(1)
  return out


@functools.partial(jax.jit, static_argnames=("method", "uniform", "scale"))
def ea_layer(method, uniform, q, k, v, q_question, scale):
  """EA's own view of one layer's context (batch 1, ``[K, S]`` each).

  Args:
    method: the Expected Attention method (``head_budget="adakv"`` or not).
    uniform: the same method with uniform head budgets.
    q, k, v: ``[1, N|K, S, D]`` post-RoPE context queries / keys / values.
    q_question: ``[1, N, Q, D]`` post-RoPE question queries (positions ``S ..``).
    scale: softmax scale.

  Returns:
    ``score`` (the ranking, Eq. 9), ``a_hat`` (Eq. 8, mean over the group), ``score_question``
    (Eq. 9 with the question's statistics), kept sets ``keep``, ``keep_uniform``,
    ``keep_question`` (uniform budgets).
  """
  _, n, s, d = q.shape
  kv = k.shape[1]
  cap = method.round_capacity(s)
  cache = method.init_cache(1, kv, cap, d, jnp.float32)
  state = method.init_state(1, n, kv, d, cap)
  _, cache, state = method.prefill(q, k, v, cache, state, jnp.arange(s)[None], scale=scale)
  count = jnp.full((1,), s, jnp.int32)
  score = method.scores(cache, state, scale, count)
  mu, cov = method.statistics(state, d)
  kmask = cache.valid & (cache.pos >= method.n_sink)
  a_hat = jnp.mean(ea.expected_attention(mu, cov, cache.k, kmask, scale), axis=2)
  keep, _ = method.prefill_keep(cache, state, scale)
  keep_uniform, _ = uniform.prefill_keep(cache, state, scale)
  sq = q_question.shape[2]
  st_q = dict(method.init_state(1, n, kv, d, cap), next_pos=state["next_pos"])
  st_q = method.observe(q_question, cache, st_q, s + jnp.arange(sq)[None], None, scale)
  score_q = method.scores(cache, st_q, scale, count)
  keep_q, _ = uniform.prefill_keep(cache, st_q, scale)
  out = dict(score=score, a_hat=a_hat, score_question=score_q, keep=keep,
             keep_uniform=keep_uniform, keep_question=keep_q)
  return {name: x[0, :, :s] for name, x in out.items()}


def top_keep(score, count, n_sink: int) -> np.ndarray:
  """``[..., S]`` bool: the sinks and the ``count [...]`` best other keys by ``score``."""
  s = score.shape[-1]
  pos = np.arange(s)
  x = np.where(pos < n_sink, np.inf, np.asarray(score, np.float64))
  rank = np.argsort(np.argsort(-x, axis=-1, kind="stable"), axis=-1)
  return rank < np.asarray(count)[..., None]


def head_measures(view: dict, true: np.ndarray, span, n_sink: int) -> dict:
  """Per (layer, kv head) measures of one sample; every value an ``[L, K]`` array.

  Args:
    view: ``ea_layer``'s outputs stacked over layers (``[L, K, S]`` each).
    true: ``[L, K, S]`` the question's attention (``question_attention_per_key``).
    span: ``(start, end)`` needle token positions.
    n_sink: EA's sinks (forced, outside its softmax): left out of the correlations.
  """
  num_layers, kv, s = true.shape
  a, b = span
  pos = np.arange(n_sink, s)
  keeps = dict(ea=view["keep"], ea_uniform=view["keep_uniform"],
               ea_question_stats=view["keep_question"])
  count = view["keep_uniform"].sum(-1)  # [L, K] tokens per head at 50%
  keeps["oracle"] = top_keep(true, count, n_sink)
  keeps["recent"] = top_keep(np.broadcast_to(np.arange(s), true.shape), count, n_sink)
  out = {f"rho_{name}": np.zeros((num_layers, kv)) for name in
         ("score", "a_hat", "question_stats", "pos_score", "pos_a_hat", "pos_true")}
  half = s // 2
  for li in range(num_layers):
    for h in range(kv):
      t = true[li, h, n_sink:]
      sc, ah = view["score"][li, h, n_sink:], view["a_hat"][li, h, n_sink:]
      out["rho_score"][li, h] = spearman(sc, t)
      out["rho_a_hat"][li, h] = spearman(ah, t)
      out["rho_question_stats"][li, h] = spearman(view["score_question"][li, h, n_sink:], t)
      out["rho_pos_score"][li, h] = spearman(sc, pos)
      out["rho_pos_a_hat"][li, h] = spearman(ah, pos)
      out["rho_pos_true"][li, h] = spearman(t, pos)
  mass = true[..., a:b].sum(-1)  # [L, K]
  out["needle_mass"] = mass / np.maximum(true[..., n_sink:].sum(-1), 1e-30)
  out["needle_true"] = mass
  for name, keep in keeps.items():
    out[f"kept_{name}"] = (true * keep)[..., a:b].sum(-1) / np.maximum(mass, 1e-30)
  late = lambda x: x[..., half:].sum(-1) / np.maximum(x[..., n_sink:].sum(-1), 1e-30)
  out["late_score"], out["late_true"] = late(view["score"]), late(true)
  out["late_a_hat"] = late(view["a_hat"])
  return out


def summarize(m: dict) -> dict:
  """One sample's numbers: medians over layers x heads, kept needle mass over all of them."""
  w = m["needle_true"]
  row = {k: float(np.nanmedian(m[k])) for k in m if k.startswith(("rho_", "late_"))}
  for name in KEEPS:
    row[f"kept_{name}"] = float((m[f"kept_{name}"] * w).sum() / max(w.sum(), 1e-30))
  row["needle_mass"] = float(np.median(m["needle_mass"]))
  return row


def run(config, workdir: str) -> list[dict]:
  """Runs ``configs/ea_needle_diagnosis.py``; returns the per-depth table rows."""
  writer = ResultWriter(workdir, config, NAME, keyed=KEYED)
  model = modelzoo.load_model(config.model)
  prompter = ruler.Prompter(model.tokenizer, chat=config.chat)
  build = functools.partial(specs.build, block_size=config.block_size, model=model)
  method = build(config.method, config.budget)
  uniform = dataclasses.replace(method, head_budget=HeadBudget.UNIFORM)
  samples = ruler.dataset(config.tasks, config.lengths, config.num_samples, prompter,
                          list(config.depths), config.seed, config.haystack)
  progress = cli.Progress(len(samples), NAME)
  for s in samples:
    key = f"{s.task}|{s.target}|{s.seed}|{s.depth}"
    if writer.done(key):
      progress.update(1)
      continue
    ids, n = accuracy.context_split(prompter, s)
    span = kept_tokens.needle_token_span(prompter.ids, s.prompt, s.context,
                                         s.needle_spans[0], n)
    cap = capture_lib.capture(model, np.asarray(ids, np.int32))
    true = question_attention_per_key(cap.q, cap.k, cap.scale, n)
    per_layer = [jax.device_get(ea_layer(
        method, uniform, jnp.asarray(cap.q[li, None, :, :n]), jnp.asarray(cap.k[li, None, :, :n]),
        jnp.asarray(cap.v[li, None, :, :n]), jnp.asarray(cap.q[li, None, :, n:]), cap.scale))
        for li in range(cap.num_layers)]
    view = {name: np.stack([np.asarray(x[name]) for x in per_layer]) for name in per_layer[0]}
    m = head_measures(view, true, span, method.n_sink)
    rec = dict(model=config.model, method=config.method, budget=config.budget, task=s.task,
               length=s.target, context_tokens=n, depth=s.depth, seed=s.seed,
               needle_tokens=list(span), **summarize(m),
               per_head={k: np.round(v, 4).tolist() for k, v in m.items()})
    if config.check_pipeline:
      rec["pipeline_agreement"] = _pipeline_agreement(model, ids[:n], method, view["keep"])
    li, h = np.unravel_index(np.argmax(m["needle_true"]), m["needle_true"].shape)
    norm = lambda x: (x / max(x[method.n_sink:].sum(), 1e-30))[method.n_sink:]
    rec["profile"] = dict(layer=int(li), head=int(h), first=method.n_sink,
                          score=np.round(norm(view["score"][li, h]), 7).tolist(),
                          true=np.round(norm(true[li, h]), 7).tolist())
    writer.write(rec, key=key)
    progress.update(1, f"depth {s.depth}")
  return render_all(writer.records(), workdir)


def _pipeline_agreement(model, ids, method, keep) -> float:
  """Share of (layer, head, position) where the method's own prefill + eviction
  (``decoding.prefill_all``) keeps what ``ea_layer`` keeps."""
  n = len(ids)
  prompts, lengths = accuracy.pad([ids])
  capacity = -(-(n + 1) // accuracy.CAPACITY_ROUND) * accuracy.CAPACITY_ROUND
  (_, pre), = decoding.prefill_all(model, prompts, lengths, [method], capacity)
  kept = np.stack([kept_tokens.kept_mask(c, n)[0] for c in pre.caches])  # [L, K, S]
  return float((kept == keep).mean())


ROW_COLUMNS = ("depth", "rho_score", "rho_a_hat", "rho_question_stats", "rho_pos_score",
               "rho_pos_true", "late_score", "late_true", "kept_ea", "kept_ea_uniform",
               "kept_ea_question_stats", "kept_oracle", "kept_recent", "needle_mass",
               "pipeline_agreement", "n")


def table(records) -> list[dict]:
  """One row per depth: the mean over its samples of each sample's summary."""
  rows = []
  for d in sorted({r["depth"] for r in records}):
    rs = [r for r in records if r["depth"] == d]
    row = {c: float(np.mean([r.get(c, np.nan) for r in rs])) for c in ROW_COLUMNS[1:-1]}
    for c in row:
      if c.startswith("kept_") or c.startswith("late_") or c == "needle_mass":
        row[c] = round(100 * row[c], 1)
    rows.append(dict(depth=d, **row, n=len(rs)))
  return rows


def render_all(records, workdir: str) -> list[dict]:
  """Writes ``ea_needle_diagnosis.md`` and ``.png`` (profiles of the shallowest and deepest
  needle's most needle-reading head; the per-depth summary)."""
  rows = table(records)
  if not rows:
    return rows
  by_depth = sorted(records, key=lambda r: r["depth"])
  shown = [by_depth[0], by_depth[-1]] if len(by_depth) > 1 else by_depth
  fig, ax = render.new_figure(ncols=2, nrows=2, size=(5.4, 3.6))
  for axis, r in zip(ax[0], shown):
    p = r["profile"]
    x = np.arange(p["first"], p["first"] + len(p["true"]))
    axis.semilogy(x, np.maximum(p["true"], 1e-9), lw=0.7, label="(b) question's attention")
    axis.semilogy(x, np.maximum(p["score"], 1e-9), lw=0.7, alpha=0.8,
                  label="(a) EA score (eps=0)")
    axis.axvspan(*r["needle_tokens"], color="red", alpha=0.3, label="needle")
    axis.set(xlabel="context key position", ylabel="share of the context (log)",
             title=f"depth {r['depth']}: layer {p['layer']} kv head {p['head']}")
    axis.legend(fontsize=7)
  depth = [r["depth"] for r in rows]
  for c, label in (("rho_score", "rho(EA score, truth)"), ("rho_a_hat", "rho(EA a_hat, truth)"),
                   ("rho_question_stats", "rho(EA w/ question stats, truth)"),
                   ("rho_pos_score", "rho(EA score, position)"),
                   ("rho_pos_true", "rho(truth, position)")):
    ax[1, 0].plot(depth, [r[c] for r in rows], "o-", label=label)
  ax[1, 0].axhline(0, color="gray", lw=0.5)
  ax[1, 0].set(xlabel="needle depth", ylabel="Spearman rho (median over layers x heads)",
               title="EA's score vs the truth, and positional trends")
  ax[1, 0].legend(fontsize=7)
  for c in KEEPS:
    ax[1, 1].plot(depth, [r[f"kept_{c}"] for r in rows], "o-", label=c)
  ax[1, 1].set(xlabel="needle depth", ylabel="needle attention mass kept at 50% (%)",
               title="the question's needle attention each kept set holds")
  ax[1, 1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, f"{NAME}.png"), dpi=110)
  plt.close(fig)
  cfg = records[0].get("config", {})
  md = render.markdown_table(rows, ROW_COLUMNS, digits=3)
  render.write_markdown(workdir, f"{NAME}.md", "Expected Attention's score against the "
                        "question's attention (needle, eps = 0)", [
      f"Model `{cfg.get('model')}`, method `{cfg.get('method')}` at {cfg.get('budget')}, tasks "
      f"{cfg.get('tasks')}, lengths {cfg.get('lengths')}, one prompt per depth "
      f"{cfg.get('depths')}. Per layer x kv head, (a) is EA's ranking score of every context "
      "key past the 4 sinks (`(a_hat + eps) ||v||`, its own code on the context's q/k/v) and "
      "(b) the dense attention of the question's tokens to it (mean over the question's tokens "
      "and the group's query heads). `rho_score` / `rho_a_hat`: Spearman of (b) with the "
      "score / with `a_hat` alone; `rho_question_stats`: the same score built from the "
      "question's own query statistics; `rho_pos_*`: Spearman with the key position (medians "
      "over layers x heads). `late_*`: share of the score / true attention on the context's "
      "second half (%). `kept_*`: share of the question's attention mass on the needle held "
      "by each 50% kept set, over all layers x heads (%): EA (Ada-KV, the paper's setting), "
      "EA uniform, EA with the question's statistics, the oracle top-50% of (b), the most "
      "recent 50%. `needle_mass`: median share of (b) on the needle. `pipeline_agreement`: "
      "share of (layer, head, position) where the method's own prefill + eviction keeps what "
      "this analysis recomputes.", md, f"![{NAME}]({NAME}.png)"])
  return rows
