"""Results as JSON lines: one record per measurement, appended, resumable.

Every record carries the git revision and a ``run`` id; the run's full config and machine are
stored once, on the file's first record of that run, and ``read_records`` gives them back to
every record of the run, so a results file stays self-describing without repeating its config
on every line (``write_records`` compacts any list of records the same way; ``merge_records``
joins runs of one config split across processes). ``ResultWriter.done(key)`` lets a long run
resume: callers give each measurement a stable key (e.g. method/budget/sample) and skip keys
already written.

Resumption is only trusted within one config: the writer fingerprints the config fields that
change a result (all but ``NON_RESULT_FIELDS``, the experiment's ``ignore`` and its ``keyed``
fields, whose value is part of every record's key, e.g. the methods or lengths of a sweep, so
extending them reuses the finished rows). A workdir holding records of another fingerprint is
refused (``ConfigMismatch`` names the differing fields), and a key is never written twice.

Records under the repository's ``results/`` must be tied to code: a checkout with uncommitted
changes (``+dirty``) is refused there (``DirtyTree``) unless ``--allow_dirty`` is given.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
from typing import Any, Iterable, Sequence

from absl import flags, logging
import numpy as np

from experiments.common import provenance

_ALLOW_DIRTY = flags.DEFINE_bool(
    "allow_dirty", False, "Write records under the repository's results/ from a checkout with "
    "uncommitted changes (such records cannot be tied to code).")

RESULTS_FILE = "results.jsonl"
# Config fields that never change a measurement (where outputs go, how progress is shown, how
# many samples share a batch).
NON_RESULT_FIELDS = ("quick", "workdir", "progress", "batch_size")


def git_revision() -> str:
  """The checkout's HEAD (``+dirty`` if modified), or ``unknown`` outside git.

  ``EXPERIMENT_REVISION``, when set, is returned instead: the revision a copy of the code was
  made from where the copy's own ``.git`` is not that code's (the GPU device tool ships the
  working tree with the session's first ``.git``; ``experiments/gpu_session.sh``).
  """
  declared = os.environ.get("EXPERIMENT_REVISION")
  if declared:
    return declared
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


class DirtyTree(ValueError):
  """Records would go under ``results/`` from a checkout with uncommitted changes."""


REPO_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "results")


def check_tied_to_code(workdir: str, revision: str, allow: bool,
                       results_root: str = REPO_RESULTS) -> None:
  """Raises ``DirtyTree`` when ``workdir`` lies under ``results_root`` and ``revision`` is a
  modified checkout (``+dirty``), unless ``allow``."""
  inside = os.path.commonpath([os.path.abspath(workdir), os.path.abspath(results_root)])
  if revision.endswith("+dirty") and inside == os.path.abspath(results_root) and not allow:
    raise DirtyTree(f"{workdir} is under results/ but the checkout has uncommitted changes: "
                    "commit first so the records are tied to code, or pass --allow_dirty")


def _allow_dirty() -> bool:
  return bool(flags.FLAGS["allow_dirty"].value)


class ConfigMismatch(ValueError):
  """A workdir holds records of the same experiment under a config that changes results."""


def result_fields(config, keyed: Sequence[str] = (), ignore: Sequence[str] = ()) -> dict:
  """The config fields that change a result (JSON-able, sorted by name)."""
  skip = set(NON_RESULT_FIELDS) | set(keyed) | set(ignore)
  return {k: v for k, v in sorted(config_dict(config).items()) if k not in skip}


def fingerprint(fields: dict) -> str:
  """A short stable hash of ``result_fields``."""
  return hashlib.sha1(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def _differences(old: dict, new: dict) -> str:
  missing = "<absent>"
  return "; ".join(f"{k}: {old.get(k, missing)!r} in the workdir, {new.get(k, missing)!r} now"
                   for k in sorted(set(old) | set(new))
                   if old.get(k, missing) != new.get(k, missing))


class ResultWriter:
  """Appends records to ``workdir/results.jsonl``; resumes only under the same config.

  Args:
    workdir: output directory.
    config: the run's config (ConfigDict or dict).
    experiment: the experiment name stored in every record.
    keyed: config fields whose value is part of every record's key (sweep axes).
    ignore: further fields that do not change a result (besides ``NON_RESULT_FIELDS``).

  Raises:
    ConfigMismatch: the workdir holds this experiment's records of another config.
  """

  def __init__(self, workdir: str, config, experiment: str, *, keyed: Sequence[str] = (),
               ignore: Sequence[str] = ()):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.path = os.path.join(workdir, RESULTS_FILE)
    self.experiment = experiment
    self.fields = result_fields(config, keyed, ignore)
    self.fingerprint = fingerprint(self.fields)
    mine = [r for r in read_records(self.path) if r.get("experiment") == experiment]
    for r in mine:
      # Recomputed from the stored config, so records written before fingerprints existed
      # (or under other keyed/ignore lists) are checked the same way.
      theirs = result_fields(r.get("config", {}), keyed, ignore)
      if fingerprint(theirs) != self.fingerprint:
        raise ConfigMismatch(
            f"{workdir} holds {experiment} records of another config "
            f"({_differences(theirs, self.fields)}); give another --workdir, or the same values "
            "to resume")
    self.header = dict(config=config_dict(config), machine=machine())
    self.run = run_id(self.header)
    self.meta = dict(git=git_revision(), fingerprint=self.fingerprint, run=self.run)
    if os.environ.get("EXPERIMENT_REVISION"):  # not read from the checkout: the claims say so
      self.meta["git_declared"] = True
    self.meta.update(provenance.record_fields())  # a declared tree hash checked (or refused)
    check_tied_to_code(workdir, self.meta["git"], _allow_dirty())
    self._header_written = self.run in _runs_with_header(_read_lines(self.path))
    self._done = {(self.fingerprint, r["key"]) for r in mine if "key" in r}

  def done(self, key: str) -> bool:
    """Whether a record with this key was already written under this config (resume)."""
    return (self.fingerprint, key) in self._done

  def write(self, record: dict, key: str | None = None) -> dict | None:
    """Appends one record; a key already written is skipped (None): rows are never rewritten."""
    if key is not None and self.done(key):
      logging.warning("%s: record %r is already in %s; not written again", self.experiment,
                      key, self.path)
      return None
    header = {} if self._header_written else self.header
    meta = {**self.meta, **provenance.record_fields(record)}  # imports since: checked again
    rec = dict(experiment=self.experiment, **header, **meta,
               time=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               **_jsonable(record))
    if key is not None:
      rec["key"] = key
      self._done.add((self.fingerprint, key))
    with open(self.path, "a+b") as f:
      f.seek(0, os.SEEK_END)
      if f.tell():  # a run killed mid-line leaves no newline: never glue onto its fragment
        f.seek(-1, os.SEEK_END)
        lead = b"" if f.read(1) == b"\n" else b"\n"
      else:
        lead = b""
      f.write(lead + (json.dumps(rec) + "\n").encode("utf-8"))
    self._header_written = True
    return dict(rec, **self.header)

  def records(self) -> list[dict]:
    return [r for r in read_records(self.path) if r.get("experiment") == self.experiment]


def run_id(header: dict) -> str:
  """A short stable hash of a run's ``{config, machine}`` header."""
  return hashlib.sha1(json.dumps(header, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def _read_lines(path: str) -> list[dict]:
  """The records of a JSONL file as stored. Lines that are not a JSON object (a truncated last
  line from a killed run, a stray edit) are skipped, and a warning names the file, how many
  and which (once per file and count)."""
  if not os.path.exists(path):
    return []
  out, bad = [], []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        record = None
      if isinstance(record, dict):
        out.append(record)
      else:
        bad.append(number)
  if bad and (path, len(bad)) not in _WARNED:
    _WARNED.add((path, len(bad)))
    shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
    logging.warning("%s: skipped %d line(s) that are not a JSON record (line %s)", path,
                    len(bad), shown)
  return out


_WARNED: set[tuple[str, int]] = set()  # (path, skipped lines) already reported


_HEADER = ("config", "machine")  # stored once per run


def _runs_with_header(stored: list[dict]) -> dict[str, dict]:
  """run id -> its ``{config, machine}`` header, from the records that carry one."""
  return {r["run"]: {k: r[k] for k in _HEADER if k in r}
          for r in stored if "run" in r and "config" in r}


def read_records(path: str) -> list[dict]:
  """All records of a JSONL file, each with its run's config and machine (records written
  before run headers existed carry their own)."""
  stored = _read_lines(path)
  headers = _runs_with_header(stored)
  return [dict(r, **headers.get(r.get("run"), {})) if "config" not in r else r for r in stored]


def write_records(path: str, records: Iterable[dict]) -> None:
  """Writes ``records`` (as ``read_records`` gives them) to ``path``, replacing it atomically,
  each run's config and machine stored once: on the first record of the run."""
  seen = set()
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for r in records:
      header = {k: r[k] for k in _HEADER if k in r}
      rid = r.get("run") or (run_id(header) if "config" in r else None)
      rec = {k: v for k, v in r.items() if k not in _HEADER}
      if rid is not None:
        rec["run"] = rid
        if rid not in seen:
          seen.add(rid)
          rec = {k: rec[k] for k in ("experiment",) if k in rec} | header | rec
      else:
        rec = r
      f.write(json.dumps(rec) + "\n")
  os.replace(tmp, path)


def _identity(r: dict) -> tuple:
  """What makes a record the same measurement: its experiment, config fingerprint and key (the
  whole record where it has no key)."""
  if "key" in r:
    return r.get("experiment"), r.get("fingerprint"), r["key"]
  return (r.get("experiment"), json.dumps({k: v for k, v in r.items() if k not in _HEADER},
                                          sort_keys=True))


def merge_records(target: list[dict], sources: dict[str, list[dict]]) -> tuple[list[dict], dict]:
  """``target`` followed by every source record not already in it (nor in an earlier source).

  Args:
    target: the records of the workdir merged into (``read_records``).
    sources: source name -> its records (a parallel run of the same config, e.g. other tasks).

  Returns:
    ``(merged, added)``: the merged records and source name -> how many of its records were new.

  Raises:
    ConfigMismatch: a source holds an experiment under another config fingerprint than the
      target (or an earlier source): its rows would not be comparable.
  """
  merged = list(target)
  have = {_identity(r) for r in merged}
  prints = {r.get("experiment"): (r.get("fingerprint"), "the target") for r in merged}
  added = {}
  for name, recs in sources.items():
    added[name] = 0
    for r in recs:
      exp = r.get("experiment")
      theirs, where = prints.setdefault(exp, (r.get("fingerprint"), name))
      if r.get("fingerprint") != theirs:
        raise ConfigMismatch(
            f"{name} holds {exp} records of config {r.get('fingerprint')}, {where} of {theirs}; "
            "only runs of the same config (up to their sweep axes) merge")
      if _identity(r) not in have:
        have.add(_identity(r))
        merged.append(r)
        added[name] += 1
  return merged, added


def find_results(root: str) -> Iterable[str]:
  """Every results.jsonl under ``root``."""
  for dirpath, _, files in os.walk(root):
    if RESULTS_FILE in files:
      yield os.path.join(dirpath, RESULTS_FILE)
