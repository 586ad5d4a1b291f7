"""Our GGUF-built tokenizer vs transformers' (``gguf_file=``) on a few hundred strings."""

import copy
import os

import numpy as np
import pytest

from models import gguf_file, sources
from tests import isolated
from tests.models.test_gguf_file import reader_metadata

BASE = [
    "", " ", "  ", "\n", "\n\n", "\t", " \t\n ", "Hello world", "Hello  world", " Hello",
    "Hello\n\nworld", "The year 2024 had 366 days; 3.14159 and 1,000,000.", "a1b22c333",
    "don't I'm we're they've he'll she'd", "ÀÉÎÕÜ àéîõü ñ ß", "Привет, мир!", "你好，世界",
    "こんにちは世界", "안녕하세요", "مرحبا بالعالم", "שלום", "😀😃😄 👍🏽 🇫🇷", "e\u0301 vs é",
    "def f(x):\n    return x ** 2\n", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>",
    "x<|im_end|>y", "tabs\tand\u00a0nbsp", "   leading and trailing   ", "URL: https://a.b/c?d=1",
    "email@example.com", "$$\\frac{a}{b}$$", "#include <stdio.h>", "\r\n windows \r\n",
    "ALL CAPS TEXT", "MiXeD cAsE", "zero\u200bwidth", "fi ligature ﬁ", "12 345 6789 0",
]


def _strings():
  rng = np.random.default_rng(0)
  pools = ["abcdefghijklmnopqrstuvwxyz", "ABCXYZ", "0123456789", " \n\t", ".,;:!?'\"()[]{}<>-_",
           "éàüßøñç", "αβγδ", "中文字符", "🙂🚀", "\u00a0\u200b\u3000"]
  out = list(BASE)
  while len(out) < 360:
    n = int(rng.integers(1, 40))
    chars = []
    use = pools if len(out) % 2 else [p for p in pools if not p[0].isdigit()]
    for _ in range(n):
      pool = use[int(rng.integers(len(use)))]
      chars.append(pool[int(rng.integers(len(pool)))])
    out.append("".join(chars))
  for i in range(0, 40, 4):  # concatenations with special tokens in the middle
    out.append(BASE[i] + "<|im_start|>" + BASE[i + 1] + "<|im_end|>")
  return out


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye\n"}]]


def _transformers_side(strings, decode_ids):
  """Everything the tests compare against, from transformers' GGUF tokenizer (in a child
  process, ``tests.isolated``: loading it imports PyTorch)."""
  from tokenizers import pre_tokenizers
  from transformers import AutoTokenizer
  path = sources.smollm2_path()
  ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  # transformers' GGUF conversion drops SmolLM2's digit split; restored on a copy
  backend = copy.deepcopy(ref.backend_tokenizer)
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  chat = {}
  for i, msgs in enumerate(CONVERSATIONS):
    for gen in (True, False):
      text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
      chat[i, gen] = (text, ref(text)["input_ids"])
  return dict(ids=[ref(x)["input_ids"] for x in strings],
              digit_ids=[backend.encode(x, add_special_tokens=False).ids for x in strings],
              decoded=[ref.decode(ids) for ids in decode_ids], chat=chat)


@pytest.fixture(scope="module")
def tokenizers_pair():
  """(our tokenizer, transformers' results on ``_strings()``)."""
  path = sources.smollm2_path()
  from models import tokenizer as tokenizer_lib
  meta = reader_metadata(path)
  assert gguf_file.read_metadata(path) == meta  # the fast reader modelzoo's tokenizer comes from
  ours = tokenizer_lib.from_gguf_metadata(meta)
  strings = _strings()
  ref = isolated.reference(_transformers_side, strings, [ours.encode(x) for x in strings[:100]])
  ref["by_string"] = dict(zip(strings, ref["ids"]))
  ref["digits_by_string"] = dict(zip(strings, ref["digit_ids"]))
  return ours, ref


def test_ids_match_transformers(tokenizers_pair):
  ours, ref = tokenizers_pair
  strings = [s for s in _strings() if not any(c.isdigit() for c in s)]
  assert len(strings) > 200
  bad = [s for s in strings if ours.encode(s) != ref["by_string"][s]]
  assert not bad, f"{len(bad)} mismatches, e.g. {bad[:3]!r}"


def test_ids_match_smollm2_pretokenizer_with_digits(tokenizers_pair):
  """transformers' GGUF conversion drops SmolLM2's digit split (its tokenizer.json and
  llama.cpp's "smollm" pre-tokenizer split digits one by one first); we keep it. With that
  pre-tokenizer restored on transformers' side, every string agrees."""
  ours, ref = tokenizers_pair
  bad = [s for s in _strings() if ours.encode(s) != ref["digits_by_string"][s]]
  assert not bad, f"{len(bad)} mismatches, e.g. {bad[:3]!r}"


def test_decode_roundtrip(tokenizers_pair):
  ours, ref = tokenizers_pair
  for s, want in zip(_strings()[:100], ref["decoded"]):
    assert ours.decode(ours.encode(s), skip_special_tokens=False) == want


def test_chat_template_matches_transformers(tokenizers_pair):
  ours, ref = tokenizers_pair
  for i, msgs in enumerate(CONVERSATIONS):
    for gen in (True, False):
      text = ours.apply_chat_template(msgs, add_generation_prompt=gen)
      assert (text, ours.encode(text)) == (ref["chat"][i, gen][0], list(ref["chat"][i, gen][1]))


def test_special_ids(tokenizers_pair):
  ours, _ = tokenizers_pair
  assert ours.eos_ids == (2,) and ours.bos_id == 1 and not ours.add_bos
  assert ours.encode("<|im_end|>") == [2]
