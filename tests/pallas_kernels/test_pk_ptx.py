"""Every kernel compiled to sm_90 PTX by Triton (the ``ptx`` extra): shared memory within the
H100 limit, no register spills (``ptxas``), and a main loop that keeps >= 2 stages of
asynchronous copies in flight.

The Triton IR is the one ``jax.export`` lowers for CUDA (what a GPU run compiles); only the last
step, Triton IR -> TTGIR -> PTX, runs in the PyPI ``triton`` package. Skipped without it.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("triton")

from pallas_kernels import ptx, shapes, sparse_decode  # pylint: disable=g-import-not-at-top

# Llama-3.1-8B on every run; Qwen (G = 7) and SmolLM2 (D = 64) shapes as slow tests.
MODELS = ("llama31_8b", pytest.param("qwen25_g7", marks=pytest.mark.slow),
          pytest.param("smollm2", marks=pytest.mark.slow))


def reports(fn, avals, tmp_path):
  reps = ptx.report(fn, *avals, workdir=str(tmp_path))
  assert reps, "no Triton call in the exported function"
  return reps


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kernel,per_head", shapes.KERNELS)
def test_kernel_is_pipelined_within_h100_shared_memory(kernel, per_head, model, tmp_path):
  fn, avals, bs = shapes.kernel_avals(kernel, model, per_head)
  for rep in reports(functools.partial(fn, block_size=bs, impl="pallas"), avals, tmp_path):
    assert rep.shared_bytes <= ptx.H100_SMEM_PER_BLOCK, str(rep)
    assert rep.registers > 0 and rep.spill_bytes == 0, str(rep)
    if rep.name == "split_combine":  # no loop: one load of the partials, one store
      continue
    assert rep.shared_bytes > 0, str(rep)
    assert rep.async_copies > 0 or rep.tma > 0, str(rep)
    assert rep.ring_depth >= 2 and rep.stages_in_flight >= 2, str(rep)


@pytest.mark.parametrize("model", sorted(shapes.TOKEN_MODELS))
@pytest.mark.parametrize("kernel,per_head", shapes.TOKEN_KERNELS)
def test_token_list_kernels_do_not_spill(kernel, per_head, model, tmp_path):
  """Token lists (one slot an entry: a tile gathers 64-128 scattered rows) within shared memory,
  pipelined, and without register spills at the Llama-3.1-8B shape."""
  fn, avals, bs = shapes.kernel_avals(kernel, model, per_head)
  for rep in reports(functools.partial(fn, block_size=bs, impl="pallas"), avals, tmp_path):
    assert rep.shared_bytes <= ptx.H100_SMEM_PER_BLOCK, str(rep)
    assert rep.registers > 0 and rep.spill_bytes == 0, str(rep)
    if rep.name != "split_combine":
      assert rep.ring_depth >= 2 and rep.stages_in_flight >= 2, str(rep)


def test_check_fails_for_the_unpipelined_configuration(tmp_path):
  """num_stages=2 with one block per iteration (the old kernel): a single buffer, waited empty."""
  fn, avals, bs = shapes.kernel_avals("sparse_decode", "llama31_8b", False)
  [rep] = [r for r in reports(functools.partial(sparse_decode, block_size=bs, impl="pallas",
                                                num_stages=2, blocks_per_iter=1), avals, tmp_path)
           if r.name != "split_combine"]
  assert rep.ring_depth == 1 and rep.stages_in_flight == 1, str(rep)


def test_mlir_string_unescape():
  assert ptx._unescape_mlir_string(r'a\22b\\c\0A\FF') == b'a"b\\c\n\xff'
