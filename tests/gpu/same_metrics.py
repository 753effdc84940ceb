#!/usr/bin/env python3
# tests/gpu/same_metrics.py - whether two training runs' metrics.jsonl logged bitwise-identical losses, balance
# losses, gradient norms and expert loads at every step: the comparison of tests/gpu/determinism.sh (one build run
# twice) and tests/gpu/ab.sh (two trees), written once.
#   same_metrics.py LABEL A.jsonl B.jsonl [STEPS]
# prints "LABEL: N steps, fields [...]: bitwise identical" or "...: DIFFERENT" followed by each differing step;
# exits 0 when identical (and, with STEPS, both have exactly STEPS steps), 1 when not, 2 when a file is missing.
import json
import sys

FIELDS = ("loss", "mtp_loss", "balance_loss", "grad_norm", "load_max_mean")


def steps(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"type":"step"' in line]


def main(argv):
    if len(argv) not in (4, 5):
        sys.exit("usage: same_metrics.py LABEL A.jsonl B.jsonl [STEPS]")
    label = argv[1]
    try:
        a, b = steps(argv[2]), steps(argv[3])
    except OSError as e:
        print(f"{label}: {e}")
        return 2
    n = int(argv[4]) if len(argv) == 5 else len(a)
    keys = [k for k in FIELDS if a and k in a[0]]
    same = len(a) == len(b) == n > 0 and all(x[k] == y[k] for x, y in zip(a, b) for k in keys)
    counts = f"{len(a)} steps" if len(a) == len(b) else f"{len(a)} and {len(b)} steps"
    print(f"{label}: {counts}, fields {keys}: " + ("bitwise identical" if same else "DIFFERENT"))
    for x, y in zip(a, b):
        if any(x[k] != y[k] for k in keys):
            print("  step", x["step"], {k: (x[k], y[k]) for k in keys})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
