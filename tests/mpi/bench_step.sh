#!/usr/bin/env bash
# bench_step.sh - `fp8moe bench step` under mpirun runs the job's parallel layout (train/job_groups.h) and
# reports it per rank; no timing is asserted (performance is measured by hand, docs/benchmarks.md):
#   - dp = 2, ep = 2 on configs/tiny-fp8.ini, 2 timed steps: exit 0; fp8 and bf16 tables; tokens/s/rank is
#     tokens/s over the 2 ranks; every phase row has a mean and a slowest rank with slowest >= mean; the
#     communication phases are measured: EP all-to-all and grad sync above 0, pipeline wait 0 (no pipeline);
#   - pp = 2 with 1f1b over 4 micro-batches (configs/tiny.ini at 4 layers): pipeline wait above 0 and the
#     pipeline lines (measured F and B > 0, each stage's costs, the simulated makespan and bubble, the same with
#     sends that do not wait, which cannot be longer, the measured / simulated ratio, the stage balance);
#   - the same with zb1p: also a measured W > 0 (the I/W split runs the weight gradients as W ops) on every stage;
#   - a layout that does not fit the launch (dp = 4 on 2 ranks) is refused with exit status 2 and its reason.
# Run from the repository root; BUILD names the build directory (default build).
set -u
. tests/mpi/env.sh
. tests/lib.sh
test_begin bench_step
COMMON=(--steps 2 --warmup 1 --set train.device=cpu --set train.threads=1 --set data.text=tests/data/shakespeare.txt
        --set data.cache_dir="$TMP/prepared")

# check NAME OUT EXPECT: the tables of OUT; EXPECT "ep" (EP and grad sync measured, no pipeline), or "pp" / "zb"
# (a pp = 2 pipeline of 1f1b / zb1p)
check() {
  python3 - "$2" "$3" <<'PY' || { fail "$1: the output is not what bench step prints under mpirun (above)"; return 1; }
import re, sys
text, expect = open(sys.argv[1]).read(), sys.argv[2]
kind = {"pp": "1f1b", "zb": "zb1p"}.get(expect)
bad = []
for mode in ("fp8", "bf16"):
    m = re.search(r"^%s: 2 steps, [0-9.]+ ms/step \(the slowest rank\)\n(.*?)(?:\n\n|\Z)" % mode, text, re.M | re.S)
    if not m:
        bad.append("no %s table" % mode); continue
    t = m.group(1)
    tps = re.search(r"^  tokens/s +([0-9.]+)$", t, re.M)
    per = re.search(r"^  tokens/s/rank +([0-9.]+) \(2 ranks\)$", t, re.M)
    if not tps or not per or abs(float(per.group(1)) - float(tps.group(1)) / 2) > 1:
        bad.append("%s: tokens/s/rank is not tokens/s over 2 ranks" % mode)
    rows = dict((n.strip(), (float(a), float(c))) for n, a, c in
                re.findall(r"^  ([A-Za-z][A-Za-z /-]+?) +([0-9.]+) +[0-9.]+% +([0-9.]+)$", t, re.M))
    for name in ("attention", "expert GEMM", "other GEMM", "quantisation", "permute", "optimizer", "EP all-to-all",
                 "pipeline wait", "grad sync"):
        if name not in rows: bad.append("%s: no '%s' row with a slowest rank" % (mode, name)); continue
        mean, slowest = rows[name]
        if slowest + 1e-3 < mean: bad.append("%s %s: slowest %g < mean %g" % (mode, name, slowest, mean))
    if expect == "ep":
        for name in ("EP all-to-all", "grad sync"):
            if rows.get(name, (0, 0))[0] <= 0: bad.append("%s: %s not measured" % (mode, name))
        if rows.get("pipeline wait", (1, 1))[0] != 0: bad.append("%s: pipeline wait without a pipeline" % mode)
    else:
        if rows.get("pipeline wait", (0, 0))[0] <= 0: bad.append("%s: pipeline wait not measured" % mode)
        p = re.search(r"^%s pipeline \(%s, pp 2, 4 micro-batches\): measured F ([0-9.]+) ms, B ([0-9.]+) ms"
                      r"(?:, W ([0-9.]+) ms)? per op" % (mode, kind), text, re.M)
        if not p or float(p.group(1)) <= 0 or float(p.group(2)) <= 0: bad.append("%s: no measured F and B" % mode)
        elif (kind == "zb1p") != (p.group(3) is not None and float(p.group(3)) > 0):
            bad.append("%s: a measured W %s" % (mode, "missing under zb1p" if kind == "zb1p" else "under 1f1b"))
        stages = re.findall(r"^    rank ([01]) chunk 0 \(stage \1 of pipe 0\): F ([0-9.]+) ms, B ([0-9.]+) ms, W ([0-9.]+) ms$",
                            text[text.index("%s pipeline" % mode):] if p else "", re.M)[:2]
        if len(stages) != 2 or any(float(f) <= 0 or float(b) <= 0 or (float(w) > 0) != (kind == "zb1p")
                                   for _, f, b, w in stages):
            bad.append("%s: not every stage's measured costs" % mode)
waiting = [float(x) for x in re.findall(r"^  simulated with every stage's costs: makespan ([0-9.]+) ms, bubble [0-9.]+ ms",
                                        text, re.M)]
if kind and len(waiting) != 2:
    bad.append("no simulated makespan for both modes")
eager = [float(x) for x in re.findall(r"^  simulated with sends that do not wait \(the executor waits for a batch's "
                                      r"sends with its receives\): makespan ([0-9.]+) ms, bubble [0-9.]+ ms$", text, re.M)]
if kind and len(eager) != 2:
    bad.append("no simulated makespan with sends that do not wait for both modes")
elif kind and len(waiting) == 2 and any(e > w + 1e-3 for e, w in zip(eager, waiting)):
    bad.append("sends that do not wait give a longer makespan (%s) than sends that wait (%s)" % (eager, waiting))
if kind and len(re.findall(r"^  stage balance: compute ops [0-9.]+ ms per step on the least busy rank, "
                                     r"[0-9.]+ on the most busy", text, re.M)) != 2:
    bad.append("no stage balance for both modes")
if kind and len(re.findall(r"measured / simulated bubble [0-9.]+$", text, re.M)) != 2:
    bad.append("no measured / simulated bubble for both modes")
for b in bad: print("   ", b)
sys.exit(1 if bad else 0)
PY
}

