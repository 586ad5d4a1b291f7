"""absl glue shared by every entry point: ``--config`` (ml_collections file) and ``--workdir``.

Usage in ``experiments/NAME.py``::

  from experiments.common import cli
  cli.define_flags("NAME")
  def main(argv): config, workdir = cli.parsed(); ...
  if __name__ == "__main__": cli.run(main)
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")


def define_flags(name: str):
  """Defines ``--config`` (default ``configs/NAME.py``) and ``--workdir`` (``results/NAME``)."""
  config_flags.DEFINE_config_file("config", os.path.join(_CONFIGS_DIR, f"{name}.py"),
                                  f"ml_collections config file for {name}.", lock_config=True)
  flags.DEFINE_string("workdir", os.path.join("results", name), "Output directory.")


def parsed():
  return FLAGS.config, FLAGS.workdir


def run(main):
  app.run(main)


class Progress:
  """Prints ``desc i/total (rate, eta)`` at most every ``every`` seconds (stderr + absl log)."""

  def __init__(self, total: int, desc: str = "", every: float = 5.0):
    self.total, self.desc, self.every = total, desc, every
    self.start = self.last = time.time()
    self.i = 0

  def update(self, n: int = 1, note: str = ""):
    self.i += n
    now = time.time()
    if now - self.last >= self.every or self.i >= self.total:
      self.last = now
      rate = self.i / max(now - self.start, 1e-9)
      eta = (self.total - self.i) / max(rate, 1e-9)
      msg = f"{self.desc} {self.i}/{self.total} ({rate:.2f}/s, eta {eta:.0f}s) {note}"
      print(msg, file=sys.stderr, flush=True)
      logging.info(msg)
