#!/usr/bin/env bash
# grad_compare.sh - `fp8moe gradcompare` (issue 22 item 4): usage errors (exit 2, message naming the argument);
# then on configs/tiny-fp8.ini (CPU, tests/data text):
#  - the CSV has one row per parameter tensor, named as the model shape implies (the list is built here from
#    tiny-fp8's shape in DeepSeek's naming, and each name must be a dataset name inside a weights.h5 that
#    `fp8moe train` wrote), plus "all", and the tensors' numel sum to the parameter count `train` prints;
#  - the gradients are the step's real ones: each mode's "all" norm equals the grad_norm that `fp8moe train
#    --set train.steps=1 --set precision.mode=M` records for step 1 (another code path: the trainer's own
#    step and norm), to 1e-6 relative;
#  - bf16 and fp8 against fp32 stay within bounds set from what was measured (below);
#  - --weights loads the weights (the norm changes) and is deterministic (two runs give the same CSV bytes);
#  - an fp8+bf16_dgrad arm is fp8 with precision.bf16_dgrad = true: its norm is the step-1 grad_norm of `train
#    --set precision.mode=fp8 --set precision.bf16_dgrad=true`, and it differs from plain fp8's;
#  - --fprop-only narrows the fp8+bf16_fprop arm (precision.bf16_fprop_only): "weight" gives the plain arm's CSV
#    byte for byte, "wq_b" a norm unlike fp8's and the plain arm's, with the fp8 column unchanged; without the
#    arm, or empty, it is a usage error.
# Under FP8MOE_SANITIZE=1 only the usage checks and one fp32,bf16 comparison on a smaller batch run.
set -u
. tests/lib.sh
test_begin grad_compare.sh
TEXT=tests/data/shakespeare.txt  # committed (tests/data/README.md); run from the repository root
[ -f "$TEXT" ] || { echo "FAIL: $TEXT not found (run from the repository root)"; exit 1; }
JOB=configs/tiny-fp8.ini
# one thread: on a busy 2-core machine two threads mostly wait for each other (test_cli.sh)
COMMON=(--set data.text="$TEXT" --set data.cache_dir="$TMP/prepared" --set train.device=cpu --set train.threads=1)

# ---- usage errors: status 2 and a message that names what was wrong
expect_usage gradcompare "unknown mode 'fp16'" $JOB --modes fp32,fp16
expect_usage gradcompare "fp8 appears twice" $JOB --modes fp8,bf16,fp8
expect_usage gradcompare "unknown mode 'fp8+bf16_attn'" $JOB --modes fp8,fp8+bf16_attn
expect_usage gradcompare "precision.bf16_dgrad: true in precision.mode = fp32" $JOB --modes fp32,fp8 \
  --set precision.bf16_dgrad=true
expect_usage gradcompare "at least two modes" $JOB --modes fp32
expect_usage gradcompare "--fprop-only wq_b: expected with the fp8+bf16_fprop arm" $JOB --modes fp32,fp8 --fprop-only wq_b
expect_usage gradcompare "--fprop-only needs tensor-name parts" $JOB --modes fp32,fp8+bf16_fprop --fprop-only ''
expect_usage gradcompare "--modes needs a value" $JOB --modes
expect_usage gradcompare "missing the job file" --modes fp32,bf16
expect_usage gradcompare "$TMP/nope.ini" "$TMP/nope.ini"
expect_usage gradcompare "unknown option --bogus" $JOB --bogus
expect_usage gradcompare "one job file expected" $JOB $JOB
expect_usage gradcompare "expected section.key=value" $JOB --set steps
expect_usage gradcompare "precision.mode is set by --modes" $JOB --set precision.mode=fp8
expect_usage gradcompare "--weights $TMP/nope.h5" $JOB --weights "$TMP/nope.h5"
expect_usage gradcompare "parallel.pp = 1, dp = 2" $JOB --set parallel.dp=2
"$BIN" help gradcompare | grep -q "fp8moe gradcompare JOB.ini" || fail "fp8moe help gradcompare"
[ "$failures" -eq 0 ] && echo "gradcompare usage errors: passed"

