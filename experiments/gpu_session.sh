#!/usr/bin/env bash
# The GPU checks of one 15-minute device lease, in one command, each part under its own timeout.
#
#   bash experiments/gpu_session.sh            # on the lent GPU (the device tool's `run`,
#                                              # carry=[".whl"], timeout_s ~590)
#   QUICK=1 bash experiments/gpu_session.sh    # the same parts on a CPU, tiny shapes (a rehearsal)
#   PARTS="precision decode_sweep" TOTAL=300 bash experiments/gpu_session.sh   # some parts
#
# Parts, cheapest first, so a short lease still brings back the most important numbers:
#   1. precision: Pallas vs XLA selections and outputs of quest:gqa=group at 8k, 32/8 heads,
#      compiled (tests/sparse_attn/test_scoring_precision.py; its GPU-only case);
#   2. per_layer: one Llama-3.1-8B attention layer at 8k/32k/128k, dense (split-K Pallas and
#      XLA), Quest p = 0.1 (and fused=true: score_select), +RESA (and fused=false: its XLA-op
#      path) also at RESA's budget of 500, +rect:f=32 and rectified, next to SDPA; and RESA's
#      last prefill chunk with and without the prior (section resa);
#   2b. per_layer_mosaic: the same layer at 8k/32k/128k, dense and quest:gqa=group through the
#      Mosaic GPU kernels (impl=mosaic) beside their Triton twins and torch SDPA, one run
#      (issue 54 item 5; its own part and workdir, so a Mosaic failure leaves per_layer's
#      records whole and its Triton rows are written, not skipped as per_layer's keys);
#   3. shape_32k: a random-weight Llama-3.1-8B end to end at batch 1 and 32k (dense prefill;
#      decode dense, Quest, +RESA), next to transformers, each row with its fraction of the
#      bandwidth bound;
#   4. shape_128k: the same model at 128k, dense, Quest, +RESA and +RESA:fused=false (ours only);
#   5. prefill_chunk: one layer's 4096-query dense prefill chunk at 32k / 128k, chunk_attention's
#      kernel vs its in-order branch (cuDNN flash attention), the GPU default;
#   6. decode_sweep: the dense split-K decode kernel's launch configurations at 32k / 128k next
#      to torch SDPA and cuDNN (experiments/decode_sweep.py);
#   6b. sparse_sweep: the Triton sparse decode over a 10% list at 128k (Quest's step) per split
#      count (default, half, double) and tokens an iteration (issue 51 item 1);
#   7. select_sweep: the block select (warps, early exit) next to lax.top_k at 2048 / 8192 entries,
#      and its parts (io floor, counting passes, placement) by device time;
#   7b. mosaic_sweep: the Mosaic GPU decode at 8k / 32k / 128k, dense and a 10% list, per step body
#      (WGMMA products vs CUDA-core rows), tokens a step (64, 128) at ring depth 3, each
#      with its fraction of peak bandwidth, next to torch SDPA and the Triton dense decode
#      (issue 54: what the WGMMA step buys; experiments/decode_sweep.py --mosaic);
#   8. profile_128k, profile_32k: per-op device microseconds of one decode step of Quest, +RESA
#      and dense (experiments/profile_step.py);
#   8b. profile_mosaic: the same at 128k for dense and Quest through the Mosaic GPU kernels
#      (issue 54: where their 4.6-6.7x over Triton on the H200 goes);
#   8c. profile_retro: the same at 32k for Retro Table 6's base and its w = 8 window (issue 51
#      item 3: where w = 8's 30-32% of throughput goes, against the paper's 5-7%), the window's
#      attended keys counted in the kernel (the default) and in XLA ops (exposed=xla);
#   8d. flat_decode: the decode over Ada-KV's flat buffer (Expected Attention's default) at 32k /
#      128k kept at 0.5, batch 1 and 8: the kernel vs the jnp form it replaced vs a per-head
#      cache of the same bytes (experiments/flat_decode_bench.py; issue 55's decode path);
#   9. profile_e2e: the same for whole-model steps of the random Llama-3.1-8B at 32k (what the
#      end-to-end ms per token is made of, next to the untraced wall clock), with the optimized
#      HLO of those programs ($OUT/hlo_e2e.tgz) to read the profile's fusion names in.
# PARTS (default: parts 1-5) names the parts to run, in its order; PER_LAYER_CONTEXTS and
# PER_LAYER_METHODS narrow per_layer (defaults: 8k / 32k / 128k, five methods).
# Each part runs under its own limit, cut to what is left of TOTAL (570 s) seconds; a part
# with under 30 s left is skipped.
# The device tool ships the working tree with the session's first .git, so the records would
# name that commit "+dirty": commit first and pass the revision the tree is, e.g.
#   run(command=f"EXPERIMENT_REVISION={sha} bash experiments/gpu_session.sh", ...)
# (experiments/common/results.py:git_revision).
# Records go under $OUT (the device tool's output folder; /tmp/gpu_session elsewhere; the part logs
# together in parts.log, since the tool brings back 8 files at most); commit each call's
# workdir in a folder of its own (e.g. results/gpu_h200/lease) with `python -m experiments.merge`:
# a record's key names (section, dtype, context, method), so a second call's rows of the same
# keys would be skipped as duplicates and its ratios lose their in-run partners. The image lacks
# ml_collections: carry its wheel in .whl/ (see the README's GPU notes); it is installed into
# /tmp/site when missing.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
if ! python3 -c "import ml_collections" 2>/dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/site .whl/ml_collections-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

