"""Tokenizer: a ``tokenizers.Tokenizer`` plus special ids and the chat template.

Built from an HF directory (``tokenizer.json`` + ``tokenizer_config.json`` /
``chat_template.jinja``) or from GGUF metadata (byte-level BPE vocabulary and merges, the
pre-tokenizer named by ``tokenizer.ggml.pre``, control tokens as special tokens; or a
SentencePiece vocabulary with scores, ``tokenizer_spm``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from models import tokenizer_spm

# llama.cpp pre-tokenizer names -> the split used when the vocabulary was trained.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


def _byte_alphabet() -> set[str]:
  """The printable characters GPT-2's byte-level BPE uses for the 256 bytes."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  out, n = [], 0
  for b in range(256):
    if b in keep:
      out.append(chr(b))
    else:
      out.append(chr(256 + n))
      n += 1
  return set(out)


class TextTokenizer:
  """Encodes/decodes text and renders chat templates.

  Attributes:
    backend: the ``tokenizers.Tokenizer``.
    bos_id: id of BOS (or None); ``add_bos`` whether ``encode`` prepends it.
    eos_ids: ids that end a generation; ``add_eos`` whether ``encode`` appends the first.
    chat_template: Jinja source (or None).
  """

  def __init__(self, backend: Tokenizer, *, bos_id=None, eos_ids=(), add_bos=False,
               chat_template=None, special_tokens: dict[str, str] | None = None,
               add_eos=False):
    self.backend = backend
    self.bos_id = bos_id
    self.eos_ids = tuple(eos_ids)
    self.add_bos = add_bos
    self.add_eos = add_eos
    self.chat_template = chat_template
    self.special_tokens = dict(special_tokens or {})

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of ``text``; special tokens written in the text are recognised. BOS (and EOS
    where ``add_eos``) are added as the model's flags say, or not at all with ``add_bos=False``
    (llama.cpp's ``add_special``)."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    add = self.add_bos if add_bos is None else add_bos
    eos = self.eos_ids[:1] if self.add_eos and add_bos is not False else []
    return ([self.bos_id] if add and self.bos_id is not None else []) + ids + list(eos)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """Renders ``messages`` with the model's chat template (Jinja, as transformers does)."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template")
    import jinja2
    from jinja2 import sandbox

    def raise_exception(msg):
      raise jinja2.exceptions.TemplateError(msg)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)

  def save(self, path: str) -> None:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
    self.backend.save(os.path.join(path, "tokenizer.json"))
    meta = {"bos_id": self.bos_id, "eos_ids": list(self.eos_ids), "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "chat_template": self.chat_template, **self.special_tokens}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
      json.dump(meta, f)


def from_hf_dir(path: str) -> TextTokenizer:
  """Loads ``tokenizer.json`` (required) and the chat template/special tokens if present."""
  tj = os.path.join(path, "tokenizer.json")
  if not os.path.exists(tj):
    raise FileNotFoundError(f"{path} has no tokenizer.json")
  backend = Tokenizer.from_file(tj)
  meta: dict[str, Any] = {}
  tc = os.path.join(path, "tokenizer_config.json")
  if os.path.exists(tc):
    with open(tc) as f:
      meta = json.load(f)
  template = meta.get("chat_template")
  jinja = os.path.join(path, "chat_template.jinja")
  if template is None and os.path.exists(jinja):
    with open(jinja) as f:
      template = f.read()
  if isinstance(template, list):  # named templates: take "default"
    template = {t["name"]: t["template"] for t in template}.get("default")
  special = {}
  for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
    tok = meta.get(key)
    if isinstance(tok, dict):
      tok = tok.get("content")
    if tok is not None:
      special[key] = tok
  bos_id = meta.get("bos_id")
  if bos_id is None and "bos_token" in special:
    bos_id = backend.token_to_id(special["bos_token"])
  eos_ids = meta.get("eos_ids")
  if eos_ids is None:
    eos_ids = [backend.token_to_id(special["eos_token"])] if "eos_token" in special else []
  return TextTokenizer(backend, bos_id=bos_id, eos_ids=[e for e in eos_ids if e is not None],
                       add_bos=bool(meta.get("add_bos_token", False)), chat_template=template,
                       special_tokens=special, add_eos=bool(meta.get("add_eos_token", False)))


def from_gguf_metadata(meta: dict[str, Any]) -> TextTokenizer:
  """Builds the tokenizer described by GGUF ``tokenizer.*`` metadata: byte-level BPE
  (``tokenizer.ggml.model = "gpt2"``) or SentencePiece (``"llama"``, ``tokenizer_spm``).

  Args:
    meta: GGUF key -> value (``tokenizer.ggml.tokens``, ``.merges``, ``.token_type``,
      ``.pre``, ``.bos_token_id``, ``.eos_token_id``, ``tokenizer.chat_template`` ...).
  """
  kind = meta.get("tokenizer.ggml.model")
  if kind == "llama":
    return _with_gguf_specials(tokenizer_spm.spm_backend(meta), meta, spm=True)
  if kind != "gpt2":
    raise ValueError(f"GGUF tokenizer model {kind!r} is not supported "
                     "(byte-level 'gpt2' and SentencePiece 'llama')")
  tokens = list(meta["tokenizer.ggml.tokens"])
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
  vocab = {t: i for i, t in enumerate(tokens)}
  backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                 byte_fallback=False))
  pre = meta.get("tokenizer.ggml.pre", "default")
  if pre == "smollm":
    # SmolLM's vocabulary was trained with digits split one by one (its tokenizer.json:
    # Digits(individual_digits) then GPT-2's byte-level regex; llama.cpp's "smollm" split).
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  elif pre in _SPLITS:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  elif pre in ("default", "gpt2", "gpt-2"):
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported "
                     f"(supported: smollm, default, {', '.join(_SPLITS)})")
  backend.decoder = decoders.ByteLevel()
  alphabet = _byte_alphabet()
  special = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
  backend.add_special_tokens(special)
  if user:
    backend.add_tokens(user)
  return _with_gguf_specials(backend, meta, spm=False)


def _with_gguf_specials(backend: Tokenizer, meta: dict[str, Any], spm: bool) -> TextTokenizer:
  """Wraps ``backend`` with the file's special ids, BOS/EOS flags and chat template; a
  SentencePiece vocabulary takes llama.cpp's SPM defaults (BOS 1, EOS 2, UNK 0, BOS added) and its
  end-of-turn tokens found by text (``tokenizer_spm.END_OF_TURN_TEXTS``) as extra EOS ids."""
  tokens = list(meta["tokenizer.ggml.tokens"])
  ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown",
                                                                  "padding")}
  if spm:
    ids = {k: tokenizer_spm.DEFAULT_IDS.get(k) if v is None else v for k, v in ids.items()}
  names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token",
           "padding": "pad_token"}
  special_tokens = {names[k]: tokens[i] for k, i in ids.items() if i is not None}
  eos = [ids["eos"]] if ids["eos"] is not None else []
  eot = meta.get("tokenizer.ggml.eot_token_id")
  for extra in [eot] + (tokenizer_spm.end_of_turn_ids(tokens) if spm else []):
    if extra is not None and extra not in eos:
      eos.append(extra)
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
  if add_eos and ids["eos"] is None:
    raise ValueError("GGUF tokenizer.ggml.add_eos_token is set but there is no EOS id")
  return TextTokenizer(backend, bos_id=ids["bos"], eos_ids=eos,
                       add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
                       add_eos=add_eos, chat_template=meta.get("tokenizer.chat_template"),
                       special_tokens=special_tokens)
