#!/usr/bin/env bash
# tests/bench/run.sh - `make bench`: CPU training throughput of the default job (configs/shakespeare.ini)
# and, measured in the same run as the comparison point, the speed of the CPU matmul at the job's GEMM
# shapes, which bounds what the step can reach. Results go to docs/benchmarks.md by hand, with date
# and machine.
#   BUILD (default build), FP8MOE_SHAKESPEARE (text), BENCH_STEPS (default 60, first 10 are warm-up)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
TEXT=${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
STEPS=${BENCH_STEPS:-60}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
echo "bench: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
"$BUILD/bench/bench_matmul"
"$BUILD/fp8moe" train configs/shakespeare.ini --set data.text="$TEXT" --set train.steps="$STEPS" \
  --set train.eval_every=0 --set train.eval_batches=1 --set checkpoint.dir="$out" \
  --set checkpoint.save_weights=false --set log.every=1000000 > "$out/train.log"
# tokens/s over the steps after the warm-up, from the metrics file (elapsed_s is cumulative)
python3 - "$out/metrics.jsonl" "$STEPS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"type":"step"' in l]
steps = int(sys.argv[2]); warm = 10
t0 = next(r for r in rows if r["step"] == warm)["elapsed_s"]; t1 = rows[-1]["elapsed_s"]
tokens_per_step = 16 * 128
tps = (rows[-1]["step"] - warm) * tokens_per_step / (t1 - t0)
print(f"default job (configs/shakespeare.ini, 16 x 128 tokens/step): {tps:,.0f} tokens/s "
      f"over steps {warm + 1}-{rows[-1]['step']} ({(t1 - t0) / (rows[-1]['step'] - warm):.3f} s/step)")
PY
grep -E "active|param" "$out/train.log" | head -3 || true
# on a GPU machine: the training step in fp8 and bf16 with its phase breakdown (configs/bench-1gpu.ini)
if nvidia-smi >/dev/null 2>&1; then
  "$BUILD/fp8moe" bench step
fi