run_np2() {  # run_np2 NAME STATUS ARGS...: mpirun -np 2 fp8moe bench step ARGS, output into $TMP/NAME.log
  local name=$1 want=$2; shift 2
  timeout 300 "${MPIRUN[@]}" -np 2 -x OMP_NUM_THREADS=1 "$BIN" bench step "$@" >"$TMP/$name.log" 2>&1
  local rc=$?
  if [ "$rc" -ne "$want" ]; then fail "$name: exit status $rc, expected $want"; tail -15 "$TMP/$name.log"; return 1; fi
}

if run_np2 ep 0 configs/tiny-fp8.ini "${COMMON[@]}" --set parallel.dp=2 --set parallel.ep=2; then
  check "dp=2 ep=2" "$TMP/ep.log" ep && echo "ok: dp=2 ep=2: per-rank tables with the EP all-to-all and grad sync measured"
  sed -n '/^fp8: 2 steps/,/^  other  /p' "$TMP/ep.log"
fi
if run_np2 pp 0 configs/tiny.ini "${COMMON[@]}" --set parallel.pp=2 --set parallel.schedule=1f1b --set train.grad_accum=4 \
    --set model.n_layers=4; then
  check "pp=2 1f1b" "$TMP/pp.log" pp && echo "ok: pp=2 1f1b: pipeline wait measured, the bubble beside the simulator's"
  grep -A6 "^fp8 pipeline" "$TMP/pp.log"
fi
if run_np2 zb 0 configs/tiny.ini "${COMMON[@]}" --set parallel.pp=2 --set parallel.schedule=zb1p --set train.grad_accum=4 \
    --set model.n_layers=4; then
  check "pp=2 zb1p" "$TMP/zb.log" zb && echo "ok: pp=2 zb1p: W measured on every stage, the bubble beside the simulator's"
  grep -A6 "^fp8 pipeline" "$TMP/zb.log"
fi
if run_np2 bad 2 configs/tiny-fp8.ini "${COMMON[@]}" --set parallel.dp=4; then
  grep -q "parallel.dp" "$TMP/bad.log" && echo "ok: dp = 4 on 2 ranks refused with exit status 2" \
    || { fail "dp = 4 on 2 ranks: no message naming parallel.dp"; tail -5 "$TMP/bad.log"; }
fi
test_end
