"""The RULER generator against NVIDIA/RULER's templates and rules, task by task."""

import collections
import re

import numpy as np
import pytest

from experiments.common import data, modelzoo
from experiments.tasks import haystack as hs
from experiments.tasks import ruler, ruler_templates, ruler_words

NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


@pytest.fixture(scope="module")
def prompter():
  return ruler.Prompter(modelzoo.smollm2_tokenizer())


def _user(s):
  """The user turn of a chat prompt, and what follows the assistant header."""
  user = s.prompt.split("<|im_start|>user\n")[1]
  body, answer_prefix = user.split("<|im_end|>\n<|im_start|>assistant\n")
  return body, answer_prefix


def test_niah_single_follows_rulers_singular_template(prompter):
  s = ruler.generate("niah_single_1", 1024, 0, prompter)
  body, prefix = _user(s)
  (key,) = {m[1] for m in NEEDLE.findall(s.context)}
  assert body.startswith("A special magic number is hidden within the following text. Make "
                         "sure to memorize it. I will quiz you about the number afterwards.\n")
  assert body.endswith(f"\nWhat is the special magic number for {key} mentioned in the "
                       "provided text?")
  assert prefix == f" The special magic number for {key} mentioned in the provided text is"
  assert re.fullmatch(r"[a-z]+-[a-z]+", key) and key in hs.key_words()
  assert re.fullmatch(r"\d{7}", s.answers[0]) and s.max_new_tokens == 128
  # the noise haystack: RULER's whole five-sentence block, one per line, the needle its own line
  lines = s.context.split("\n")
  assert sum(line == hs.NOISE for line in lines) == len(lines) - 1
  assert NEEDLE.fullmatch(lines[[NEEDLE.match(x) is not None for x in lines].index(True)])


def test_niah_multiquery_plural_template_and_query_join(prompter):
  s = ruler.generate("niah_multiquery", 1024, 0, prompter)
  body, prefix = _user(s)
  needles = NEEDLE.findall(s.context)
  assert len(needles) == 4 and len(s.answers) == 4
  asked = re.search(r"for (.*) mentioned in the provided text\?$", body).group(1)
  keys = asked.replace(", and ", ", ").split(", ")
  assert asked == ", ".join(keys[:-1]) + ", and " + keys[-1]
  assert sorted(keys) == sorted(k for _, k, _ in needles)
  assert body.startswith("Some special magic numbers are hidden")
  assert prefix == f" The special magic numbers for {asked} mentioned in the provided text are"
  assert [dict((k, v) for _, k, v in needles)[k] for k in keys] == list(s.answers)


def test_niah_multikey_and_multivalue_needles(prompter):
  s = ruler.generate("niah_multikey_1", 1024, 0, prompter)
  needles = NEEDLE.findall(s.context)
  assert len({k for _, k, _ in needles}) == 4 and s.context.count(s.answers[0]) == 1
  s = ruler.generate("niah_multikey_3", 1024, 0, prompter)
  lines = s.context.split("\n")
  assert all(NEEDLE.fullmatch(x) for x in lines) and len(lines) > 10  # the haystack is needles
  assert all(re.fullmatch(UUID, k) and re.fullmatch(UUID, v) for _, k, v in NEEDLE.findall(
      s.context)) and len({x for x in lines}) == len(lines)
  assert NEEDLE.findall(s.context)[0][0] == "uuids"
  s = ruler.generate("niah_multivalue", 1024, 0, prompter)
  needles = NEEDLE.findall(s.context)
  assert len(needles) == 4 and len({k for _, k, _ in needles}) == 1
  assert sorted(v for _, _, v in needles) == sorted(s.answers)


def test_needle_depths_follow_rulers_rule(prompter):
  essay = [ruler.generate("niah_single_2", 400, i, prompter).depth for i in range(40)]
  assert set(essay) <= {d / 100 for d in hs.DEPTHS}  # RULER's 40 evenly spaced depths
  assert len(set(essay)) >= 20
  noise = np.array([ruler.generate("niah_single_1", 400, i, prompter).depth for i in range(40)])
  assert 0.35 < noise.mean() < 0.65 and np.mean((noise < 0.05) | (noise > 0.95)) < 0.25
  # the needle sits where its depth says, in sentences (essay) or lines (noise)
  for i in range(5):
    s = ruler.generate("niah_single_2", 1024, i, prompter)
    start = s.needle_spans[0][0]
    before = sum(hs.ends_sentence(w) for w in s.context[:start].split())
    total = sum(hs.ends_sentence(w) for w in s.context[:s.needle_spans[0][0]].split() +
                s.context[s.needle_spans[0][1]:].split())
    assert abs(before - int(s.depth * total)) <= 1, (s.depth, before, total)


