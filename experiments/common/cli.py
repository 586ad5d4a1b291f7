"""absl glue shared by every entry point: flags, quick resolution, user errors, progress lines.

Usage in ``experiments/NAME.py``::

  from experiments.common import cli
  cli.define_flags("NAME")
  def main(argv): config, workdir = cli.parsed(); ...
  if __name__ == "__main__": cli.run(main)

* ``--config`` (``configs/NAME.py``; ``--help`` lists its fields and defaults), ``--workdir``;
  ``define_flags(NAME, mesh=True)`` adds ``--mesh`` / ``--distributed`` (read by ``cli.mesh()``).
* ``cli.parsed()`` applies ``--config.quick=True`` (``experiments.common.quick``: explicit
  ``--config.FIELD`` flags win; a tiny random model, default workdir ``results_quick/NAME``)
  and checks the model and method specs before anything heavy.
* ``cli.run`` prints a user error (bad spec, budget, model, config value, a workdir of another
  config) as one line on stderr and exits 1; ``--traceback`` shows the traceback instead.
  Library INFO logs (orbax, absl) are silenced unless ``--verbosity`` is given. Freed buffers
  go back to the OS (``experiments.common.heap``).
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.common import config_check, distributed, heap, quick

# Flags defined here become key flags of the entry point that calls define_flags (--help).
flags.disclaim_key_flags()

FLAGS = flags.FLAGS
_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")
_TRACEBACK = flags.DEFINE_bool("traceback", False,
                               "Show the full traceback of a user error instead of one line.")
ALLOW_LONG_CONTEXT = flags.DEFINE_bool(
    "allow_long_context", False,
    "Run prompts whose positions (prompt + new tokens) exceed the model's "
    "max_position_embeddings (refused otherwise; RoPE scaling may allow them).")
QUICK_ROOT = "results_quick"  # quick runs' default workdirs (git-ignored)
QUICK_NOTE = ("quick mode (--config.quick=True): CI sizes on a tiny random model, so its scores "
              "are meaningless by design (it checks that the code runs)")
USER_ERRORS = (app.UsageError, ValueError, OSError)  # OSError: missing model or config file
_STATE = {}


def fields_help(name: str) -> str:
  """``--config`` help: every field of ``configs/NAME.py`` with its default."""
  try:
    config = quick.module_get_config(name)()
  except (ImportError, AttributeError, TypeError) as e:  # help must not fail
    return f"(fields of configs/{name}.py unavailable: {e})"
  lines = [f"  --config.{k}={config_check.show(v)}" for k, v in config.items()]
  return ("Fields and defaults (override with --config.FIELD=VALUE). --config.quick=True takes "
          "the CI sizes on a tiny random model (scores meaningless by design: it checks that "
          f"the code runs), explicit fields win, and writes to {QUICK_ROOT}/{name} unless "
          "--workdir is given:\n" + "\n".join(lines))


def define_flags(name: str, mesh: bool = False):
  """Defines ``--config`` (default ``configs/NAME.py``) and ``--workdir`` (``results/NAME``);
  with ``mesh``, also ``--mesh`` and ``--distributed`` (``experiments.common.distributed``)."""
  _STATE["name"] = name
  if mesh:
    distributed.define_flags()
  try:  # without --config=..., ml_collections applies the --config.FIELD overrides here
    config_flags.DEFINE_config_file(
        "config", os.path.join(_CONFIGS_DIR, f"{name}.py"),
        f"ml_collections config file for {name}.\n{fields_help(name)}", lock_config=True)
  except (AttributeError, KeyError, flags.Error) as e:
    _exit_with(_unknown_field(sys.argv) or _one_line(e))
  flags.DEFINE_string("workdir", os.path.join("results", name),
                      "Output directory (results.jsonl, markdown, figures); a rerun resumes "
                      "there if its config is the same. Quick runs (--config.quick=True) "
                      f"default to {QUICK_ROOT}/{name}.")
  flags.declare_key_flag("traceback")
  flags.declare_key_flag("allow_long_context")


def quick_workdir(name: str) -> str:
  """Where a ``--config.quick=True`` run writes unless ``--workdir`` is given: its own folder,
  so a quick run never meets the committed records of ``results/NAME`` (another config)."""
  return os.path.join(QUICK_ROOT, name)


def parsed():
  """``(config, workdir)``: quick values resolved, model and method specs checked.

  A quick run without ``--workdir`` writes to ``quick_workdir(NAME)`` and says so on stderr.
  """
  name = _STATE["name"]
  holder = FLAGS["config"]
  _check_config_file(config_flags.get_config_filename(holder))
  explicit = config_flags.get_override_values(holder).keys()
  get_config = quick.module_get_config(name, config_flags.get_config_filename(holder))
  config = quick.resolve(FLAGS.config, get_config, explicit)
  config_check.check(config, get_config)  # types and signs, before JAX is imported
  from experiments.common import checks  # pylint: disable=g-import-not-at-top (imports jax)
  checks.check_config(config)
  workdir = FLAGS.workdir
  if config.get("quick", False):
    if not FLAGS["workdir"].present:
      workdir = quick_workdir(name)
    print(f"{name}: {QUICK_NOTE}; writing to {workdir}", file=sys.stderr, flush=True)
  return config, workdir


def mark_quick(path: str) -> None:
  """Puts ``QUICK_NOTE`` under the title of the markdown file at ``path`` (once): a quick run's
  written report says its scores are meaningless, not only its stderr."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  note = f"> **{QUICK_NOTE[0].upper()}{QUICK_NOTE[1:]}.**\n\n"
  if note in text:
    return
  title, sep, rest = text.partition("\n\n") if text.startswith("# ") else ("", "", text)
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"{title}{sep}{note}{rest}")


