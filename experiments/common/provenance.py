r"""Which code a record ran: a revision's tree hash, checked on the machine that runs it.

The GPU device tool ships a copy of the working tree with a ``.git`` that is not the code's, so a
record's revision there cannot be read from git. Instead (issue 51, item 6):

* here, ``python -m experiments.common.provenance prepare`` writes a *manifest* of the committed
  revision: every tracked file under ``CODE_PATHS`` with its git blob hash (``git ls-tree``), and
  prints the manifest's *tree hash* (sha256 of the revision and the file table);
* there, the run gets ``EXPERIMENT_REVISION`` (the revision), ``EXPERIMENT_TREE_HASH`` and
  ``EXPERIMENT_MANIFEST`` (the carried manifest); ``check`` recomputes the tree hash from the
  manifest (a stale or edited manifest is refused), then the blob hash of every listed file as it
  lies on disk, and lists the files that differ, are missing, or are Python files the revision
  does not have;
* a record is *verified* when the manifest is the declared one and none of those files was
  imported by the process that wrote it (nor, for records a child measured, by the child:
  ``imports_unverified``, ``child_fields``). Files that differ but never ran (another
  session's edits elsewhere in the tree) do not change a measurement and are only listed.

``writer_meta`` gives ``ResultWriter`` the fields every record then carries: ``git`` (the
revision, or ``REV+unverified``), ``git_verified``, ``tree_hash``. An unverified record is
refused (``UnverifiedTree``) unless ``EXPERIMENT_ALLOW_UNVERIFIED=1``. ``EXPERIMENT_SESSION``
(one id per device session, set by the GPU scripts) is stored as ``session``: the claims pair
rounds only within one session.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_PATHS = ("sparse_attn", "pallas_kernels", "models", "experiments", "configs",
              "pyproject.toml")
DEFAULT_MANIFEST = ".whl/tree_manifest.json"
UNVERIFIED = "+unverified"


class UnverifiedTree(RuntimeError):
  """The files that ran are not the declared revision's (and that was not allowed)."""


def blob_hash(data: bytes) -> str:
  """Git's blob id of ``data`` (what ``git ls-tree`` lists)."""
  return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_hash(manifest: dict) -> str:
  """The manifest's hash: its revision and file table (16 hex digits)."""
  body = json.dumps({"revision": manifest["revision"], "files": manifest["files"]},
                    sort_keys=True)
  return hashlib.sha256(body.encode("utf-8")).hexdigest()[:16]


def _git(*args: str, root: str = ROOT) -> str:
  return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                        check=True).stdout


def make_manifest(root: str = ROOT, rev: str = "HEAD") -> dict:
  """The committed revision's file table (from git, not from the working tree) and which
  tracked files the working tree changes (listed, not refused: the device decides by imports)."""
  sha = _git("rev-parse", rev, root=root).strip()
  files = {}
  for line in _git("ls-tree", "-r", sha, "--", *CODE_PATHS, root=root).splitlines():
    meta, path = line.split("\t", 1)
    files[path] = meta.split()[2]
  dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS,
               root=root).splitlines()
  return {"revision": sha, "paths": list(CODE_PATHS), "files": files,
          "modified_here": sorted(line[3:] for line in dirty)}


def manifest_from_disk(root: str = ROOT, revision: str = "disk") -> dict:
  """A manifest of the files as they lie under ``root`` (every file ``problems`` would walk and
  every tracked kind under ``CODE_PATHS``): tests, and a tree outside git."""
  files = {}
  for top in CODE_PATHS:
    full = os.path.join(root, top)
    walk = [(root, [], [top])] if os.path.isfile(full) else os.walk(full)
    for dirpath, dirs, names in walk:
      dirs[:] = [d for d in dirs if d != "__pycache__"]
      for name in names:
        if name.endswith(".pyc"):
          continue
        with open(os.path.join(dirpath, name), "rb") as f:
          files[os.path.relpath(os.path.join(dirpath, name), root)] = blob_hash(f.read())
  return {"revision": revision, "paths": list(CODE_PATHS), "files": files, "modified_here": []}


def problems(manifest: dict, root: str = ROOT) -> dict[str, str]:
  """``path -> what is wrong`` for files on disk that are not the manifest's: changed,
  missing, or a Python file under ``CODE_PATHS`` the revision does not have."""
  out = {}
  for path, blob in manifest["files"].items():
    full = os.path.join(root, path)
    if not os.path.isfile(full):
      out[path] = "missing"
      continue
    with open(full, "rb") as f:
      if blob_hash(f.read()) != blob:
        out[path] = "changed"
  for top in manifest.get("paths", CODE_PATHS):
    for dirpath, dirs, names in os.walk(os.path.join(root, top)):
      dirs[:] = [d for d in dirs if d != "__pycache__"]
      for name in names:
        rel = os.path.relpath(os.path.join(dirpath, name), root)
        if name.endswith(".py") and rel not in manifest["files"]:
          out[rel] = "not in the revision"
  return out


def imported_files(root: str = ROOT) -> set[str]:
  """Repository-relative paths of the modules this process has imported."""
  out = set()
  for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if path and os.path.abspath(path).startswith(root + os.sep):
      out.add(os.path.relpath(os.path.abspath(path), root))
  return out


