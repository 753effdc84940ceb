"""tests/gpu/kernel_profile_summary.py - the per-kernel table of tests/gpu/kernel_profile.sh: GPU time per
kernel name (ncu's gpu__time_duration) over one training step of an `fp8moe train` run profiled with --csv.

A step is found by its first kernel: with MTP off and one micro-batch per step (as kernel_profile.sh runs
it), every forward pass starts with one embedding_forward_kernel, so training step s (1-based) is the
kernels from the s-th embedding_forward up to the next one (the trainer's final evaluation, also forwards,
follows the last step). The last training step is reported by default: step 1 also holds one-time work
(cuBLASLt algorithm tuning, weight-cache fills); a later step still tunes the routed experts' GEMM size
classes it meets for the first time (count_differing_kernel and extra nvjet launches in the table).

  python3 tests/gpu/kernel_profile_summary.py kernels.csv STEPS [STEP]
"""
import collections
import csv
import sys

# ncu writes the unit of each value; both spellings have been seen
TO_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}
STEP_START = "embedding_forward_kernel"


def kernels(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    hdr = rows[0]
    name_i, val_i, unit_i = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
    out = []
    for r in rows[1:]:
        if r[unit_i] not in TO_MS:
            sys.exit(f"kernel_profile_summary: unknown time unit {r[unit_i]!r} in {path}")
        name = r[name_i].split("(")[0].strip()
        out.append((name, float(r[val_i].replace(",", "")) * TO_MS[r[unit_i]]))
    return out


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    seq = kernels(sys.argv[1])
    steps = int(sys.argv[2])
    step = int(sys.argv[3]) if len(sys.argv) == 4 else steps
    starts = [i for i, (name, _) in enumerate(seq) if name.startswith(STEP_START)]
    if not 1 <= step <= steps or len(starts) < steps:
        sys.exit(f"kernel_profile_summary: asked for step {step} of {steps}, found {len(starts)} forward passes")
    first = starts[step - 1]
    last = starts[step] if step < len(starts) else len(seq)
    part = seq[first:last]
    tot, cnt = collections.defaultdict(float), collections.Counter()
    for name, ms in part:
        tot[name] += ms
        cnt[name] += 1
    all_ms = sum(tot.values())
    print(f"step {step} of {steps}: {len(part)} kernels, {all_ms:.2f} ms of GPU time "
          f"(the whole profile: {len(seq)} kernels, {sum(ms for _, ms in seq):.2f} ms)")
    for name, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {ms:9.3f} ms {100 * ms / all_ms:5.1f}%  {cnt[name]:6d}x  {name[:100]}")


if __name__ == "__main__":
    main()
