#!/usr/bin/env bash
# nccl.sh - the NCCL backend of parallel/comm.h (parallel/comm_nccl.c) under mpirun: $BUILD/tests/test_gpu_nccl on one
# rank per GPU of this machine (every collective and message against the MPI backend, bitwise; one rank on a one-GPU
# machine, where comm_nccl_force_for_tests sends the group of one through NCCL), then the jobs that must end, each
# within 30 s with its exit status and a line naming the rank, the operation and the group: a receive of another
# size than was sent (exit 3), an all-reduce whose NCCL work cannot finish within a 2 s timeout (exit 4), with two
# GPUs or more an all-reduce of different counts on two ranks (exit 3), and two ranks on one GPU, which NCCL cannot
# serve (exit 3). tests/gpu/run.sh runs it after building; needs Open MPI's mpirun. NCCL_NVLS_ENABLE=0 always.
set -u
BUILD=${BUILD:-build-gpu}
BIN=$BUILD/tests/test_gpu_nccl
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
if ! command -v mpirun >/dev/null 2>&1; then echo "nccl: FAIL: mpirun not found (Open MPI's openmpi-bin)"; exit 1; fi
if [ ! -x "$BIN" ]; then echo "nccl: FAIL: $BIN was not built (a CUDA build with NCCL: see make's 'fp8moe: ... NCCL' line)"; exit 1; fi
MPIRUN=(mpirun --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH)
n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
n_gpus=${n_gpus:-0}
fail=0

echo "== test_gpu_nccl on $n_gpus rank(s), one GPU each"
t0=$SECONDS
if ! timeout 300 "${MPIRUN[@]}" -np "$n_gpus" "$BIN"; then echo "FAIL: test_gpu_nccl -np $n_gpus"; fail=1; fi
echo "   ($((SECONDS - t0)) s)"

# expect NAME NP STATUS PATTERN MODE: the job must exit STATUS within 30 s, its output matching PATTERN
expect() {
  local name=$1 np=$2 status=$3 pattern=$4 mode=$5 out rc t1
  out=$(mktemp)
  t1=$(date +%s.%N)
  timeout 60 "${MPIRUN[@]}" -np "$np" "$BIN" "$mode" >"$out" 2>&1
  rc=$?
  local dt
  dt=$(awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -ne "$status" ] || ! grep -Eq -- "$pattern" "$out" || awk -v t="$dt" 'BEGIN { exit !(t > 30) }'; then
    echo "FAIL: $name: exit $rc after $dt s (expected exit $status within 30 s and a line matching: $pattern)"
    sed 's/^/    /' "$out" | head -30
    fail=1
  else
    echo "ok: $name: exit $rc after $dt s: $(grep -Eo -m1 -- "fp8moe: rank .*" "$out" | cut -c1-260)"
  fi
  rm -f "$out"
}
expect "a receive of 200 bytes for a message of 100" 1 3 \
  "fp8moe: rank 0: comm_recv_bytes on group world \(size 1, rank 0 there\): the message from rank 0 \(world rank 0, tag 3\) has 100 bytes, expected 200" mismatch
expect "an all-reduce behind an 8 s stall, 2 s timeout" 1 4 \
  "fp8moe: rank 0: comm_allreduce_sum_real on group world \(size 1\) timed out after 2 s" timeout
if [ "$n_gpus" -ge 2 ]; then
  expect "all-reduces of 10 and 11 elements" 2 3 \
    "comm_allreduce_sum_real on group world \(size 2, rank [01] there\): world rank [01] passed n = 1[01], this rank n = 1[01]" collective
fi
expect "two ranks on one GPU" 2 3 \
  "comm_nccl_dup on group world \(size 2, rank [01] there\): world ranks 0 and 1 both use GPU 0 .* - parallel.backend = nccl needs one GPU per rank; use backend = mpi to share a GPU" shared-gpu
echo "nccl: $([ $fail = 0 ] && echo passed || echo FAILED)"
exit $fail
