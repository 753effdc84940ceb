#!/usr/bin/env bash
# train_faults.sh - faults of a real training job (issue 19, "Done when"): `fp8moe train` under mpirun,
# not the small tests/mpi/fault_worker of faults.sh, so the trainer's own collectives, its SIGTERM handler
# and mpirun's clean-up are what is measured.
#   - SIGKILL of a non-zero rank mid-run (dp = 4, ep = 2: the rank dies between or inside the EP
#     all-to-alls and the dp sums): the job must end non-zero within parallel.timeout_s + a margin, and the
#     output must name the killed rank (mpirun: "process rank 3 ... exited on signal 9");
#   - SIGSTOP of rank 1 of dp = 2: rank 0's next collective times out after parallel.timeout_s and names
#     itself, the operation, the group and the stopped rank: "nothing yet from world rank(s) 1" when one of
#     its receives is pending, "world rank(s) 1 have not taken this rank's messages" when only its sends are
#     (the stopped rank's own part had already arrived: seen under ASan); the job must end non-zero within
#     timeout_s + the margin. The stopped process is then killed if mpirun left it behind (it should not);
#   - bad layouts (-np 3 with dp = 2; ep = 3 with dp = 4): every rank exits 2 on its own, and the job
#     prints one message naming the keys.
# The trainer runs configs/tiny.ini on tests/data/shakespeare.txt with one thread per rank and many steps,
# and a fault is injected once metrics.jsonl holds a step record (training is under way). A rank's pid is
# found from the unique checkpoint.dir on its command line and OMPI_COMM_WORLD_RANK in its environment.
# Run from the repository root; BUILD names the build directory (default build). Exit status non-zero if a
# check failed; a failure prints the job's output.
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
BIN=$BUILD/fp8moe
TIMEOUT_S=5    # parallel.timeout_s of the jobs
MARGIN_S=5     # mpirun's clean-up (SIGTERM, then SIGKILL after its grace period) and the sanitizers' exit
TMP=$(mktemp -d /tmp/fp8moe_train_faults_XXXXXX)
cleanup() {
  # the jobs this script started (timeout's process group), then any rank left behind under TMP's dirs
  jobs -p | xargs -r kill -KILL 2>/dev/null
  for p in $(pgrep -f -- "checkpoint.dir=$TMP/" 2>/dev/null); do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  rm -rf "$TMP"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
[ -x "$BIN" ] || { echo "FAIL: $BIN not built"; exit 1; }

COMMON=(--set data.text=tests/data/shakespeare.txt --set data.cache_dir="$TMP/cache" --set train.threads=1
        --set checkpoint.save_weights=false --set train.eval_every=0 --set log.every=100)
now() { date +%s.%N; }
elapsed() { echo "$(now) - $1" | bc; }

# The shards once, in one process, so that no rank of a job waits on another's data preparation.
"$BIN" train configs/tiny.ini "${COMMON[@]}" --set train.steps=1 --set checkpoint.dir="$TMP/prep" \
  >"$TMP/prep.log" 2>&1 || { echo "FAIL: preparing the data failed:"; tail -5 "$TMP/prep.log"; exit 1; }

# rank_pid DIR RANK: the pid of world rank RANK of the job whose checkpoint.dir is DIR
rank_pid() {
  local p
  for p in $(pgrep -f -- "checkpoint.dir=$1( |$)"); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = fp8moe ] || continue
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && { echo "$p"; return 0; }
  done
  return 1
}

# alive PID: the process exists and is not a zombie (mpirun's killed ranks are orphans that init reaps later)
alive() { local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null); [ -n "$st" ] && [ "$st" != Z ]; }