def _check_config_file(path: str) -> None:
  """A missing ``--config`` file is one line naming the configs there are."""
  path = path.split(":")[0]  # ml_collections' "file.py:param" form
  if path and not os.path.isfile(path):
    names = sorted(f for f in os.listdir(_CONFIGS_DIR) if f.endswith(".py") and f[0] != "_")
    raise FileNotFoundError(f"--config={path}: no such config file; the configs are "
                            f"configs/{{{','.join(n[:-3] for n in names)}}}.py")


def mesh():
  """The device mesh of ``--mesh`` (after ``--distributed``'s initialisation), or None."""
  return distributed.mesh_from_flags()


def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split()) or type(error).__name__


def guarded(main):
  """``main`` with library INFO logs silenced and user errors turned into one stderr line."""

  def wrapped(argv):
    if not FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # orbax and absl are chatty at INFO
    try:
      return main(argv)
    except USER_ERRORS as e:
      if _TRACEBACK.value:
        raise
      _exit_with(_one_line(e))

  return wrapped


def _program() -> str:
  """The name errors start with: the experiment's (also under ``python -m experiments NAME``)."""
  return _STATE.get("name") or os.path.basename(sys.argv[0]).removesuffix(".py")


def _parse_flags(argv):
  """absl's flag parsing, with a bad flag, config field or config value reported as one line."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    message = _one_line(e)
  except (AttributeError, KeyError) as e:  # ml_collections: --config.FIELD the config lacks
    message = _unknown_field(argv) or _one_line(e)
  _exit_with(message)


def _exit_with(message: str):
  print(f"{_program()}: error: {message}", file=sys.stderr, flush=True)
  sys.exit(1)


def _unknown_field(argv) -> str | None:
  """``config_check.unknown_field`` for the ``--config`` file named in ``argv`` (or the
  default one)."""
  name = _STATE.get("name")
  if name is None:
    return None
  path = os.path.join(_CONFIGS_DIR, f"{name}.py")
  for arg in argv:
    if arg.startswith(("--config=", "-config=")):
      path = arg.split("=", 1)[1].split(":")[0]
  shown = os.path.relpath(path) if os.path.isabs(path) else path
  return config_check.unknown_field(argv, quick.module_get_config(name, path), shown)


def run(main):
  heap.return_freed_memory()  # a long run's resident memory follows its live buffers
  app.run(guarded(main), flags_parser=_parse_flags)


def _clock(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
  """One stderr line per update, at most every ``every`` seconds (and at the end):

    ``desc i/total (pct%) rate/s, elapsed h:mm:ss, eta h:mm:ss note``
  """

  def __init__(self, total: int, desc: str = "", every: float = 5.0, stream=None):
    self.total, self.desc, self.every = max(int(total), 0), desc, every
    self.stream = stream
    self.start = self.last = time.time()
    self.i = 0
    self.ended = False

  def update(self, n: int = 1, note: str = ""):
    self.i += n
    now = time.time()
    finished = self.i >= self.total
    if (now - self.last >= self.every or finished) and not self.ended:
      self.ended = finished
      self.last = now
      elapsed = max(now - self.start, 1e-9)
      rate = self.i / elapsed
      eta = (self.total - self.i) / rate if rate > 0 else float("inf")
      pct = 100.0 * self.i / self.total if self.total else 100.0
      eta_text = _clock(max(eta, 0.0)) if eta != float("inf") else "?"
      msg = (f"{self.desc} {self.i}/{self.total} ({pct:.0f}%) {rate:.3g}/s, "
             f"elapsed {_clock(elapsed)}, eta {eta_text}")
      print(f"{msg} {note}".rstrip(), file=self.stream or sys.stderr, flush=True)
