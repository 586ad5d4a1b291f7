"""RULER-style accuracy of methods x budgets x tasks x context lengths (RESA Table 1 layout).

``run(config, workdir)`` generates the samples (``experiments.tasks.ruler``), decodes them
greedily in batches with every method (one shared dense prefill for the plain methods), scores
them with RULER's string match and appends one JSON record per (method, sample). ``render``
turns records into one table per (model, context length): rows are methods (dense first),
columns tasks, each cell ``accuracy% [95% Wilson CI] n``.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from experiments.common import cli, modelzoo, render, results
from experiments.tasks import decoding, ruler, scoring, specs

EXPERIMENT = "accuracy"
KEYED = ("model", "methods", "budgets", "tasks", "lengths")  # in every record's key
CAPACITY_ROUND = 256


def _key(model_name, label, s: ruler.Sample) -> str:
  return f"{model_name}|{label}|{s.task}|{s.target}|{s.seed}|{s.depth}"


def run(config, workdir: str) -> list[dict]:
  """Runs the accuracy sweep of ``config`` (see ``configs/accuracy.py``); returns the records."""
  model = modelzoo.load_model(config.model)
  prompter = ruler.Prompter(model.tokenizer, chat=config.chat)
  entries = specs.expand(config.methods, config.budgets, block_size=config.block_size,
                         rope_inv_freq=modelzoo.rope_inv_freq(model))
  writer = results.ResultWriter(workdir, config, EXPERIMENT, keyed=KEYED)
  samples = ruler.dataset(config.tasks, config.lengths, config.num_samples, prompter,
                          list(config.depths), config.seed, config.haystack)
  groups = collections.defaultdict(list)
  for s in samples:
    groups[(s.task, s.target)].append(s)
  progress = cli.Progress(len(samples) * len(entries), "accuracy")
  for (task, target), group in groups.items():
    for start in range(0, len(group), config.batch_size):
      batch = group[start:start + config.batch_size]
      todo = [e for e in entries if not all(writer.done(_key(config.model, e.label, s))
                                            for s in batch)]
      progress.update((len(entries) - len(todo)) * len(batch))
      if not todo:
        continue
      ids = [prompter.ids(s.prompt) for s in batch]
      lengths = np.array([len(x) for x in ids], np.int32)
      prompts = np.zeros((len(ids), int(lengths.max())), np.int32)
      for i, x in enumerate(ids):
        prompts[i, :len(x)] = x
      max_new = config.max_new_tokens or batch[0].max_new_tokens
      # Rounded up so batches of one target length share the compiled steps.
      capacity = -(-(int(lengths.max()) + max_new) // CAPACITY_ROUND) * CAPACITY_ROUND
      t0 = time.perf_counter()
      for e, (m, pre) in zip(todo, decoding.prefill_all(model, prompts, lengths,
                                                         [e.method for e in todo], capacity)):
        rows = decoding.greedy(model, pre, m, max_new)
        secs = time.perf_counter() - t0
        for s, row in zip(batch, rows):
          pred = model.decode(row)
          writer.write(dict(
              model=config.model, method=e.label, spec=e.spec, budget=e.budget, task=task,
              length=target, num_tokens=s.num_tokens, depth=s.depth, seed=s.seed,
              score=scoring.score(pred, s.answers, s.metric), metric=s.metric,
              answers=list(s.answers), prediction=pred[:300], new_tokens=len(row),
              batch_seconds=secs), key=_key(config.model, e.label, s))
        progress.update(len(batch), e.label)
        t0 = time.perf_counter()
  records = writer.records()
  write_outputs(records, workdir)
  return records


# ---------------------------------------------------------------- rendering


def _order(labels):
  """Dense first, then first-appearance order."""
  seen = list(dict.fromkeys(labels))
  return sorted(seen, key=lambda x: (x != "dense", seen.index(x)))


def cell(scores) -> dict:
  n = len(scores)
  mean = float(np.mean(scores)) if n else float("nan")
  lo, hi = scoring.wilson(mean * n, n)
  return dict(mean=mean, lo=lo, hi=hi, n=n)


def _fmt(c) -> str:
  return f"{100 * c['mean']:.1f} [{100 * c['lo']:.0f}-{100 * c['hi']:.0f}] n={c['n']}"


def tables(records) -> list[str]:
  """Markdown sections: one table per (model, context length)."""
  by = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in records:
    by[(r["model"], r["length"])][(r["method"], r["task"])].append(r["score"])
  out = []
  for (model, length), cells in sorted(by.items()):
    tasks = [t for t in ruler.TASKS if any(k[1] == t for k in cells)]
    rows = []
    for label in _order([k[0] for k in cells]):
      row = {"method": label}
      for t in tasks:
        if (label, t) in cells:
          row[t] = _fmt(cell(cells[(label, t)]))
      allsc = [x for t in tasks for x in cells.get((label, t), [])]
      row["avg"] = _fmt(cell(allsc))
      rows.append(row)
    title = (f"### Accuracy (%), model `{model}`, context {length} tokens\n\n"
             "Cells: mean string-match score [95% Wilson interval] and the number of samples.")
    out.append(title + "\n\n" + render.markdown_table(rows, ["method"] + tasks + ["avg"]))
  return out


def figure(records, workdir: str, name: str = "accuracy_vs_length.png"):
  """Average accuracy vs context length per method (one panel per model)."""
  by = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in records:
    by[r["model"]][(r["method"], r["length"])].append(r["score"])
  if not by:
    return None
  fig, axes = render.new_figure(ncols=len(by))
  for ax, (model, cells) in zip(axes[0], sorted(by.items())):
    for label in _order([k[0] for k in cells]):
      pts = sorted((ln, np.mean(v)) for (lab, ln), v in cells.items() if lab == label)
      ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(model, fontsize=9)
    ax.legend(fontsize=6)
  return render.save_figure(fig, workdir, name)


def write_outputs(records, workdir: str) -> str:
  fig = figure(records, workdir)
  sections = tables(records)
  if fig:
    sections.append("![accuracy vs context length](accuracy_vs_length.png)")
  return render.write_markdown(workdir, "accuracy.md", "RULER-style accuracy", sections)