# fault NAME NP RANK SIGNAL PATTERN SETTINGS...: starts a job of NP ranks with SETTINGS (--set k=v ...), waits
# for its first step record, sends SIGNAL to world rank RANK, and checks that the job ends non-zero within
# TIMEOUT_S + MARGIN_S with a line matching PATTERN.
fault() {
  local name=$1 np=$2 rank=$3 sig=$4 pattern=$5; shift 5
  local dir="$TMP/$sig" log="$TMP/$sig.log" job pid i t0 dt rc limit start=$SECONDS
  limit=$((TIMEOUT_S + MARGIN_S))
  timeout 120 "${MPIRUN[@]}" -np "$np" -x OMP_NUM_THREADS=1 "$BIN" train configs/tiny.ini "${COMMON[@]}" \
    --set parallel.timeout_s=$TIMEOUT_S --set train.steps=1000000 --set checkpoint.dir="$dir" "$@" >"$log" 2>&1 &
  job=$!
  for ((i = 0; i < 600; i++)); do  # up to 60 s for the start (4 ranks on 2 cores under ASan)
    grep -q '"type":"step"' "$dir/metrics.jsonl" 2>/dev/null && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  if ! grep -q '"type":"step"' "$dir/metrics.jsonl" 2>/dev/null || ! pid=$(rank_pid "$dir" "$rank"); then
    fail "$name: the job did not start training (or rank $rank was not found)"
    sed 's/^/    /' "$log" | tail -20
    kill -KILL "$job" 2>/dev/null; wait "$job" 2>/dev/null
    return
  fi
  t0=$(now)
  kill "-$sig" "$pid"
  wait "$job"; rc=$?
  dt=$(elapsed "$t0")
  for ((i = 0; i < 50; i++)); do alive "$pid" || break; sleep 0.1; done  # mpirun's SIGKILL may still be landing
  if [ "$sig" = STOP ] && alive "$pid"; then  # mpirun should have ended it; never leave it behind
    fail "$name: the stopped rank (pid $pid, state $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)) outlived the job"
    kill -CONT "$pid"; kill -KILL "$pid"
  fi
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || ! grep -Eq -- "$pattern" "$log" || [ "$(echo "$dt > $limit" | bc)" = 1 ]; then
    fail "$name: exit $rc after $dt s (expected non-zero within $limit s and a line matching: $pattern)"
    sed 's/^/    /' "$log" | tail -30
  else
    echo "ok: $name: exit $rc $(printf '%.1f' "$dt") s after SIG$sig ($((SECONDS - start)) s in all): $(grep -Eo -m1 -- "$pattern.*" "$log" | cut -c1-150)"
  fi
}

fault "SIGKILL of rank 3 while dp = 4, ep = 2 trains" 4 3 KILL \
  "process rank 3 .*(signal 9|Killed)" --set parallel.dp=4 --set parallel.ep=2
fault "SIGSTOP of rank 1 while dp = 2 trains" 2 1 STOP \
  "fp8moe: rank 0: comm_[a-z_0-9]+ on group [a-z]+ \(size 2\) timed out after $TIMEOUT_S s - (nothing yet from )?world rank\(s\) 1( |;)" \
  --set parallel.dp=2

# layout NAME NP PLAIN PATTERN SETTINGS...: every rank of the job must exit 2 by itself (each rank runs under a
# shell that records its exit status, so mpirun's clean-up cannot hide a rank that went on) and the output must
# hold exactly one line matching PATTERN; with PLAIN = 1 the job runs again without the wrapper and mpirun must
# exit 2 (once is enough: each launch of ranks under ASan costs seconds).
layout() {
  local name=$1 np=$2 plain=$3 pattern=$4; shift 4
  local log="$TMP/layout.log" codes="$TMP/layout.codes" rc n bad start=$SECONDS
  rm -f "$codes"
  timeout 60 "${MPIRUN[@]}" -np "$np" -x OMP_NUM_THREADS=1 bash -c \
    '"$0" "$@"; echo "rank $OMPI_COMM_WORLD_RANK exit $?" >>'"$codes" "$BIN" train configs/tiny.ini \
    "${COMMON[@]}" --set checkpoint.dir="$TMP/layout" "$@" >"$log" 2>&1
  n=$(grep -c ' exit 2$' "$codes" 2>/dev/null); bad=$(grep -vc ' exit 2$' "$codes" 2>/dev/null)
  if [ "${n:-0}" -ne "$np" ] || [ "${bad:-0}" -ne 0 ]; then
    fail "$name: expected all $np ranks to exit 2; got: $(tr '\n' ';' <"$codes" 2>/dev/null)"
  fi
  rc=2
  if [ "$plain" = 1 ]; then
    timeout 60 "${MPIRUN[@]}" -np "$np" -x OMP_NUM_THREADS=1 "$BIN" train configs/tiny.ini "${COMMON[@]}" \
      --set checkpoint.dir="$TMP/layout" "$@" >"$log" 2>&1
    rc=$?
  fi
  n=$(grep -Ec -- "$pattern" "$log")
  if [ "$rc" -ne 2 ] || [ "$n" -ne 1 ]; then
    fail "$name: mpirun exit $rc, $n lines matching: $pattern (expected exit 2 and one line)"
    sed 's/^/    /' "$log" | tail -20
  else
    echo "ok: $name: every rank exit 2$([ "$plain" = 1 ] && echo ", mpirun exit 2") ($((SECONDS - start)) s): $(grep -Eo -m1 -- "$pattern.*" "$log" | cut -c1-150)"
  fi
}

layout "-np 3 with parallel.dp = 2" 3 1 \
  "parallel.pp \* parallel.dp = 1 \* 2 = 2 ranks, but the job has 3 ranks" --set parallel.dp=2
layout "parallel.ep = 3 with parallel.dp = 4" 4 0 \
  "parallel.ep: 3 does not divide parallel.dp = 4" --set parallel.dp=4 --set parallel.ep=3

echo "train_faults: $([ $failures = 0 ] && echo passed || echo "FAILED ($failures)")"
[ "$failures" -eq 0 ]
