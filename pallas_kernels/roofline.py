"""Cost model of the kernels on an H100: bytes moved, predicted time, fraction of HBM bandwidth.

    python -m pallas_kernels.roofline                    # presets, before / after issue 17
    python -m pallas_kernels.roofline --hq 32 --hkv 8 --head-dim 128 --context 32768 --blocks 102

Decode kernels are bandwidth bound (~G flop/byte against an H100 ridge of ~300), so their time is
set by how many bytes each SM keeps in flight (Little's law), not by FLOPs:

  ``bandwidth = min(HBM peak, resident programs x bytes in flight per program / latency)``

with ``bytes in flight`` per program = pipeline stages outstanding x the K+V tile, resident
programs limited by the grid and by shared memory per SM, at most ``SM_CAP_BYTES`` in flight per
busy SM, and ``latency`` a loaded HBM round trip. Each kernel launch adds ``LAUNCH_US``. The two designs are:

  * ``before``: one 16-token block per iteration, ``num_stages=2`` compiled to one buffer that
    the loop waits empty (PTX: ``cp.async.wait_group 0``), >= 4 blocks per split, per-head
    selection read once per query head;
  * ``after`` (this package): J blocks (64-128 tokens) per iteration, ``num_stages=3`` (two tiles
    in flight, checked on the PTX by ``pallas_kernels.ptx``), >= 16 blocks per split, per-head
    selection read once per kv head over the union of the group's lists.

The whole sparse step of one layer adds the XLA work around the kernels (cache write scatters,
score ranking, split combine; ``before`` also ``lax.top_k``, a sort, where ``after`` runs the
radix select of ``pallas_kernels.block_select``), each a launch plus its bytes at
``XLA_FRACTION`` of peak. All constants are assumptions of the model, printed with the tables; measured numbers
come from ``experiments.latency`` on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses

HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
BF16_FLOPS_PER_S = 989e12  # H100 SXM dense bf16 tensor core
NUM_SMS = 132
SMEM_PER_SM = 228 * 1024
LATENCY_S = 1.0e-6  # loaded HBM round trip
SM_CAP_BYTES = 3 * 25e3  # one SM sustains at most ~3x its fair share of the HBM bandwidth
LAUNCH_US = 3.0  # per kernel launch inside a jitted step (host + GPU front end)
XLA_FRACTION = 0.5  # bandwidth fraction of the small XLA gathers / scatters / sorts
DESIGNS = ("before", "after")


@dataclasses.dataclass(frozen=True)
class Shape:
  """One decode step of one layer.

  Attributes:
    batch, hq, hkv, head_dim: model sizes.
    context: filled cache slots.
    block_size: tokens per block.
    blocks: listed blocks per selection head (``n``).
    per_head: per-query-head selection (``H = Hq``) instead of group-shared (``H = Hkv``).
    union: blocks of a group's union of per-head lists, in units of ``n`` (1 = identical lists,
      G = disjoint); an assumption of the model for per-head selection.
    window: queries per head of the multi-query kernel (RetroAttention's w).
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
  union: float = 2.0
  window: int = 8
  itemsize: int = 2

  @property
  def group(self) -> int:
    return self.hq // self.hkv

  @property
  def sel_heads(self) -> int:
    return self.hq if self.per_head else self.hkv


@dataclasses.dataclass(frozen=True)
class Cost:
  """Bytes, FLOPs and the launch geometry of one kernel (or XLA op) in one decode step."""
  name: str
  bytes: float
  flops: float
  programs: int = 1
  inflight_bytes: float = 0.0  # per program
  smem_bytes: float = 0.0  # per program
  launches: int = 1
  xla: bool = False

  @property
  def memory_us(self) -> float:
    """The HBM bound: all bytes at peak bandwidth."""
    return self.bytes / HBM_BYTES_PER_S * 1e6

  @property
  def compute_us(self) -> float:
    return self.flops / BF16_FLOPS_PER_S * 1e6

  @property
  def bandwidth(self) -> float:
    """Sustained bytes/s predicted for the kernel's streaming phase."""
    if self.xla:
      return XLA_FRACTION * HBM_BYTES_PER_S
    resident = min(self.programs, NUM_SMS * max(1, SMEM_PER_SM // max(self.smem_bytes, 1)))
    in_flight = min(resident * self.inflight_bytes, min(NUM_SMS, self.programs) * SM_CAP_BYTES)
    return min(HBM_BYTES_PER_S, in_flight / LATENCY_S)

  @property
  def predicted_us(self) -> float:
    return (self.launches * LAUNCH_US + self.bytes / self.bandwidth * 1e6
            + self.compute_us)

  @property
  def streaming_fraction(self) -> float:
    """Fraction of HBM peak while streaming (launch overhead excluded)."""
    return self.bandwidth / HBM_BYTES_PER_S

  @property
  def fraction(self) -> float:
    """Fraction of HBM peak over the predicted time (launches included)."""
    return self.memory_us / self.predicted_us


def _splits(programs: int, n: int, min_blocks: int) -> int:
  want = -(-264 // max(programs, 1))
  return int(max(1, min(want, max(1, n // min_blocks))))


def _tokens_per_iter(s: Shape, design: str) -> int:
  if design == "before":
    return s.block_size
  from pallas_kernels._common import tokens_per_iter  # pylint: disable=g-import-not-at-top
  return max(s.block_size, tokens_per_iter(s.head_dim, s.itemsize, 3))


def _decode(s: Shape, design: str, name: str, rows_per_head: int, extra_per_token: float = 0.0,
            flops_per_token: int = 4) -> Cost:
  """Sparse flash-decoding over ``blocks`` listed blocks per program head."""
  check_design(design)
  b, d, n, bs = s.batch, s.head_dim, s.blocks, s.block_size
  if design == "before" or not s.per_head:
    heads, listed = s.sel_heads, n
  else:
    heads, listed = s.hkv, min(s.group, max(1.0, s.union)) * n
  min_blocks = 4 if design == "before" else 16
  splits = _splits(b * heads, int(listed), min_blocks)
  tokens = b * heads * listed * bs
  kv = 2 * tokens * d * s.itemsize + tokens * extra_per_token
  lists = b * heads * (listed + 1) * 4
  rows = b * s.hq * rows_per_head
  q_out = 2 * rows * d * s.itemsize
  partials = 2 * rows * splits * (d + 1) * 4  # written by the kernel, read by the combine
  tile = _tokens_per_iter(s, design)
  tile_bytes = tile * (2 * d * s.itemsize + extra_per_token)
  stages_in_flight = 1 if design == "before" else 2
  smem = (1 if design == "before" else 2) * tile_bytes + 16 * 128 * s.itemsize * 2
  # Every row runs its program's dots over the program's whole list (masked or not).
  return Cost(name, kv + lists + q_out + partials, flops_per_token * rows * listed * bs * d,
              programs=b * heads * splits, inflight_bytes=stages_in_flight * tile_bytes,
              smem_bytes=smem, launches=2)  # kernel + split combine


def check_design(design: str):
  if design not in DESIGNS:
    raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")


def block_score_cost(s: Shape, design: str = "after", pooled: bool = False) -> Cost:
  check_design(design)
  nb = s.context // s.block_size
  rows = s.hkv if pooled else s.hq
  read = s.batch * (2 * s.hkv * nb * s.head_dim * s.itemsize + s.hq * s.head_dim * s.itemsize)
  write = s.batch * rows * nb * 4
  tile = 64 * 2 * s.head_dim * s.itemsize
  tiles = s.batch * s.hkv * -(-nb // 64)
  # before: one tile per program, no loop to pipeline; after: a loop with two tiles in flight.
  programs = tiles if design == "before" else max(1, min(tiles, 264))
  inflight = tile if design == "before" else 2 * tile
  return Cost("block_score_pooled" if pooled else "block_score", read + write,
              4 * s.batch * rows * nb * s.head_dim, programs=programs, inflight_bytes=inflight,
              smem_bytes=inflight + 8 * 1024)


def score_select_cost(s: Shape) -> Cost:
  """``score_select`` (group-shared Quest): one program per (batch, kv head) streams its head's
  digests (64-block tiles, two in flight, 72 KB of shared memory on sm_90), keeps the keys on
  chip and writes the list; the select's counting passes (latency, ~0.7 us each on an H100 in
  ``block_select``, 2048 entries as slow as 8192) are not in this bandwidth model. With
  ``B x K`` programs only (8 at batch 1 on Llama-3.1-8B) the digests stream through 8 SMs."""
  nb = s.context // s.block_size
  read = s.batch * s.hkv * (2 * nb + 1) * s.head_dim * s.itemsize
  write = s.batch * s.hkv * (s.blocks + 1) * 4
  tile = 64 * 2 * s.head_dim * s.itemsize
  return Cost("score_select (fused, one program per kv head)", read + write,
              4 * s.batch * s.hkv * 16 * nb * s.head_dim, programs=s.batch * s.hkv,
              inflight_bytes=2 * tile, smem_bytes=72 * 1024)


def fused_step_costs(s: Shape) -> list[Cost]:
  """``sparse_step_costs(s, "after")`` with scoring, ranking and select as one ``score_select``
  (group-shared selection only)."""
  write, _, _, _, decode = sparse_step_costs(s, "after")
  return [write, score_select_cost(s), decode]


def sparse_decode_cost(s: Shape, design: str = "after") -> Cost:
  return _decode(s, design, "sparse_decode", 1)


def sparse_decode_resa_cost(s: Shape, design: str = "after") -> Cost:
  # The prior P_j (f32) of each row is read beside K and V.
  return _decode(s, design, "sparse_decode_resa", 1, extra_per_token=4 * s.group,
                 flops_per_token=6)


def sparse_decode_multiquery_cost(s: Shape, design: str = "after") -> Cost:
  return _decode(s, design, "sparse_decode_multiquery", s.window)


CHUNK = 512  # queries of the prefill / rectification chunk in ``chunk_attention_cost``


def chunk_attention_cost(s: Shape, design: str = "after") -> Cost:
  """The last ``CHUNK``-query prefill chunk of a ``context``-token prompt, dense and causal.

  ``before``: XLA over the whole capacity with the ``[B, Hq, CHUNK, T]`` f32 logits materialised
  (written, read by the max, the exp and the p.v: ~4 passes). ``after``: ``chunk_attention``, one
  program per (batch, kv head, 64-row query tile), K/V tiles read once per kv head from HBM (the
  tile programs of a head run together and share them through L2); it is compute bound, so its
  time is mostly ``compute_us`` at the tensor-core peak (an optimistic floor).
  """
  check_design(design)
  b, d, t, it = s.batch, s.head_dim, s.context, s.itemsize
  kv = 2 * b * s.hkv * t * d * it
  q_out = 2 * b * s.hq * CHUNK * d * it
  if design == "before":
    logits = 4 * b * s.hq * CHUNK * t * 4
    return Cost("chunk_attention", kv + q_out + logits, 4 * b * s.hq * CHUNK * t * d,
                launches=6, xla=True)
  gp = 1 << (s.group - 1).bit_length()
  rows = 64
  programs = b * s.hkv * -(-CHUNK * gp // rows)
  tile = 64 * 2 * d * it
  return Cost("chunk_attention", kv + q_out, 4 * b * s.hkv * CHUNK * gp * t * d,
              programs=programs, inflight_bytes=2 * tile, smem_bytes=3 * tile + rows * d * it)


def all_costs(s: Shape, design: str = "after") -> list[Cost]:
  return [block_score_cost(s, design), block_score_cost(s, design, pooled=True),
          sparse_decode_cost(s, design), sparse_decode_resa_cost(s, design),
          sparse_decode_multiquery_cost(s, design), chunk_attention_cost(s, design)]


def sparse_step_costs(s: Shape, design: str = "after") -> list[Cost]:
  """One Quest decode step of one layer: cache write, scoring, selection, decode + combine."""
  nb = s.context // s.block_size
  row = s.batch * s.hkv * s.head_dim * s.itemsize
  # k, v, pos and the digests, one scatter each: before, all four digests (kmin, kmax, kcen,
  # krad); after, only the two Quest reads (``KVCache`` keeps the kinds its selector uses).
  # Bytes: the written rows (a digest row is one block's ``[D]`` per kv head, krad one float).
  digests = 4 if design == "before" else 2
  pos = s.batch * s.hkv * 4
  digest_bytes = 3 * row + pos if design == "before" else 2 * row
  write = Cost(f"cache write ({3 + digests} scatters)", 2 * row + pos + digest_bytes, 0,
               launches=3 + digests, xla=True)
  scores = s.batch * s.sel_heads * nb * 4
  if design == "before":
    select = [Cost("clip/where + lax.top_k (sort)", 3 * scores, 0, launches=3, xla=True)]
  else:  # the ranking fusion, then one program per row holding the row (block_select)
    rows = s.batch * s.sel_heads
    select = [Cost("rank_scores (XLA fusion)", 2 * scores, 0, xla=True),
              Cost("block_select (radix select, no sort)", scores + rows * s.blocks * 4, 0,
                   programs=rows, inflight_bytes=nb * 4, smem_bytes=16 * 1024)]
  return [write, block_score_cost(s, design), *select, sparse_decode_cost(s, design)]


def format_table(title: str, s: Shape) -> str:
  head = (f"## {title}: B={s.batch} Hq={s.hq} Hkv={s.hkv} D={s.head_dim} T={s.context} "
          f"block={s.block_size} n={s.blocks} ({s.blocks * s.block_size} tokens, "
          f"{'per-head, union ' + format(s.union, 'g') + 'n' if s.per_head else 'group-shared'}) "
          f"W={s.window}")
  lines = [head, "| kernel | design | MB moved | programs | KB in flight / program | "
           "HBM bound (us) | predicted (us) | streaming BW fraction | fraction incl. launch |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  rows = [(c, design) for before, after in zip(all_costs(s, "before"), all_costs(s, "after"))
          for c, design in ((before, "before"), (after, "after"))]
  for c, design in rows:
    lines.append(f"| {c.name} | {design} | {c.bytes / 1e6:.3f} | {c.programs} | "
                 f"{c.inflight_bytes / 1024:.0f} | {c.memory_us:.2f} | {c.predicted_us:.2f} | "
                 f"{c.streaming_fraction:.0%} | {c.fraction:.0%} |")
  for design in DESIGNS:
    step = sparse_step_costs(s, design)
    total_b = sum(c.bytes for c in step)
    total_t = sum(c.predicted_us for c in step)
    lines.append(f"| **whole sparse step** ({sum(c.launches for c in step)} launches) | "
                 f"{design} | {total_b / 1e6:.3f} | | | {total_b / HBM_BYTES_PER_S * 1e6:.2f} | "
                 f"{total_t:.2f} | | {total_b / HBM_BYTES_PER_S * 1e6 / total_t:.0%} |")
  if not s.per_head:
    step = fused_step_costs(s)
    total_b, total_t = sum(c.bytes for c in step), sum(c.predicted_us for c in step)
    lines.append(f"| **whole sparse step, score_select** ({sum(c.launches for c in step)} "
                 f"launches) | after | {total_b / 1e6:.3f} | | | "
                 f"{total_b / HBM_BYTES_PER_S * 1e6:.2f} | {total_t:.2f} | | "
                 f"{total_b / HBM_BYTES_PER_S * 1e6 / total_t:.0%} |")
  return "\n".join(lines)


ASSUMPTIONS = (f"Model constants: HBM {HBM_BYTES_PER_S / 1e12:.2f} TB/s, {NUM_SMS} SMs, latency "
               f"{LATENCY_S * 1e6:.1f} us, per-SM cap {SM_CAP_BYTES / 1e3:.0f} KB in flight, "
               f"launch {LAUNCH_US:.0f} us, XLA ops at {XLA_FRACTION:.0%} of peak.")

PRESETS = {
    # 8k context, Quest-style 5% budget in 16-token blocks.
    "Llama-3.1-8B 8k": Shape(context=8192, blocks=26),
    "Llama-3.1-8B 32k": Shape(context=32768, blocks=102),
    "Llama-3.1-8B 32k per-head": Shape(context=32768, blocks=102, per_head=True),
    "Llama-3.1-8B 32k batch 8": Shape(batch=8, context=32768, blocks=102),
    "Llama-3.1-8B 128k": Shape(context=131072, blocks=820),
    "Qwen2.5 (G=7) 32k per-head": Shape(hq=14, hkv=2, head_dim=64, context=32768, blocks=102,
                                        per_head=True),
    "SmolLM2-135M 8k": Shape(hq=9, hkv=3, head_dim=64, context=8192, blocks=26),
}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for field in dataclasses.fields(Shape):
    flag = "--" + field.name.replace("_", "-")
    if field.type in ("bool", bool):
      parser.add_argument(flag, action="store_true")
    else:
      parser.add_argument(flag, type=float if field.type in ("float", float) else int,
                          default=None)
  args = vars(parser.parse_args(argv))
  given = {k: v for k, v in args.items() if v not in (None, False)}
  print(ASSUMPTIONS + "\n")
  if given:
    print(format_table("custom", dataclasses.replace(Shape(), **given)))
    return
  for name, shape in PRESETS.items():
    print(format_table(name, shape))
    print()


if __name__ == "__main__":
  main()