@functools.lru_cache(maxsize=None)
def _state(revision: str, declared_hash: str, manifest_path: str) -> dict:
  """The check of this process's tree against the manifest (files do not change mid-run)."""
  path = manifest_path if os.path.isabs(manifest_path) else os.path.join(ROOT, manifest_path)
  if not os.path.exists(path):
    return dict(fatal=f"no manifest at {manifest_path} (carry it: see experiments/gpu_claims.sh)")
  with open(path, encoding="utf-8") as f:
    manifest = json.load(f)
  got = tree_hash(manifest)
  if got != declared_hash:
    return dict(fatal=f"the manifest's tree hash is {got}, the run declares {declared_hash} "
                      "(a stale manifest: prepare again)")
  if revision and manifest["revision"] != revision:
    return dict(fatal=f"the manifest is of {manifest['revision']}, the run declares {revision}")
  return dict(fatal=None, revision=manifest["revision"], hash=got,
              problems=problems(manifest))


def _env() -> tuple[str, str, str] | None:
  declared = os.environ.get("EXPERIMENT_TREE_HASH")
  if not declared:
    return None
  return (os.environ.get("EXPERIMENT_REVISION", ""), declared,
          os.environ.get("EXPERIMENT_MANIFEST", DEFAULT_MANIFEST))


def unverified_imports(extra: set[str] | None = None) -> list[str]:
  """Files imported here (plus ``extra``: a child's) that are not the revision's; [] when no
  tree hash is declared."""
  env = _env()
  if env is None:
    return []
  st = _state(*env)
  if st["fatal"]:
    return ["<manifest>"]
  ran = imported_files() | set(extra or ())
  return sorted(p for p in st["problems"] if p in ran)


def child_fields() -> dict:
  """What a child process that measured a record adds to it: its own unverified imports."""
  return {"imports_unverified": unverified_imports()} if _env() else {}


def record_fields(record: dict | None = None) -> dict:
  """The provenance fields of a record about to be written (``{}`` without a declared tree
  hash, and only ``session`` when one is set).

  Raises:
    UnverifiedTree: the record would be unverified and ``EXPERIMENT_ALLOW_UNVERIFIED`` is unset.
  """
  out = {}
  if os.environ.get("EXPERIMENT_SESSION"):
    out["session"] = os.environ["EXPERIMENT_SESSION"]
  env = _env()
  if env is None:
    return out
  st = _state(*env)
  revision = env[0] or st.get("revision") or "unknown"
  if st["fatal"]:
    why = st["fatal"]
  else:
    bad = unverified_imports(set((record or {}).get("imports_unverified") or ()))
    why = (f"ran files that are not {revision[:12]}'s: " + ", ".join(
        f"{p} ({st['problems'].get(p, 'child')})" for p in bad[:8])) if bad else None
  out.update(git=revision, git_declared=False, git_verified=why is None,
             tree_hash=env[1])
  if why:
    if os.environ.get("EXPERIMENT_ALLOW_UNVERIFIED") != "1":
      raise UnverifiedTree(why + "; set EXPERIMENT_ALLOW_UNVERIFIED=1 to record it as "
                                 "unverified")
    out.update(git=revision + UNVERIFIED, unverified_reason=why)
  return out


def main(argv=None) -> int:
  """``prepare [--out PATH]`` (here) or ``check`` (on the device, with the env vars set)."""
  ap = argparse.ArgumentParser(prog="python -m experiments.common.provenance")
  ap.add_argument("command", choices=("prepare", "check"))
  ap.add_argument("--out", default=DEFAULT_MANIFEST)
  ap.add_argument("--imports", default="", help="check: modules to import first (comma list)")
  args = ap.parse_args(argv)
  if args.command == "prepare":
    manifest = make_manifest()
    out = os.path.join(ROOT, args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
      json.dump(manifest, f, indent=0, sort_keys=True)
    for path in manifest["modified_here"]:
      print(f"modified here (travels; a run that imports it is unverified): {path}",
            file=sys.stderr)
    print(f"EXPERIMENT_REVISION={manifest['revision']} EXPERIMENT_TREE_HASH={tree_hash(manifest)}")
    return 0
  import importlib  # pylint: disable=g-import-not-at-top
  for name in filter(None, args.imports.split(",")):
    importlib.import_module(name)
  env = _env()
  if env is None:
    print("no EXPERIMENT_TREE_HASH: records will carry a declared revision at most")
    return 0
  st = _state(*env)
  if st["fatal"]:
    print(f"provenance: refused: {st['fatal']}", file=sys.stderr)
    return 2
  for path, what in sorted(st["problems"].items()):
    print(f"provenance: {path}: {what}")
  try:
    record_fields()
  except UnverifiedTree as e:
    print(f"provenance: refused: {e}", file=sys.stderr)
    return 3
  bad = unverified_imports()
  print(f"provenance: tree {env[1]} of {st['revision'][:12]}: {len(st['problems'])} file(s) "
        f"differ; imported so far: {', '.join(bad) if bad else 'none'}"
        + (" (allowed: records say +unverified)" if bad else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
