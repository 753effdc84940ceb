#!/usr/bin/env bash
# run_outputs.sh - a training run never loses its result, or another file, to its outputs (issue 17,
# "Ways to lose a run"): every output location is checked before the first step (a read-only
# checkpoint.dir, log.jsonl = /dev/full, log.jsonl naming the job file), a write error in the middle of
# the run still saves the weights, a second live run on the same directory or metrics file is refused,
# a finished run's files are kept as *.prev instead of replaced without a word, a killed run's temp
# file is removed by the next run, the first Ctrl-C stops an evaluation, and a second Ctrl-C during the
# save neither stops the save nor leaves a temp file.
#
# Trains configs/tiny.ini on tests/data/shakespeare.txt with one thread; the evaluation case uses
# configs/shakespeare.ini, whose full validation pass takes seconds. The read-only directory is a
# read-only bind mount when this runs as root (CI), else a directory without write permission (which
# root would ignore). The mid-run write error comes from RLIMIT_FSIZE (ulimit -f with SIGXFSZ ignored,
# so a write past the limit fails with EFBIG), set between the weights file's size and the size the
# metrics file reaches. Run from the repository root; uses $FP8MOE_BUILD/fp8moe (default build/).
set -u
BIN=${FP8MOE_BUILD:-build}/fp8moe
TEXT=tests/data/shakespeare.txt
TMP=$(mktemp -d /tmp/fp8moe_outputs_XXXXXX)
MNT=""
cleanup() {
  [ -n "$MNT" ] && umount "$MNT" 2>/dev/null
  jobs -p | xargs -r kill -9 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }
[ -x "$BIN" ] || { echo "FAIL: $BIN not built"; exit 1; }
[ -f "$TEXT" ] || { echo "FAIL: $TEXT missing"; exit 1; }