@pytest.mark.parametrize("task", ["passkey", "niah_single_2", "niah_single_3", "qa"])
@pytest.mark.parametrize("depth", [0.0, 0.35, 1.0])
def test_an_explicit_depth_pins_the_queried_needle(prompter, task, depth):
  s = ruler.generate(task, 1536, 3, prompter, depth)
  assert s.context in s.prompt and s.depth == depth
  start, end = s.needle_spans[0]
  assert any(a in s.context[start:end] for a in s.answers)
  before = prompter.count(s.context[:start]) if start else 0
  after = prompter.count(s.context[end:]) if end < len(s.context) else 0
  # QA places whole documents (~100-300 tokens each), the rest whole sentences or lines
  tol = 0.15 if task == "qa" else 0.04
  assert abs(before / (before + after) - depth) < tol, (task, depth)


def test_variable_tracking_has_rulers_one_shot_example_and_chain(prompter):
  s = ruler.generate("vt", 1024, 0, prompter)
  body, prefix = _user(s)
  value = re.search(r"VAR [A-Z]{5} = (\d{5})\n", s.context).group(1)
  assert prefix == (" Answer: According to the chain(s) of variable assignment in the text "
                    f"above, 5 variables are assigned the value {value}, they are: ")
  example, task = body.split("\n\nMemorize and track")
  assert example.startswith(ruler_templates.VT[:60])
  names = re.search(r"they are:  ((?:[A-Z]{3} ){4}[A-Z]{3})\n$", example + "\n").group(1).split()
  assert len(set(names)) == 5 and f"VAR {names[1]} = VAR {names[0]} \n" in example
  assert 400 < prompter.count(example) <= 520  # RULER's 500-token example (+ its answer)
  pos = [s.context.index(f"VAR {a} =") for a in s.answers]
  assert pos == sorted(pos) and f"VAR {s.answers[0]} = {value}" in s.context
  for prev, cur in zip(s.answers, s.answers[1:]):
    assert f"VAR {cur} = VAR {prev} \n" in s.context + "\n"
  assert s.max_new_tokens == 30


@pytest.mark.parametrize("target,repeats", [(1024, (6, 1)), (4096, (30, 3))])
def test_common_words_counts_and_example(prompter, target, repeats):
  s = ruler.generate("cwe", target, 0, prompter)
  counts = collections.Counter(re.findall(r"\d+\. (\S+)", s.context))
  assert {counts[w] for w in s.answers} == {repeats[0]}
  assert {c for w, c in counts.items() if w not in s.answers} == {repeats[1]}
  assert set(counts) <= set(hs.common_words())
  body, prefix = _user(s)
  assert prefix == ruler_templates.CWE_PREFIX and s.max_new_tokens == 120
  example = body.split("\n" + ruler_templates.CWE[:40])[0]
  ex_counts = collections.Counter(re.findall(r"\d+\. (\S+)", example.split(" Answer:")[0]))
  ex_common = re.findall(r"\d+\. (\S+)", example.split(ruler_templates.CWE_PREFIX)[1])
  assert len(ex_counts) == (20 if target < 4096 else 40) and len(ex_common) == 10
  assert {ex_counts[w] for w in ex_common} == {3 if target < 4096 else 10}


def test_frequent_words_follow_rulers_zipf_rule(prompter):
  s = ruler.generate("fwe", 4096, 0, prompter)
  words = s.context.split(" ")
  counts = collections.Counter(words)
  ranked = [w for w, _ in counts.most_common()]
  assert ranked[0] == "..." and tuple(ranked[1:4]) == s.answers  # ranks 2-4 are the answers
  assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
  assert len(counts) <= (4096 - 50) // 50 == 80
  # RULER's counts int(N k^-2 / zeta(2)): N follows from the top count, the rest must match
  got = sorted(counts.values(), reverse=True)
  z = hs.zeta(2.0)
  assert any([c for c in ruler_words.zipf_counts(m, 80) if c] == got
             for m in range(int(got[0] * z) - 1, int((got[0] + 1) * z) + 2))
  assert "Please ignore the dots '....'." in s.prompt and s.max_new_tokens == 50


