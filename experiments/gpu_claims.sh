#!/usr/bin/env bash
# The papers' efficiency claims on one GPU (issue 51 items 3-6): prepare here, run there.
#
#   bash experiments/gpu_claims.sh prepare     # here, on a committed tree: ml_collections' wheel
#                                              # and the revision's manifest into .whl/ (ignored);
#                                              # prints the variables the run needs
#   EXPERIMENT_REVISION=<sha> EXPERIMENT_TREE_HASH=<hash> bash experiments/gpu_claims.sh
#                                              # on the lent GPU: the device tool's `run`,
#                                              # carry=[".whl"], timeout_s=590
#   QUICK=1 bash experiments/gpu_claims.sh     # the same on a CPU, tiny shapes (a rehearsal)
#
# What runs: python -m experiments.latency --config=configs/latency_gpu_claims.py (its docstring
# lists the plan's items, in priority order, with estimated seconds), records into
# $OUT/gpu_claims; no part starts after DEADLINE seconds (480) and the whole run stops at TOTAL
# (560). Before anything is timed, `python -m experiments.common.provenance check` compares
# every file of the revision's manifest with the copy that travelled and refuses (exit 2/3) a
# stale manifest or a run that imports a file that is not the revision's; with
# ALLOW_UNVERIFIED=1 such records are kept as REV+unverified (the claims mark them). Every record
# carries the session id (EXPERIMENT_SESSION) and the claims pair parts only within one session.
# Resume: the items the committed records (RESUME, default results/gpu_claims/results.jsonl; none
# with QUICK=1) hold complete from one session are seeded into the workdir, so the next session
# runs the rest; RESUME= (empty) seeds nothing, so every item reruns at this revision (after a
# kernel change: seeded items keep the revision they were timed at).
# Back here: copy $OUT/gpu_claims/results.jsonl to results/gpu_claims/ and regenerate the report
# (python -m experiments.claims --workdir=results), from a clean tree.
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = "prepare" ]; then
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
  mkdir -p .whl
  ls .whl/ml_collections-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .whl ml_collections==1.1.0 || exit 1
  VARS=$(python3 -m experiments.common.provenance prepare --out .whl/tree_manifest.json) || exit 1
  echo "run(command=\"$VARS bash experiments/gpu_claims.sh\", carry=[\".whl\"], timeout_s=590)"
  exit 0
fi

OUT=${OUT:-/tmp/gpu_claims}
WORK="$OUT/gpu_claims"
mkdir -p "$WORK"
EXTRA=()
if [ "${QUICK:-0}" = 1 ]; then
  EXTRA=(--config.quick=True)
elif ! python3 -c "import ml_collections" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/ml_collections-*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "${EXPERIMENT_TREE_HASH:-}" ] && [ "${QUICK:-0}" != 1 ] && [ "${ALLOW_UNVERIFIED:-0}" != 1 ]; then
  echo "refused: no EXPERIMENT_TREE_HASH (run 'bash experiments/gpu_claims.sh prepare' here" \
       "first), or ALLOW_UNVERIFIED=1 for records of a declared revision at most" >&2
  exit 2
fi
[ "${ALLOW_UNVERIFIED:-0}" = 1 ] && export EXPERIMENT_ALLOW_UNVERIFIED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export EXPERIMENT_SESSION=${EXPERIMENT_SESSION:-$(date -u +%Y%m%dT%H%M%SZ)-$$}
export EXPERIMENT_MANIFEST=${EXPERIMENT_MANIFEST:-.whl/tree_manifest.json}
python3 -m experiments.common.provenance check --imports=configs.latency_gpu_claims,\
experiments.latency_lib.runner,experiments.latency_lib.shape_ours,experiments.latency_lib.breakdown \
  2>&1 | tee "$OUT/provenance.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || exit "$rc"
# A quick rehearsal's tiny config never matches the committed records: it seeds none by default.
[ "${QUICK:-0}" = 1 ] && DEFAULT_RESUME="" || DEFAULT_RESUME=results/gpu_claims/results.jsonl
RESUME=${RESUME-$DEFAULT_RESUME}
[ -n "$RESUME" ] && [ -f "$RESUME" ] && python3 -m experiments.latency_lib.paper_runs seed "$RESUME" "$WORK"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout "${TOTAL:-560}" python3 -m experiments.latency --config=configs/latency_gpu_claims.py \
  --workdir="$WORK" "--config.paper_deadline_s=${DEADLINE:-480}" "${EXTRA[@]}" \
  > "$OUT/run.log" 2>&1
rc=$?
echo "== latency rc=$rc (124 = stopped at TOTAL)"
grep -E "shape_e2e:|paper:|Error|refused" "$OUT/run.log" | tail -n 40
exit "$rc"
