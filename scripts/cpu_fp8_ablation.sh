#!/usr/bin/env bash
# scripts/cpu_fp8_ablation.sh - the fp8-vs-bf16 convergence question at a size the CPU can repeat over seeds
# (docs/benchmarks.md, "CPU seeds and GEMM-kind ablation"): a 3-layer MoE shaped like configs/bench-1gpu.ini
# (MLA, 8 routed experts top-2 + 1 shared, MTP 1; widths multiples of 128 so the FP8 tiles are full) trained for 300
# steps of 8 x 128 tokens on the first 120,000 bytes of tinyshakespeare (about 2.6 passes over it, so the run
# memorises as the GPU job does), learning rate 1e-3 with 100 warm-up steps and a cosine decay. For each seed it
# runs bf16, fp8, and fp8 with each GEMM kind in BF16 (precision.bf16_fprop / _dgrad / _wgrad), JOBS at a time,
# one thread each, and prints the last 50-step mean training loss of every run and its difference from bf16,
# with the mean, standard deviation and standard error over the seeds.
#   SEEDS (default "1 2 3 4 5 6"), JOBS (default 2), OUT (default a new temporary folder),
#   FP8MOE_BUILD (default build), FP8MOE_SHAKESPEARE (default ../shared/data/tinyshakespeare.txt).
# About 4 to 7 minutes per run on one core of a 2-core machine: 6 seeds x 5 runs take about 1.5 hours.
set -u -o pipefail
BIN=$(realpath "${FP8MOE_BUILD:-build}/fp8moe")
TEXT=${FP8MOE_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
SEEDS=${SEEDS:-1 2 3 4 5 6} JOBS=${JOBS:-2}
OUT=${OUT:-$(mktemp -d /tmp/fp8moe_ablation_XXXXXX)}
mkdir -p "$OUT"
head -c 120000 "$TEXT" > "$OUT/slice.txt" || { echo "cpu_fp8_ablation: cannot read $TEXT"; exit 1; }
cat > "$OUT/mini.ini" <<'INI'
[model]
vocab_size = 256
dim = 256
n_layers = 3
n_dense_layers = 1
inter_dim = 512
n_heads = 2
q_lora_rank = 128
kv_lora_rank = 128
qk_nope_head_dim = 128
qk_rope_head_dim = 64
v_head_dim = 128
init_std = 0.006
[moe]
n_routed_experts = 8
n_shared_experts = 1
n_activated_experts = 2
n_expert_groups = 4
n_limited_groups = 2
moe_inter_dim = 128
route_scale = 2.5
bias_update_speed = 0.01
[optim]
lr = 0.001
min_lr = 0.0001
warmup_steps = 100
[train]
steps = 300
micro_batch_size = 8
seq_len = 128
device = cpu
threads = 1
eval_every = 0
eval_batches = 0
[log]
every = 50
INI
run() {  # variant seed
  local v=$1 s=$2 args=()
  case $v in
    bf16) args=(--set precision.mode=bf16) ;;
    fp8) args=(--set precision.mode=fp8) ;;
    *) args=(--set precision.mode=fp8 --set "precision.bf16_$v=true") ;;
  esac
  "$BIN" train "$OUT/mini.ini" "${args[@]}" --set train.seed="$s" --set data.text="$OUT/slice.txt" \
    --set data.cache_dir="$OUT/prepared" --set checkpoint.dir="$OUT/$v-$s" --set checkpoint.save_weights=false \
    > "$OUT/$v-$s.log" 2>&1 || echo "cpu_fp8_ablation: the $v run of seed $s failed (see $OUT/$v-$s.log)"
  echo "$v seed $s done $(date +%T)"
}
export -f run
export BIN OUT
# the data is prepared once (by a 1-step run) before the parallel runs
"$BIN" train "$OUT/mini.ini" --set train.steps=1 --set data.text="$OUT/slice.txt" --set data.cache_dir="$OUT/prepared" \
  --set checkpoint.dir="$OUT/prepare" --set checkpoint.save_weights=false > "$OUT/prepare.log" 2>&1 ||
  { echo "cpu_fp8_ablation: data preparation failed:"; tail -5 "$OUT/prepare.log"; exit 1; }
for s in $SEEDS; do for v in bf16 fp8 fprop dgrad wgrad; do echo "$v $s"; done; done |
  xargs -P "$JOBS" -L 1 bash -c 'run "$0" "$1"'
python3 - "$OUT" $SEEDS <<'PY'
import json, math, os, sys
out, seeds = sys.argv[1], [int(s) for s in sys.argv[2:]]
variants = ("bf16", "fp8", "fprop", "dgrad", "wgrad")
def last(v, s):
    p = f"{out}/{v}-{s}/metrics.jsonl"
    if not os.path.exists(p): return None
    l = [json.loads(x)["loss"] for x in open(p) if '"type":"step"' in x]
    return sum(l[250:300]) / 50 if len(l) >= 300 and all(map(math.isfinite, l)) else None
print("last 50-step mean training loss (fp8 with <kind> in BF16 as fprop / dgrad / wgrad); difference from bf16")
print("seed " + " ".join(f"{v:>8s}" for v in variants))
diffs = {v: [] for v in variants[1:]}
for s in seeds:
    row = {v: last(v, s) for v in variants}
    print(f"{s:4d} " + " ".join(f"{row[v]:8.4f}" if row[v] else "       -" for v in variants) + "   " +
          " ".join(f"{v} {100 * (row[v] - row['bf16']) / row['bf16']:+.2f}%" for v in variants[1:] if row[v] and row["bf16"]))
    for v in variants[1:]:
        if row[v] and row["bf16"]: diffs[v].append(100 * (row[v] - row["bf16"]) / row["bf16"])
for v, d in diffs.items():
    if len(d) < 2: continue
    m = sum(d) / len(d); sd = (sum((x - m) ** 2 for x in d) / (len(d) - 1)) ** 0.5
    print(f"{v:5s} - bf16 over {len(d)} seeds: mean {m:+.2f}%, sd {sd:.2f}%, standard error {sd / len(d) ** 0.5:.2f}%")
PY
