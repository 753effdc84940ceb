#!/usr/bin/env bash
# train_parity.sh - the whole model on the GPU against the CPU reference (issue 4): 20 training steps of
# configs/tiny.ini in bf16 and in fp8 mode on the CPU and on CUDA, same data order; every step's loss
# must agree within 1e-3 relative. Then determinism: the same CUDA run twice gives bitwise-identical
# losses. Run on a GPU machine after tests/gpu/run.sh has built $BUILD (default build-gpu).
set -u
BUILD=${BUILD:-build-gpu}
BIN=$BUILD/fp8moe
TEXT=${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
TMP=$(mktemp -d /tmp/fp8moe_parity_XXXXXX)
trap 'rm -rf "$TMP"' EXIT
fail=0
run() {  # run NAME DEVICE MODE
  "$BIN" train configs/tiny.ini --set train.device="$2" --set precision.mode="$3" --set train.steps=20 \
    --set train.eval_every=0 --set train.eval_batches=1 --set data.text="$TEXT" --set checkpoint.dir="$TMP/$1" \
    --set checkpoint.save_weights=false --set log.every=5 > "$TMP/$1.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then echo "FAIL: $1 exited $rc:"; tail -5 "$TMP/$1.log"; fail=1; fi
  grep -E '^step (5|20)/' "$TMP/$1.log" | sed "s/^/$1: /"
}
compare() {  # compare A B TOLERANCE: per-step losses
  python3 - "$TMP/$1/metrics.jsonl" "$TMP/$2/metrics.jsonl" "$3" <<'PY'
import json, sys
def losses(p):
    try: return [json.loads(l)["loss"] for l in open(p) if '"type":"step"' in l]
    except OSError: return []
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if len(a) != 20 or len(b) != 20:
    print(f"FAIL: {sys.argv[1]} / {sys.argv[2]}: expected 20 steps, got {len(a)} and {len(b)}"); sys.exit(1)
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
ok = worst <= tol if tol > 0 else a == b
print(f"{'ok' if ok else 'FAIL'}: {sys.argv[1].split('/')[-2]} vs {sys.argv[2].split('/')[-2]}: "
      f"max relative loss difference over 20 steps {worst:.3e} ({'limit %g' % tol if tol > 0 else 'bitwise'})")
sys.exit(0 if ok else 1)
PY
  [ $? -eq 0 ] || fail=1
}
for mode in bf16 fp8; do
  run cpu_$mode cpu $mode
  run cuda_$mode cuda $mode
  compare cuda_$mode cpu_$mode 1e-3
done
run cuda_fp8_again cuda fp8
compare cuda_fp8_again cuda_fp8 0
[ $fail -eq 0 ] && echo "train_parity: passed" || echo "train_parity: FAILED"
exit $fail
