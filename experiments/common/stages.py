"""Progress lines for the steps of one run that can take more than a few seconds.

``Stages`` prints ``PROGRAM: [elapsed] message`` lines on stderr: a line when a step starts
(``start("loading smollm2-135m-instruct")``) and, through ``callback(label)`` (the
``progress(stage, i, n)`` hook of ``models.decode.generate``), one per prefill chunk and one
per ``every`` seconds of decoding (the first and last token always), e.g.::

  generate: [0:00:12] quest@0.1: prefill chunk 2/3
  generate: [0:00:15] quest@0.1: decoding 32/64 tokens
"""

from __future__ import annotations

import sys
import time


class Stages:
  """Stage and step lines on ``stream`` (default stderr), timed from construction."""

  def __init__(self, program: str, every: float = 2.0, stream=None):
    self.program, self.every, self.stream = program, every, stream
    self.t0 = time.time()
    self._last = 0.0

  def _print(self, message: str):
    secs = int(time.time() - self.t0)
    print(f"{self.program}: [{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}] {message}",
          file=self.stream or sys.stderr, flush=True)

  def start(self, message: str):
    """A step begins (loading, compiling, a timed run)."""
    self._print(message)

  def callback(self, label: str):
    """``progress(stage, i, n)`` for ``models.decode.generate``, its lines prefixed ``label``."""

    def progress(stage: str, i: int, n: int):
      now = time.time()
      if stage == "prefill":
        self._print(f"{label}: prefill chunk {i}/{n}")
      elif i in (2, n) or now - self._last >= self.every:  # token 1 comes from the prefill
        self._print(f"{label}: decoding {i}/{n} tokens")
      else:
        return
      self._last = now

    return progress
