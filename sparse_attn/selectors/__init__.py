"""The selectors: a registry of spec names -> selector classes, open like the presses.

``SELECTORS`` maps a spec name to its class; ``register(MySelector)`` adds one (its ``name``
class attribute), after which ``methods.make("mine:budget=0.1")``, ``methods.make("mine+resa")``
and the experiments' ``--method=mine`` build it. ``build(name, options, block_size)`` turns
spec options into a selector: the budget options (``BUDGET_OPTIONS``, a ``Budget``) plus the
class's own dataclass fields (``gqa``, ``variant``, ``topp``, ...).
"""

from __future__ import annotations

import dataclasses

from sparse_attn.budget import Budget
from sparse_attn.selectors.arkvale import ArkVale
from sparse_attn.selectors.base import BlockSelector, Selector
from sparse_attn.selectors.hybrid import HybridSparse
from sparse_attn.selectors.quest import Quest
from sparse_attn.selectors.shadowkv import ShadowKV
from sparse_attn.selectors.tidal import TidalDecode
from sparse_attn.selectors.token import Streaming, TopK
from sparse_attn.selectors.twilight import Twilight

BUDGET_OPTIONS = ("budget", "p", "n_min", "n_local", "n_sink", "local_window", "forced_count",
                  "min_tokens")

SELECTORS: dict[str, type[Selector]] = {
    "quest": Quest,
    "arkvale": ArkVale,
    "topk": TopK,
    "streaming": Streaming,
    "twilight": Twilight,
    "tidaldecode": TidalDecode,
    "hybrid": HybridSparse,
    "shadowkv": ShadowKV,
}


def register(cls: type[Selector], *, replace: bool = False) -> type[Selector]:
  """Makes ``cls.name`` a spec name (usable as a class decorator). Refuses a name taken by
  another class unless ``replace``."""
  if not (isinstance(cls, type) and issubclass(cls, Selector)):
    raise TypeError(f"register takes a Selector subclass, got {cls!r}")
  name = cls.name
  if not name or name != name.strip().lower() or any(c in name for c in "+:,=@ "):
    raise ValueError(f"{cls.__name__}.name must be a lowercase spec name without '+:,=@ ', "
                     f"got {name!r}")
  if SELECTORS.get(name, cls) is not cls and not replace:
    raise ValueError(f"selector name {name!r} is taken by {SELECTORS[name].__name__}")
  SELECTORS[name] = cls
  return cls


def options(name: str) -> tuple[str, ...]:
  """The spec options of selector ``name``: the budget's and its class's fields."""
  own = tuple(f.name for f in dataclasses.fields(SELECTORS[name])
              if f.name not in ("budget", "block_size"))
  return BUDGET_OPTIONS + own


def build(name: str, opts: dict, block_size: int) -> Selector:
  """The selector ``name`` from spec options (keys of ``options(name)``; others ignored)."""
  kw = {k: opts[k] for k in BUDGET_OPTIONS if k in opts}
  if kw.get("p") is not None:
    if kw.get("budget") is not None:
      raise ValueError("give either budget or ReSA's p, not both")
    kw["budget"] = None
    kw.setdefault("n_local", 1)  # ReSA's defaults (Sec. 3): n_min=16, n_local=1
  cls = SELECTORS[name]
  kw = {**getattr(cls, "budget_defaults", {}), **kw}  # a paper's forced tokens (TidalDecode)
  own = {k: opts[k] for k in options(name) if k in opts and k not in BUDGET_OPTIONS}
  return cls(budget=Budget(**kw), block_size=block_size, **own)


__all__ = ["ArkVale", "BlockSelector", "BUDGET_OPTIONS", "Quest", "SELECTORS", "Selector",
           "ShadowKV", "Streaming", "TidalDecode", "TopK", "build", "options", "register"]
