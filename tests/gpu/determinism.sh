#!/usr/bin/env bash
# tests/gpu/determinism.sh - issue 4's bitwise check at full size: the same job trained twice on the GPU
# for STEPS steps (default 5) of configs/bench-1gpu.ini (as written: fp8, MTP depth 1, 2 x 8 x 2048
# tokens per step) must log bitwise-identical losses and gradient norms. Needs $BUILD (default build-gpu).
# With OUT set, the first run's metrics.jsonl is kept as $OUT/determinism_metrics.jsonl, or, when extra arguments
# are given, as $OUT/determinism_metrics_<the arguments, as a file name>.jsonl (so a bf16 run does not overwrite
# the fp8 run's file).
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu} STEPS=${STEPS:-5}
. tests/gpu/env.sh
TMP=$(mktemp -d)
for run in a b; do
  "$BUILD/fp8moe" train configs/bench-1gpu.ini --set train.steps="$STEPS" --set train.eval_every=0 \
    --set log.every=1 --set checkpoint.dir="$TMP/$run" "$@" \
    --set data.text="${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}" > "$TMP/$run.log" 2>&1 \
    || { echo "determinism: run $run failed:"; tail -5 "$TMP/$run.log"; exit 1; }
  grep -E '^step ' "$TMP/$run.log" | tail -n "$STEPS"
done
if [ -n "${OUT:-}" ]; then  # to compare with other builds
  mkdir -p "$OUT"
  tag=$(printf '%s' "$*" | tr -c 'A-Za-z0-9.' '_' | sed 's/^_*//')
  cp "$TMP/a/metrics.jsonl" "$OUT/determinism_metrics${tag:+_$tag}.jsonl"
fi
python3 tests/gpu/same_metrics.py determinism "$TMP/a/metrics.jsonl" "$TMP/b/metrics.jsonl" "$STEPS"