COMMON=(--set data.text="$TEXT" --set data.cache_dir="$TMP/cache" --set train.threads=1)
# (tiny runs in the foreground; a background run calls "$BIN" itself, so that $! is its pid)
tiny() { "$BIN" train configs/tiny.ini "${COMMON[@]}" "$@"; }
# wait_for FILE PATTERN SECONDS: polls until FILE has a line matching PATTERN; returns 1 on timeout
wait_for() {
  local i
  for ((i = 0; i < $3 * 20; i++)); do
    grep -Eq -- "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}
trained() { grep -Eq '^step 1/' "$1"; }

# Prepare the shards once, so every later run starts training at once.
tiny --set train.steps=1 --set checkpoint.dir="$TMP/first" >"$TMP/first.log" 2>&1 \
  || { echo "FAIL: the first run failed:"; tail -5 "$TMP/first.log"; exit 1; }

# ---- a read-only checkpoint.dir (log.jsonl elsewhere) is refused before the first step
RO="$TMP/ro"
mkdir -p "$RO"
if [ "$(id -u)" -eq 0 ]; then
  MNT=$RO
  mount --bind "$RO" "$RO" && mount -o remount,bind,ro "$RO" || { echo "FAIL: cannot make a read-only bind mount"; exit 1; }
  tiny --set checkpoint.dir="$RO" --set log.jsonl="$TMP/ro_metrics.jsonl" >"$TMP/ro.log" 2>&1; rc=$?
else
  chmod 555 "$RO"
  tiny --set checkpoint.dir="$RO" --set log.jsonl="$TMP/ro_metrics.jsonl" >"$TMP/ro.log" 2>&1; rc=$?
fi
if [ "$rc" -eq 1 ] && grep -q "checkpoint.dir: $RO" "$TMP/ro.log" && ! trained "$TMP/ro.log"; then
  pass "read-only checkpoint.dir refused before training: $(grep -m1 'checkpoint.dir:' "$TMP/ro.log")"
else
  fail "read-only checkpoint.dir: exit $rc (expected 1, before any step)"; tail -3 "$TMP/ro.log"
fi
[ -n "$MNT" ] && umount "$MNT" && MNT=""

# ---- log.jsonl = /dev/full is refused before the first step
tiny --set checkpoint.dir="$TMP/full" --set log.jsonl=/dev/full >"$TMP/devfull.log" 2>&1; rc=$?
if [ "$rc" -eq 1 ] && grep -q 'log.jsonl: /dev/full' "$TMP/devfull.log" && ! trained "$TMP/devfull.log"; then
  pass "log.jsonl = /dev/full refused before training"
else
  fail "log.jsonl = /dev/full: exit $rc (expected 1, before any step)"; tail -3 "$TMP/devfull.log"
fi

# ---- log.jsonl naming an existing file that is not a metrics file: refused, the file untouched
cp configs/tiny.ini "$TMP/job.ini"
tiny --set checkpoint.dir="$TMP/job" --set log.jsonl="$TMP/job.ini" >"$TMP/job.log" 2>&1; rc=$?
if [ "$rc" -eq 1 ] && cmp -s configs/tiny.ini "$TMP/job.ini" && grep -q 'not an fp8moe metrics file' "$TMP/job.log"; then
  pass "log.jsonl naming the job file refused, the file unchanged"
else
  fail "log.jsonl = a job file: exit $rc, file unchanged: $(cmp -s configs/tiny.ini "$TMP/job.ini" && echo yes || echo no)"
fi
cp "$TMP/first/weights.h5" "$TMP/w.h5"
tiny --set checkpoint.dir="$TMP/wj" --set log.jsonl="$TMP/w.h5" >"$TMP/wj.log" 2>&1; rc=$?
if [ "$rc" -eq 1 ] && cmp -s "$TMP/first/weights.h5" "$TMP/w.h5"; then
  pass "log.jsonl naming a weights file refused, the file unchanged"
else
  fail "log.jsonl = a weights file: exit $rc"
fi

# ---- a write error mid-run (the metrics file passes RLIMIT_FSIZE) still saves the weights
wsize_kb=$(( $(stat -c %s "$TMP/first/weights.h5") / 1024 + 64 ))
( trap '' XFSZ; ulimit -f "$wsize_kb"; exec "$BIN" train configs/tiny.ini "${COMMON[@]}" \
    --set checkpoint.dir="$TMP/midrun" --set train.steps=100000 --set log.every=100000 --set train.eval_every=0 \
    --set train.micro_batch_size=1 --set train.seq_len=8 ) >"$TMP/midrun.log" 2>&1; rc=$?
steps_logged=$(grep -c '"type":"step"' "$TMP/midrun/metrics.jsonl" 2>/dev/null || echo 0)
if [ "$rc" -eq 1 ] && grep -q 'cannot write metrics' "$TMP/midrun.log" && grep -q 'saving the weights of step' "$TMP/midrun.log" \
   && "$BIN" sample "$TMP/midrun/weights.h5" --prompt "ROMEO:" --steps 8 --temperature 0 >/dev/null 2>&1; then
  pass "a metrics write error after $steps_logged steps saved loadable weights: $(grep -m1 'saving the weights' "$TMP/midrun.log")"
else
  fail "mid-run write error: exit $rc, weights saved and loadable: no"; tail -4 "$TMP/midrun.log"
fi

# ---- a second live run on the same checkpoint.dir, or the same log.jsonl, is refused
"$BIN" train configs/tiny.ini "${COMMON[@]}" --set checkpoint.dir="$TMP/live" --set train.steps=100000 \
  --set log.every=1000 --set train.eval_every=0 >"$TMP/live.log" 2>&1 &
live=$!
if wait_for "$TMP/live.log" '^step 1/' 60; then
  tiny --set checkpoint.dir="$TMP/live" >"$TMP/second.log" 2>&1; rc=$?
  if [ "$rc" -eq 1 ] && grep -q "in use by another fp8moe run (pid $live" "$TMP/second.log"; then
    pass "a second run on a live checkpoint.dir refused, naming pid $live"
  else
    fail "second run on a live checkpoint.dir: exit $rc"; tail -3 "$TMP/second.log"
  fi
  tiny --set checkpoint.dir="$TMP/other" --set log.jsonl="$TMP/live/metrics.jsonl" >"$TMP/second2.log" 2>&1; rc=$?
  if [ "$rc" -eq 1 ] && grep -q 'being written by another fp8moe run' "$TMP/second2.log" \
     && [ "$(grep -c '"type":"step"' "$TMP/live/metrics.jsonl")" -ge 1 ]; then
    pass "a second run writing the live run's metrics file refused, the file kept"
  else
    fail "second run on a live log.jsonl: exit $rc"; tail -3 "$TMP/second2.log"
  fi
else
  fail "the live run did not start"
fi
kill -INT "$live"; wait "$live"; rc=$?
[ "$rc" -eq 0 ] && [ -s "$TMP/live/weights.h5" ] && pass "the live run, interrupted, saved and exited 0" \
  || fail "the interrupted live run exited $rc"

# ---- a finished run's files are kept as *.prev; a killed run's temp file is removed
cp "$TMP/first/weights.h5" "$TMP/first_weights.h5"
touch "$TMP/first/weights.h5.tmp.99999"
tiny --set train.steps=2 --set checkpoint.dir="$TMP/first" >"$TMP/again.log" 2>&1; rc=$?
if [ "$rc" -eq 0 ] && cmp -s "$TMP/first/weights.prev.h5" "$TMP/first_weights.h5" && [ -s "$TMP/first/metrics.prev.jsonl" ] \
   && grep -q "kept the earlier run's $TMP/first/weights.h5 as $TMP/first/weights.prev.h5" "$TMP/again.log"; then
  pass "a rerun into a finished run's directory keeps its weights.h5 and metrics.jsonl as *.prev, saying so"
else
  fail "rerun into a finished run's directory: exit $rc"; grep -i kept "$TMP/again.log"
fi
if [ ! -e "$TMP/first/weights.h5.tmp.99999" ] && grep -q 'removed .*weights.h5.tmp.99999' "$TMP/again.log"; then
  pass "a killed run's weights.h5.tmp.* removed by the next run on the directory"
else
  fail "the stale weights.h5.tmp.99999 was not removed"
fi

# ---- the first Ctrl-C stops a running evaluation (shakespeare.ini: its full validation pass takes seconds)
"$BIN" train configs/shakespeare.ini "${COMMON[@]}" --set checkpoint.dir="$TMP/eval" --set train.steps=3 \
  --set train.eval_every=1 --set train.eval_batches=0 >"$TMP/eval.log" 2>&1 &
ev=$!
if wait_for "$TMP/eval.log" '^step 1/' 120; then
  sleep 0.3
  t0=$(date +%s.%N); kill -INT "$ev"; wait "$ev"; rc=$?; t1=$(date +%s.%N)
  took=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
  if [ "$rc" -eq 0 ] && grep -q '^eval step 1: interrupted, not recorded' "$TMP/eval.log" \
     && ! grep -q '"type":"eval"' "$TMP/eval/metrics.jsonl" && [ -s "$TMP/eval/weights.h5" ]; then
    pass "Ctrl-C during an evaluation stopped it (exit after ${took}s), saved the weights, recorded no partial eval"
  else
    fail "Ctrl-C during an evaluation: exit $rc after ${took}s"; tail -4 "$TMP/eval.log"
  fi
else
  fail "the evaluation run did not start"; kill -9 "$ev" 2>/dev/null
fi

# ---- a second Ctrl-C during the save: the save completes, nothing is left behind, exit 0
"$BIN" train configs/tiny.ini "${COMMON[@]}" --set checkpoint.dir="$TMP/save" --set train.steps=100000 \
  --set log.every=1 --set train.eval_every=0 >"$TMP/save.log" 2>&1 &
sv=$!
if wait_for "$TMP/save.log" '^step 1/' 60; then
  kill -INT "$sv"
  saw_save=0
  if wait_for "$TMP/save.log" '^saving weights to' 30; then saw_save=1; kill -INT "$sv" 2>/dev/null; fi
  wait "$sv"; rc=$?
  [ "$saw_save" -eq 1 ] || fail "no 'saving weights to' line: the second Ctrl-C could not be sent during the save"
  leftovers=$(ls "$TMP/save" | grep -c '\.tmp\.')
  if [ "$rc" -eq 0 ] && [ "$leftovers" -eq 0 ] && grep -q '^weights saved to' "$TMP/save.log" \
     && "$BIN" sample "$TMP/save/weights.h5" --prompt "ROMEO:" --steps 8 --temperature 0 >/dev/null 2>&1; then
    pass "a second Ctrl-C during the save: saved, loadable, no temp file, exit 0"
  else
    fail "second Ctrl-C during the save: exit $rc, temp files $leftovers"; tail -4 "$TMP/save.log"
  fi
else
  fail "the save run did not start"
fi

[ "$failures" -eq 0 ] && echo "run_outputs: passed" || echo "run_outputs: $failures FAILED"
exit $((failures > 0))
