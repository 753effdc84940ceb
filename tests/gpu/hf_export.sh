#!/usr/bin/env bash
# tests/gpu/hf_export.sh - the Hugging Face export against transformers (issue 21's Done-when, GPU machine line), on
# a machine with python3, torch and transformers (the GPU machine's image; the training itself runs on the CPU):
#   1. configs/tiny.ini trained TRAIN_STEPS (default 20) steps in fp32 on the CPU with train.seq_len = 256 (so that a
#      200-byte greedy continuation of a short prompt stays inside one window: fp8moe sample slides a window of
#      seq_len bytes, and transformers' generate attends to everything), checkpointed at the end;
#   2. exported with --dtype fp32 and with the default bf16;
#   3. a fixed batch (4 windows of 257 bytes of tests/data/shakespeare.txt) evaluated by `fp8moe eval --text`, and by
#      AutoModelForCausalLM.from_pretrained(DIR, dtype=float32) on the CPU and the GPU (tests/gpu/hf_export.py):
#      the fp32 export's loss within 1e-4 relative; the bf16 export's difference reported;
#   4. `fp8moe sample --temperature 0` 200 bytes after each of two prompts, against transformers' greedy generate:
#      identical (prompt + 200 <= seq_len).
# Build first (CPU-only is enough): BUILD_ONLY=1 JOBS=16 BUILD=build-gpu MAKE_GOALS="NO_CUDA=1 build-gpu/fp8moe"
# bash tests/gpu/run.sh. Environment: BUILD (default build-gpu), OUT (a copy of the log goes to $OUT/hf_export.log),
# TRAIN_STEPS, OMP_NUM_THREADS (default 8). Results of a run: docs/checkpoints.md, "Exporting to Hugging Face".
set -u -o pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
BIN=$BUILD/fp8moe
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && exec > >(tee -a "$OUT/hf_export.log") 2>&1
. tests/gpu/env.sh
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
T=256 STEPS=200 TRAIN_STEPS=${TRAIN_STEPS:-20}
PROMPTS=("ROMEO:" $'KING RICHARD III:\nNow is the winter of our discontent\n')
"$BIN" train configs/tiny.ini --set data.text=tests/data/shakespeare.txt --set "data.cache_dir=$TMP/data" \
  --set train.device=cpu --set precision.mode=fp32 --set train.steps=$TRAIN_STEPS --set train.seq_len=$T \
  --set checkpoint.every_steps=$TRAIN_STEPS --set "checkpoint.dir=$TMP/run" > "$TMP/train.log" 2>&1 \
  || { echo "FAIL: training"; tail -5 "$TMP/train.log"; exit 1; }
grep -E "^step 20/|val_loss" "$TMP/train.log" | tail -2
"$BIN" export "$TMP/run" --format hf --dtype fp32 --out "$TMP/hf32" && "$BIN" export "$TMP/run" --format hf --out "$TMP/hf16" \
  || { echo "FAIL: export"; exit 1; }
head -c $((4 * T + 1)) < <(tail -c +10001 tests/data/shakespeare.txt) > "$TMP/batch.txt"
"$BIN" eval "$TMP/run" --text "$TMP/batch.txt" | tee "$TMP/eval.log" || { echo "FAIL: fp8moe eval"; exit 1; }
loss=$(sed -n 's/^eval | loss=\([^ ]*\) .*/\1/p' "$TMP/eval.log")
pairs=()
for i in "${!PROMPTS[@]}"; do
  "$BIN" sample "$TMP/run/weights.h5" --prompt "${PROMPTS[$i]}" --steps $STEPS --temperature 0 > "$TMP/sample$i.txt" \
    || { echo "FAIL: fp8moe sample"; exit 1; }
  echo "fp8moe sample: $(head -c 160 "$TMP/sample$i.txt" | tr '\n' '|')"
  pairs+=("${PROMPTS[$i]}" "$TMP/sample$i.txt")
done
python3 tests/gpu/hf_export.py "$TMP/hf32" "$TMP/hf16" "$TMP/batch.txt" $T "$loss" $STEPS "${pairs[@]}"
