"""Every method ``methods.make`` can build, with its family, panels and one-line summary.

``available()`` reads the registries themselves (``selectors.SELECTORS``,
``compression.BUILDERS``, ``presets.PRESETS``), so a registered custom selector is listed too:

  for m in methods.available():
    print(m.name, m.family, m.panels, m.summary)
"""

from __future__ import annotations

import collections
import dataclasses
import re
import sys

from sparse_attn import compression, presets, selectors

FAMILIES = ("dense", "sparse-decode", "compression", "preset")
_BOTH_PANELS = ("query_agnostic", "query_aware")


@dataclasses.dataclass(frozen=True)
class MethodInfo:
  """One buildable method.

  Attributes:
    name: its spec name (``methods.make(name, ...)``, ``--method=name``).
    family: ``"dense"``; ``"sparse-decode"`` (a selector: the whole cache is kept and each
      decode step reads a subset); ``"compression"`` (tokens evicted for good); ``"preset"``
      (a paper's setting, ``spec`` holds its expansion).
    panels: the leaderboard panels it runs on: ``"query_agnostic"`` (question after the
      compressed context) and/or ``"query_aware"`` (question compressed with it). A method
      keeping the whole cache runs on both.
    query_aware: whether it needs the question in view (kvpress runs it query-aware only).
    summary: the first line of its class docstring (its paper).
    spec: the full spec string of a preset; the name otherwise.
    signal: for a compression method (or its preset), what its token scores are computed from
      (``compression.SIGNALS``: ``"attention"``, ``"queries"`` or ``"keys"``); None otherwise.
  """

  name: str
  family: str
  panels: tuple[str, ...]
  summary: str
  spec: str
  signal: str | None = None

  @property
  def query_aware(self) -> bool:
    return self.panels == ("query_aware",)


def _first_paragraph(doc: str | None) -> str:
  return " ".join((doc or "").strip().split("\n\n")[0].split())


def _summary(cls, shared_module: bool = False) -> str:
  """The first paragraph of ``cls``'s docstring, or of its module's where it points there (and
  the module holds no other listed method)."""
  own = _first_paragraph(cls.__doc__)
  if own and "module docstring" not in own:
    return own
  if shared_module:
    return re.sub(r"\s*\(see the module docstring\)", "", own)
  return _first_paragraph(sys.modules[cls.__module__].__doc__) or own


def _compression_panels(name: str) -> tuple[str, ...]:
  cls = getattr(compression.BUILDERS[name], "method_class", None)
  return tuple(getattr(cls, "PANELS", ("query_agnostic",)))


def _signal(name: str) -> str | None:
  build = compression.BUILDERS.get(name)
  return getattr(getattr(build, "method_class", build), "SIGNAL", None)


def available(family: str | None = None) -> tuple[MethodInfo, ...]:
  """Every buildable method (of ``family`` if given), in registry order: dense, the selectors,
  the compression methods, the presets.

  Raises:
    ValueError: ``family`` is not one of ``FAMILIES``.
  """
  if family is not None and family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  rows = [MethodInfo("dense", "dense", _BOTH_PANELS, "Exact attention over the whole cache.",
                     "dense")]
  per_module = collections.Counter(c.__module__ for c in selectors.SELECTORS.values())
  rows += [MethodInfo(name, "sparse-decode", _BOTH_PANELS,
                      _summary(cls, per_module[cls.__module__] > 1), name)
           for name, cls in selectors.SELECTORS.items()]
  for name, build in compression.BUILDERS.items():
    cls = getattr(build, "method_class", build)
    rows.append(MethodInfo(name, "compression", _compression_panels(name), _summary(cls), name,
                           _signal(name)))
  for name, spec in presets.PRESETS.items():
    base = spec.split(":")[0].split("+")[0]
    panels = _compression_panels(base) if base in compression.BUILDERS else _BOTH_PANELS
    rows.append(MethodInfo(name, "preset", panels, f"Preset: {spec}", spec, _signal(base)))
  return tuple(r for r in rows if family is None or r.family == family)


def builtin(info: MethodInfo) -> bool:
  """Whether ``info`` is one of this package's methods (not one registered by user code)."""
  if info.family != "sparse-decode":
    return True
  return selectors.SELECTORS[info.name].__module__.startswith("sparse_attn.")


def markdown() -> str:
  """The README's table of this package's methods (tests/sparse_attn/test_catalog.py keeps the
  README's copy current)."""
  short = {"query_agnostic": "agnostic", "query_aware": "aware"}
  lines = ["| name | family | leaderboard panels | scores from | what |",
           "|---|---|---|---|---|"]
  for m in filter(builtin, available()):
    what = m.summary.replace("|", "\\|")
    lines.append(f"| `{m.name}` | {m.family} | {', '.join(short[p] for p in m.panels)} | "
                 f"{m.signal or '-'} | {what} |")
  return "\n".join(lines) + "\n"

