#!/usr/bin/env bash
# run_large.sh - make test-mpi-large: EP64 (issue 19, "Done when"). 64 CPU ranks under
# `mpirun --oversubscribe` train one step of configs/tiny.ini with 64 routed experts in 8 expert groups,
# dp = 64, ep = 64 (one expert per rank), micro-batch 4 x 32 tokens per rank, grad_accum 1, and
# tests/mpi/test_parallel_equivalence checks the loss and every gradient against one process that trains the same
# global batch (256 x 32 tokens) in one micro-batch. tiny.ini's moe.n_limited_groups = 2 fits 8 groups.
# Not part of `make test`: 64 processes on CI's 2 cores take ~10 s, but start-up under ASan and the memory
# of 64 ranks (~4 GB) are more than the default suite should ask for.
#   FP8MOE_LARGE_MODES  precision modes to run (default fp32; e.g. "fp32 bf16 fp8")
#   FP8MOE_LARGE_RANKS  ranks = dp = ep (default 64; must divide 64 experts)
# Prints the test's result line and the wall time of each run; exit status non-zero if one failed. Each
# mpirun has a 600 s limit. Run from the repository root; BUILD names the build directory (default build).
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
N=${FP8MOE_LARGE_RANKS:-64}
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
failed=0
for mode in ${FP8MOE_LARGE_MODES:-fp32}; do
  cmd=("${MPIRUN[@]}" -np "$N" -x OMP_NUM_THREADS=1 "$BUILD/mpi/test_parallel_equivalence" "$mode" "$cache" 1 4 1 "$N" 64 8)
  echo "== ${cmd[*]}"
  t0=$(date +%s.%N)
  timeout 600 "${cmd[@]}"; rc=$?
  printf '   (%s: exit %d, %.1f s)\n' "$mode" "$rc" "$(echo "$(date +%s.%N) - $t0" | bc)"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
done
echo "mpi-large: $([ $failed = 0 ] && echo passed || echo "FAILED ($failed)")"
[ "$failed" -eq 0 ]
