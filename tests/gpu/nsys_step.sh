#!/usr/bin/env bash
# tests/gpu/nsys_step.sh - GPU time per kernel over a few training steps of the full configs/bench-1gpu.ini
# (MTP off, 16 x 2048 tokens per step, as `bench step`), from Nsight Systems: unlike kernel_profile.sh
# (ncu, which serialises kernels and needs a cut-down model), kernels run as in training, so the sums
# are the real per-kernel share of a step. MODES (default "fp8 bf16"), STEPS (default 4; the first is
# warm-up and included in the sums). Needs a build in $BUILD (default build-gpu) and nsys.
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
STEPS=${STEPS:-4}
OUTDIR=${OUT:-/tmp}
. tests/gpu/env.sh
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)
if [ -z "$NSYS" ]; then echo "nsys_step: nsys not found"; exit 1; fi
for mode in ${MODES:-fp8 bf16}; do
  rep=$OUTDIR/step_$mode
  "$NSYS" profile -t cuda -s none --cpuctxsw=none -f true -o "$rep" \
    "$BUILD/fp8moe" train configs/bench-1gpu.ini --set mtp.depth=0 --set train.steps="$STEPS" \
    --set precision.mode="$mode" --set train.eval_every=0 --set train.eval_batches=1 --set checkpoint.save_weights=false \
    --set data.text="${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}" \
    --set checkpoint.dir="$OUTDIR/nsys_run_$mode" > "$OUTDIR/nsys_train_$mode.log" 2>&1
  echo "nsys_step: $mode: exit $? ($STEPS steps); $(grep -E "^step" "$OUTDIR/nsys_train_$mode.log" | tail -n 1)"
  "$NSYS" stats -q --report cuda_gpu_kern_sum --format csv -o "$rep" "$rep.nsys-rep" > /dev/null 2>&1
  python3 - "${rep}_cuda_gpu_kern_sum.csv" "$STEPS" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
steps = int(sys.argv[2])
tot = sum(float(r["Total Time (ns)"]) for r in rows)
print(f"  {tot / 1e6 / steps:9.1f} ms of kernel time per step ({steps} steps), top kernels:")
for r in rows[:40]:
    t = float(r["Total Time (ns)"])
    print(f"  {t / 1e6 / steps:9.2f} ms/step {100 * t / tot:5.1f}% {int(r['Instances']) // steps:7d}x/step  {r['Name'][:110]}")
PY
done
