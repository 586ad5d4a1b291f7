"""Our SentencePiece (``tokenizer.ggml.model = "llama"``) GGUF tokenizer vs transformers' GGUF
loading and vs llama.cpp's SPM algorithm (``_llamacpp_encode``, written here from
``src/llama-vocab.cpp``), on a tiny vocabulary trained here SentencePiece-style (BPE pieces with
score -rank, characters after them, 256 byte-fallback tokens, control and user-defined tokens).

transformers picks the space handling by ``general.architecture``: its ``phi3`` and ``gemma2``
builders add the prefix space as llama.cpp does, so they must agree everywhere; its generic
(``llama``) builder's ``Metaspace`` adds none to text that starts with a space or follows a special
token (``models/tokenizer_spm.py`` docstring), so it must agree everywhere else.
"""

import collections
import os

import numpy as np
import pytest

from models import gguf_file
from models import tokenizer as tokenizer_lib
from tests import isolated
from tests.models.test_gguf_file import reader_metadata

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "hello world hello there the world is wide",
    "a naïve café owner said hello to the cat",
    "on and on the river ran to the sea",
    "she sells sea shells on the sea shore",
    "über alles and über nothing",
]
CONTROL = ["<start_of_turn>", "<end_of_turn>"]
USER = ["<think>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
            "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
BASE = [
    "", " ", "  ", "hello world", "hello  world", " hello", "  two leading", "trailing ",
    "the cat sat on the mat", "naïve café", "über", "Zebra", "x\ny", "tab\there", "😀 emoji",
    "你好", "é vs e\u0301", "<start_of_turn>user\nhi<end_of_turn>", "a<end_of_turn>b",
    "<think>the sea</think>", "<s>hello</s>", "<unk>", " <end_of_turn> x", "theworld",
    "<end_of_turn><end_of_turn>", "the<think> cat", "sea shells\n\nsea shore", "ÿ\x00\x7f",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hello the cat"}],
    [{"role": "user", "content": "über café?"}, {"role": "model", "content": "on the sea"},
     {"role": "user", "content": " two  spaces 😀"}]]


def _train(corpus, n_merges=150):
  """SentencePiece-style BPE: words carry their leading ``▁``; the most frequent pair merges."""
  words = collections.Counter("▁" + w for line in corpus for w in line.split(" "))
  splits = {w: list(w) for w in words}
  pieces = []
  for _ in range(n_merges):
    pairs = collections.Counter()
    for w, c in words.items():
      for a, b in zip(splits[w], splits[w][1:]):
        pairs[a, b] += c
    if not pairs:
      break
    (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
    if a + b not in pieces:
      pieces.append(a + b)
    for w, s in splits.items():
      i, out = 0, []
      while i < len(s):
        if i + 1 < len(s) and (s[i], s[i + 1]) == (a, b):
          out.append(a + b)
          i += 2
        else:
          out.append(s[i])
          i += 1
      splits[w] = out
  return pieces, sorted(set("".join(words)))


def _vocab():
  """(tokens, scores, types) laid out as Llama's / Gemma's files are."""
  pieces, chars = _train(CORPUS)
  head = ["<unk>", "<s>", "</s>"] + CONTROL + USER
  tokens = head + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
  types = [2, 3, 3] + [3] * len(CONTROL) + [4] * len(USER) + [6] * 256
  types += [1] * (len(pieces) + len(chars))
  scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(pieces) + len(chars))]
  return tokens, scores, types


def write_spm_gguf(path, arch="llama", add_space_prefix=True, name="tiny-spm"):
  """A tensor-free GGUF with the ``_vocab`` SentencePiece tokenizer (and the few ``{arch}.*``
  keys transformers needs to build a config)."""
  import gguf
  tokens, scores, types = _vocab()
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name(name)
  for add, v in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                 (w.add_feed_forward_length, 16), (w.add_head_count, 2),
                 (w.add_head_count_kv, 2), (w.add_layer_norm_rms_eps, 1e-6),
                 (w.add_rope_freq_base, 10000.0)]:
    add(v)
  w.add_tokenizer_model("llama")
  w.add_token_list(tokens)
  w.add_token_scores(scores)
  w.add_token_types(types)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_unk_token_id(0)
  w.add_add_bos_token(True)
  w.add_add_eos_token(False)
  w.add_add_space_prefix(add_space_prefix)
  w.add_chat_template(TEMPLATE)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _strings():
  rng = np.random.default_rng(0)
  alphabet = list("the cat sea wörld  ") + ["\n", "é", "Q", "😀", "中", "<end_of_turn>", "<think>"]
  out = list(BASE)
  while len(out) < 160:
    out.append("".join(alphabet[int(i)] for i in rng.integers(len(alphabet),
                                                              size=int(rng.integers(1, 25)))))
  return out