if [ "${FP8MOE_SANITIZE:-0}" = 1 ]; then  # one pair, on one sequence of 32 tokens
  "$BIN" gradcompare $JOB --modes fp32,bf16 "${COMMON[@]}" --set train.micro_batch_size=1 --set train.seq_len=32 \
    --out "$TMP/san.csv" > "$TMP/san.log" 2>&1 || { echo "FAIL: gradcompare fp32,bf16:"; tail -5 "$TMP/san.log"; exit 1; }
  grep -A3 "^  mode" "$TMP/san.log"
  [ "$(grep -c . "$TMP/san.csv")" = 95 ] || fail "$TMP/san.csv: expected a header, 93 tensors and all"
  echo "grad_compare.sh: sanitizer pass: usage and one pair"
  test_end
fi

start=$(date +%s) times=()
timed() {  # timed NAME ARGS...: fp8moe ARGS > $TMP/NAME.log (its time kept), or FAIL and exit
  local name=$1 t0=$(date +%s%N); shift
  "$BIN" "$@" > "$TMP/$name.log" 2>&1 || { echo "FAIL: fp8moe $* failed:"; tail -8 "$TMP/$name.log"; exit 1; }
  times+=("$name $(( ($(date +%s%N) - t0) / 1000000 ))ms")
}
# the reference numbers, from the trainer: step 1's grad_norm per mode (fp32's from the 5-step run, whose
# weights.h5 the --weights runs read)
timed train-fp32 train $JOB "${COMMON[@]}" --set precision.mode=fp32 --set train.steps=5 \
  --set checkpoint.save_weights=true --set checkpoint.dir="$TMP/train-fp32"
for m in bf16 fp8; do
  timed train-$m train $JOB "${COMMON[@]}" --set precision.mode=$m --set train.steps=1 --set checkpoint.dir="$TMP/train-$m"
done
timed train-fp8-dgrad train $JOB "${COMMON[@]}" --set precision.mode=fp8 --set precision.bf16_dgrad=true \
  --set train.steps=1 --set checkpoint.dir="$TMP/train-fp8-dgrad"
timed gcv gradcompare $JOB --modes fp8,fp8+bf16_dgrad "${COMMON[@]}" --out "$TMP/v/grads.csv"
# --fprop-only narrows the fp8+bf16_fprop arm only: "weight" (in every name) gives the plain arm's numbers, wq_b others
timed gcf gradcompare $JOB --modes fp8,fp8+bf16_fprop "${COMMON[@]}" --out "$TMP/f/grads.csv"
timed gcfa gradcompare $JOB --modes fp8,fp8+bf16_fprop --fprop-only weight "${COMMON[@]}" --out "$TMP/fa/grads.csv"
timed gcfq gradcompare $JOB --modes fp8,fp8+bf16_fprop --fprop-only wq_b "${COMMON[@]}" --out "$TMP/fq/grads.csv"
cmp -s "$TMP/f/grads.csv" "$TMP/fa/grads.csv" || fail "--fprop-only weight: the CSV differs from the plain fp8+bf16_fprop arm's"
python3 - "$TMP" <<'PY' || fail "--fprop-only wq_b: the arm is not between fp8 and fp8+bf16_fprop (above)"
import csv, sys
f, q = (list(csv.DictReader(open(f"{sys.argv[1]}/{d}/grads.csv")))[-1] for d in ("f", "fq"))
n = "fp8+bf16_fprop_norm"
print(f"--fprop-only wq_b: norm {q[n]} (fp8 {q['fp8_norm']}, every Fprop in BF16 {f[n]})")
sys.exit(0 if q["fp8_norm"] == f["fp8_norm"] and q[n] not in (f[n], f["fp8_norm"]) else 1)
PY
timed gc gradcompare $JOB "${COMMON[@]}" --set checkpoint.dir="$TMP/job"   # default modes fp32,bf16,fp8 and CSV path
sed -n '/^gradcompare: configs/,$p' "$TMP/gc.log"
W="$TMP/train-fp32/weights.h5"
timed gcw1 gradcompare $JOB --modes fp32,bf16 --weights "$W" "${COMMON[@]}" --out "$TMP/w1/grads.csv"
timed gcw2 gradcompare $JOB --modes fp32,bf16 --weights "$W" "${COMMON[@]}" --out "$TMP/w2/grads.csv"
sed -n '/^  mode/,/^  bf16/p' "$TMP/gcw1.log"
echo "runs: $(( $(date +%s) - start ))s (${times[*]})"
cmp -s "$TMP/w1/grads.csv" "$TMP/w2/grads.csv" || fail "two --weights runs wrote different CSVs"

