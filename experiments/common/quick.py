"""The one ``quick`` (CI) convention: ``get_config(quick=False)`` in every ``configs/NAME.py``.

A config file's ``get_config(quick=True)`` returns the quick variant. With ``quick`` set (on the
command line, ``--config.quick=True``, or programmatically), every field whose quick value
differs from its full default takes the quick value, except fields the user chose:

* fields given explicitly on the command line (``--config.lengths=512``), even when the value
  equals the full default, and
* fields whose value already differs from the full default (set programmatically).

So explicit choices always win over quick's overrides, and resolving twice changes nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable, Iterable


def _plain(x):
  return list(x) if isinstance(x, (list, tuple)) else x


def overrides(get_config: Callable) -> dict:
  """``field -> quick value`` for the fields where ``get_config(True)`` differs from the full."""
  full, quick = get_config(False), get_config(True)
  return {k: quick[k] for k in quick.keys() if k == "quick" or k not in full
          or _plain(quick[k]) != _plain(full[k])}


def resolve(config, get_config: Callable, explicit: Iterable[str] = ()):
  """``config`` with quick values applied when ``config.quick`` (a copy; unchanged otherwise).

  Args:
    config: the parsed ml_collections ConfigDict.
    get_config: the config module's ``get_config(quick: bool)``.
    explicit: top-level fields given on the command line (they keep their value).
  """
  if not config.get("quick", False):
    return config
  full = get_config(False)
  keep = {f.split(".")[0] for f in explicit}
  out = config.copy_and_resolve_references()
  with out.unlocked():
    for key, value in overrides(get_config).items():
      chosen = key in keep or (key in full and _plain(config.get(key)) != _plain(full[key]))
      if not chosen:
        out[key] = value
  return out


def module_get_config(name: str, path: str | None = None) -> Callable:
  """``get_config`` of ``configs/NAME.py`` (or of the config file at ``path``)."""
  if path and os.path.exists(path):
    spec = importlib.util.spec_from_file_location(f"_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    module = importlib.import_module(f"configs.{name}")
  return module.get_config
