#!/usr/bin/env bash
# tests/gpu/kernel_profile.sh - GPU time per kernel of one training step, from Nsight Compute (ncu),
# to see which kernels a step's phases are made of and how much of a phase is GPU work at all (the rest
# is the GPU waiting for the host). Runs `fp8moe train` for 1 step of configs/bench-1gpu.ini cut to
# LAYERS layers (default 2: the dense layer and one MoE layer; every kernel shape is the full job's)
# with one micro-batch of MB sequences (default 4), in precision MODE (default fp8), then sums
# gpu__time_duration per kernel name. ncu serialises kernels, so only the per-kernel times mean
# anything, not the wall time. Needs a build in $BUILD (default build-gpu, tests/gpu/run.sh makes it).
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
LAYERS=${LAYERS:-2} MB=${MB:-4} MODE=${MODE:-fp8}
OUTDIR=${OUT:-/tmp}
. tests/gpu/env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then echo "kernel_profile: ncu not found"; exit 1; fi
csv=$OUTDIR/kernels_$MODE.csv
"$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$csv" \
  "$BUILD/fp8moe" train configs/bench-1gpu.ini --set model.n_layers="$LAYERS" --set mtp.depth=0 \
  --set train.micro_batch_size="$MB" --set train.grad_accum=1 --set train.steps=1 --set precision.mode="$MODE" \
  --set data.text="${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}" \
  --set checkpoint.dir="$OUTDIR/kp_run" > "$OUTDIR/kernel_profile_train_$MODE.log" 2>&1
echo "kernel_profile: ncu exit $? ($MODE, $LAYERS layers, $MB x 2048 tokens, 1 step)"
python3 - "$csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; name_i = hdr.index("Kernel Name"); val_i = hdr.index("Metric Value"); unit_i = hdr.index("Metric Unit")
tot = collections.defaultdict(float); cnt = collections.Counter()
scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}
for r in rows[1:]:
    name = r[name_i].split("(")[0].split("<")[0].strip()
    tot[name] += float(r[val_i].replace(",", "")) * scale.get(r[unit_i], 1e-6); cnt[name] += 1
all_ms = sum(tot.values())
print(f"{sum(cnt.values())} kernels, {all_ms:.2f} ms of GPU time")
for name, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:30]:
    print(f"  {ms:9.3f} ms {100 * ms / all_ms:5.1f}%  {cnt[name]:6d}x  {name[:90]}")
PY