python3 - "$TMP" "$W" <<'PY' || fail "grads.csv: the checks above"
import csv, json, math, re, sys
tmp, weights = sys.argv[1], sys.argv[2]
rows = list(csv.DictReader(open(f"{tmp}/job-gradcompare/grads.csv")))
fail = []

# 1. one row per tensor of tiny-fp8 (dim 384, 2 layers of which 1 dense, 8 routed experts, MTP depth 1), in
#    DeepSeek's names, then "all"
attn = ["attn_norm", "attn.wq_a", "attn.q_norm", "attn.wq_b", "attn.wkv_a", "attn.kv_norm", "attn.wkv_b", "attn.wo",
        "ffn_norm"]
moe = ["ffn.gate"] + [f"ffn.shared_experts.{w}" for w in ("w1", "w2", "w3")]
experts = lambda p: [f"{p}.ffn.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3") for e in range(8)]
want = ["embed.weight"] + [f"layers.0.{t}.weight" for t in attn + ["ffn.w1", "ffn.w2", "ffn.w3"]]
want += [f"layers.1.{t}.weight" for t in attn + moe] + ["norm.weight", "head.weight"]
want += [f"mtp.0.{t}.weight" for t in ("enorm", "hnorm", "eh_proj")]
want += [f"mtp.0.block.{t}.weight" for t in attn + moe] + ["mtp.0.norm.weight"]
want += experts("layers.1") + experts("mtp.0.block")
names = [r["tensor"] for r in rows]
if names[-1] != "all" or sorted(names[:-1]) != sorted(want):
    fail.append(f"CSV rows {len(names)}: expected the {len(want)} tensors of tiny-fp8 and all; "
                f"missing {sorted(set(want) - set(names))}, unexpected {sorted(set(names) - set(want) - {'all'})}")
blob = open(weights, "rb").read()  # the HDF5 file stores its datasets' names as bytes
absent = [n for n in names[:-1] if n.encode() not in blob]
if absent: fail.append(f"not dataset names in {weights}: {absent}")
banner = int(re.search(r"^model: (\d+) parameters", open(f"{tmp}/train-fp32.log").read(), re.M).group(1))
numel = sum(int(r["numel"]) for r in rows[:-1])
if not numel == int(rows[-1]["numel"]) == banner:
    fail.append(f"numel: tensors sum to {numel}, all says {rows[-1]['numel']}, train printed {banner} parameters")

