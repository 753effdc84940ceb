#!/usr/bin/env bash
# tests/gpu/compare_study.sh - issue 22's GPU comparison of FP8 against BF16 (and BF16 against FP32):
# `fp8moe compare configs/compare-110m.ini` over seeds, with the null arm, on the corpus of scripts/corpus.sh.
# docs/fp8.md ("Measuring FP8 against BF16") gives the method, docs/benchmarks.md the results.
#
#   bash tests/gpu/compare_study.sh [extra fp8moe compare arguments]
#   e.g. STUDY_DIR=runs/fork500 bash tests/gpu/compare_study.sh --fork 500   (the resolving form, docs/fp8.md)
#
# Environment:
#   BUILD      build directory (default build-gpu; fp8moe is (re)built there with tests/gpu/run.sh BUILD_ONLY=1)
#   SHARDS     the corpus's shards (default data/prepared/debian-docs/shards, what scripts/corpus.sh writes). When
#              they are missing and CORPUS_XZ (default .gpudata/corpus.txt.xz) exists, that file - scripts/corpus.sh's
#              corpus.txt, compressed with xz to carry it to a GPU machine that lacks the Debian packages - is
#              unpacked and prepared with `fp8moe prep` (the same bytes, so the same shards).
#   STUDY_DIR  the comparison's directory (default runs/cmp110m; `--resume` keeps its finished runs)
#   MODES      default bf16,fp8,fp32 (the first is the baseline of every gap and of the null arm)
#   SEEDS      default 3;  JOBS: runs at once on the GPU (default 1)
#   NULL=0     leave out the null arm (default 1: --null), e.g. to add one mode's arm to a seed whose null arm exists
#   PROBE=1    instead of the study, time 30 steps of each mode alone and then JOBS fp8 runs side by side
#   STUDY_TIMEOUT  if set, compare is interrupted (SIGINT: no new run starts, the running ones stop) after so many
#              seconds, so that the copy to $OUT below still happens inside a device call's time limit
#   STUDY_DEADLINE the same as an absolute time (seconds since the epoch, e.g. $(( $(date +%s) + 560 )) at the
#              start of a device call), so that the build and the corpus's preparation come out of the same budget
#   OUT        if set, the runs' metrics, logs and job files and the summary are copied to $OUT/cmp110m
# Exit status: that of fp8moe compare (0 when every run finished), or 1 when the build or the data fails.
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
SHARDS=${SHARDS:-data/prepared/debian-docs/shards}
CORPUS_XZ=${CORPUS_XZ:-.gpudata/corpus.txt.xz}
STUDY_DIR=${STUDY_DIR:-runs/cmp110m}
MODES=${MODES:-bf16,fp8,fp32} SEEDS=${SEEDS:-3} JOBS=${JOBS:-1}
NULL_ARG=--null; [ "${NULL:-1}" = 0 ] && NULL_ARG=
say() { echo "compare_study: $(date -u +%H:%M:%S) $*"; }

# always through run.sh: make is incremental, and run.sh unpacks the .debs libraries the binary is linked against
say "building $BUILD/fp8moe"
BUILD=$BUILD MAKE_GOALS=$BUILD/fp8moe BUILD_ONLY=1 SKIP_CPU_TESTS=1 bash tests/gpu/run.sh > /tmp/compare_study_build.log 2>&1 ||
  { tail -30 /tmp/compare_study_build.log; say "FAIL: the build failed"; exit 1; }
if [ ! -s "$SHARDS/bytes_train_000000.bin" ]; then
  [ -f "$CORPUS_XZ" ] || { say "FAIL: no shards in $SHARDS and no $CORPUS_XZ: run scripts/corpus.sh first"; exit 1; }
  corpus_dir=$(dirname "$SHARDS")
  mkdir -p "$corpus_dir"
  say "unpacking $CORPUS_XZ into $corpus_dir/corpus.txt and preparing it"
  xz -dc "$CORPUS_XZ" > "$corpus_dir/corpus.txt" && "$BUILD/fp8moe" prep --text "$corpus_dir/corpus.txt" --out "$SHARDS" ||
    { say "FAIL: preparing the corpus"; exit 1; }
fi
say "corpus: $(stat -c %s "$(dirname "$SHARDS")/corpus.txt" 2>/dev/null || echo '?') bytes; sha256 $(sha256sum "$SHARDS/bytes_train_000000.bin" | cut -c1-16) (train shard)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

if [ "${PROBE:-0}" = 1 ]; then
  probe() {  # probe NAME MODE
    "$BUILD/fp8moe" train configs/compare-110m.ini --set precision.mode="$2" --set train.steps=30 --set train.eval_every=0 \
      --set log.every=10 --set checkpoint.dir="runs/probe-$1" --set data.shards="$SHARDS" > "runs/probe-$1.log" 2>&1
    echo "probe $1 ($2): exit $? | $(grep -E '^step 30/' "runs/probe-$1.log") | $(grep -E '^done' "runs/probe-$1.log")"
  }
  mkdir -p runs
  IFS=, read -r -a modes <<< "$MODES"
  for m in "${modes[@]}"; do probe "$m" "$m"; done
  start=$(date +%s)
  for j in $(seq 1 "$JOBS"); do probe "fp8-side$j" fp8 & done
  wait
  say "$JOBS fp8 runs side by side: $(( $(date +%s) - start )) s in all"
  exit 0
fi

if [ -n "${STUDY_DEADLINE:-}" ]; then
  STUDY_TIMEOUT=$(( STUDY_DEADLINE - $(date +%s) ))
  [ "$STUDY_TIMEOUT" -gt 0 ] || { say "FAIL: STUDY_DEADLINE has passed before the comparison started"; exit 1; }
fi
say "fp8moe compare configs/compare-110m.ini --modes $MODES --seeds $SEEDS $NULL_ARG --jobs $JOBS --resume --no-plot --out $STUDY_DIR $*"
${STUDY_TIMEOUT:+timeout -s INT -k 30 "$STUDY_TIMEOUT"} "$BUILD/fp8moe" compare configs/compare-110m.ini --modes "$MODES" --seeds "$SEEDS" $NULL_ARG --jobs "$JOBS" --resume --no-plot \
  --out "$STUDY_DIR" --set data.shards="$SHARDS" "$@"
rc=$?
say "compare exit $rc"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/cmp110m"
  (cd "$STUDY_DIR" && find . -maxdepth 2 \( -name metrics.jsonl -o -name train.log -o -name compare-job.ini -o -name 'compare*.csv' \
    -o -name summary.txt \) -print0 | xargs -0 -r cp --parents -t "$OUT/cmp110m")
fi
exit $rc
