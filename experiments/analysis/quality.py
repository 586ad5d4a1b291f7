"""Teacher-forced NLL tasks on real text, for the lambda sweep and the budget search.

Two kinds of sample, both scored by ``models.teacher_forced`` (prompt prefilled densely, the
continuation decoded one token at a time through the method's sparse decode path):
  * ``longdoc`` (summary-like, PG-19 style): ``ctx`` tokens of an Austen novel, NLL of the next
    ``cont`` tokens;
  * ``squad`` (retrieval-like): SQuAD v1.1 dev paragraphs as a haystack of about ``ctx``
    tokens with the question's own paragraph at a random depth, then ``Question: ... Answer:``;
    NLL of the gold answer's tokens only.
Quality is reported as ``exp(-NLL)`` per token relative to dense (``1.0`` = dense);
"within 2% of dense" means ``NLL - NLL_dense <= -log(0.98)``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import models
from experiments.common import data


@dataclasses.dataclass(frozen=True)
class Sample:
  """``tokens [S]``; the prompt is ``tokens[:prefill_len]``; NLL over ``tokens[score_from:]``."""

  tokens: np.ndarray
  prefill_len: int
  score_from: int


def longdoc_samples(model, n: int, ctx: int, cont: int) -> list[Sample]:
  """``n`` windows of ``ctx + cont`` tokens, one per Austen novel (cycled, later offsets)."""
  out = []
  for i in range(n):
    novel = data.AUSTEN_NOVELS[i % len(data.AUSTEN_NOVELS)]
    skip = 2000 + 50_000 * (i // len(data.AUSTEN_NOVELS))
    ids = np.asarray(model.encode(data.austen(novel)[skip:skip + 8 * (ctx + cont)]), np.int32)
    if len(ids) < ctx + cont:
      raise ValueError(f"{novel} too short for {ctx + cont} tokens")
    out.append(Sample(ids[:ctx + cont], ctx, ctx))
  return out


def squad_samples(model, n: int, ctx: int, seed: int = 0) -> list[Sample]:
  """``n`` SQuAD questions, each in a haystack of about ``ctx`` tokens of other paragraphs."""
  qa = data.squad()
  rng = np.random.default_rng(seed)
  paras = sorted({x["context"] for x in qa})
  out = []
  for i in rng.choice(len(qa), size=n, replace=False):
    item = qa[int(i)]
    hay, used = [], 0
    for j in rng.permutation(len(paras)):
      if paras[j] == item["context"]:
        continue
      ids = model.encode(paras[j] + "\n\n")
      if used + len(ids) > ctx:
        break
      hay.append(ids)
      used += len(ids)
    gold = model.encode(item["context"] + "\n\n")
    while hay and used + len(gold) > ctx:
      used -= len(hay.pop())
    hay.insert(int(rng.integers(0, len(hay) + 1)), gold)
    prompt = [t for ids in hay for t in ids]
    question = model.encode(f"Question: {item['question']}\nAnswer:")
    answer = model.encode(" " + item["answers"][0])
    toks = np.asarray(prompt + question + answer, np.int32)
    out.append(Sample(toks, len(prompt), len(prompt) + len(question)))
  return out


def samples(model, task: str, n: int, ctx: int, cont: int, seed: int = 0) -> list[Sample]:
  if task == "longdoc":
    return longdoc_samples(model, n, ctx, cont)
  if task == "squad":
    return squad_samples(model, n, ctx, seed)
  raise ValueError(f"unknown task {task!r}; valid: longdoc, squad")


def capacity_for(method, items: list[Sample]) -> int:
  """One capacity for every sample (one compilation per method)."""
  return method.round_capacity(max(len(s.tokens) for s in items))


def sample_nll(logits, sample: Sample) -> tuple[float, int]:
  """Summed NLL of ``tokens[score_from:]`` from teacher-forced ``logits [1, S - p + 1, V]``."""
  p = sample.prefill_len
  tgt = sample.tokens[sample.score_from:]
  lg = np.asarray(logits[0, sample.score_from - p:len(sample.tokens) - p], np.float64)
  lg = lg - lg.max(-1, keepdims=True)
  logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
  return float(-logp[np.arange(len(tgt)), tgt].sum()), len(tgt)


def nll(model, method, items: list[Sample], progress=None, forced=None) -> dict:
  """Mean NLL per scored token of ``method`` over ``items`` (``forced``: a custom teacher-forced
  function with ``models.teacher_forced``'s signature)."""
  fn = forced or models.teacher_forced
  cap = capacity_for(method, items)
  total, count, per = 0.0, 0, []
  for s in items:
    logits = fn(model, s.tokens[None], s.prefill_len, method, capacity=cap)
    t, c = sample_nll(logits, s)
    total, count = total + t, count + c
    per.append(t / c)
    if progress is not None:
      progress.update()
  return dict(nll=total / max(count, 1), tokens=count, per_sample=per)


def relative_quality(nll_method: float, nll_dense: float) -> float:
  """``exp(-(NLL - NLL_dense))``: the per-token probability ratio to dense (1 = dense)."""
  return math.exp(-(nll_method - nll_dense))