# 2. each mode's global norm is the trainer's step-1 grad_norm (metrics.jsonl keeps 9 digits), the fp8+bf16_dgrad
#    arm's that of fp8 with precision.bf16_dgrad = true
v = list(csv.DictReader(open(f"{tmp}/v/grads.csv")))
for m, run, table in (("fp32", "fp32", rows), ("bf16", "bf16", rows), ("fp8", "fp8", rows),
                      ("fp8+bf16_dgrad", "fp8-dgrad", v)):
    step1 = [json.loads(l) for l in open(f"{tmp}/train-{run}/metrics.jsonl") if '"type":"step"' in l][0]
    got = float(table[-1][f"{m}_norm"])
    rel = abs(got - step1["grad_norm"]) / step1["grad_norm"]
    print(f"{m}: gradcompare norm {got:.9g}, train's step-1 grad_norm {step1['grad_norm']:.9g} (rel {rel:.1e})")
    if rel > 1e-6: fail.append(f"{m}: the all row's norm {got} is not step 1's grad_norm {step1['grad_norm']}")

if v[-1]["fp8+bf16_dgrad_norm"] == v[-1]["fp8_norm"]:
    fail.append(f"fp8+bf16_dgrad: the same norm as fp8's ({v[-1]['fp8_norm']}): the arm ran no BF16 Dgrad")

# 3. bounds. Measured on 2026-12-02 (this CPU, seed 1234, the first batch of tests/data/shakespeare.txt):
#    all rows:             bf16 cos 0.99992 ratio 1.0002;  fp8 cos 0.99672 ratio 0.9977
#    other tensors:        bf16 cos >= 0.99923, ratios 0.995-1.002;  fp8 cos >= 0.98797, ratios 0.985-1.021
#    routers and routed experts: bf16 cos >= 0.9714 (layers.1 expert 0), ratios 0.989-1.059;
#                          fp8 cos >= 0.8697 (mtp expert 3 w2), ratios 0.826 (layers.1 gate)-1.223
#    The routing-dependent tensors move most: a token whose top-2 experts change under the mode's rounding takes
#    its whole contribution from one expert to another, and an expert with few tokens changes by a large
#    fraction (we expect this to be the cause; it is not measured separately). The bounds leave about 2x-5x
#    the measured distance from 1.
bounds = {  # group: (bf16 min cos, fp8 min cos, (min ratio, max ratio))
    "all": (0.9995, 0.99, (0.99, 1.01)),
    "routing": (0.95, 0.80, (0.70, 1.40)),
    "other": (0.995, 0.97, (0.95, 1.05)),
}
group = lambda r: "all" if r["role"] == "all" else "routing" if r["role"] in ("router", "routed_expert") else "other"
for m, mi in (("bf16", 0), ("fp8", 1)):
    for g, b in bounds.items():
        rs = [r for r in rows if group(r) == g and float(r["fp32_norm"]) > 0]
        worst = min(rs, key=lambda r: float(r[f"{m}_cos"]))
        ratios = [float(r[f"{m}_ratio"]) for r in rs]
        print(f"{m} {g:7s} {len(rs):2d} tensors: min cos {float(worst[f'{m}_cos']):.6f} ({worst['tensor']}), "
              f"ratios {min(ratios):.4f}-{max(ratios):.4f}")
        for r in rs:
            c, q = float(r[f"{m}_cos"]), float(r[f"{m}_ratio"])
            if not (c >= b[mi] and b[2][0] <= q <= b[2][1]):
                fail.append(f"{m} {r['tensor']}: cos {c} (bound {b[mi]}), ratio {q} (bound {b[2]})")

# 4. --weights: the weights after 5 steps, not the initial ones
w = list(csv.DictReader(open(f"{tmp}/w1/grads.csv")))
if w[-1]["fp32_norm"] == rows[-1]["fp32_norm"]:
    fail.append(f"--weights: the fp32 norm {w[-1]['fp32_norm']} is that of the initial weights")
print(f"--weights: fp32 norm {w[-1]['fp32_norm']} (initial weights: {rows[-1]['fp32_norm']}), bf16 cos "
      f"{w[-1]['bf16_cos']}, min over tensors {min(float(r['bf16_cos']) for r in w if float(r['fp32_norm']) > 0):.6f}")
for f in fail: print("FAIL:", f)
sys.exit(1 if fail else 0)
PY
test_end
