#!/usr/bin/env bash
# mpi_parity.sh - GPU ranks that share one GPU over the MPI backend train the model of one GPU (issue 19): the
# device-buffer collectives first (test_gpu_comm under mpirun on 2 and 3 ranks), then 20 training steps of
# configs/tiny.ini as dp = 2, ep = 2 on 2 ranks and dp = 4, ep = 4 on 4 ranks, every rank on GPU 0, in bf16 and
# fp8, each against the one-GPU run of the same global batch; every step's loss must agree within 1e-3 relative
# (the training-parity tolerance of tests/gpu/train_parity.sh). Then fp8 dp = 4, ep = 4 with parallel.zero1
# (gradients reduce-scattered, weights all-gathered on the device) against the same reference, and determinism:
# the fp8 dp = 2, ep = 2 run twice gives bitwise-identical losses (reductions in rank order, parallel/comm.h).
#
# The reference is built as tests/mpi/test_parallel_equivalence.c builds it: P ranks of an EP group with B sequences
# each read, micro-batch for micro-batch, the consecutive blocks of one process's micro-batch of P x B sequences
# (data/loader.h), and dispatch fills each expert's segment from source ranks in order, so each expert sees its
# rows in the order of one process; with dp / ep EP groups, one process takes (dp / ep) x A micro-batches. Here
# dp = ep, so the reference is micro_batch_size ep x B, grad_accum A. B x T = 4 x 32 = 128 tokens, one FP8 tile
# along the tokens, so the tiles of every rank cover the rows they cover in one process. Not bitwise: the ranks
# sum their own gradients, then the ranks' sums (docs/parallelism.md), and the GEMMs of P x B rows and of B rows
# may round differently. Run on a GPU machine after tests/gpu/run.sh has built $BUILD (default build-gpu),
# $BUILD/fp8moe and $BUILD/tests/test_gpu_comm; needs Open MPI's mpirun. Pipeline parallel: pp = 2 with dualpipev
# and with dualpipe, and pp = 2 dp = 2 ep = 2 with 1f1b, against the one-GPU run of the same global batch. MPI_PARITY_DEVICE=cpu runs the same
# comparisons on CPU ranks (without test_gpu_comm), to try the script on a machine without a GPU.
# MPI_PARITY_BACKEND=nccl (issue 24, tests/gpu/two_gpu.sh): the same comparisons over the NCCL backend, one GPU per
# rank, on the layouts that fit two GPUs (dp = ep = 2, pp = 2; the 4-rank ones are left out), without the ranks
# that share GPU 0.
set -u
BUILD=${BUILD:-build-gpu}
DEVICE=${MPI_PARITY_DEVICE:-cuda}
BACKEND=${MPI_PARITY_BACKEND:-mpi}
case "$BACKEND" in mpi|nccl) ;; *) echo "mpi_parity: FAIL: MPI_PARITY_BACKEND=$BACKEND: expected mpi or nccl"; exit 2;; esac
export NCCL_NVLS_ENABLE=0
BIN=$BUILD/fp8moe
TEXT=${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
TMP=$(mktemp -d /tmp/fp8moe_mpi_parity_XXXXXX)
trap 'rm -rf "$TMP"' EXIT
fail=0
if ! command -v mpirun >/dev/null 2>&1; then
  echo "mpi_parity: FAIL: mpirun not found (Open MPI's openmpi-bin): the ranks cannot be started"
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# the ranks share the cores: no binding, Open MPI's waits yield, and a few OpenMP threads each
MPIRUN=(mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS=4 -x LD_LIBRARY_PATH
        -x NCCL_NVLS_ENABLE)
MAX_EP=4  # the largest dp = ep layout; over NCCL each rank needs its own GPU
if [ "$BACKEND" = nccl ]; then
  n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "${n_gpus:-0}" -lt 2 ]; then echo "mpi_parity: FAIL: MPI_PARITY_BACKEND=nccl needs 2 GPUs; this machine has ${n_gpus:-0}"; exit 1; fi
  MAX_EP=2
fi

for np in 2 3; do
  [ "$DEVICE" = cuda ] && [ "$BACKEND" = mpi ] || break
  echo "== test_gpu_comm on $np ranks sharing the GPU"
  if ! timeout 300 "${MPIRUN[@]}" -np $np "$BUILD/tests/test_gpu_comm"; then echo "FAIL: test_gpu_comm -np $np"; fail=1; fi
done

