#!/usr/bin/env bash
# hf_export.sh - `fp8moe export --format hf` and `fp8moe eval` (issue 21 item 5), through the command line:
#   1. configs/tiny.ini trained 6 steps with checkpoint.every_steps = 3; its checkpoint (DIR, so DIR/latest) exported
#      with --dtype bf16 and fp32; tests/unit/hf_export_check.py (standard library only) checks config.json against
#      the job, the safetensors header (names, shapes, dtypes of transformers' DeepseekV3ForCausalLM and DeepSeek's
#      MTP layout), the FP32 values against the checkpoint's rank files and the BF16 values as their rounding;
#      a weights.h5 exports to the same bytes as the checkpoint of the same step;
#   2. `fp8moe eval` of the checkpoint, of DIR/latest and of weights.h5 prints the trainer's last val_loss exactly
#      (tolerance 0: the same kernels over the same rows in the same order on the same weights, one thread; both are
#      printed with 9 significant digits), and --text / --shards evaluate other data;
#   3. under mpirun (when present): a pp = 2, dp = 2, ep = 2 checkpoint exports, and eval of it matches that run's
#      val_loss within 1e-6 relative (its sum over ranks is in another order than one process's);
#   4. errors: a missing checkpoint, a bad --format, an unwritable --out, a --set of a model key, a missing --text
#      file each exit non-zero naming the thing.
# One thread, tests/data/shakespeare.txt.
set -u
BUILD=${FP8MOE_BUILD:-${BUILD:-build}}
BIN=$BUILD/fp8moe
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=1
fail=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fail=1; }
C=(--set data.text=tests/data/shakespeare.txt --set "data.cache_dir=$TMP/data")
last_val() { grep '"type":"eval"' "$1" | tail -1 | sed 's/.*"val_loss":\([^,]*\),.*/\1/'; }
eval_loss() { sed -n 's/^eval | loss=\([^ ]*\) .*/\1/p' "$1"; }

# ---- 1. train, export, check the files
"$BIN" train configs/tiny.ini "${C[@]}" --set train.steps=6 --set train.eval_every=0 --set checkpoint.every_steps=3 \
  --set "checkpoint.dir=$TMP/run" > "$TMP/train.log" 2>&1 || { bad "training"; tail -3 "$TMP/train.log"; exit 1; }
"$BIN" export "$TMP/run" --format hf --out "$TMP/hf" > "$TMP/export.log" 2>&1 &&
  "$BIN" export "$TMP/run/latest" --format hf --out "$TMP/hf32" --dtype fp32 >> "$TMP/export.log" 2>&1 &&
  "$BIN" export "$TMP/run/weights.h5" --format hf --out "$TMP/hfw" >> "$TMP/export.log" 2>&1
if [ $? -eq 0 ] && grep -q "exported checkpoint .*step_00000006 (step 6) to $TMP/hf:" "$TMP/export.log"; then
  ok "exported the step 6 checkpoint (bf16, fp32) and weights.h5"
  python3 tests/unit/hf_export_check.py configs/tiny.ini "$TMP/hf" "$TMP/hf32" "$TMP/run/step_00000006" || fail=1
  # the same weights from the two sources: the same tensors (the metadata names the source, so it differs)
  if cmp -s "$TMP/hf/config.json" "$TMP/hfw/config.json" && python3 - "$TMP/hf" "$TMP/hfw" <<'PY'
