"""``--config.quick=True``: switch a config to its quick (CI) values.

A config file's ``get_config(quick=False)`` gives both variants; with ``quick`` set on the
command line, every field the user left at its full default takes its quick value, and fields
given explicitly on the command line (``--config.lengths=512``) are kept.
"""

from __future__ import annotations

import importlib


def resolve(config, name: str):
  """The config with quick values applied when ``config.quick`` (``configs/NAME.py``, or the
  config's own ``config_name`` when one file serves several configs of an experiment)."""
  if not config.get("quick", False):
    return config
  module = importlib.import_module(f"configs.{config.get('config_name', name)}")
  full, quick = module.get_config(False), module.get_config(True)
  out = config.copy_and_resolve_references()
  with out.unlocked():
    for key in quick.keys():
      if key in full and _same(config.get(key), full[key]):
        out[key] = quick[key]
  return out


def _same(a, b) -> bool:
  to = lambda x: list(x) if isinstance(x, (list, tuple)) else x
  return to(a) == to(b)
