"""experiments.ptx_steps (the ``ptx`` extra): every launch of a decode step compiled for sm_90
with ptxas's registers and spills; RetroAttention's w = 8 step at the 8B shape spills nowhere."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from experiments import ptx_steps  # pylint: disable=g-import-not-at-top


def test_retro_window_step_at_8b_has_no_spill():
  """Retro Table 6's w = 8 step at 8192 slots (its launches; the combine spilled 17,980 bytes a
  thread before its row tiles)."""
  spec = "quest:budget=0.15,min_tokens=256,n_sink=0,local_window=1,forced_count=inside+retro:w=8"
  launches = ptx_steps.step_launches(spec, 8192, 1)
  names = [r["name"] for r in launches]
  assert "sparse_decode_multiquery" in names and "split_combine" in names, names
  for r in launches:
    assert r["registers"] > 0 and r["spill_bytes"] == 0, r
  [combine] = [r for r in launches if r["name"] == "split_combine"]
  assert combine["grid"][:2] == (1, 8) and combine["grid"][2] > 1, combine


@pytest.mark.parametrize("spec", ["tidaldecode", "rocketkv"])
def test_token_decoders_steps_compile_without_spills(spec):
  """TidalDecode (a selection layer, then a reuse layer reading its relay) and RocketKV (a
  compression method, no ``impl`` in its spec: swept as a GPU's ``"auto"`` runs it) reach the
  sparse decode kernel over their token lists, and nothing spills."""
  launches = ptx_steps.step_launches(spec, 8192, 1)
  assert "sparse_decode" in [r["name"] for r in launches], launches
  for r in launches:
    assert r["registers"] > 0 and r["spill_bytes"] == 0, r


def test_adakv_step_decodes_the_flat_buffer_in_one_program_head():
  """Expected Attention's default head budget (Ada-KV) decodes over its flat buffer: the kernel
  runs one program head per batch row (every query head its rows), splits filling the GPU, and
  nothing spills."""
  launches = ptx_steps.step_launches("expected_attention", 8192, 1)
  [decode] = [r for r in launches if r["name"] == "sparse_decode"]
  assert decode["grid"][:2] == (1, 1) and decode["grid"][2] > 32, decode
  for r in launches:
    assert r["registers"] > 0 and r["spill_bytes"] == 0, r
