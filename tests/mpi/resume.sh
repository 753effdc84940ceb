#!/usr/bin/env bash
# resume.sh - `mpirun ... fp8moe train --resume` (issue 21) at dp = 2, ep = 2 on CPU ranks: 20 steps of
# configs/tiny.ini with a checkpoint every 5, uninterrupted; a run resumed from its step-10 checkpoint under the
# same layout logs steps 11-20 with the same loss and gradient-norm bits; one resumed as one process (the
# experts reassembled on one rank; grad_accum 2, so that its micro-batches are the two ranks' rows, data/loader.h)
# logs step 11 within 1e-6 relative of the parallel run's.
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
BIN=$BUILD/fp8moe
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
C=(train configs/tiny.ini --set data.text=tests/data/shakespeare.txt --set "data.cache_dir=$TMP/data"
   --set train.eval_every=0 --set train.steps=20 --set checkpoint.every_steps=5 --set checkpoint.save_weights=false)
P=(--set parallel.dp=2 --set parallel.ep=2)
OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np 2 "$BIN" "${C[@]}" "${P[@]}" --set "checkpoint.dir=$TMP/full" \
  > "$TMP/full.log" 2>&1 || { echo "FAIL: the uninterrupted dp=2 ep=2 run"; tail -5 "$TMP/full.log"; exit 1; }
OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np 2 "$BIN" "${C[@]}" "${P[@]}" --set "checkpoint.dir=$TMP/res" \
  --resume "$TMP/full/step_00000010" > "$TMP/res.log" 2>&1 || { echo "FAIL: the resumed dp=2 ep=2 run"; tail -5 "$TMP/res.log"; fail=1; }
OMP_NUM_THREADS=1 timeout 120 "$BIN" "${C[@]}" --set train.steps=11 --set train.grad_accum=2 --set "checkpoint.dir=$TMP/one" \
  --resume "$TMP/full/step_00000010" > "$TMP/one.log" 2>&1 || { echo "FAIL: the one-process resume"; tail -5 "$TMP/one.log"; fail=1; }
python3 - "$TMP/full/metrics.jsonl" "$TMP/res/metrics.jsonl" "$TMP/one/metrics.jsonl" <<'PY' || fail=1
import json, sys
def steps(p):
    try: return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if r.get("type") == "step"}
    except OSError: return {}
full, res, one = (steps(p) for p in sys.argv[1:4])
same = len(res) == 10 and all(full[s] == res[s] for s in res)
print(("ok" if same else "FAIL") + f": dp=2 ep=2 resumed at step 10: steps {sorted(res)[:1]}..{sorted(res)[-1:]} "
      + ("bitwise those of the uninterrupted run" if same else "differ"))
rel = abs(one.get(11, (float("nan"),))[0] - full[11][0]) / abs(full[11][0]) if 11 in one else float("nan")
print(("ok" if rel <= 1e-6 else "FAIL") + f": one process resumed from the dp=2 ep=2 checkpoint: step 11 loss "
      f"{one.get(11, ('-',))[0]} vs {full[11][0]} (relative {rel:.2e}, limit 1e-6)")
sys.exit(0 if same and rel <= 1e-6 else 1)
PY
[ "$fail" -eq 0 ] && echo "resume.sh (mpi): passed" || echo "resume.sh (mpi): FAILED"
exit "$fail"
