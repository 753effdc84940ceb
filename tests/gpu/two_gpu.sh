#!/usr/bin/env bash
# two_gpu.sh - issue 24's runs on a machine with two GPUs (device kind nvidia-h200-x2), after tests/gpu/run.sh
# has built $BUILD (default build-gpu), one GPU per rank over NCCL (NCCL_NVLS_ENABLE=0 always):
#   1. equivalence: tests/gpu/mpi_parity.sh with MPI_PARITY_BACKEND=nccl (dp = 2 ep = 2 and pp = 2 with
#      dualpipev and dualpipe, bf16 and fp8, 20 steps of tiny.ini each against the one-GPU run of the same global
#      batch within the training-parity tolerance 1e-3, and dp = 2 ep = 2 fp8 twice bitwise);
#   2. weak scaling: `fp8moe bench step configs/bench-1gpu.ini` on one GPU and `mpirun -np 2 fp8moe bench step
#      configs/bench-2gpu.ini` (twice the experts, ep = 2: the same parameters and tokens per GPU) in this call,
#      MTP off as issue 4's comparison point; the efficiency is tokens/s per rank over the one-GPU tokens/s;
#   3. `mpirun -np 2 fp8moe bench a2a` (bench-1gpu's shapes) beside the raw NCCL all-to-all at the same bytes;
#   4. the pipeline: `mpirun -np 2 fp8moe bench step configs/bench-1gpu.ini --set parallel.pp=2` with 1f1b, zb1p,
#      dualpipev and dualpipe over 8 micro-batches of 4 x 2048: step time, and the measured bubble beside the
#      simulator's from every stage's measured F, B and W (bench step's pipeline lines, docs/gpu.md "Step benchmark").
# Prints a summary of the numbers; logs under $OUT (default /tmp/fp8moe_two_gpu) for docs/benchmarks.md.
# STAGES (default "1 2 3 4") picks the parts. Exit status non-zero if a part failed (numbers are not judged here:
# performance targets are read from the logs, never asserted by a test).
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
BIN=$BUILD/fp8moe
OUT=${OUT:-/tmp/fp8moe_two_gpu}
TEXT=${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
STAGES=${STAGES:-1 2 3 4}
mkdir -p "$OUT"
. tests/gpu/env.sh
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${n_gpus:-0}" -lt 2 ]; then echo "two_gpu: FAIL: needs 2 GPUs; this machine has ${n_gpus:-0} (nvidia-h200-x2)"; exit 1; fi
[ -x "$BIN" ] || { echo "two_gpu: FAIL: $BIN not built (tests/gpu/run.sh builds it)"; exit 1; }
[ -f "$TEXT" ] || { echo "two_gpu: FAIL: $TEXT not found (FP8MOE_SHAKESPEARE)"; exit 1; }
MPIRUN=(mpirun --bind-to none -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x OMP_NUM_THREADS=4)
DATA=(--set data.text="$TEXT" --set data.cache_dir="$OUT/prepared")
fail=0
part() { echo; echo "== $*"; }
runlog() {  # runlog NAME CMD...: CMD's output into $OUT/NAME.log (and the end of it here on failure)
  local name=$1; shift
  local t0=$SECONDS
  if ! timeout 900 "$@" > "$OUT/$name.log" 2>&1; then
    echo "FAIL: $name (exit $?):"; tail -20 "$OUT/$name.log"; fail=1; return 1
  fi
  echo "$name: $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$OUT/gpus.csv"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1

for stage in $STAGES; do
  case $stage in
  1)
    part "1. equivalence over NCCL (tests/gpu/mpi_parity.sh, MPI_PARITY_BACKEND=nccl)"
    runlog parity env MPI_PARITY_BACKEND=nccl BUILD="$BUILD" FP8MOE_SHAKESPEARE="$TEXT" bash tests/gpu/mpi_parity.sh
    grep -E '^(ok|FAIL):' "$OUT/parity.log"
    ;;
  2)
    part "2. weak scaling: bench-1gpu on one GPU, bench-2gpu on two"
    runlog step_1gpu "$BIN" bench step configs/bench-1gpu.ini --set mtp.depth=0 "${DATA[@]}"
    runlog step_2gpu "${MPIRUN[@]}" -np 2 "$BIN" bench step configs/bench-2gpu.ini --set mtp.depth=0 "${DATA[@]}"
    python3 - "$OUT/step_1gpu.log" "$OUT/step_2gpu.log" <<'PY' || fail=1
import re, sys
def table(path, mode):
    text = open(path).read()
    m = re.search(r"^%s: \d+ steps.*?(?:\n\n|\Z)" % mode, text, re.M | re.S)
    if not m: sys.exit("no %s table in %s" % (mode, path))
    t = m.group(0)
    get = lambda label: float(re.search(r"^  %s +([0-9.]+)" % re.escape(label), t, re.M).group(1))
    return t, get
for mode in ("fp8", "bf16"):
    _, one = table(sys.argv[1], mode)
    t2, two = table(sys.argv[2], mode)
    eff = two("tokens/s/rank") / one("tokens/s")
    comm = sum(two(p) for p in ("EP all-to-all", "grad sync"))
    print("%s: one GPU %.0f tokens/s, two GPUs %.0f tokens/s (%.0f per GPU): weak-scaling efficiency %.1f%% "
          "(target >= 95%%); peak %.1f / %.1f GiB; EP all-to-all + grad sync %.1f ms of %.1f ms per step"
          % (mode, one("tokens/s"), two("tokens/s"), two("tokens/s/rank"), 100 * eff, one("peak memory"),
             two("peak memory"), comm, float(re.search(r"([0-9.]+) ms/step", t2).group(1))))
PY
    ;;
  3)
    part "3. bench a2a on two GPUs against the raw NCCL all-to-all"
    runlog a2a "${MPIRUN[@]}" -np 2 "$BIN" bench a2a configs/bench-1gpu.ini
    grep -E 'x raw|GB/s' "$OUT/a2a.log" | head -20
    ;;
  4)
    part "4. the pipeline: pp = 2 on bench-1gpu, each schedule, 8 micro-batches of 4 x 2048"
    for sched in 1f1b zb1p dualpipev dualpipe; do
      runlog "pp2_$sched" "${MPIRUN[@]}" -np 2 "$BIN" bench step configs/bench-1gpu.ini --set mtp.depth=0 \
        --set parallel.pp=2 --set parallel.schedule=$sched --set train.micro_batch_size=4 --set train.grad_accum=8 \
        "${DATA[@]}" && grep -E '^(fp8|bf16): [0-9]+ steps|^(fp8|bf16) pipeline|^    rank |^  (simulated|measured|stage balance)' \
        "$OUT/pp2_$sched.log"
    done
    ;;
  *) echo "two_gpu: FAIL: unknown stage $stage (STAGES: 1 2 3 4)"; fail=1 ;;
  esac
done
echo
[ $fail -eq 0 ] && echo "two_gpu: every part ran (logs in $OUT)" || echo "two_gpu: FAILED (logs in $OUT)"
exit $fail
