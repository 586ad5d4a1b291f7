#!/usr/bin/env bash
# The GPU checks of one 15-minute device lease, in one command, each part under its own timeout.
#
#   bash experiments/gpu_session.sh            # on the lent GPU (the device tool's `run`,
#                                              # carry=[".whl"], timeout_s ~590)
#   QUICK=1 bash experiments/gpu_session.sh    # the same parts on a CPU, tiny shapes (a rehearsal)
#
# Parts, cheapest first, so a short lease still brings back the most important numbers:
#   1. precision: Pallas vs XLA selections and outputs of quest:gqa=group at 8k, 32/8 heads,
#      compiled (tests/sparse_attn/test_scoring_precision.py; its GPU-only case);
#   2. per_layer: one Llama-3.1-8B attention layer at 8k/32k/128k, dense (split-K Pallas and
#      XLA), Quest p = 0.1, +RESA, rectified, next to torch SDPA;
#   3. prefill_chunk: one layer's 4096-query dense prefill chunk at 32k / 128k, chunk_attention's
#      kernel vs its in-order branch (cuDNN flash attention), the GPU default;
#   4. shape_e2e: a random-weight Llama-3.1-8B end to end at batch 1 (32k, 128k), dense, Quest,
#      +RESA, next to transformers, with each row's fraction of the bandwidth bound.
# Records go under $OUT (the device tool's output folder; /tmp/gpu_session elsewhere); commit
# them under results/latency_gpu with `python -m experiments.merge`. The image lacks
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
LIMITS=(100 180 80 220)
EXTRA=()
CHUNK_CONTEXTS=(--config.contexts=32768,131072)
if [ "$QUICK" = 1 ]; then
  CHUNK_CONTEXTS=()
  LIMITS=(300 300 300 300)
  EXTRA=(--config.quick=True)
fi

part() {  # part NAME LIMIT_S COMMAND...: runs it, reports rc and seconds, shows its tail
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name (limit ${limit}s)"
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc ($(( $(date +%s) - start )) s; 124 = timed out)"
  tail -n 25 "$OUT/$name.log"
}

part precision "${LIMITS[0]}" python3 -m pytest -q -p no:cacheprovider \
  tests/sparse_attn/test_scoring_precision.py
part per_layer "${LIMITS[1]}" python3 -m experiments.latency --config=configs/latency_gpu.py \
  --workdir="$OUT/latency_gpu" --config.sections=per_layer,torch_peer \
  "--config.methods=dense,dense:impl=xla,quest:gqa=group,quest:gqa=group+resa,rectified" \
  "${EXTRA[@]}"
part prefill_chunk "${LIMITS[2]}" python3 -m experiments.latency --config=configs/latency_gpu.py \
  --workdir="$OUT/latency_gpu" --config.sections=prefill_chunk \
  "${CHUNK_CONTEXTS[@]}" "${EXTRA[@]}"
part shape_e2e "${LIMITS[3]}" python3 -m experiments.latency --config=configs/latency_gpu.py \
  --workdir="$OUT/latency_gpu" --config.sections=shape_e2e --config.shape_batches=1 \
  "--config.shape_methods=dense,quest:gqa=group,quest:gqa=group+resa" "${EXTRA[@]}"
