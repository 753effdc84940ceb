#!/usr/bin/env bash
# rank_memory.sh - a rank holds its share of the model (issue 19): at dp = 4, ep = 4 rank 0's parameters (and
# gradients) are every non-expert element plus a quarter of the experts' elements, its AdamW moments the same
# elements, and with parallel.zero1 only its shards: a quarter of the non-expert part (rounded up: rank 0 takes the
# remainder first, train/train_state.h) plus its experts, whose edp group is itself. The whole model's numbers come
# from the one-process run of the same config; the trainer prints `memory...: parameters N elements (D non-expert +
# X of experts ...) ... AdamW moments for M elements`.
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
BIN=$BUILD/fp8moe
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
common=(train configs/tiny.ini --set train.steps=1 --set checkpoint.save_weights=false --set train.eval_every=0
        --set data.text=tests/data/shakespeare.txt --set "data.cache_dir=$TMP/data")
nums() {  # the four numbers of the memory line: parameters, non-expert, experts, moments
  sed -n 's/^memory[^:]*: parameters \([0-9]*\) elements (\([0-9]*\) non-expert + \([0-9]*\) of experts.*AdamW moments for \([0-9]*\) elements.*/\1 \2 \3 \4/p' "$1"
}
"$BIN" "${common[@]}" --set "checkpoint.dir=$TMP/one" > "$TMP/one.log" 2>&1 || { echo "FAIL: one process"; tail -3 "$TMP/one.log"; exit 1; }
read -r n d x m < <(nums "$TMP/one.log")
for z in false true; do
  OMP_NUM_THREADS=1 "${MPIRUN[@]}" -np 4 "$BIN" "${common[@]}" --set parallel.dp=4 --set parallel.ep=4 \
    --set parallel.zero1=$z --set "checkpoint.dir=$TMP/ep4$z" > "$TMP/ep4$z.log" 2>&1 \
    || { echo "FAIL: dp=4 ep=4 zero1=$z"; tail -5 "$TMP/ep4$z.log"; fail=1; continue; }
  read -r rn rd rx rm < <(nums "$TMP/ep4$z.log")
  want_x=$((x / 4)); want_m=$((d + x / 4))
  [ "$z" = true ] && want_m=$(( (d + 3) / 4 + x / 4 ))
  if [ "$rd" -eq "$d" ] && [ "$rx" -eq "$want_x" ] && [ "$rn" -eq $((d + want_x)) ] && [ "$rm" -eq "$want_m" ]; then
    echo "ok: dp=4 ep=4 zero1=$z: rank 0 holds $rn of $n parameters ($rd non-expert + $rx of $x expert), moments for $rm"
  else
    echo "FAIL: dp=4 ep=4 zero1=$z: rank 0 holds $rn ($rd + $rx), moments $rm; expected $((d + want_x)) ($d + $want_x), moments $want_m"
    fail=1
  fi
done
[ "$fail" -eq 0 ] && echo "rank_memory: passed" || echo "rank_memory: FAILED"
exit "$fail"
