"""A flat dict of numpy arrays saved and restored with orbax (fitted parameters, e.g. the
per-head RESA lambda of ``experiments.resa_calibrate``)."""

from __future__ import annotations

import os

import numpy as np


def save_arrays(path: str, arrays: dict) -> None:
  """Writes ``arrays`` (name -> array) as an orbax checkpoint at ``path`` (replaced)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top (heavy import)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.abspath(path), {k: np.asarray(v) for k, v in arrays.items()}, force=True)


def restore_arrays(path: str) -> dict:
  """name -> numpy array of the checkpoint at ``path``."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.StandardCheckpointer() as ckpt:
    return {k: np.asarray(v) for k, v in ckpt.restore(os.path.abspath(path)).items()}
