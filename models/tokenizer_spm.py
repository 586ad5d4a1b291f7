"""SentencePiece vocabularies of GGUF files (``tokenizer.ggml.model = "llama"``) as a
``tokenizers`` pipeline that tokenizes as llama.cpp does.

Llama-2-style, Gemma 2/3 and Phi-3 files carry tokens, scores and token types but no merges.
llama.cpp (``src/llama-vocab.cpp``: the SPM branch of ``llama_vocab::impl::tokenize`` and
``llm_tokenizer_spm_session``) encodes with them in four steps; each is one component here:

1. Control, unknown-type and user-defined tokens are cut out of the raw text first, whole
   (``tokenizer_st_partition``) -> added tokens with ``normalized=False`` (control and unknown
   ones special, so ``skip_special_tokens`` drops them as llama.cpp's detokenizer does).
2. Every remaining fragment follows either the start of the text or such a token, and gets a
   leading space when ``add_space_prefix`` is set; then spaces become ``▁`` -> the normalizers
   ``Prepend("▁")`` and ``Replace(" ", "▁")``, which ``tokenizers`` runs on each fragment between
   added tokens. No pre-tokenizer: a fragment is one word, spaces included.
3. The fragment starts as its characters; the adjacent pair whose concatenation is the token with
   the highest score merges, repeatedly -> a BPE model whose merges are every split of every token
   into two tokens, ranked by that token's score (``spm_merges``).
4. A character that is no token goes out as the ``<0xNN>`` tokens of its UTF-8 bytes ->
   ``byte_fallback=True``.

Decoding inverts it: ``▁`` -> space, runs of byte tokens -> their UTF-8 text, and one leading
space dropped when the vocabulary adds one (as transformers' Llama tokenizer does).

Where this and llama.cpp can part (corner cases; the test's vocabulary, trained as SentencePiece's
BPE trainer does, has none): llama.cpp breaks ties of equal score by position (leftmost pair
first), BPE by rank -- between different tokens the lower id, between two overlapping splits of
one token (``ab|a`` and ``a|ba`` over ``ab a ba``) the split listed first; llama.cpp can merge
into a token through a character that is not itself a token, BPE cannot; llama.cpp cuts
overlapping special tokens longest first, ``tokenizers`` leftmost first; Phi-3's right strip
after special tokens counts ASCII whitespace in llama.cpp, Unicode whitespace here.

transformers (5.x, ``integrations/gguf/gguf_tokenizer_mapping.py``) builds a BPE of the same kind
but picks the rest by architecture: ``phi3`` as above; ``gemma*`` with no prefix space (Gemma files
set ``add_space_prefix = false``), merges ordered by position in the file instead of score, and
whitespace-only user-defined tokens respelled with ``▁`` and merged rather than cut out whole;
other architectures (Llama-2 files) with a ``Metaspace`` that adds no space to a text already
starting with one, nor after a special token, where SentencePiece and llama.cpp do (``" Hi"`` ->
``▁▁Hi`` here and in llama.cpp, ``▁Hi`` there).
"""

from __future__ import annotations

from typing import Any, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

# llama.cpp token types (``llama_token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's SPM defaults for files that leave the ids out (``llama_vocab::impl::load``).
DEFAULT_IDS = {"bos": 1, "eos": 2, "unknown": 0}
# Token texts llama.cpp treats as end of generation whatever the file says (the text list in
# ``llama_vocab::impl::load``, the subset SentencePiece chat models use): Gemma's turn end,
# Phi-3's ``<|end|>`` and ``<|endoftext|>``.
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|end|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>")


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
  """BPE merges that reproduce score-driven SentencePiece merging.

  llama.cpp merges the adjacent pair whose concatenation is the highest-scoring token; a BPE
  applies the lowest-ranked merge present. Listing, for every token, each split into two
  in-vocabulary tokens, best score first, makes the two pick the same pair. Ties between
  different tokens go to the lower id, splits of one token to the shorter left piece (llama.cpp:
  the leftmost pair; module docstring).

  Args:
    tokens: the vocabulary, ``[V]``; scores: its scores, ``[V]``.

  Returns:
    ``(left, right)`` pairs, highest priority first.
  """
  ids = {t: i for i, t in enumerate(tokens)}
  ranked = []
  for i, t in enumerate(tokens):
    for k in range(1, len(t)):
      if t[:k] in ids and t[k:] in ids:
        ranked.append((-float(scores[i]), i, k))
  ranked.sort()
  return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def spm_backend(meta: dict[str, Any]) -> Tokenizer:
  """The ``tokenizers`` pipeline of a GGUF SentencePiece vocabulary (module docstring).

  Args:
    meta: GGUF metadata: ``tokenizer.ggml.tokens``, ``.scores`` (absent: all 0, as llama.cpp),
      ``.token_type``, ``.add_space_prefix`` (default true), ``.unknown_token_id``;
      ``general.name`` (a Phi-3 model strips whitespace after its special tokens).
  """
  tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
  scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
  types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
  if len(set(tokens)) != len(tokens):
    raise ValueError("GGUF vocabulary has duplicate tokens")
  unk = meta.get("tokenizer.ggml.unknown_token_id", DEFAULT_IDS["unknown"])
  backend = Tokenizer(models.BPE(
      vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores),
      unk_token=tokens[unk] if unk is not None and unk < len(tokens) else None,
      fuse_unk=True, byte_fallback=True))
  prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
  steps = [normalizers.Prepend("▁")] if prefix else []
  backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
  backend.pre_tokenizer = None
  backend.decoder = decoders.Sequence(
      [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
      + ([decoders.Strip(" ", 1, 0)] if prefix else []))
  # llama.cpp right-strips after a Phi-3 model's special tokens (found by name), all but these.
  name = str(meta.get("general.name", "")).lower()
  phi3 = "phi-3" in name or "phi3" in name
  keep = {"<unk>", "<s>", "<|endoftext|>"}
  special = [AddedToken(t, special=True, normalized=False, rstrip=phi3 and t not in keep)
             for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
  user = [AddedToken(t, special=False, normalized=False, rstrip=phi3 and t not in keep)
          for t, ty in zip(tokens, types) if ty == USER_DEFINED]
  backend.add_special_tokens(special)
  if user:
    backend.add_tokens(user)
  return backend


def end_of_turn_ids(tokens: Sequence[str]) -> list[int]:
  """Ids of the ``END_OF_TURN_TEXTS`` this vocabulary has."""
  index = {t: i for i, t in enumerate(tokens)}
  return [index[t] for t in END_OF_TURN_TEXTS if t in index]
