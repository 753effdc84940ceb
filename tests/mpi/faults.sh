#!/usr/bin/env bash
# faults.sh - a rank that hangs, stops or dies, and a send/receive size mismatch, each end the whole job
# non-zero within a bound, with a message naming the rank, the operation and the group
# (tests/mpi/fault_worker.c does the faults; the timeout is 2 s). Run from the repository root.
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
failures=0
# expect NAME NP LIMIT_S PATTERN MODE: the job must exit non-zero within LIMIT_S seconds, its output matching PATTERN
expect() {
  local name=$1 np=$2 limit=$3 pattern=$4 mode=$5 out rc t0 dt
  out=$(mktemp)
  t0=$(date +%s.%N)
  timeout 60 "${MPIRUN[@]}" -np "$np" "$BUILD/mpi/fault_worker" "$mode" 2 >"$out" 2>&1
  rc=$?
  dt=$(echo "$(date +%s.%N) - $t0" | bc)
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || ! grep -Eq -- "$pattern" "$out" || [ "$(echo "$dt > $limit" | bc)" = 1 ]; then
    echo "FAIL: $name: exit $rc after ${dt} s (expected non-zero within $limit s and a line matching: $pattern)"
    sed 's/^/    /' "$out" | head -30
    failures=$((failures + 1))
  else
    echo "ok: $name: exit $rc after $(printf '%.1f' "$dt") s: $(grep -Eo -m1 -- "$pattern.*" "$out" | cut -c1-160)"
  fi
  rm -f "$out"
}
expect "a rank sleeps past the timeout in a barrier" 3 10 \
  "fp8moe: rank [01]: comm_barrier on group dp \(size 3\) timed out after 2(\.[0-9]+)? s - nothing yet from world rank\(s\) 2 " sleep
expect "a rank stopped by SIGSTOP" 2 10 \
  "fp8moe: rank 0: comm_allreduce_sum_double on group dp \(size 2\) timed out after 2(\.[0-9]+)? s - (nothing yet from )?world rank\(s\) 1( |;)" stop
expect "a rank killed by SIGKILL" 2 10 "process rank 1 .*(signal 9|Killed)" kill
expect "a receive longer than the message" 2 10 \
  "fp8moe: rank 1: comm_recv_bytes on group dp \(size 2, rank 1 there\): received 8 bytes from rank 0, expected 16" mismatch
expect "a receive shorter than the message" 2 10 \
  "fp8moe: rank 1: comm_recv_bytes on group dp \(size 2, rank 1 there\): .*(truncat|TRUNCATE)" truncate
echo "faults: $([ $failures = 0 ] && echo passed || echo "FAILED ($failures)")"
[ "$failures" -eq 0 ]
