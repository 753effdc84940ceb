#!/usr/bin/env bash
# node_limited.sh - node-limited routing under expert parallel (issue 19 item 4): with parallel.gpus_per_node = 2
# eight ranks stand for 4 nodes; configs/tiny.ini's 8 experts in 4 groups over ep = 8 put each group (2 experts,
# ranks 2g and 2g+1) whole on node g. A token's experts then lie in at most moe.n_limited_groups groups, so on at
# most that many nodes: every step's nodes_per_token_max in metrics.jsonl must be <= the limit (and reach it with
# limit 2, 1 with limit 1), and the rows the dispatches count within and across nodes must add up to every
# (token, k) row of the step: 8 ranks x 4 x 32 tokens x top-2 x 3 MoE layers (2 main + the MTP block's).
# A layout that splits an expert group over two nodes (gpus_per_node = 1) is refused, exit 2, naming the keys.
set -u
BUILD=${BUILD:-build}
. tests/mpi/env.sh
BIN=$BUILD/fp8moe
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
common=(train configs/tiny.ini --set train.steps=3 --set train.micro_batch_size=4 --set checkpoint.save_weights=false
        --set train.eval_every=0 --set data.text=tests/data/shakespeare.txt --set "data.cache_dir=$TMP/data"
        --set parallel.dp=8 --set parallel.ep=8)
for limit in 2 1; do
  OMP_NUM_THREADS=1 timeout 120 "${MPIRUN[@]}" -np 8 "$BIN" "${common[@]}" --set parallel.gpus_per_node=2 \
    --set moe.n_limited_groups=$limit --set "checkpoint.dir=$TMP/l$limit" > "$TMP/l$limit.log" 2>&1 \
    || { echo "FAIL: limit $limit: the run failed"; tail -5 "$TMP/l$limit.log"; fail=1; continue; }
  if python3 - "$TMP/l$limit/metrics.jsonl" "$limit" <<'PY'
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
limit, rows = int(sys.argv[2]), 8 * 4 * 32 * 2 * 3
ok = len(steps) == 3
for r in steps:
    total = r["a2a_rows_within_node"] + r["a2a_rows_across_nodes"]
    ok &= r["nodes_per_token_max"] <= limit and total == rows and r["a2a_rows_across_nodes"] > 0
print(f"limit {limit}: nodes per token max {[r['nodes_per_token_max'] for r in steps]}, rows within/across "
      f"{[(r['a2a_rows_within_node'], r['a2a_rows_across_nodes']) for r in steps]} of {rows} per step")
ok &= max(r["nodes_per_token_max"] for r in steps) == limit
sys.exit(0 if ok else 1)
PY
  then echo "ok: n_limited_groups = $limit: no token's experts on more than $limit nodes"
  else echo "FAIL: n_limited_groups = $limit"; fail=1; fi
done
OMP_NUM_THREADS=1 timeout 60 "${MPIRUN[@]}" -np 8 "$BIN" "${common[@]}" --set parallel.gpus_per_node=1 \
  --set "checkpoint.dir=$TMP/split" > "$TMP/split.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && grep -q "moe.n_expert_groups" "$TMP/split.log" && grep -q "parallel.gpus_per_node" "$TMP/split.log"; then
  echo "ok: an expert group split over two nodes is refused (exit $rc, keys named)"
else
  echo "FAIL: gpus_per_node = 1 (exit $rc)"; tail -3 "$TMP/split.log"; fail=1
fi
[ "$fail" -eq 0 ] && echo "node_limited: passed" || echo "node_limited: FAILED"
exit "$fail"
