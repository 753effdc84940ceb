# lib.sh - sourced by the shell tests (tests/unit/*.sh, tests/mpi/bench_step.sh): the binary under test, a scratch directory that is
# removed on exit, and the checks the tests share, so that every test reports a failure the same way.
#   test_begin NAME              BIN=$FP8MOE_BUILD/fp8moe (else $BUILD/, else build/; the test fails at once if it is not
#                                built), TMP=a fresh /tmp/fp8moe_NAME_XXXXXX (removed at exit), failures=0
#   fail MSG, pass MSG           "FAIL: MSG" (counted) or "ok: MSG"
#   run NAME STATUS CMD...       CMD's stdout and stderr into $TMP/NAME.out and .err; a failure unless it
#                                exits with STATUS (returns 1 then, with the end of its stderr shown)
#   has NAME SUFFIX RE           a failure unless $TMP/NAME.SUFFIX matches the extended regex RE; lacks: the opposite
#   expect_usage CMD WORD ARGS...  `fp8moe CMD ARGS...` must exit 2 (bad usage) with WORD in its stderr
#   test_end                     prints "NAME: passed" or "NAME: N failure(s)"; exit status 0 or 1
# Run the tests from the repository root.
test_begin() {
  TEST_NAME=$1
  BIN=${FP8MOE_BUILD:-${BUILD:-build}}/fp8moe
  if [ ! -x "$BIN" ]; then echo "FAIL: $BIN not built"; exit 1; fi
  TMP=$(mktemp -d "/tmp/fp8moe_${TEST_NAME%.sh}_XXXXXX")
  trap 'rm -rf "$TMP"' EXIT
  failures=0
}
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }
run() {
  local name=$1 want=$2; shift 2
  "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"
  local got=$?
  if [ "$got" -ne "$want" ]; then
    fail "$name: exit status $got, expected $want"; sed 's/^/  | /' "$TMP/$name.err" | tail -5; return 1
  fi
  return 0
}
has() { grep -Eq -- "$3" "$TMP/$1.$2" || { fail "$1: $2 lacks /$3/"; sed 's/^/  | /' "$TMP/$1.$2" | tail -5; return 1; }; }
lacks() { ! grep -Eq -- "$3" "$TMP/$1.$2" || { fail "$1: $2 has /$3/"; return 1; }; }
expect_usage() {
  local cmd=$1 word=$2; shift 2
  "$BIN" "$cmd" "$@" >"$TMP/usage.out" 2>"$TMP/usage.err"
  local rc=$?
  if [ "$rc" -ne 2 ] || ! grep -qF -- "$word" "$TMP/usage.err"; then
    fail "fp8moe $cmd $*: expected exit status 2 and '$word' in the message; got $rc:"; sed 's/^/  | /' "$TMP/usage.err"
  fi
}
test_end() {
  if [ "$failures" -ne 0 ]; then echo "$TEST_NAME: $failures failure(s)"; exit 1; fi
  echo "$TEST_NAME: passed"
  exit 0
}
