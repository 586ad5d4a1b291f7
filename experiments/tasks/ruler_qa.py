"""Question answering over documents: RULER's ``qa`` and the LongGenBench-style ``qa_multi``.

qa (RULER ``qa.py``, SQuAD): the gold paragraph among distractor paragraphs taken first from the
gold's own article (then from the rest of the set when the article runs out), all shuffled,
numbered ``Document i:`` and separated by blank lines; whole documents only, so a prompt lands
within one document of its target.

qa_multi (LongGenBench, Liu et al. 2024, as RetroAttention Table 1 uses it): ``questions``
SQuAD questions with distinct gold paragraphs at evenly spread depths among random paragraphs,
answered in one output ("Answer 1: ... Answer 2: ..."), each answer scored on its own.
"""

from __future__ import annotations

import numpy as np

from experiments.common import data
from experiments.tasks import haystack as hs
from experiments.tasks import ruler_templates as tpl
from experiments.tasks.ruler_built import Built, split_template

DEFAULT_QUESTIONS = 8  # qa_multi's questions per prompt (``ruler.generate``'s default)
_DOC = "Document \x00:\n"  # numbered once the order is final (hs.number_documents)


def _paragraphs() -> tuple[list[str], dict[str, list[str]]]:
  """The distinct SQuAD paragraphs (sorted) and each article's paragraphs."""
  squad = data.squad()
  by_article: dict[str, list[str]] = {}
  for item in squad:
    paras = by_article.setdefault(item["article"], [])
    if item["context"] not in paras:
      paras.append(item["context"])
  return sorted({item["context"] for item in squad}), by_article


def qa(rng, target, depth, **_) -> Built:
  squad = data.squad()
  item = squad[int(rng.integers(len(squad)))]
  while len(item["context"]) + len(item["question"]) > 2 * target:  # the gold must fit
    item = squad[int(rng.integers(len(squad)))]
  paragraphs, by_article = _paragraphs()
  same = [p for p in by_article[item["article"]] if p != item["context"]]
  rest = sorted(set(paragraphs) - set(by_article[item["article"]]))
  order = ([same[i] for i in rng.permutation(len(same))] +
           [rest[i] for i in rng.permutation(len(rest))])
  units = [_DOC + p for p in order]
  position = float(rng.uniform()) if depth is None else float(depth)
  head, tail = split_template(tpl.QA.replace("{query}", item["question"]))
  layout = hs.Layout(head, units, [(_DOC + item["context"], position)], tail, sep="\n\n",
                     post=hs.number_documents)
  hi = min(len(units), max(1, target // 40))
  return Built(head, tail, tpl.QA_PREFIX, layout.context, lambda n: item["answers"], hi,
                     round(position, 4), metric="part")


def qa_multi(rng, target, depth, questions=DEFAULT_QUESTIONS, **_) -> Built:
  """``questions`` SQuAD items with distinct paragraphs; golds at evenly spread depths."""
  del depth
  squad = data.squad()
  budget = 2 * target // max(questions, 1)  # characters per gold paragraph, leaving room
  fits = [i for i, it in enumerate(squad) if len(it["context"]) + len(it["question"]) <= budget]
  if len({squad[i]["context"] for i in fits}) < questions:
    raise ValueError(f"qa_multi: {questions} questions need {questions} SQuAD paragraphs of at "
                     f"most {budget} characters at a target of {target} tokens; only "
                     f"{len({squad[i]['context'] for i in fits})} exist (raise the target or "
                     "lower the question count)")
  items, seen = [], set()
  for i in rng.permutation(fits):
    item = squad[int(i)]
    if item["context"] not in seen:
      seen.add(item["context"])
      items.append(item)
      if len(items) == questions:
        break
  others = sorted(set(_paragraphs()[0]) - seen)
  units = [_DOC + others[i] for i in rng.permutation(len(others))]
  depths = (np.arange(questions) + 0.5) / questions
  golds = [(_DOC + it["context"], float(d)) for it, d in zip(items, rng.permutation(depths))]
  head = ("Answer the questions based on the given documents.\n\nThe following are given "
          "documents.\n\n")
  asked = "\n".join(f"Question {i + 1}: {it['question']}" for i, it in enumerate(items))
  tail = (f"\n\nAnswer each of the {questions} questions below based on the given documents, "
          "in order, one line per question. Start each line with 'Answer N:' (N the question's "
          "number) followed by a short answer only; answer every question.\n\n" + asked)
  layout = hs.Layout(head, units, golds, tail, sep="\n\n", post=hs.number_documents)
  answers = tuple(tuple(it["answers"]) for it in items)
  return Built(head, tail, "Answer 1:", layout.context, lambda n: answers,
                     min(len(units), max(1, target // 40)), None, metric="each")