QUICK=${QUICK:-0}
TOTAL=${TOTAL:-570}  # the whole script's seconds: a part gets what is left, up to its own limit
PARTS=${PARTS:-precision per_layer shape_32k shape_128k prefill_chunk}
DEADLINE=$(( $(date +%s) + TOTAL ))
EXTRA=()
CTX32=(--config.shape_contexts=32768)
CTX128=(--config.shape_contexts=131072 --config.shape_transformers=False)
CHUNK_CONTEXTS=(--config.contexts=32768,131072)
SWEEP=(--contexts=32768,131072)
SPARSE_SWEEP=(--contexts=131072 --sparse_keep=0.1 --nodense_grid --splits=0,0.5,2 --iters=0/3,8/3
              --warps=4)
SELECT=(--select_entries=8192,2048 --select_rows=8 --select_bits=1 --select_warps=0,4
        --select_phases=io,threshold,place,all)
MOSAIC_SWEEP=(--contexts=8192,32768,131072 --iters= --mosaic=mma,rows --mosaic_tokens=64,128
              --mosaic_stages=3)  # 24 rows; --mosaic_stages=2,3,4 in a lease of its own
PROFILE=(--steps=32 --calls=2)
FLAT=(--contexts=32768,131072)
PROFILE_E2E=(--shape=llama-3.1-8b --context=32768 --steps=8 --calls=2 --top=30)
CTX_SMALL=(131072 32768)
MOSAIC=dense,dense:impl=mosaic,quest:gqa=group,quest:gqa=group,impl=mosaic
MOSAIC_EXTRA=()
MOSAIC_PROFILE=()
# Retro Table 6's base (the retro preset's Quest) and its w = 8 window, one layer at 32k.
RETRO_BASE=quest:budget=0.15,min_tokens=256,n_sink=0,local_window=1,forced_count=inside
RETRO_PROFILE=$RETRO_BASE,$RETRO_BASE+retro:w=8,$RETRO_BASE+retro:w=8,exposed=xla
# The GPU claim rows' methods (RESA Table 4 at budget 500, ReSA's memory access, Retro's layer)
# and what issue 51 compares (score_select fused, RESA's XLA-op path); 8k + 32k took ~105 s on
# an H200, 128k ~65 s more.
PER_LAYER=dense,dense:impl=xla,quest:gqa=group,quest:gqa=group,fused=true,quest:gqa=group+resa
PER_LAYER+=,quest:gqa=group+resa:fused=false,quest:gqa=group,budget=500
PER_LAYER+=,quest:gqa=group,budget=500+resa,quest:gqa=group+rect:f=32,rectified
if [ "$QUICK" = 1 ]; then
  CTX32=()
  CTX128=(--config.shape_transformers=False)
  CHUNK_CONTEXTS=()
  SWEEP=(--contexts=256 --steps=2 --repeats=1 --splits=0,2 --iters=0/3 --warps=4 --interpret)
  SPARSE_SWEEP=(--contexts=256 --sparse_keep=0.25 --nodense_grid --splits=0,0.5 --iters=0/3
                --warps=4 --steps=2 --repeats=1 --interpret)
  SELECT=(--select_entries=64 --select_rows=2 --steps=2 --repeats=1 --interpret
          --select_phases=io,threshold,place,all)
  MOSAIC_SWEEP=(--contexts=256 --iters= --mosaic=mma,rows --mosaic_tokens=64 --mosaic_stages=2
                --steps=1 --repeats=1 --interpret)
  PROFILE=(--steps=2 --calls=1 --interpret)
  FLAT=(--contexts=256 --steps=2 --repeats=1 --interpret)
  PROFILE_E2E=(--shape=tiny --dtype=float32 --context=128 --steps=2 --calls=1 --interpret)
  CTX_SMALL=(256 256)
  MOSAIC=dense,dense:impl=mosaic,interpret=true,quest:gqa=group
  MOSAIC+=,quest:gqa=group,impl=mosaic,interpret=true
  MOSAIC_EXTRA=(--config.head_dim=32)  # the Mosaic kernels' smallest float32 head
  MOSAIC_PROFILE=(--num_heads=4 --num_kv_heads=2 --head_dim=32 --dtype=float32)
  DEADLINE=$(( $(date +%s) + 3600 ))
  EXTRA=(--config.quick=True)
