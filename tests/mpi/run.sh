#!/usr/bin/env bash
# run.sh - the MPI tests (make test-mpi): tests/mpi/test_comm and test_groups under mpirun on 1, 2, 3, 4 and 8
# ranks, test_comm once more as an MPI singleton (no mpirun: the way `fp8moe` runs as one process), then
# the fault tests (tests/mpi/faults.sh). Prints one summary line "mpi: N passed, N failed"; exit status is
# non-zero if anything failed. Each mpirun has a 120 s limit, so a hang fails the test instead of CI.
# Run from the repository root; BUILD names the build directory (default build).
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
passed=0; failed=0; failed_names=()
run() {  # run NAME COMMAND...
  local name=$1; shift
  echo "== $name"
  local t0=$SECONDS
  if timeout 120 "$@"; then
    passed=$((passed+1)); echo "   ($((SECONDS - t0)) s)"
  else
    failed=$((failed+1)); failed_names+=("$name")
  fi
}
start=$SECONDS
run "test_comm singleton" "$BUILD/mpi/test_comm"
for n in ${FP8MOE_MPI_RANKS:-1 2 3 4 8}; do
  run "test_comm -np $n" "${MPIRUN[@]}" -np "$n" "$BUILD/mpi/test_comm"
  run "test_groups -np $n" "${MPIRUN[@]}" -np "$n" "$BUILD/mpi/test_groups"
done
run "faults.sh" bash tests/mpi/faults.sh
[ ${#failed_names[@]} -gt 0 ] && printf 'FAILED: %s\n' "${failed_names[@]}"
echo "mpi: $passed passed, $failed failed ($((SECONDS - start)) s)"
[ "$failed" -eq 0 ]