run() {  # run NAME RANKS EP MODE [ZERO1]: dp = RANKS, micro-batches of 4 x 32 per rank; RANKS 1 with EP = P: the reference
  local name=$1 np=$2 ep=$3 mode=$4 zero1=${5:-false} B=4 dp=$2 t0=$SECONDS
  if [ "$np" = 1 ]; then B=$((4 * ep)); dp=1; ep=1; fi
  local cmd=("$BIN" train configs/tiny.ini --set train.device="$DEVICE" --set precision.mode="$mode" --set train.steps=20
             --set train.eval_every=0 --set train.eval_batches=1 --set data.text="$TEXT" --set data.cache_dir="$TMP/data"
             --set checkpoint.dir="$TMP/$name" --set checkpoint.save_weights=false --set log.every=5
             --set train.micro_batch_size=$B --set train.grad_accum=1 --set parallel.dp=$dp --set parallel.ep=$ep
             --set parallel.zero1=$zero1 --set parallel.backend=$BACKEND)
  local rc
  if [ "$np" = 1 ]; then timeout 300 "${cmd[@]}" > "$TMP/$name.log" 2>&1; rc=$?
  else timeout 300 "${MPIRUN[@]}" -np "$np" "${cmd[@]}" > "$TMP/$name.log" 2>&1; rc=$?; fi
  if [ $rc -ne 0 ]; then echo "FAIL: $name exited $rc:"; tail -15 "$TMP/$name.log"; fail=1; fi
  echo "$name: $((SECONDS - t0)) s; $(grep -E '^step 20/' "$TMP/$name.log" | head -1)"
  grep -E 'cudaMalloc calls after' "$TMP/$name.log" | sed "s/^/$name: /"
}
compare() {  # compare A B TOLERANCE: per-step losses of A against B (0: bitwise)
  python3 - "$TMP/$1/metrics.jsonl" "$TMP/$2/metrics.jsonl" "$3" <<'PY'
import json, sys
def losses(p):
    try: return [json.loads(l)["loss"] for l in open(p) if '"type":"step"' in l]
    except OSError: return []
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
name = f"{sys.argv[1].split('/')[-2]} vs {sys.argv[2].split('/')[-2]}"
if len(a) != 20 or len(b) != 20:
    print(f"FAIL: {name}: expected 20 steps, got {len(a)} and {len(b)}"); sys.exit(1)
rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
worst = max(rel)
ok = worst <= tol if tol > 0 else a == b
print(f"{'ok' if ok else 'FAIL'}: {name}: max relative loss difference over 20 steps {worst:.3e} at step "
      f"{rel.index(worst) + 1}, step 1 {rel[0]:.3e}, step 20 losses {a[-1]:.7f} / {b[-1]:.7f} "
      f"({'limit %g' % tol if tol > 0 else 'bitwise'})")
sys.exit(0 if ok else 1)
PY
  [ $? -eq 0 ] || fail=1
}
for mode in bf16 fp8; do
  for ep in 2 4; do
    [ "$ep" -le "$MAX_EP" ] || continue
    run one_b$((4 * ep))_$mode 1 $ep $mode
    run dp${ep}_ep${ep}_$mode $ep $ep $mode
    compare dp${ep}_ep${ep}_$mode one_b$((4 * ep))_$mode 1e-3
  done
done
# ZeRO-1: the gradients reduce-scattered and the weights all-gathered on the device (in place, staged)
if [ "$MAX_EP" -ge 4 ]; then
  run dp4_ep4_fp8_zero1 4 4 fp8 true
  compare dp4_ep4_fp8_zero1 one_b16_fp8 1e-3
fi
run dp2_ep2_fp8_again 2 2 fp8
compare dp2_ep2_fp8_again dp2_ep2_fp8 0
# pipeline parallel (issue 20), ranks sharing the GPU: tiny.ini with 4 layers, 4 micro-batches of 4 x 32 per dp rank
run_pp() {  # run_pp NAME RANKS PP SCHEDULE EP MODE: dp = RANKS / PP; RANKS 1: the one-GPU reference of dp = EP
  local name=$1 np=$2 pp=$3 sched=$4 ep=$5 mode=$6 B=4 A=4 t0=$SECONDS
  local dp=$((np / pp))
  if [ "$np" = 1 ]; then B=$((4 * ep)); dp=1; ep=1; fi
  local cmd=("$BIN" train configs/tiny.ini --set train.device="$DEVICE" --set precision.mode="$mode" --set train.steps=20
             --set train.eval_every=0 --set train.eval_batches=1 --set data.text="$TEXT" --set data.cache_dir="$TMP/data"
             --set checkpoint.dir="$TMP/$name" --set checkpoint.save_weights=false --set log.every=5
             --set model.n_layers=4 --set train.micro_batch_size=$B --set train.grad_accum=$A --set parallel.pp=$pp
             --set parallel.schedule="$sched" --set parallel.dp=$dp --set parallel.ep=$ep --set parallel.backend=$BACKEND)
  local rc
  if [ "$np" = 1 ]; then timeout 300 "${cmd[@]}" > "$TMP/$name.log" 2>&1; rc=$?
  else timeout 300 "${MPIRUN[@]}" -np "$np" "${cmd[@]}" > "$TMP/$name.log" 2>&1; rc=$?; fi
  if [ $rc -ne 0 ]; then echo "FAIL: $name exited $rc:"; tail -15 "$TMP/$name.log"; fail=1; fi
  echo "$name: $((SECONDS - t0)) s; $(grep -E '^step 20/' "$TMP/$name.log" | head -1)"
}
for mode in bf16 fp8; do
  run_pp one_L4_b4_$mode 1 1 1f1b 1 $mode
  run_pp pp2_dualpipev_$mode 2 2 dualpipev 1 $mode
  compare pp2_dualpipev_$mode one_L4_b4_$mode 1e-3
  run_pp pp2_dualpipe_$mode 2 2 dualpipe 1 $mode
  compare pp2_dualpipe_$mode one_L4_b4_$mode 1e-3
  [ "$MAX_EP" -ge 4 ] || continue  # pp = 2 with dp = ep = 2 takes 4 ranks
  run_pp one_L4_b8_$mode 1 1 1f1b 2 $mode
  run_pp pp2_dp2_ep2_1f1b_$mode 4 2 1f1b 2 $mode
  compare pp2_dp2_ep2_1f1b_$mode one_L4_b8_$mode 1e-3
done
[ $fail -eq 0 ] && echo "mpi_parity ($BACKEND): passed" || echo "mpi_parity ($BACKEND): FAILED"
exit $fail
