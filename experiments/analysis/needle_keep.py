"""``experiments.needle_keep``: does a compression method keep the needle? (EA Fig. 3 diagnosis)

For needle prompts (``experiments.tasks.ruler``) the context (everything before the question,
as the query-agnostic protocol compresses it) is prefilled once for every compression method
(``decoding.prefill_all``), each method evicts with its own ``end_prefill``, and the kept
positions of every layer and kv head are compared with the needle's tokens
(``needle_keep``). One record per (method, sample): the needle's kept share overall, per
layer and per kv head, the kept share of each tenth of the context (where in the context a
method keeps its budget), and the recall weighted by where the dense model looks: the share of
its attention from the question's tokens that lands on the needle, per layer and kv head (one
dense prefill of the whole prompt, ``capture``). No answer is generated: this explains an
accuracy, it does not measure one.

Each context is prefilled twice on purpose: the compression union must see the context alone
(the query-agnostic protocol), while the question's attention needs a dense pass that reads
the question after the whole, uncompressed context.
"""

from __future__ import annotations

import collections
import os

import matplotlib.pyplot as plt
import numpy as np

from experiments.common import capture as capture_lib
from experiments.analysis import kept_tokens
from experiments.common import cli, modelzoo, render, specs
from experiments.common.results import ResultWriter
from experiments.tasks import accuracy, decoding, ruler
from sparse_attn.protocol import PrefillGroup

NAME = "needle_keep"
KEYED = ("methods", "budgets", "depths")  # in every record's key (extending reuses rows)


def _key(label, s) -> str:
  return f"{label}|{s.task}|{s.target}|{s.seed}|{s.depth}"