def _partition(text, specials):
  """llama.cpp's ``tokenizer_st_partition``: special texts cut out, longest first."""
  frags = [text] if text else []
  for tok in sorted(specials, key=len, reverse=True):
    out = []
    for f in frags:
      if not isinstance(f, str):
        out.append(f)
        continue
      for j, part in enumerate(f.split(tok)):
        out += ([(tok,)] if j else []) + ([part] if part else [])
    frags = out
  return frags


def _llamacpp_encode(text, tokens, scores, types, add_space_prefix):
  """llama.cpp's SPM tokenization (``llama_vocab::impl::tokenize``, ``llm_tokenizer_spm``),
  re-implemented naively: BOS, then per fragment the best-scoring merge (leftmost on ties) until
  none applies, characters that are no token as ``<0xNN>`` byte tokens."""
  index = {t: i for i, t in enumerate(tokens)}
  out, prev_special = [1], True
  for frag in _partition(text, [t for t, ty in zip(tokens, types) if ty in (2, 3, 4)]):
    if isinstance(frag, tuple):
      out.append(index[frag[0]])
      prev_special = True
      continue
    syms = list(((" " if add_space_prefix and prev_special else "") + frag).replace(" ", "▁"))
    prev_special = False
    while True:
      cands = [(scores[index[a + b]], -i) for i, (a, b) in enumerate(zip(syms, syms[1:]))
               if a + b in index]
      if not cands:
        break
      i = -max(cands)[1]
      syms[i:i + 2] = [syms[i] + syms[i + 1]]
    for s in syms:
      out += [index[s]] if s in index else [index[f"<0x{b:02X}>"] for b in s.encode()]
  return out


