"""The RULER-style generator: needles at the requested depth, lengths on target, seeded."""

import collections
import re

import pytest

from experiments.common import data, modelzoo
from experiments.tasks import ruler


@pytest.fixture(scope="module")
def prompter():
  return ruler.Prompter(modelzoo.smollm2_tokenizer())


@pytest.mark.parametrize("task", ["passkey", "niah_single_2", "niah_single_3", "qa"])
@pytest.mark.parametrize("depth", [0.0, 0.35, 1.0])
def test_needle_at_requested_depth(prompter, task, depth):
  s = ruler.generate(task, 1536, 3, prompter, depth)
  assert s.context in s.prompt
  ((start, end),) = s.needle_spans
  needle = s.context[start:end]
  assert needle.startswith(("One of the special", "The pass key", "Document"))
  assert any(a in needle for a in s.answers)  # the answer sits in that needle
  # the fraction of the haystack (in tokens, needle excluded) that precedes the needle
  before = prompter.count(s.context[:start]) if start else 0
  after = prompter.count(s.context[end:]) if end < len(s.context) else 0
  frac = before / (before + after)
  # QA places whole documents (~100-300 tokens each): depth holds to within one document
  tol = 0.15 if task == "qa" else 0.03
  assert abs(frac - depth) < tol, (task, depth, frac)


@pytest.mark.parametrize("target", [512, 2048])
def test_lengths_within_two_percent(prompter, target):
  small = tuple(t for t in ruler.TASKS if t != "qa_multi")  # 8 paragraphs need >= 2k tokens
  for task in small if target < 1024 else ("niah_multikey_3", "cwe", "qa", "qa_multi"):
    s = ruler.generate(task, target, 1, prompter, 0.5)
    assert s.num_tokens == len(prompter.ids(s.prompt))
    assert s.num_tokens <= target
    assert (target - s.num_tokens) / target <= 0.02, (task, target, s.num_tokens)


def test_seeds_reproduce_and_differ(prompter):
  for task in (t for t in ruler.TASKS if t != "qa_multi"):
    a = ruler.generate(task, 300, 7, prompter, 0.4)
    b = ruler.generate(task, 300, 7, prompter, 0.4)
    c = ruler.generate(task, 300, 8, prompter, 0.4)
    assert a == b
    assert a.prompt != c.prompt and a.answers != c.answers, task


def test_multikey_and_multiquery_needles(prompter):
  s = ruler.generate("niah_multikey_1", 1024, 0, prompter, 0.5)
  keys = re.findall(r"special magic numbers for (\S+) is:", s.context)
  assert len(keys) == 4 and len(set(keys)) == 4
  assert s.context.count(s.answers[0]) == 1
  s = ruler.generate("niah_multikey_2", 1024, 0, prompter, 0.5)
  keys = re.findall(r"special magic numbers for (\S+) is:", s.context)
  assert len(keys) > 20 and len(set(keys)) == len(keys)  # the haystack is distinct needles
  s = ruler.generate("niah_multiquery", 1024, 0, prompter, 0.5)
  assert len(s.answers) == 4 and all(a in s.context for a in s.answers)
  s = ruler.generate("niah_multivalue", 1024, 0, prompter, 0.5)
  assert len(set(s.answers)) == 4 and all(a in s.context for a in s.answers)


def test_variable_tracking_chain_in_order(prompter):
  s = ruler.generate("vt", 1024, 0, prompter, 0.2)
  value = re.search(r"VAR \w+ = (\d+)\.", s.context).group(1)
  assert f"VAR {s.answers[0]} = {value}." in s.context
  pos = [s.context.index(f"VAR {a} =") for a in s.answers]
  assert pos == sorted(pos)
  for prev, cur in zip(s.answers, s.answers[1:]):
    assert f"VAR {cur} = VAR {prev}." in s.context


def test_word_extraction_answers_are_the_most_frequent(prompter):
  s = ruler.generate("cwe", 1024, 0, prompter)
  counts = collections.Counter(re.findall(r"\d+\. (\w+)", s.context))
  top = {w for w, _ in counts.most_common(10)}
  assert top == set(s.answers)
  assert min(counts[w] for w in s.answers) > max(c for w, c in counts.items() if w not in top)
  s = ruler.generate("fwe", 1024, 0, prompter)
  counts = collections.Counter(s.context.split())
  assert [w for w, _ in counts.most_common(3)] == list(s.answers)


def test_dataset_sweeps_depths(prompter):
  ds = ruler.dataset(["passkey"], [256], 3, prompter)
  assert [s.depth for s in ds] == [0.0, 0.5, 1.0]
  assert len({s.prompt for s in ds}) == 3
  with pytest.raises(ValueError, match="unknown task"):
    ruler.generate("nope", 256, 0, prompter)


def test_qa_multi_holds_every_gold_paragraph_and_asks_in_order(prompter):
  s = ruler.generate("qa_multi", 1024, 0, prompter, questions=3)
  assert s.metric == "each" and len(s.answers) == 3 and s.max_new_tokens == 3 * 24
  assert s.num_tokens <= 1024 and s.num_tokens >= 0.95 * 1024
  asked = re.findall(r"Question (\d+): ", s.prompt)
  assert asked == ["1", "2", "3"] and s.prompt.endswith("Answer 1:")
  squad = {item["question"]: item for item in data.squad()}
  for i, q in enumerate(re.findall(r"Question \d+: (.*)", s.prompt)):
    item = squad[q.split("<|")[0].strip()]  # the last one runs into the chat template
    assert item["context"] in s.context and tuple(item["answers"]) == s.answers[i]


def test_qa_multi_refuses_a_target_too_small_for_its_paragraphs(prompter):
  with pytest.raises(ValueError, match="qa_multi: 8 questions need 8 SQuAD paragraphs"):
    ruler.generate("qa_multi", 512, 0, prompter)
  a, b = (ruler.generate("qa_multi", 1024, 7, prompter, questions=2) for _ in range(2))
  assert a == b
