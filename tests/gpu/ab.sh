#!/usr/bin/env bash
# tests/gpu/ab.sh - a same-machine A/B measurement of a change, the comparison point docs/benchmarks.md asks
# for: device calls land on machines whose step times differ by up to 3%, so a change is timed against its base
# in ONE call. Two steps:
#
#   tests/gpu/ab.sh prepare BASE   (here, in the git checkout) copies BASE's version of every file under kernels/,
#                                  train/, optim/ and data/ that differs from the working tree into .ab/base/ (git-ignored;
#                                  carry ".ab" to the device). A file the working tree added is listed in
#                                  .ab/added and is moved aside for the base build; one it deleted (or moved)
#                                  is listed in .ab/deleted, put back for the base build and removed after.
#   tests/gpu/ab.sh run            (on the GPU machine, after tests/gpu/run.sh's libraries are in .debs) builds the
#                                  working tree ("new"), runs `tests/gpu/bench.sh` and `tests/gpu/kernel_profile.sh`,
#                                  swaps the base files in, rebuilds and measures again ("base"), then restores the
#                                  working tree's files and rebuilds them.
#
# Logs under $OUT (a new temporary folder when unset): ab_new_bench.log, ab_base_bench.log, ab_new_kernels.txt,
# ab_base_kernels.txt (the kernel profile's top 40), then a side-by-side summary on stdout. Extra arguments after
# `run` go to bench.sh. AB_PROFILE=0 skips the kernel profiles. Each tree also trains 3 steps of bench-1gpu
# (tests/gpu/determinism.sh: twice, bitwise run to run) and the summary says whether the two trees' losses and
# gradient norms are bitwise identical - a "same bits" change must say yes (AB_BITS=0 skips it, about 80 s).
# Needs nvcc and, for the profiles, ncu.
# The base is built as $AB/build-base/fp8moe only (tests/ stay the working tree's, which may call new ops) and kept
# there, so later commands can run it: e.g. BUILD=.ab/build-base tests/gpu/determinism.sh.
set -u -o pipefail
cd "$(dirname "$0")/../.."
AB=.ab

prepare() {
  local base=$1
  git rev-parse --verify --quiet "$base^{commit}" > /dev/null || { echo "ab.sh: '$base' is not a commit"; exit 2; }
  rm -rf "$AB" && mkdir -p "$AB/base"
  : > "$AB/added"
  : > "$AB/deleted"
  local n=0 f status
  while IFS=$'\t' read -r status f; do
    case $status in
      A) echo "$f" >> "$AB/added" ;;
      M) mkdir -p "$AB/base/$(dirname "$f")" && git show "$base:$f" > "$AB/base/$f" ;;
      D) mkdir -p "$AB/base/$(dirname "$f")" && git show "$base:$f" > "$AB/base/$f" && echo "$f" >> "$AB/deleted" ;;
      *) echo "ab.sh: $f is $status against $base (only added, modified or deleted files can be swapped)"; exit 2 ;;
    esac
    n=$((n + 1))
  done < <(git diff --no-renames --name-status "$base" -- kernels train optim data)
  if [ "$n" = 0 ]; then echo "ab.sh: the working tree's kernels/, train/, optim/ and data/ equal $base's"; exit 2; fi
  git rev-parse --short "$base" > "$AB/base_rev"
  echo "ab.sh: $n files differ from $base ($(wc -l < "$AB/added") added); carry \"$AB\" to the device and run" \
       "tests/gpu/ab.sh run"
}

build() {  # label, make goals (default all)
  MAKE_GOALS=${2:-all} BUILD_ONLY=1 SKIP_CPU_TESTS=1 bash tests/gpu/run.sh > "$OUT/ab_build_$1.log" 2>&1 ||
    { echo "ab.sh: the $1 build failed:"; tail -30 "$OUT/ab_build_$1.log"; restore; exit 1; }
}

measure() {  # label, bench args...
  local label=$1; shift
  OUT=$OUT/ab_$label bash tests/gpu/bench.sh "$@" > /dev/null 2>&1
  cp "$OUT/ab_$label/bench.log" "$OUT/ab_${label}_bench.log" 2> /dev/null
  grep -q 'tokens/s' "$OUT/ab_${label}_bench.log" 2> /dev/null ||
    { echo "ab.sh: the $label benchmark printed no step results:"; tail -5 "$OUT/ab_${label}_bench.log" 2> /dev/null; }
  if [ "${AB_PROFILE:-1}" = 1 ]; then
    OUT=$OUT/ab_$label bash tests/gpu/kernel_profile.sh > "$OUT/ab_$label/kernels.log" 2>&1
    grep -E '^ +[0-9.]+ ms' "$OUT/ab_$label/kernels.log" | head -n 40 > "$OUT/ab_${label}_kernels.txt"
  fi
  if [ "${AB_BITS:-1}" = 1 ]; then
    STEPS=3 OUT=$OUT/ab_bits_$label bash tests/gpu/determinism.sh > "$OUT/ab_${label}_bits.log" 2>&1
    cp "$OUT/ab_bits_$label/determinism_metrics.jsonl" "$OUT/ab_${label}_metrics.jsonl" 2> /dev/null
  fi
  rm -rf "$OUT/ab_$label" "$OUT/ab_bits_$label"  # the profile's run folder and CSV: too many files to bring back
}