def run(config, workdir: str) -> list[dict]:
  """Runs ``configs/needle_keep.py``'s methods on its needle prompts; returns the table rows."""
  writer = ResultWriter(workdir, config, NAME, keyed=KEYED)
  model = modelzoo.load_model(config.model)
  prompter = ruler.Prompter(model.tokenizer, chat=config.chat)
  entries = specs.expand(config.methods, config.budgets, block_size=config.block_size,
                         model=model)
  bad = [e.label for e in entries if e.method.prefill_group != PrefillGroup.COMPRESSION]
  if bad:
    raise ValueError(f"{bad} are not compression methods: only an eviction keeps a subset")
  samples = ruler.dataset(config.tasks, config.lengths, config.num_samples, prompter,
                          list(config.depths), config.seed, config.haystack)
  progress = cli.Progress(len(samples) * len(entries), NAME)
  for start in range(0, len(samples), config.batch_size):
    batch = samples[start:start + config.batch_size]
    todo = [e for e in entries if not all(writer.done(_key(e.label, s)) for s in batch)]
    progress.update((len(entries) - len(todo)) * len(batch))
    if not todo:
      continue
    split = [accuracy.context_split(prompter, s) for s in batch]
    spans = [kept_tokens.needle_token_span(prompter.ids, s.prompt, s.context,
                                           s.needle_spans[0], n)
             for s, (_, n) in zip(batch, split)]
    attention = [_question_attention(model, ids, n, span) for (ids, n), span in zip(split, spans)]
    prompts, lengths = accuracy.pad([ids[:n] for ids, n in split])
    capacity = -(-int(lengths.max() + 1) // accuracy.CAPACITY_ROUND) * accuracy.CAPACITY_ROUND
    todo = [todo[i] for i in decoding.prefill_order(model, [e.method for e in todo], capacity)]
    for e, (_, pre) in zip(todo, decoding.prefill_all(model, prompts, lengths,
                                                     [e.method for e in todo], capacity)):
      s_max = int(lengths.max())
      kept = np.stack([kept_tokens.kept_mask(c, s_max) for c in pre.caches], axis=1)  # [B,L,K,S]
      for i, s in enumerate(batch):
        summary = kept_tokens.keep_summary(kept[i], int(lengths[i]), spans[i])
        rec = dict(model=config.model, method=e.label, spec=e.spec, budget=e.budget,
                   task=s.task, length=s.target, context_tokens=int(lengths[i]), depth=s.depth,
                   seed=s.seed, needle_tokens=list(spans[i]), **summary,
                   question_attention=attention[i].round(5).tolist(),
                   weighted_recall=kept_tokens.weighted_recall(
                       summary["needle_recall_per_head"], attention[i]))
        writer.write(rec, key=_key(e.label, s))
      progress.update(len(batch), e.label)
  return render_all(writer.records(), workdir)


def _question_attention(model, ids, num_context, span):
  """``[L, K]`` dense attention share of the question's tokens on the needle (one prefill)."""
  cap = capture_lib.capture(model, np.asarray(ids, np.int32))
  return kept_tokens.question_attention(cap.q, cap.k, cap.scale, num_context, span)


def table(records) -> list[dict]:
  """Per method: mean needle recall (with its range over samples), the recall weighted by the
  question's attention (overall, and for needles at depth < 0.5 / >= 0.5), the layer x head
  pairs keeping the needle, and the kept fraction."""
  by = collections.defaultdict(list)
  for r in records:
    by[r["method"]].append(r)
  rows = []
  for method, rs in by.items():
    recall = np.array([r["needle_recall"] for r in rs])
    weighted = np.array([r.get("weighted_recall", np.nan) for r in rs])
    depth = np.array([r["depth"] for r in rs], float)
    part = lambda m: f"{100 * weighted[m].mean():.0f}" if m.any() else "-"
    rows.append(dict(method=method, needle_recall=100 * recall.mean(),
                     min_max=f"[{100 * recall.min():.0f}, {100 * recall.max():.0f}]",
                     weighted_recall=100 * weighted.mean(), shallow=part(depth < 0.5),
                     deep=part(depth >= 0.5),
                     heads_with_needle=100 * np.mean([r["heads_with_needle"] for r in rs]),
                     kept=100 * np.mean([r["kept_fraction"] for r in rs]), n=len(rs)))
  rows.sort(key=lambda r: -r["weighted_recall"])
  return rows


def render_all(records, workdir: str) -> list[dict]:
  """Writes ``needle_keep.md`` and ``needle_keep.png`` (recall vs depth; the position profile)."""
  rows = table(records)
  if not rows:
    return rows
  fig, ax = render.new_figure(ncols=2, size=(5.0, 4.6))
  by = collections.defaultdict(list)
  for r in records:
    by[r["method"]].append(r)
  for method in (r["method"] for r in rows):
    rs = by[method]
    depths = sorted({r["depth"] for r in rs})
    ax[0, 0].plot(depths, [100 * np.mean([r.get("weighted_recall", np.nan) for r in rs
                                          if r["depth"] == d]) for d in depths], "o-",
                  label=method)
    prof = np.nanmean([r["position_profile"] for r in rs], axis=0)
    centres = (np.arange(len(prof)) + 0.5) / len(prof)
    ax[0, 1].plot(centres, 100 * prof, ".-", label=method)
  ax[0, 0].set(xlabel="needle depth", ylabel="needle kept (%, attention-weighted)",
               title="needle kept where the question reads it")
  ax[0, 1].set(xlabel="position in the context (fraction)", ylabel="tokens kept (%)",
               title="where the budget goes")
  handles, labels = ax[0, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
  fig.tight_layout(rect=(0, 0.02 + 0.045 * -(-len(labels) // 3), 1, 1))
  fig.savefig(os.path.join(workdir, "needle_keep.png"), dpi=110)
  plt.close(fig)
  cfg = records[0].get("config", {})
  md = render.markdown_table(rows, ["method", "needle_recall", "min_max", "weighted_recall",
                                    "shallow", "deep", "heads_with_needle", "kept", "n"],
                             digits=3)
  render.write_markdown(workdir, "needle_keep.md", "Which tokens compression keeps (needle)", [
      f"Model `{cfg.get('model')}`, tasks {cfg.get('tasks')}, lengths {cfg.get('lengths')}, "
      f"depths {cfg.get('depths')}: the context is prefilled and compressed as in the "
      "query-agnostic protocol, and the kept positions of every layer and kv head are compared "
      "with the needle's tokens. `needle_recall`: kept share of the needle's tokens over layers "
      "x kv heads (%); `weighted_recall`: the same, each layer x kv head weighted by the share "
      "of the dense model's attention from the question's tokens on the needle there (where "
      "the model reads it); `shallow` / `deep`: `weighted_recall` for needles at depth < 0.5 / "
      ">= 0.5; "
      "`heads_with_needle`: layer x head pairs keeping at least half of the needle (%); `kept`: "
      "share of the context kept.", md, "![needle_keep](needle_keep.png)"])
  return rows
