"""Results as JSON lines: one record per measurement, appended, resumable.

Every record carries the full config, the git revision and the machine, so a results file is
self-describing. ``ResultWriter.done(key)`` lets a long run resume: callers give each
measurement a stable key (e.g. method/budget/sample) and skip keys already written.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from typing import Any, Iterable

import numpy as np

RESULTS_FILE = "results.jsonl"


def git_revision() -> str:
  """The checkout's HEAD (``+dirty`` if modified), or ``unknown`` outside git."""
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                         text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, check=True).stdout.strip()
    return rev + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def machine() -> dict:
  import jax  # pylint: disable=g-import-not-at-top (keep module import light)
  return dict(host=platform.node(), cpu=platform.processor() or platform.machine(),
              cores=os.cpu_count(), backend=jax.default_backend(),
              devices=[str(d) for d in jax.devices()], jax=jax.__version__)


def _jsonable(x: Any):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.generic,)):
    return x.item()
  if isinstance(x, np.ndarray) or hasattr(x, "__array__"):
    return np.asarray(x).tolist()
  if isinstance(x, float) and not np.isfinite(x):
    return str(x)
  return x


def config_dict(config) -> dict:
  """A plain dict of an ml_collections ConfigDict (or a dict)."""
  return _jsonable(config.to_dict() if hasattr(config, "to_dict") else dict(config))


class ResultWriter:
  """Appends records to ``workdir/results.jsonl``."""

  def __init__(self, workdir: str, config, experiment: str):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.path = os.path.join(workdir, RESULTS_FILE)
    self.experiment = experiment
    self.meta = dict(experiment=experiment, config=config_dict(config), git=git_revision(),
                     machine=machine())
    self._done = {r.get("key") for r in read_records(self.path)
                  if r.get("experiment") == experiment and "key" in r}

  def done(self, key: str) -> bool:
    """Whether a record with this key was already written (resume support)."""
    return key in self._done

  def write(self, record: dict, key: str | None = None) -> dict:
    rec = dict(self.meta, time=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               **_jsonable(record))
    if key is not None:
      rec["key"] = key
      self._done.add(key)
    with open(self.path, "a+b") as f:
      f.seek(0, os.SEEK_END)
      if f.tell():  # a run killed mid-line leaves no newline: never glue onto its fragment
        f.seek(-1, os.SEEK_END)
        lead = b"" if f.read(1) == b"\n" else b"\n"
      else:
        lead = b""
      f.write(lead + (json.dumps(rec) + "\n").encode("utf-8"))
    return rec

  def records(self) -> list[dict]:
    return [r for r in read_records(self.path) if r.get("experiment") == self.experiment]


def read_records(path: str) -> list[dict]:
  """All records of a JSONL file (a truncated last line from a killed run is skipped)."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          continue
  return out


def find_results(root: str) -> Iterable[str]:
  """Every results.jsonl under ``root``."""
  for dirpath, _, files in os.walk(root):
    if RESULTS_FILE in files:
      yield os.path.join(dirpath, RESULTS_FILE)
