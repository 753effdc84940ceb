#!/usr/bin/env bash
# bench_a2a.sh - `fp8moe bench a2a` runs and prints sane numbers (issue 19 item 8); no timing is asserted
# (performance is measured by hand and recorded in docs/benchmarks.md, never by timed tests).
#   - one process and mpirun -np 2 on configs/bench-1gpu.ini's shapes with few tokens (--tokens 64: 384
#     rows of 8 KiB per rank): exit 0, a table for uniform and for skewed routing, every rank's row with
#     rows out = tokens x top-K, the rows received summing to the rows sent, rank 0's bytes to others equal
#     to rank 1's bytes from others, every time finite and >= 0, at -np 2 GB/s > 0 and a ratio to raw;
#   - -np 3 (3 does not divide the 32 experts) and --runs 0 are refused with exit status 2 and a message.
# Run from the repository root; BUILD names the build directory (default build).
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
BIN=$BUILD/fp8moe
TMP=$(mktemp -d /tmp/fp8moe_bench_a2a_XXXXXX)
trap 'rm -rf "$TMP"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
[ -x "$BIN" ] || { echo "FAIL: $BIN not built"; exit 1; }
ARGS=(bench a2a configs/bench-1gpu.ini --tokens 64 --runs 3 --warmup 1)

# check NAME RANKS OUT: the printed tables of a run of RANKS ranks
check() {
  python3 - "$2" "$3" <<'EOF' || fail "$1: the output is not what bench a2a prints (above)"
import math, re, sys
ranks, path = int(sys.argv[1]), sys.argv[2]
text = open(path).read()
bad = []
m = re.search(r"per rank: (\d+) tokens x top-(\d+) = (\d+) rows", text)
if not m: bad.append("no 'per rank:' line")
tokens, k = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
sections = re.split(r"\n(?=(?:uniform|skewed) routing)", text)[1:]
if [s.split()[0] for s in sections] != ["uniform", "skewed"]: bad.append("expected a uniform and a skewed table")
for s in sections:
    name = s.split()[0]
    rows = [l.split() for l in s.splitlines() if re.match(r"^  \d+ ", l)]
    if len(rows) != ranks: bad.append(f"{name}: {len(rows)} rank rows, expected {ranks}"); continue
    vals = [[float(x) for x in r[1:]] for r in rows]
    if any(not math.isfinite(x) or x < 0 for r in vals for x in r): bad.append(f"{name}: a negative or non-finite number")
    if any(r[0] != tokens * k for r in vals): bad.append(f"{name}: rows out != {tokens} x {k}")
    if sum(r[1] for r in vals) != sum(r[0] for r in vals): bad.append(f"{name}: rows in do not sum to rows out")
    if ranks == 2 and (vals[0][2] != vals[1][3] or vals[1][2] != vals[0][3]): bad.append(f"{name}: bytes to / from others differ")
    ops = {l[:26].strip(): l[26:].split() for l in s.splitlines() if re.match(r"^  (dispatch|combine|raw a2a)", l) and "+" not in l}
    for op in ("dispatch", "combine", "raw a2a (dispatch way)", "raw a2a (combine way)"):
        if op not in ops: bad.append(f"{name}: no '{op}' line"); continue
        ms, gbs = float(ops[op][0]), float(ops[op][1])
        if not (math.isfinite(ms) and ms >= 0 and math.isfinite(gbs) and gbs >= 0): bad.append(f"{name}: {op}: {ops[op]}")
        if ranks > 1 and gbs <= 0: bad.append(f"{name}: {op}: GB/s {gbs} at {ranks} ranks")
        if ranks > 1 and op in ("dispatch", "combine") and not re.match(r"^\d+\.\d+$", ops[op][2]): bad.append(f"{name}: {op}: no ratio to raw")
    if not re.search(r"dispatch \+ combine [0-9.]+ ms, raw [0-9.]+ ms: [0-9.]+ x raw", s): bad.append(f"{name}: no total line")
for b in bad: print("   ", b)
sys.exit(1 if bad else 0)
EOF
}

# run NAME RANKS: runs the benchmark (RANKS 0: without mpirun) and checks its output
run() {
  local out="$TMP/$1.out" rc
  if [ "$2" = 0 ]; then timeout 120 "$BIN" "${ARGS[@]}" >"$out" 2>&1; rc=$?
  else timeout 120 "${MPIRUN[@]}" -np "$2" -x OMP_NUM_THREADS=1 "$BIN" "${ARGS[@]}" >"$out" 2>&1; rc=$?; fi
  if [ "$rc" -ne 0 ]; then fail "$1: exit $rc"; sed 's/^/    /' "$out" | tail -20; return; fi
  local before=$failures
  check "$1" "$([ "$2" = 0 ] && echo 1 || echo "$2")" "$out"
  if [ "$failures" -eq "$before" ]; then
    echo "ok: $1: $(grep -m1 -E '^  dispatch \+ combine' "$out" | sed 's/^ *//') (uniform)"
  else
    sed 's/^/    /' "$out" | head -40
  fi
}
run "one process" 0
run "mpirun -np 2" 2

out="$TMP/bad.out"
timeout 60 "${MPIRUN[@]}" -np 3 "$BIN" "${ARGS[@]}" >"$out" 2>&1; rc=$?
n=$(grep -c "3 ranks do not divide moe.n_routed_experts = 32" "$out")
{ [ "$rc" -eq 2 ] && [ "$n" -eq 1 ]; } && echo "ok: -np 3 refused: $(grep -m1 -o '3 ranks do not divide.*' "$out" | cut -c1-100)" \
  || { fail "-np 3: exit $rc, $n messages (expected exit 2 and one message naming moe.n_routed_experts)"; sed 's/^/    /' "$out" | head; }
"$BIN" bench a2a --runs 0 >"$out" 2>&1; rc=$?
{ [ "$rc" -eq 2 ] && grep -q -- "--runs 0: expected an integer from 1" "$out"; } && echo "ok: --runs 0 refused" \
  || { fail "--runs 0: exit $rc"; sed 's/^/    /' "$out" | head -5; }

echo "bench_a2a: $([ $failures = 0 ] && echo passed || echo "FAILED ($failures)")"
[ "$failures" -eq 0 ]
