"""pallas_kernels._common helpers and the roofline script."""

from __future__ import annotations

import pytest

from pallas_kernels import _common, roofline


def test_padding_helpers():
  assert [_common.next_pow2(x) for x in (0, 1, 3, 16, 17, 80)] == [1, 1, 4, 16, 32, 128]
  assert [_common.pad_rows(x) for x in (1, 3, 16, 24, 64)] == [16, 16, 16, 32, 64]


def test_choose_num_splits():
  # Batch x heads already fill the GPU: no split.
  assert _common.choose_num_splits(512, 200) == 1
  # Few programs, long list: split, but keep >= MIN_BLOCKS_PER_SPLIT entries per split.
  assert _common.choose_num_splits(8, 26) == 26 // _common.MIN_BLOCKS_PER_SPLIT
  assert _common.choose_num_splits(8, 4096) == -(-_common.TARGET_PROGRAMS // 8)
  assert _common.choose_num_splits(8, 0) == 1


def test_tile_config_and_block_size_validation():
  with pytest.raises(ValueError):
    _common.TileConfig(block_nb=24)
  with pytest.raises(ValueError):
    _common.TileConfig(num_splits=0)
  assert _common.check_block_size(16, 128) == 8
  for bad in ((8, 128), (24, 96), (16, 100)):
    with pytest.raises(ValueError):
      _common.check_block_size(*bad)


def test_tokens_per_iter_fits_the_shared_memory_budget():
  for d, itemsize in ((64, 2), (96, 2), (128, 2), (256, 2), (128, 4)):
    tokens = _common.tokens_per_iter(d, itemsize, 3)
    assert 16 <= tokens <= _common.MAX_TOKENS_PER_ITER and tokens & (tokens - 1) == 0
    assert tokens * 2 * _common.pad_rows(d) * itemsize * 3 <= _common.KV_RING_BYTES
  assert _common.tokens_per_iter(128, 2, 3) == 64  # J = 4 blocks of 16 at Llama shapes


def test_roofline_prints_every_kernel(capsys):
  roofline.main([])
  text = capsys.readouterr().out
  for name in ("block_score", "sparse_decode", "sparse_decode_resa", "sparse_decode_multiquery",
               "whole sparse step", "Llama-3.1-8B", "SmolLM2", "before", "after"):
    assert name in text
  roofline.main(["--hq", "8", "--hkv", "8", "--per-head", "--blocks", "4"])
  assert "per-head" in capsys.readouterr().out


def test_roofline_counts_scale_with_selection():
  small = roofline.sparse_decode_cost(roofline.Shape(blocks=10))
  big = roofline.sparse_decode_cost(roofline.Shape(blocks=20))
  assert big.bytes > small.bytes and big.flops == 2 * small.flops
  # Before: per-head selection reads the listed blocks once per query head, G times more;
  # after: once per kv head over the union (``union`` lists' worth of blocks).
  shared = roofline.Shape(blocks=64)
  per_head = roofline.Shape(blocks=64, per_head=True, union=1.0)
  cost = lambda s, design: roofline.sparse_decode_cost(s, design).bytes
  assert 3.5 < cost(per_head, "before") / cost(shared, "before") < 4.0
  assert 0.95 < cost(per_head, "after") / cost(shared, "after") < 1.05
  with pytest.raises(ValueError):
    roofline.sparse_decode_cost(shared, "later")


def test_roofline_pipelining_raises_the_predicted_bandwidth():
  """Llama-3.1-8B at 32k: one 8 KB tile per program waited empty vs two 32 KB tiles in flight."""
  s = roofline.Shape(context=32768, blocks=102)
  before, after = (roofline.sparse_decode_cost(s, d) for d in roofline.DESIGNS)
  assert before.streaming_fraction < 0.5 < 0.9 < after.streaming_fraction <= 1.0
  assert after.predicted_us < before.predicted_us