import json, struct, sys
def body(d):
    b = open(d + "/model.safetensors", "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n]); h.pop("__metadata__")
    return h, b[8 + n:]
sys.exit(0 if body(sys.argv[1]) == body(sys.argv[2]) else 1)
PY
  then ok "weights.h5 exports the same config.json and tensors as the checkpoint of its step"
  else bad "the exports of weights.h5 and of the step 6 checkpoint differ"; fi
else
  bad "export"; cat "$TMP/export.log"
fi

# ---- 2. eval against the trainer's evaluation
want=$(last_val "$TMP/run/metrics.jsonl")
for src in "$TMP/run" "$TMP/run/latest" "$TMP/run/weights.h5"; do
  "$BIN" eval "$src" > "$TMP/eval.log" 2>&1; rc=$?
  got=$(eval_loss "$TMP/eval.log")
  if [ "$rc" -eq 0 ] && [ -n "$want" ] && [ "$got" = "$want" ] && grep -q "mtp_loss=" "$TMP/eval.log"; then
    ok "eval ${src#$TMP/}: loss=$got, the trainer's last val_loss exactly"
  else bad "eval ${src#$TMP/}: exit $rc, loss '$got', trainer's val_loss '$want'"; cat "$TMP/eval.log"; fi
done
"$BIN" eval "$TMP/run" --text tests/data/shakespeare.txt --batches 3 > "$TMP/text.log" 2>&1 &&
  "$BIN" eval "$TMP/run/step_00000003" --shards "$(sed -n 's/^data: .* in \(.*\): .*/\1/p' "$TMP/eval.log")" \
    --set train.micro_batch_size=2 > "$TMP/shards.log" 2>&1
if [ $? -eq 0 ] && grep -q "^eval | loss=.* | 384 targets" "$TMP/text.log" && grep -q "(step 3)" "$TMP/shards.log" \
   && grep -q "of 2 x 32 tokens" "$TMP/shards.log"; then
  ok "eval --text FILE --batches 3 and eval --shards DIR --set train.micro_batch_size=2: $(eval_loss "$TMP/text.log"), $(eval_loss "$TMP/shards.log")"
else bad "eval --text / --shards"; cat "$TMP/text.log" "$TMP/shards.log"; fi

# ---- 3. a checkpoint of another layout
if command -v mpirun > /dev/null && [ "${FP8MOE_SANITIZE:-0}" != 1 ]; then
  . tests/mpi/env.sh
  timeout 300 "${MPIRUN[@]}" -np 4 -x OMP_NUM_THREADS=1 "$BIN" train configs/tiny.ini "${C[@]}" --set train.steps=4 \
    --set train.eval_every=0 --set checkpoint.every_steps=4 --set parallel.pp=2 --set parallel.dp=2 \
    --set parallel.ep=2 --set checkpoint.save_weights=false --set "checkpoint.dir=$TMP/pp" > "$TMP/pp.log" 2>&1
  if [ $? -eq 0 ] && "$BIN" export "$TMP/pp" --format hf --out "$TMP/hfpp" > "$TMP/ppx.log" 2>&1 &&
     "$BIN" eval "$TMP/pp" > "$TMP/ppe.log" 2>&1; then
    ppwant=$(last_val "$TMP/pp/metrics.jsonl"); ppgot=$(eval_loss "$TMP/ppe.log")
    if python3 -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(abs(a - b) > 1e-6 * abs(a))" \
         "$ppwant" "$ppgot"; then
      ok "pp=2 dp=2 ep=2 checkpoint ($(ls "$TMP/pp/step_00000004" | grep -c '^rank') rank files): exported; eval loss=$ppgot, the run's val_loss $ppwant"
    else bad "pp=2 dp=2 ep=2: eval loss '$ppgot', the run's val_loss '$ppwant'"; fi
  else bad "pp=2 dp=2 ep=2: train, export or eval failed"; for f in pp ppx ppe; do [ -f "$TMP/$f.log" ] && tail -n 3 "$TMP/$f.log"; done; fi
else
  echo "skip: no mpirun (or under the sanitizers): the pp=2 dp=2 ep=2 checkpoint case"
fi

# ---- 4. errors name the thing
expect_error() {  # expect_error RC TEXT DESCRIPTION -- COMMAND...
  local want_rc=$1 text=$2 what=$3; shift 4
  "$@" > "$TMP/err.log" 2>&1; local rc=$?
  if [ "$rc" -eq "$want_rc" ] && grep -qF -- "$text" "$TMP/err.log"; then ok "$what: exit $rc, names $text"
  else bad "$what: exit $rc (expected $want_rc), output:"; cat "$TMP/err.log"; fi
}
expect_error 1 "$TMP/nothing" "export of a missing checkpoint" -- "$BIN" export "$TMP/nothing" --format hf --out "$TMP/x"
expect_error 1 "$TMP/nothing" "eval of a missing checkpoint" -- "$BIN" eval "$TMP/nothing"
expect_error 2 "--format onnx" "export --format onnx" -- "$BIN" export "$TMP/run" --format onnx --out "$TMP/x"
expect_error 2 "--format" "export without --format" -- "$BIN" export "$TMP/run" --out "$TMP/x"
touch "$TMP/afile"
expect_error 1 "$TMP/afile" "export --out under a regular file" -- "$BIN" export "$TMP/run" --format hf --out "$TMP/afile/hf"
expect_error 2 "model.dim" "eval --set model.dim=64" -- "$BIN" eval "$TMP/run" --set model.dim=64
expect_error 1 "$TMP/none.txt" "eval --text of a missing file" -- "$BIN" eval "$TMP/run" --text "$TMP/none.txt"
[ ! -e "$TMP/x" ] && ok "no output directory was made by the failed exports" || bad "a failed export left $TMP/x"
[ "$fail" -eq 0 ] && echo "hf_export.sh: passed" || echo "hf_export.sh: FAILED"
exit "$fail"