# Whether the two trees' 3 training steps (measure) gave the same losses and gradient norms, bit for bit.
same_bits() {
  [ "${AB_BITS:-1}" = 1 ] || return 0
  local label
  for label in new base; do echo "bits: $label: $(tail -n 1 "$OUT/ab_${label}_bits.log" 2> /dev/null)"; done
  python3 tests/gpu/same_metrics.py "bits: new and base" "$OUT/ab_new_metrics.jsonl" "$OUT/ab_base_metrics.jsonl"
}

swap_in_base() {  # the working tree's versions go to $AB/new, the base's come in; added files move aside
  local f
  (cd "$AB/base" && find . -type f) | while read -r f; do  # a file the working tree deleted has no new copy
    if [ -e "$f" ]; then mkdir -p "$AB/new/$(dirname "$f")" && cp -p "$f" "$AB/new/$f"; fi
    mkdir -p "$(dirname "$f")" && cp "$AB/base/$f" "$f"
  done
  while read -r f; do [ -n "$f" ] && mkdir -p "$AB/new/$(dirname "$f")" && mv "$f" "$AB/new/$f"; done < "$AB/added"
}

restore() {  # touched, so that make rebuilds them
  [ -d "$AB/new" ] || return 0
  (cd "$AB/new" && find . -type f) | while read -r f; do cp "$AB/new/$f" "$f" && touch "$f"; done
  while read -r f; do [ -n "$f" ] && rm -f "$f"; done < "$AB/deleted"  # the base's files the working tree lacks
  rm -rf "$AB/new"
}

# The value of `label` in the `mode` section (fp8 or bf16) of a bench.log: its ms/step header, or a row's number.
field() {  # mode label file
  awk -v mode="$1" -v label="$2" '
    $1 == mode ":" { in_mode = 1; if (label == "ms/step") { print $4; exit } next }
    /^[a-z0-9]+: / { in_mode = 0 }
    in_mode {
      line = $0; sub(/^ +/, "", line)
      if (index(line, label) == 1) { rest = substr(line, length(label) + 1); if (rest ~ /^ +[0-9]/) { split(rest, f, " "); print f[1]; exit } }
    }' "$3"
}

summary() {
  local label mode
  printf '%-58s %14s %14s\n' "" "new" "base ($(cat "$AB/base_rev"))"
  for mode in fp8 bf16; do
    for label in "ms/step" "tokens/s" "model TFLOPS" "peak memory" "attention" "expert GEMM" "other GEMM" \
                 "quantisation" "permute" "optimizer" "other"; do
      printf '%-58s %14s %14s\n' "$mode $label" "$(field "$mode" "$label" "$OUT/ab_new_bench.log")" \
        "$(field "$mode" "$label" "$OUT/ab_base_bench.log")"
    done
  done
  grep -h -E 'fp8/bf16|GEMM time' "$OUT/ab_new_bench.log" | sed 's/^/new:  /'
  grep -h -E 'fp8/bf16|GEMM time' "$OUT/ab_base_bench.log" | sed 's/^/base: /'
}

case "${1:-}" in
  prepare)
    [ $# -eq 2 ] || { echo "usage: tests/gpu/ab.sh prepare BASE"; exit 2; }
    prepare "$2" ;;
  run)
    shift
    [ -f "$AB/base_rev" ] || { echo "ab.sh: no $AB/base_rev: run 'tests/gpu/ab.sh prepare BASE' first and carry $AB"; exit 2; }
    if [ -z "${OUT:-}" ]; then export OUT=$(mktemp -d); echo "ab.sh: logs in $OUT"; fi
    mkdir -p "$OUT"
    build new && measure new "$@"
    swap_in_base && build base build-gpu/fp8moe && measure base "$@"  # tests/ stay new: they may call new ops
    mkdir -p "$AB/build-base" && cp build-gpu/fp8moe "$AB/build-base/"  # for later runs: BUILD=$AB/build-base
    restore && build restored
    summary
    same_bits ;;
  *)
    sed -n '2,19p' "$0"; exit 2 ;;
esac
