#!/usr/bin/env bash
# no_outside_files.sh - a fresh clone passes `make test` with nothing beside it (issue 17, part 1):
#   - no test that `make test` runs (tests/run_unit.sh, tests/unit/*, the Makefile, .ci/run, the configs
#     the tests train) names a file outside the checkout: no `shared/` and no `tinyshakespeare` outside
#     comments;
#   - the text the tests train on, tests/data/shakespeare.txt, is in the repository (git ls-files);
#   - the README's first commands work on a bare Debian 12, which has no make: each starts with
#     `bash scripts/deps.sh` (deps.sh installs build-essential), none with make; and .ci/run's last line
#     is the README's test command, verbatim.
# Run from the repository root.
set -u
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }
root=$(pwd -P)

# ---- references to files outside the checkout, in what make test runs
files=(tests/run_unit.sh Makefile .ci/run configs/tiny.ini configs/tiny-fp8.ini configs/shakespeare.ini)
for f in tests/unit/*; do [ -f "$f" ] && [ "$f" != tests/unit/no_outside_files.sh ] && files+=("$f"); done
bad=0
for f in "${files[@]}"; do
  [ -f "$f" ] || { fail "$f missing"; continue; }
  # drop comment lines (#, //, /* and * continuation lines), keep the rest with their line numbers
  while IFS= read -r hit; do
    line=${hit#*:}
    fail "$f:${hit%%:*} names a file outside the checkout: $(sed 's/^[[:space:]]*//' <<< "$line")"
    bad=$((bad + 1))
  done < <(grep -nE 'shared/|tinyshakespeare' -- "$f" | grep -vE '^[0-9]+:[[:space:]]*(#|//|/\*|\*)')
done
[ "$bad" -eq 0 ] && pass "no test names a file outside the checkout (${#files[@]} files read)"

if [ -e .git ]; then  # a git checkout: the text must be committed, not just lie here
  git ls-files --error-unmatch tests/data/shakespeare.txt >/dev/null 2>&1 \
    && pass "tests/data/shakespeare.txt is committed" || fail "tests/data/shakespeare.txt is not committed"
else
  [ -f tests/data/shakespeare.txt ] && pass "tests/data/shakespeare.txt is present" \
    || fail "tests/data/shakespeare.txt missing"
fi

# ---- README's first commands and .ci/run
mapfile -t first < <(awk '/^```sh$/ && !seen {inblock=1; seen=1; next} inblock && /^```/ {exit} inblock' README.md)
if [ ${#first[@]} -eq 0 ]; then
  fail "README.md: no first \`\`\`sh block"
else
  for cmd in "${first[@]}"; do
    cmd=${cmd%%#*}; cmd=$(sed 's/[[:space:]]*$//' <<< "$cmd")
    case "$cmd" in
      make*|sudo\ make*) fail "README's first command '$cmd' starts with make, which a bare Debian 12 lacks" ;;
      "bash scripts/deps.sh && "*) pass "README: '$cmd' installs make before using it" ;;
      *) fail "README's first command '$cmd' does not start with 'bash scripts/deps.sh && '" ;;
    esac
  done
fi
grep -Eq '^[[:space:]]*build-essential([[:space:]]|$)' scripts/deps.sh \
  && pass "scripts/deps.sh installs build-essential (make)" || fail "scripts/deps.sh does not install build-essential"
readme_test=$(printf '%s\n' "${first[@]}" | grep -m1 'make test' | sed 's/[[:space:]]*#.*$//; s/[[:space:]]*$//')
ci_last=$(grep -v '^[[:space:]]*$' .ci/run | tail -1)
if [ -n "$readme_test" ] && [ "$ci_last" = "$readme_test" ]; then
  pass ".ci/run ends with the README's test command: $ci_last"
else
  fail ".ci/run's last line '$ci_last' is not the README's test command '$readme_test'"
fi

echo "no_outside_files: $([ $failures = 0 ] && echo passed || echo "FAILED ($failures)")"
[ "$failures" -eq 0 ]