def test_qa_distractors_come_from_the_gold_article(prompter):
  s = ruler.generate("qa", 2048, 0, prompter)
  docs = re.split(r"\n\n(?=Document \d+:\n)", s.context)
  assert [int(re.match(r"Document (\d+):", d).group(1)) for d in docs] == list(
      range(1, len(docs) + 1))
  texts = [d.split(":\n", 1)[1] for d in docs]
  article = {it["context"]: it["article"] for it in data.squad()}
  gold = s.context[s.needle_spans[0][0]:s.needle_spans[0][1]].split(":\n", 1)[1]
  same = sum(article[t] == article[gold] for t in texts)
  paras = {it["context"] for it in data.squad() if it["article"] == article[gold]}
  assert same == min(len(texts), len(paras))  # the article's own paragraphs come first
  body, prefix = _user(s)
  assert prefix == " Answer:" and body.startswith(ruler_templates.QA[:80])
  assert s.metric == "part" and s.max_new_tokens == 32


def test_lengths_land_within_one_haystack_unit(prompter):
  for task in (t for t in ruler.TASKS if t != "qa_multi"):
    s = ruler.generate(task, 2048, 1, prompter)
    assert s.num_tokens == len(prompter.ids(s.prompt)) and s.num_tokens <= 2048
    slack = 400 if task == "qa" else 60  # a QA document; a noise line or a needle
    assert 2048 - s.num_tokens <= slack, (task, s.num_tokens)


def test_seeds_reproduce_and_differ(prompter):
  for task in (t for t in ruler.TASKS if t != "qa_multi"):
    n = 1024 if task in ("vt", "cwe") else 640  # their one-shot examples take 500+ tokens
    a, b, c = (ruler.generate(task, n, seed, prompter) for seed in (7, 7, 8))
    assert a == b
    assert a.prompt != c.prompt and a.answers != c.answers, task


def test_dataset_depths_random_or_pinned_and_errors(prompter):
  pinned = ruler.dataset(["passkey"], [256], 3, prompter, depths=[0.0, 0.5, 1.0])
  assert [s.depth for s in pinned] == [0.0, 0.5, 1.0]
  drawn = ruler.dataset(["passkey"], [256], 3, prompter)
  assert len({s.depth for s in drawn}) == 3 and len({s.prompt for s in drawn}) == 3
  with pytest.raises(ValueError, match="unknown task"):
    ruler.generate("nope", 256, 0, prompter)
  with pytest.raises(ValueError, match="depth must be in"):
    ruler.generate("passkey", 256, 0, prompter, 1.5)
  with pytest.raises(ValueError, match="cwe: a target of 128 tokens is too small"):
    ruler.generate("cwe", 128, 0, prompter)


def test_generation_caps_are_rulers():
  caps = ruler.MAX_NEW_TOKENS
  assert {caps[t] for t in ruler.NIAH_TASKS if t != "passkey"} == {128}
  assert (caps["vt"], caps["cwe"], caps["fwe"], caps["qa"]) == (30, 120, 50, 32)


def test_qa_multi_holds_every_gold_paragraph_and_asks_in_order(prompter):
  s = ruler.generate("qa_multi", 1024, 0, prompter, questions=3)
  assert s.metric == "each" and len(s.answers) == 3 and s.max_new_tokens == 3 * 24
  assert s.num_tokens <= 1024 and s.num_tokens >= 0.7 * 1024
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


def test_qa_differences_from_ruler_are_as_named(prompter):
  """Two of the qa differences ``ruler.DIFFERENCES`` names, shown on the generator: the gold
  document's slot varies between samples of one length (RULER's is fixed by the document
  count), and the questions are drawn across the dev set, not SQuAD's first ones in order."""
  samples = [ruler.generate("qa", 2048, i, prompter) for i in range(6)]
  slots = {s.context[:s.needle_spans[0][0]].count("Document ") for s in samples}
  assert len(slots) > 2
  first = {it["question"] for it in data.squad()[:50]}
  asked = [s.prompt.split("Question: ")[-1].split("<|im_end|>")[0] for s in samples]
  assert set(asked) <= {it["question"] for it in data.squad()} and not set(asked) & first
  named = " ".join(ruler.DIFFERENCES)
  assert "random.Random(42)" in named and "SQuAD's i-th question" in named
  assert "one position in 20-40" not in named  # the old, wrong account of RULER's shuffle


def test_vt_chain_lines_can_be_adjacent_as_named(prompter):
  """``ruler.DIFFERENCES``: RULER keeps a noise line between two chain lines, ours draws each
  line's position on its own, so two chain lines can touch."""
  def touching(seed):
    lines = ruler.generate("vt", 1024, seed, prompter).context.split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith("VAR ")]
    return any(b - a == 1 for a, b in zip(at, at[1:]))
  assert any(touching(seed) for seed in range(4))
  assert any("at least one noise line separates" in d for d in ruler.DIFFERENCES)
