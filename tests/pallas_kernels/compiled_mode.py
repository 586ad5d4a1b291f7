"""A pytest plugin that runs the kernel tests compiled on a GPU instead of in interpret mode.

  python -m pytest -p tests.pallas_kernels.compiled_mode tests/pallas_kernels \
      --deselect tests/pallas_kernels/test_pk_lowering.py --deselect tests/pallas_kernels/test_pk_ptx.py

The tests ask for ``interpret=True`` (the CPU proof); on a GPU machine this plugin makes every
``pallas_call`` compile through Triton instead, so the same properties are checked on hardware.
It refuses to load without a GPU (compiled Pallas-Triton kernels need one). Tests that assert
CPU-only facts (``impl="auto"`` resolving to XLA on a CPU) fail here by design.
"""

import jax
from jax.experimental import pallas as pl

if jax.default_backend() != "gpu":
  raise RuntimeError("tests.pallas_kernels.compiled_mode needs a GPU backend, found "
                     f"{jax.default_backend()!r}")

_pallas_call = pl.pallas_call


def _compiled_pallas_call(*args, **kwargs):
  kwargs["interpret"] = False
  return _pallas_call(*args, **kwargs)


pl.pallas_call = _compiled_pallas_call
# The CPU tests compare against XLA paths in exact float32; XLA:GPU would run their float32 dots
# in TF32 (~1e-4 relative), which is the reference's error, not the kernel's.
jax.config.update("jax_default_matmul_precision", "highest")
