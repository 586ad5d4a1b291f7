"""Cost model of the kernels: HBM bytes, FLOPs and the H100 roofline time, per decode step/layer.

    python -m pallas_kernels.roofline                       # Llama-3.1-8B and SmolLM2 presets
    python -m pallas_kernels.roofline --hq 32 --hkv 8 --head-dim 128 --context 32768 --blocks 128

Decode kernels are bandwidth bound (arithmetic intensity ~G flop/byte, far below the H100 ridge of
~300 flop/byte), so the expected time is ``bytes / 3.35 TB/s``; the compute bound (989 TFLOP/s
dense bf16) is printed for comparison. Counts are what the kernels move, not an idealisation:
each listed block is read once per program head (once per kv head with group-shared selection,
once per query head with per-head selection), splits write and re-read float32 partials.
At decode sizes the bound is often below a microsecond, so a measured time will be dominated by
launch overhead (~2-5 us per kernel, plus the split combine) unless batch x context is large.
"""

from __future__ import annotations

import argparse
import dataclasses

HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
BF16_FLOPS_PER_S = 989e12  # H100 SXM dense bf16 tensor core


@dataclasses.dataclass(frozen=True)
class Shape:
  """One decode step of one layer.

  Attributes:
    batch, hq, hkv, head_dim: model sizes.
    context: cache slots in use (``T`` for scoring; selection covers ``blocks * block_size``).
    block_size: tokens per block.
    blocks: listed blocks per selection head (``n``).
    per_head: per-query-head selection (``H = Hq``) instead of group-shared (``H = Hkv``).
    window: queries per head of the multi-query kernel (RetroAttention's w).
    splits: split-K count.
    itemsize: bytes per cache / query element (2 for bf16).
  """
  batch: int = 1
  hq: int = 32
  hkv: int = 8
  head_dim: int = 128
  context: int = 8192
  block_size: int = 16
  blocks: int = 26
  per_head: bool = False
  window: int = 8
  splits: int = 4
  itemsize: int = 2

  @property
  def sel_heads(self) -> int:
    return self.hq if self.per_head else self.hkv

  @property
  def selected_tokens(self) -> int:
    return self.blocks * self.block_size


@dataclasses.dataclass(frozen=True)
class Cost:
  name: str
  bytes: float
  flops: float

  @property
  def memory_us(self) -> float:
    return self.bytes / HBM_BYTES_PER_S * 1e6

  @property
  def compute_us(self) -> float:
    return self.flops / BF16_FLOPS_PER_S * 1e6


def block_score_cost(s: Shape, pooled: bool = False) -> Cost:
  nb = s.context // s.block_size
  rows = s.hkv if pooled else s.hq
  read = s.batch * (2 * s.hkv * nb * s.head_dim * s.itemsize + s.hq * s.head_dim * s.itemsize)
  write = s.batch * rows * nb * 4
  # Two multiply-adds per (row, block, channel): relu(q).kmax + min(q, 0).kmin.
  flops = 4 * s.batch * rows * nb * s.head_dim
  return Cost("block_score_pooled" if pooled else "block_score", read + write, flops)


def _decode_bytes(s: Shape, rows_per_head: int) -> tuple[float, int]:
  b, d, n = s.batch, s.head_dim, s.blocks
  kv = 2 * b * s.sel_heads * s.selected_tokens * d * s.itemsize
  lists = b * s.sel_heads * (n + 1) * 4
  q_out = 2 * b * s.hq * rows_per_head * d * s.itemsize
  # Each split writes (out f32, lse f32) that the combine reads back.
  partials = 2 * b * s.hq * rows_per_head * s.splits * (d + 1) * 4
  return kv + lists + q_out + partials, b * s.hq * rows_per_head


def sparse_decode_cost(s: Shape) -> Cost:
  total, rows = _decode_bytes(s, 1)
  return Cost("sparse_decode", total, 4 * rows * s.selected_tokens * s.head_dim)


def sparse_decode_resa_cost(s: Shape) -> Cost:
  total, rows = _decode_bytes(s, 1)
  prior = s.batch * s.hq * s.selected_tokens * 4
  partials = 2 * s.batch * s.hq * s.splits * (s.head_dim + 1) * 4
  # q.k and p.v, plus the prior's own p.v over the same V tile.
  flops = 6 * rows * s.selected_tokens * s.head_dim
  return Cost("sparse_decode_resa", total + prior + partials, flops)


def sparse_decode_multiquery_cost(s: Shape) -> Cost:
  total, rows = _decode_bytes(s, s.window)
  masks = s.batch * s.sel_heads * s.blocks * (s.hq // s.sel_heads) * s.window * 4
  return Cost("sparse_decode_multiquery", total + masks,
              4 * rows * s.selected_tokens * s.head_dim)


def all_costs(s: Shape) -> list[Cost]:
  return [block_score_cost(s), block_score_cost(s, pooled=True), sparse_decode_cost(s),
          sparse_decode_resa_cost(s), sparse_decode_multiquery_cost(s)]


def format_table(title: str, s: Shape) -> str:
  lines = [f"## {title}: B={s.batch} Hq={s.hq} Hkv={s.hkv} D={s.head_dim} T={s.context} "
           f"block={s.block_size} n={s.blocks} ({s.selected_tokens} tokens, "
           f"{'per-head' if s.per_head else 'group-shared'}) W={s.window} splits={s.splits}",
           "| kernel | MB read+written | MFLOP | flop/byte | H100 HBM bound (us) | "
           "bf16 compute bound (us) |",
           "|---|---:|---:|---:|---:|---:|"]
  for c in all_costs(s):
    lines.append(f"| {c.name} | {c.bytes / 1e6:.3f} | {c.flops / 1e6:.2f} | "
                 f"{c.flops / c.bytes:.2f} | {c.memory_us:.2f} | {c.compute_us:.3f} |")
  return "\n".join(lines)


PRESETS = {
    # 8k context, Quest-style 5% budget in 16-token blocks.
    "Llama-3.1-8B": Shape(batch=1, hq=32, hkv=8, head_dim=128, context=8192, block_size=16,
                          blocks=26),
    "SmolLM2-135M": Shape(batch=1, hq=9, hkv=3, head_dim=64, context=8192, block_size=16,
                          blocks=26),
}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for field in dataclasses.fields(Shape):
    flag = "--" + field.name.replace("_", "-")
    if field.type in ("bool", bool):
      parser.add_argument(flag, action="store_true")
    else:
      parser.add_argument(flag, type=int, default=None)
  args = vars(parser.parse_args(argv))
  given = {k: v for k, v in args.items() if v not in (None, False)}
  if given:
    print(format_table("custom", dataclasses.replace(Shape(), **given)))
    return
  for name, shape in PRESETS.items():
    print(format_table(name, shape))
    print()


if __name__ == "__main__":
  main()
