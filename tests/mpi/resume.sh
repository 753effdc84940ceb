#!/usr/bin/env bash
# resume.sh - `mpirun ... fp8moe train --resume` (issue 21) on CPU ranks, for two layouts: dp = 2, ep = 2; and
# pp = 2, dp = 2, ep = 2 with parallel.schedule = dualpipev (4 layers, 4 micro-batches per rank). Each: 20 steps
# of configs/tiny.ini with a checkpoint every 5, uninterrupted; a run resumed from its step-10 checkpoint under the
# same layout logs steps 11-20 with the same loss and gradient-norm bits; one resumed as one process (the experts
# and stages reassembled on one rank; its micro-batches those of the ranks: micro_batch_size ep x B, grad_accum
# dp / ep x A, data/loader.h) logs step 11 within 1e-6 relative of the parallel run's. The pipeline layout is also
# killed during step 13 and inside the save at step 10 and resumed (layout's KILLS below). Then a one-process run's
# step-10 checkpoint resumes under pp = 2, dp = 2, ep = 2 with ZeRO-1, and that run's step-15 checkpoint as one
# process again: each next step's loss within 1e-6 relative of the uninterrupted one-process run's.
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
BIN=$BUILD/fp8moe
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
C=(train configs/tiny.ini --set data.text=tests/data/shakespeare.txt --set "data.cache_dir=$TMP/data"
   --set train.eval_every=0 --set train.steps=20 --set checkpoint.every_steps=5 --set checkpoint.save_weights=false)

# layout NAME NP "PARALLEL SETTINGS" "ONE-PROCESS SETTINGS" [KILLS]: KILLS = 1 also kills a rank with SIGKILL
# during step 13 (world rank 1) and inside the save at step 10 (world rank NP-1) (FP8MOE_FAULT, train/fault.h):
# the job ends non-zero, `latest` is the last complete checkpoint (10, 5), and --resume latest in the same
# directory continues from it with the uninterrupted run's bits.
layout() {
  local name=$1 np=$2 dir="$TMP/$1"
  local -a par=($3) one=($4)
  mkdir -p "$dir"
  OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np "$np" "$BIN" "${C[@]}" "${par[@]}" --set "checkpoint.dir=$dir/full" \
    > "$dir/full.log" 2>&1 || { echo "FAIL: $name: the uninterrupted run"; tail -5 "$dir/full.log"; fail=1; return; }
  OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np "$np" "$BIN" "${C[@]}" "${par[@]}" --set "checkpoint.dir=$dir/res" \
    --resume "$dir/full/step_00000010" > "$dir/res.log" 2>&1 || { echo "FAIL: $name: the resumed run"; tail -5 "$dir/res.log"; fail=1; }
  OMP_NUM_THREADS=1 timeout 120 "$BIN" "${C[@]}" "${one[@]}" --set train.steps=11 --set "checkpoint.dir=$dir/one" \
    --resume "$dir/full/step_00000010" > "$dir/one.log" 2>&1 || { echo "FAIL: $name: the one-process resume"; tail -5 "$dir/one.log"; fail=1; }
  python3 - "$name" "$dir/full/metrics.jsonl" "$dir/res/metrics.jsonl" "$dir/one/metrics.jsonl" <<'PY' || fail=1
import json, sys
def steps(p):
    try: return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if r.get("type") == "step"}
    except OSError: return {}
name = sys.argv[1]
full, res, one = (steps(p) for p in sys.argv[2:5])
same = len(res) == 10 and all(full[s] == res[s] for s in res)
print(("ok" if same else "FAIL") + f": {name} resumed at step 10: steps {sorted(res)[:1]}..{sorted(res)[-1:]} "
      + (f"bitwise those of the uninterrupted run (step 20 loss {float(full[20][0]).hex()})" if same else "differ"))
rel = abs(one.get(11, (float("nan"),))[0] - full[11][0]) / abs(full[11][0]) if 11 in one else float("nan")
print(("ok" if rel <= 1e-6 else "FAIL") + f": one process resumed from the {name} checkpoint: step 11 loss "
      f"{one.get(11, ('-',))[0]} vs {full[11][0]} (relative {rel:.2e}, limit 1e-6)")
