"""NVIDIA's kvpress as a peer (outside CI): imported from a folder its wheel was installed into.

kvpress's package imports ``datasets`` and ``fire`` for its evaluation scripts; the presses do
not need them, so where they are missing they are stood in by empty modules.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types


def load(path: str = ""):
  """The ``kvpress`` module (``path``: a ``pip install --target`` folder, first on the path),
  with ``kvpress.version`` set from its metadata."""
  if path:
    sys.path.insert(0, path)
  for name in ("datasets", "fire"):
    try:
      __import__(name)
    except ImportError:
      sys.modules[name] = types.SimpleNamespace(load_dataset=None, Fire=None)
  import kvpress  # pylint: disable=g-import-not-at-top (after the path and the stand-ins)
  kvpress.version = importlib.metadata.version("kvpress")
  return kvpress
