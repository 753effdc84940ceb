#!/usr/bin/env bash
# tests/gpu/kernel_profile.sh - GPU time per kernel of one training step, from Nsight Compute (ncu),
# to see which kernels a step's phases are made of and how much of a phase is GPU work at all (the rest
# is the GPU waiting for the host). Runs `fp8moe train` for STEPS steps (default 2) of
# configs/bench-1gpu.ini cut to LAYERS layers (default 2: the dense layer and one MoE layer; every kernel
# shape is the full job's) with one micro-batch of MB sequences (default 4), in precision MODE (default
# fp8), then tests/gpu/kernel_profile_summary.py sums gpu__time_duration per kernel name over the LAST
# step only: the first step also times cuBLASLt's algorithm candidates (gemm.cu tuning) and fills the
# weight caches, and the trainer's final evaluation runs forwards after the last step. ncu serialises
# kernels, so only the per-kernel times mean anything, not the wall time. Needs a build in $BUILD
# (default build-gpu, tests/gpu/run.sh makes it).
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
LAYERS=${LAYERS:-2} MB=${MB:-4} MODE=${MODE:-fp8} STEPS=${STEPS:-2}
OUTDIR=${OUT:-/tmp}
. tests/gpu/env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then echo "kernel_profile: ncu not found"; exit 1; fi
csv=$OUTDIR/kernels_$MODE.csv
"$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$csv" \
  "$BUILD/fp8moe" train configs/bench-1gpu.ini --set model.n_layers="$LAYERS" --set mtp.depth=0 \
  --set train.micro_batch_size="$MB" --set train.grad_accum=1 --set train.steps="$STEPS" --set train.eval_every=0 \
  --set precision.mode="$MODE" --set data.text="${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}" \
  --set checkpoint.dir="$OUTDIR/kp_run" > "$OUTDIR/kernel_profile_train_$MODE.log" 2>&1
echo "kernel_profile: ncu exit $? ($MODE, $LAYERS layers, $MB x 2048 tokens, $STEPS steps, the last one reported)"
python3 tests/gpu/kernel_profile_summary.py "$csv" "$STEPS"
