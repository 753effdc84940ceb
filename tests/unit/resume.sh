#!/usr/bin/env bash
# resume.sh - `fp8moe train --resume` continues a run bit for bit (issue 21), through the command line:
#   1. configs/tiny-fp8.ini (fp8 mode) for 20 steps with checkpoint.every_steps = 5, uninterrupted; a second run
#      resumed from its step_00000010 checkpoint in another directory logs steps 11-20 with the same loss and
#      gradient norm bits (metrics.jsonl), and says what it resumed from;
#   2. SIGTERM during a long run: it finishes its step, writes a checkpoint and exits 0; `--resume latest`
#      (checkpoint.dir's newest) continues from that step;
#   3. --resume of a directory with no checkpoint fails (exit 1) naming it;
#   4. (after 1) SIGKILL during step 13 and inside the save at step 10 (FP8MOE_FAULT, train/fault.h): the latest
#      complete checkpoint (10, 5) survives, and --resume latest in the same directory continues from it with
#      the uninterrupted run's bits; its metrics.jsonl holds steps 1-20 once each (the records up to the
#      checkpoint's step kept, the killed run's later ones dropped: train/metrics.h).
# One thread, tests/data/shakespeare.txt. Under the sanitizers only cases 2 and 3 run (cases 1 and 4 are slow
# there).
set -u
BUILD=${FP8MOE_BUILD:-${BUILD:-build}}
BIN=$BUILD/fp8moe
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=1
fail=0
C=(--set data.text=tests/data/shakespeare.txt --set "data.cache_dir=$TMP/data" --set train.eval_every=0)
same_steps() {  # same_steps A.jsonl B.jsonl: every step of B has A's loss and gradient norm, exactly
  python3 - "$1" "$2" <<'PY'
import json, sys
def steps(p): return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if r.get("type") == "step"}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
ok = len(b) > 0 and all(s in a and a[s] == b[s] for s in b)
print(f"  steps {min(b) if b else '-'}-{max(b) if b else '-'}: " + ("identical" if ok else "DIFFERENT"))
sys.exit(0 if ok else 1)
PY
}
if [ "${FP8MOE_SANITIZE:-0}" != 1 ]; then
  "$BIN" train configs/tiny-fp8.ini "${C[@]}" --set train.steps=20 --set checkpoint.every_steps=5 \
    --set "checkpoint.dir=$TMP/full" > "$TMP/full.log" 2>&1 || { echo "FAIL: the uninterrupted run"; tail -3 "$TMP/full.log"; fail=1; }
  "$BIN" train configs/tiny-fp8.ini "${C[@]}" --set train.steps=20 --set checkpoint.every_steps=5 \
    --set "checkpoint.dir=$TMP/res" --resume "$TMP/full/step_00000010" > "$TMP/res.log" 2>&1
  if [ $? -eq 0 ] && grep -q "resumed from .*step_00000010 at step 10" "$TMP/res.log" \
     && same_steps "$TMP/full/metrics.jsonl" "$TMP/res/metrics.jsonl"; then
    echo "ok: resumed at step 10, steps 11-20 bitwise those of the uninterrupted run"
  else echo "FAIL: resume from step 10"; tail -3 "$TMP/res.log"; fail=1; fi
  # SIGKILL during step 13 and inside the save at step 10 (FP8MOE_FAULT, train/fault.h): the job dies with 137,
  # `latest` is the last complete checkpoint (10, 5), and --resume latest in the same directory continues from it
  # with the uninterrupted run's bits
  for fault in step:13:10 save:10:5; do
    point=${fault%:*}; last=${fault##*:}; dir="$TMP/kill_${point%%:*}"
    (FP8MOE_FAULT=$point "$BIN" train configs/tiny-fp8.ini "${C[@]}" --set train.steps=20 --set checkpoint.every_steps=5 \
      --set "checkpoint.dir=$dir" > "$dir.log" 2>&1; exit $?) 2>/dev/null; rc=$?  # (its "Killed" line silenced)
    resumed=$(readlink "$dir/latest" 2>/dev/null)
    "$BIN" train configs/tiny-fp8.ini "${C[@]}" --set train.steps=20 --set checkpoint.every_steps=5 \
      --set "checkpoint.dir=$dir" --resume latest > "$dir.res.log" 2>&1
    if [ "$rc" -eq 137 ] && [ "$resumed" = "$(printf 'step_%08d' "$last")" ] \
       && grep -q "resumed from .* at step $last " "$dir.res.log" && grep -q "^step 20/" "$dir.res.log" \
       && same_steps "$TMP/full/metrics.jsonl" "$dir/metrics.jsonl" \
       && python3 -c "import json, sys; s = [r['step'] for r in map(json.loads, open(sys.argv[1])) if r['type'] == 'step']
sys.exit(0 if s == list(range(1, 21)) else 'metrics.jsonl steps: %s' % s)" "$dir/metrics.jsonl"; then
      echo "ok: SIGKILL at $point: exit 137, latest = $resumed, resumed from step $last to 20 with the uninterrupted bits;" \
        "metrics.jsonl continues the run (steps 1-20 once each)"
    else echo "FAIL: SIGKILL at $point: exit $rc, latest '$resumed'"; tail -3 "$dir.log" "$dir.res.log"; fail=1; fi
  done
fi
"$BIN" train configs/tiny.ini "${C[@]}" --set train.steps=100000 --set log.every=100000 --set checkpoint.every_steps=100000 \
  --set "checkpoint.dir=$TMP/term" > "$TMP/term.log" 2>&1 &
pid=$!
for _ in $(seq 600); do grep -q '"type":"step"' "$TMP/term/metrics.jsonl" 2>/dev/null && break; sleep 0.1; done
sleep 0.5
kill -TERM $pid
wait $pid; rc=$?
step=$(sed -n 's/^checkpoint saved: .*step_0*\([0-9][0-9]*\)$/\1/p' "$TMP/term.log" | tail -1)
if [ "$rc" -eq 0 ] && [ -n "$step" ] && [ -e "$TMP/term/latest" ]; then
  echo "ok: SIGTERM finished step $step, checkpointed and exited 0"
  "$BIN" train configs/tiny.ini "${C[@]}" --set train.steps=$((step + 2)) --set checkpoint.every_steps=100000 \
    --set "checkpoint.dir=$TMP/term" --resume latest > "$TMP/term2.log" 2>&1
  if [ $? -eq 0 ] && grep -q "resumed from .* at step $step" "$TMP/term2.log" && grep -q "^step $((step + 2))/" "$TMP/term2.log"; then
    echo "ok: --resume latest continued from step $step to $((step + 2))"
  else echo "FAIL: --resume latest after SIGTERM"; tail -3 "$TMP/term2.log"; fail=1; fi
else
  echo "FAIL: SIGTERM: exit $rc, checkpoint step '$step'"; tail -3 "$TMP/term.log"; fail=1
fi
mkdir -p "$TMP/empty"
"$BIN" train configs/tiny.ini "${C[@]}" --set train.steps=2 --set "checkpoint.dir=$TMP/e2" --resume "$TMP/empty" \
  > "$TMP/empty.log" 2>&1; rc=$?
if [ "$rc" -eq 1 ] && grep -q "$TMP/empty" "$TMP/empty.log"; then echo "ok: --resume of a directory without a checkpoint fails naming it"
else echo "FAIL: --resume of an empty directory: exit $rc"; tail -2 "$TMP/empty.log"; fail=1; fi
[ "$fail" -eq 0 ] && echo "resume.sh: passed" || echo "resume.sh: FAILED"
exit "$fail"