sys.exit(0 if same and rel <= 1e-6 else 1)
PY
  [ "${5:-0}" = 1 ] || return
  local fault point last kdir rc latest
  for fault in step:13:1:10 "save:10:$((np - 1)):5"; do
    point=${fault%:*}; last=${fault##*:}; kdir="$dir/kill_${point%%:*}"
    OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np "$np" -x FP8MOE_FAULT="$point" "$BIN" "${C[@]}" "${par[@]}" \
      --set "checkpoint.dir=$kdir" > "$kdir.log" 2>&1; rc=$?
    latest=$(readlink "$kdir/latest" 2>/dev/null)
    OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np "$np" "$BIN" "${C[@]}" "${par[@]}" --set "checkpoint.dir=$kdir" \
      --resume latest > "$kdir.res.log" 2>&1
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$latest" = "$(printf 'step_%08d' "$last")" ] \
       && grep -q "resumed from .* at step $last " "$kdir.res.log" && python3 - "$dir/full/metrics.jsonl" "$kdir/metrics.jsonl" <<'PY'
import json, sys
def steps(p): return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if r.get("type") == "step"}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
sys.exit(0 if len(b) > 0 and max(b) == 20 and all(s in a and a[s] == b[s] for s in b) else 1)
PY
    then echo "ok: $name: SIGKILL at $point: exit $rc, latest = $latest, resumed from step $last to 20 with the uninterrupted bits"
    else echo "FAIL: $name: SIGKILL at $point: exit $rc, latest '$latest'"; tail -3 "$kdir.log" "$kdir.res.log"; fail=1; fi
  done
}

layout "dp=2 ep=2" 2 "--set parallel.dp=2 --set parallel.ep=2" "--set train.grad_accum=2"
layout "pp=2 dp=2 ep=2 dualpipev" 4 \
  "--set parallel.pp=2 --set parallel.dp=2 --set parallel.ep=2 --set parallel.schedule=dualpipev --set model.n_layers=4 --set train.grad_accum=4" \
  "--set model.n_layers=4 --set train.micro_batch_size=8 --set train.grad_accum=4" 1
# one process -> pp = 2, dp = 2, ep = 2, ZeRO-1 (1f1b) -> one process
ONE=(--set model.n_layers=4 --set train.micro_batch_size=8 --set train.grad_accum=2)
PAR=(--set parallel.pp=2 --set parallel.dp=2 --set parallel.ep=2 --set parallel.zero1=true --set model.n_layers=4
     --set train.grad_accum=2)
x="$TMP/cross"
OMP_NUM_THREADS=1 timeout 120 "$BIN" "${C[@]}" "${ONE[@]}" --set "checkpoint.dir=$x/one" > "$x.one.log" 2>&1 \
  || { echo "FAIL: the one-process run"; tail -3 "$x.one.log"; fail=1; }
# (train.steps stays 20 in every leg: the LR schedule's length is part of the state)
OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np 4 "$BIN" "${C[@]}" "${PAR[@]}" \
  --set "checkpoint.dir=$x/par" --resume "$x/one/step_00000010" > "$x.par.log" 2>&1 \
  || { echo "FAIL: pp=2 dp=2 ep=2 zero1 resumed from one process"; tail -3 "$x.par.log"; fail=1; }
OMP_NUM_THREADS=1 timeout 120 "$BIN" "${C[@]}" "${ONE[@]}" --set "checkpoint.dir=$x/back" \
  --resume "$x/par/step_00000015" > "$x.back.log" 2>&1 || { echo "FAIL: one process resumed from pp=2 dp=2 ep=2 zero1"; tail -3 "$x.back.log"; fail=1; }
python3 - "$x/one/metrics.jsonl" "$x/par/metrics.jsonl" "$x/back/metrics.jsonl" <<'PY' || fail=1
import json, sys
def steps(p):
    try: return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r.get("type") == "step"}
    except OSError: return {}
one, par, back = (steps(p) for p in sys.argv[1:4])
ok = True
for name, run, s in (("pp=2 dp=2 ep=2 zero1 from a one-process checkpoint", par, 11), ("one process from that run's step-15 checkpoint", back, 16)):
    rel = abs(run[s] - one[s]) / abs(one[s]) if s in run and s in one else float("nan")
    good = rel <= 1e-6
    ok = ok and good
    print(("ok" if good else "FAIL") + f": {name}: step {s} loss {run.get(s, '-')} vs {one.get(s, '-')} (relative {rel:.2e}, limit 1e-6)")
sys.exit(0 if ok else 1)
PY
[ "$fail" -eq 0 ] && echo "resume.sh (mpi): passed" || echo "resume.sh (mpi): FAILED"
exit "$fail"
