#!/usr/bin/env bash
# Runs every CPU test binary in $BUILD/tests (CMocka unit tests) and the script tests in tests/unit/*.sh,
# then prints one summary line "N passed, N failed". Exit status is non-zero if anything failed.
set -u
BUILD=${BUILD:-build}
export FP8MOE_BUILD=$BUILD
# Every test reads only files of the repository, files `scripts/deps.sh` installs, or files it makes. The
# text the tests train on is tests/data/shakespeare.txt (tests/data/README.md), which each test names
# itself. tests/unit/no_outside_files.sh checks that no test reaches outside the checkout.
passed=0; failed=0; failed_names=()
for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  case "$(basename "$t")" in test_gpu_*) continue;; esac
  echo "== $t"
  if "$t"; then passed=$((passed+1)); else failed=$((failed+1)); failed_names+=("$t"); fi
done
for s in tests/unit/*.sh; do
  [ -f "$s" ] || continue
  echo "== $s"
  if bash "$s"; then passed=$((passed+1)); else failed=$((failed+1)); failed_names+=("$s"); fi
done
[ ${#failed_names[@]} -gt 0 ] && printf 'FAILED: %s\n' "${failed_names[@]}"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
