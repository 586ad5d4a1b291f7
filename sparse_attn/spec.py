"""Parsing of method spec strings such as ``"quest:gqa=group+resa:lam=0.5"``.

A spec is ``part(+part)*``; each part is ``name`` or ``name:key=value,key=value``. The first part
names the base method (dense, a selector, or a compression method); later parts name enhancers.
Values are parsed as int, float, bool or None when they look like one, else kept as strings.
"""

from __future__ import annotations

import ast


def parse_value(text: str):
  """``"0.5"`` -> 0.5, ``"16"`` -> 16, ``"true"`` -> True, ``"none"`` -> None, else the text."""
  low = text.strip().lower()
  if low in ("true", "false"):
    return low == "true"
  if low == "none":
    return None
  try:
    value = ast.literal_eval(text.strip())
  except (ValueError, SyntaxError):
    return text.strip()
  return value if isinstance(value, (int, float)) else text.strip()


def parse_spec(spec: str) -> list[tuple[str, dict]]:
  """Splits a spec into ``[(name, inline_options), ...]``."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"a method spec must be a non-empty string, got {spec!r}")
  parts = []
  for raw in spec.strip().lower().split("+"):
    name, _, opts = raw.partition(":")
    name = name.strip()
    if not name:
      raise ValueError(f"empty component in method spec {spec!r}")
    options = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
      key, eq, value = item.partition("=")
      if not eq:
        raise ValueError(f"option {item!r} in spec {spec!r} is not of the form key=value")
      options[key.strip()] = parse_value(value)
    parts.append((name, options))
  return parts


def _format_value(value) -> str:
  return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def with_options(spec: str, options: dict, owners: dict) -> str:
  """``spec`` with keyword ``options`` written inline, so the string names what was built.

  ``owners`` maps an enhancer name to the options it owns; every other option belongs to the
  base part. Values that are not scalars (arrays) are left out: a spec string cannot hold them.
  ``with_options("quest:budget=0.1+resa:lam=1.0", {"lam": 0.5}, {"resa": ("lam",)})`` ->
  ``"quest:budget=0.1+resa:lam=0.5"``.
  """
  parts = parse_spec(spec)
  names = [name for name, _ in parts]
  scalar = {k: v for k, v in options.items()
            if v is None or isinstance(v, (bool, int, float, str))}
  for key, value in scalar.items():
    owner = next((i for i, n in enumerate(names) if key in owners.get(n, ())), 0)
    parts[owner][1][key] = value
  return "+".join(name + (":" + ",".join(f"{k}={_format_value(v)}" for k, v in opts.items())
                          if opts else "")
                  for name, opts in parts)


def check_options(name: str, options, valid) -> None:
  """Raises ValueError naming the keys of ``options`` not in ``valid`` (and the valid ones)."""
  bad = sorted(set(options) - set(valid))
  if bad:
    raise ValueError(f"unknown option(s) {bad} for {name!r}; valid options: {sorted(valid)}")