fi
MOSAIC_METHODS=${MOSAIC_METHODS:-$MOSAIC}
LATENCY=(python3 -m experiments.latency --config=configs/latency_gpu.py
         --workdir="$OUT/latency_gpu")

part() {  # part NAME LIMIT_S COMMAND...: runs it, reports rc and seconds, shows its tail
  local name=$1 limit=$2 start rc left
  shift 2
  left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "== $name skipped (${left}s left of the script's time)"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  start=$(date +%s)
  timeout "$limit" "$@" > "/tmp/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc ($(( $(date +%s) - start )) s; 124 = timed out)"
  { echo "==== $name rc=$rc"; cat "/tmp/$name.log"; } >> "$OUT/parts.log"  # one file back
  grep -E "shape_e2e:|passed|failed|Error" "/tmp/$name.log" | tail -n 12
  tail -n 12 "/tmp/$name.log"
}

for name in $PARTS; do
  case $name in
    precision) part precision 90 python3 -m pytest -q -p no:cacheprovider \
        tests/sparse_attn/test_scoring_precision.py ;;
    per_layer) part per_layer 260 "${LATENCY[@]}" --config.sections=per_layer,torch_peer,resa \
        "--config.methods=${PER_LAYER_METHODS:-$PER_LAYER}" \
        ${PER_LAYER_CONTEXTS:+"--config.contexts=$PER_LAYER_CONTEXTS"} "${EXTRA[@]}" ;;
    per_layer_mosaic) part per_layer_mosaic 150 python3 -m experiments.latency \
        --config=configs/latency_gpu.py --workdir="$OUT/latency_mosaic" \
        --config.sections=per_layer,torch_peer "--config.methods=${MOSAIC_METHODS}" \
        ${PER_LAYER_CONTEXTS:+"--config.contexts=$PER_LAYER_CONTEXTS"} "${EXTRA[@]}" \
        "${MOSAIC_EXTRA[@]}" ;;
    shape_32k) part shape_32k 220 "${LATENCY[@]}" --config.sections=shape_e2e \
        --config.shape_batches=1 \
        "--config.shape_methods=dense,quest:gqa=group,quest:gqa=group+resa" \
        --config.shape_prefill_methods=dense "${CTX32[@]}" "${EXTRA[@]}" ;;
    shape_128k) part shape_128k 170 "${LATENCY[@]}" --config.sections=shape_e2e \
        --config.shape_batches=1 \
        "--config.shape_methods=dense,quest:gqa=group,quest:gqa=group+resa,quest:gqa=group+resa:fused=false" \
        --config.shape_prefill_methods=dense "${CTX128[@]}" "${EXTRA[@]}" ;;
    prefill_chunk) part prefill_chunk 80 "${LATENCY[@]}" --config.sections=prefill_chunk \
        "${CHUNK_CONTEXTS[@]}" "${EXTRA[@]}" ;;
    decode_sweep) part decode_sweep 170 python3 -m experiments.decode_sweep "${SWEEP[@]}" \
        --out="$OUT/decode_sweep.jsonl" ;;
    sparse_sweep) part sparse_sweep 75 python3 -m experiments.decode_sweep "${SPARSE_SWEEP[@]}" \
        --out="$OUT/decode_sweep.jsonl" ;;
    select_sweep) part select_sweep 60 python3 -m experiments.decode_sweep --contexts= \
        "${SELECT[@]}" --out="$OUT/decode_sweep.jsonl" ;;
    mosaic_sweep) part mosaic_sweep 150 python3 -m experiments.decode_sweep "${MOSAIC_SWEEP[@]}" \
        --out="$OUT/decode_sweep.jsonl" ;;
    profile_128k) part profile_128k 80 python3 -m experiments.profile_step \
        --context="${CTX_SMALL[0]}" --impl=pallas "${PROFILE[@]}" \
        --methods=quest:gqa=group,quest:gqa=group+resa,quest:gqa=group+resa:fused=false,dense ;;
    profile_mosaic) part profile_mosaic 80 python3 -m experiments.profile_step \
        --context="${CTX_SMALL[0]}" --impl=mosaic "${PROFILE[@]}" --methods=dense,quest:gqa=group \
        "${MOSAIC_PROFILE[@]}" ;;
    profile_retro) part profile_retro 60 python3 -m experiments.profile_step \
        --context="${CTX_SMALL[1]}" --impl=pallas "${PROFILE[@]}" --methods="$RETRO_PROFILE" ;;
    profile_32k) part profile_32k 60 python3 -m experiments.profile_step \
        --context="${CTX_SMALL[1]}" --impl=pallas "${PROFILE[@]}" \
        --methods=quest:gqa=group,dense ;;
    flat_decode) part flat_decode 90 bash -c 'for b in 1 8; do python3 -m \
        experiments.flat_decode_bench --batch=$b "$@" --out="$0/flat_decode.jsonl" || exit; \
        done' "$OUT" "${FLAT[@]}" ;;
    profile_e2e) rm -rf /tmp/hlo_e2e
      part profile_e2e 240 env "XLA_FLAGS=--xla_dump_to=/tmp/hlo_e2e --xla_dump_hlo_as_text \
        --xla_dump_hlo_module_re=.*decode_program.*" python3 -m experiments.profile_step \
        --impl=pallas "${PROFILE_E2E[@]}" --methods=dense,quest:gqa=group,quest:gqa=group+resa
      # the optimized programs, so the profile's fusion names can be read back as HLO
      find /tmp/hlo_e2e -name "*decode_program*after_optimizations.txt" 2>/dev/null \
        | tar czf "$OUT/hlo_e2e.tgz" -T - ;;
    *) echo "unknown part: $name"; exit 2 ;;
  esac
done
rm -f "$OUT"/latency_*/latency.png  # re-rendered here; the device tool brings back 8 files
