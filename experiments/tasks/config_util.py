"""``--config.quick=True``: kept for callers of ``resolve(config, NAME)``; see
``experiments.common.quick`` (the one quick convention, explicit fields win)."""

from __future__ import annotations

from experiments.common import quick


def resolve(config, name: str, explicit=()):
  """The config with quick values applied when ``config.quick`` (``configs/NAME.py``)."""
  return quick.resolve(config, quick.module_get_config(name), explicit)
