#!/usr/bin/env bash
# Gradient check (tests/unit/test_gradcheck.c): the FP32 build dumps its analytic gradients, the double
# build checks every loss term against finite differences, runs the negative control, and compares the
# FP32 gradients with its own.
set -eu
BUILD=${FP8MOE_BUILD:-build}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1  # tiny shapes: threading costs more than it saves
"$BUILD/gradcheck_f32" --dump "$tmp/grads_f32.bin"
"$BUILD/gradcheck" --compare "$tmp/grads_f32.bin"