def _transformers_side(paths, strings, decode_ids):
  """transformers' GGUF tokenizers (child process: it imports PyTorch): ids of ``strings``,
  decoded ``decode_ids`` (with and without special tokens) and the rendered chats."""
  from transformers import AutoTokenizer
  out = {}
  for arch, path in paths.items():
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    chats = [ref.apply_chat_template(m, tokenize=False, add_generation_prompt=g)
             for m in CONVERSATIONS for g in (True, False)]
    out[arch] = dict(
        ids=[list(ref(x)["input_ids"]) for x in strings],
        decoded=[ref.decode(ids) for ids in decode_ids[arch]],
        decoded_skip=[ref.decode(ids, skip_special_tokens=True) for ids in decode_ids[arch]],
        chats=chats, chat_ids=[list(ref(c)["input_ids"]) for c in chats])
  return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(ours by arch, transformers' results by arch, strings)."""
  d = tmp_path_factory.mktemp("spm")
  paths, ours = {}, {}
  for arch, prefix in (("llama", True), ("phi3", True), ("gemma2", False)):
    paths[arch] = str(d / f"{arch}.gguf")
    write_spm_gguf(paths[arch], arch, add_space_prefix=prefix)
    meta = reader_metadata(paths[arch])
    assert gguf_file.read_metadata(paths[arch]) == meta
    ours[arch] = tokenizer_lib.from_gguf_metadata(meta)
  strings = _strings()
  decode_ids = {a: [t.encode(s) for s in strings] for a, t in ours.items()}
  return ours, isolated.reference(_transformers_side, paths, strings, decode_ids), strings


def _follows_special_or_space(s):
  frags = _partition(s, CONTROL + USER + ["<unk>", "<s>", "</s>"])
  return any(isinstance(f, str) and (i > 0 or f.startswith(" ")) for i, f in enumerate(frags))


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_ids_match_llamacpp_algorithm(pair, arch):
  ours, _, strings = pair
  tokens, scores, types = _vocab()
  bad = [s for s in strings if ours[arch].encode(s)
         != _llamacpp_encode(s, tokens, scores, types, add_space_prefix=arch != "gemma2")]
  assert not bad, f"{len(bad)} mismatches, e.g. {bad[:3]!r}"


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_ids_match_transformers(pair, arch):
  ours, ref, strings = pair
  bad = [s for s, want in zip(strings, ref[arch]["ids"]) if ours[arch].encode(s) != want]
  assert not bad, f"{len(bad)} mismatches, e.g. {bad[:3]!r}"


def test_ids_match_transformers_llama_metaspace(pair):
  """transformers' generic builder differs only where its ``Metaspace`` adds no prefix space."""
  ours, ref, strings = pair
  differ = {s for s, want in zip(strings, ref["llama"]["ids"]) if ours["llama"].encode(s) != want}
  expected = {s for s in strings if _follows_special_or_space(s)}
  assert differ <= expected and " hello" in differ
  assert len(strings) - len(expected) > 60


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_decode_matches_transformers(pair, arch):
  ours, ref, strings = pair
  for s, want, want_skip in zip(strings, ref[arch]["decoded"], ref[arch]["decoded_skip"]):
    ids = ours[arch].encode(s)
    assert ours[arch].decode(ids, skip_special_tokens=False) == want, s
    assert ours[arch].decode(ids) == want_skip, s


def test_decode_roundtrip_bytes(pair):
  ours, _, _ = pair
  tok = ours["gemma2"]
  for s in ["😀 emoji", "你好", "x\ny", "ÿ\x00\x7f", "Zebra  über"]:
    ids = tok.encode(s, add_bos=False)
    assert tok.decode(ids) == s
  assert any(tok.backend.id_to_token(i).startswith("<0x") for i in tok.encode("😀"))


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_chat_template_matches_transformers(pair, arch):
  ours, ref, _ = pair
  chats = [ours[arch].apply_chat_template(m, add_generation_prompt=g)
           for m in CONVERSATIONS for g in (True, False)]
  assert chats == ref[arch]["chats"]
  assert [ours[arch].encode(c) for c in chats] == ref[arch]["chat_ids"]


def test_special_ids_and_flags(pair):
  ours, _, _ = pair
  tok = ours["llama"]
  tokens = _vocab()[0]
  assert tok.bos_id == 1 and tok.add_bos and not tok.add_eos
  assert tok.eos_ids == (2, tokens.index("<end_of_turn>"))
  assert tok.encode("") == [1] and tok.encode("", add_bos=False) == []
  assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def test_phi3_right_strip_and_add_eos(tmp_path):
  """llama.cpp strips whitespace after a Phi-3 model's special tokens (by ``general.name``);
  ``add_eos_token`` appends EOS."""
  path = tmp_path / "phi.gguf"
  write_spm_gguf(path, "phi3", name="Phi-3-mini-4k-instruct")
  meta = gguf_file.read_metadata(str(path))
  tok = tokenizer_lib.from_gguf_metadata(meta)
  eot = _vocab()[0].index("<end_of_turn>")
  assert tok.encode("<end_of_turn> \n the") == [1, eot] + tok.encode("the", add_bos=False)
  meta["tokenizer.ggml.add_eos_token"] = True
  tok = tokenizer_lib.from_gguf_metadata(meta)
  assert tok.encode("the")[-1] == 2 and tok.encode("the", add_bos=False)[-1] != 2


def test_save_and_reload(pair, tmp_path):
  """``TextTokenizer.save`` -> ``from_hf_dir`` keeps the pipeline and the flags."""
  ours, _, strings = pair
  ours["phi3"].save(str(tmp_path))
  back = tokenizer_lib.from_hf_dir(str(tmp_path))
  assert (back.bos_id, back.eos_ids, back.add_bos, back.add_eos) == (
      ours["phi3"].bos_id, ours["phi3"].eos_ids, True, False)
  assert all(back.encode(s) == ours["phi3"].encode(s) for s in strings)
  assert back.decode(back.encode("über 😀")) == "über 😀"
