#!/usr/bin/env bash
# tests/gpu/session.sh - one device call's worth of GPU work, for sessions whose device minutes are few:
# build once (tests/gpu/run.sh BUILD_ONLY=1), then the GPU tests (tests/gpu/run.sh, CPU unit tests
# skipped: CI runs them) and the step benchmark (tests/gpu/bench.sh). With two or more GPUs the two run at
# the same time, tests on GPU 0 and the benchmark on GPU 1; they share the host's CPUs, so say so when
# quoting those benchmark numbers (one GPU: one after the other). Logs go to $OUT/gpu_tests.log (build
# and tests) and $OUT/bench.log ($OUT: a new temporary folder when unset). Exit status: that of the
# tests, or of the benchmark if the tests passed. Extra arguments go to bench.sh.
set -u -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 SKIP_CPU_TESTS=1
if [ -z "${OUT:-}" ]; then export OUT=$(mktemp -d); echo "session: logs in $OUT"; fi
BUILD_ONLY=1 bash tests/gpu/run.sh > /dev/null 2>&1 || { tail -30 "$OUT/gpu_tests.log"; exit 1; }
n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${n_gpus:-0}" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 bash tests/gpu/run.sh > /dev/null 2>&1 & tests=$!
  CUDA_VISIBLE_DEVICES=1 bash tests/gpu/bench.sh "$@" > /dev/null 2>&1; bench_rc=$?
  wait $tests; tests_rc=$?
else
  bash tests/gpu/run.sh > /dev/null 2>&1; tests_rc=$?
  bash tests/gpu/bench.sh "$@" > /dev/null 2>&1; bench_rc=$?
fi
echo "session: GPU tests exit $tests_rc, benchmark exit $bench_rc ($n_gpus GPUs)"
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$bench_rc"
