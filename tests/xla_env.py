"""The suite's XLA:CPU compile settings, and the environment of a run that goes without them.

The suite's time goes mostly to XLA:CPU compiling hundreds of small programs, not to running
them, so tests/conftest.py puts these flags into ``XLA_FLAGS`` before JAX starts (pytest workers
and the suite's subprocesses inherit them). Every test compares against a reference with a
tolerance that holds under any of them; the library itself runs at XLA's defaults.
"""

import os
import re

SUITE_FLAGS = (
    # LLVM at -O0 compiles faster.
    "--xla_backend_optimization_level=0",
    # XLA:CPU's older elemental emitters instead of its MLIR fusion emitters: measured
    # (2026-12-02, 2 cores, a cold compilation cache) 77 -> 50 CPU seconds for
    # tests/sparse_attn/test_masked_rows.py, and 40 distinct small attention programs compile
    # in half the time.
    "--xla_cpu_use_fusion_emitters=false",
    # One LLVM module per program: the split into parallel modules pays only for large ones.
    "--xla_cpu_parallel_codegen_split_count=1",
)


def with_suite_flags(flags: str) -> str:
  """``flags`` plus each suite flag whose name it does not set (a value given wins)."""
  for flag in SUITE_FLAGS:
    if flag.split("=")[0] not in flags:
      flags = f"{flags} {flag}"
  return flags.strip()


def default_optimization() -> dict[str, str]:
  """``os.environ`` without the suite flags: for a subprocess whose time goes into executing a
  real model as a user runs it (the main job on SmolLM2 spends ~60% more CPU at -O0)."""
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in SUITE_FLAGS:
    flags = re.sub(rf"\s*{re.escape(flag.split('=')[0])}=\S+", "", flags)
  return dict(os.environ, XLA_FLAGS=flags.strip())
