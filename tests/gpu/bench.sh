#!/usr/bin/env bash
# tests/gpu/bench.sh - the H200 benchmarks in one go, after tests/gpu/run.sh has built $BUILD (default
# build-gpu): `fp8moe bench step` on configs/bench-1gpu.ini (MTP off, as issue 4's comparison point)
# and, with BENCH_GEMM=1, `fp8moe bench gemm`. Extra arguments go to bench step (e.g. --set
# train.micro_batch_size=4). Logs to $OUT/bench.log when OUT is set. See docs/gpu.md.
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; exec > >(tee -a "$OUT/bench.log") 2>&1; fi
. tests/gpu/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
"$BUILD/fp8moe" bench step configs/bench-1gpu.ini --set mtp.depth=0 \
  --set data.text="${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}" "$@"
if [ "${BENCH_GEMM:-0}" = 1 ]; then "$BUILD/fp8moe" bench gemm; fi
