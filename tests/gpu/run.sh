#!/usr/bin/env bash
# tests/gpu/run.sh - build fp8moe with CUDA and run the GPU parity tests ($BUILD/tests/test_gpu_*), the GPU
# training parity run (tests/gpu/train_parity.sh), MPI ranks sharing the GPU against one GPU
# (tests/gpu/mpi_parity.sh), the NCCL backend under mpirun (tests/gpu/nccl.sh) and the CPU unit tests, on a machine with an NVIDIA GPU (`make test-gpu` runs this). See docs/gpu.md.
#
# Environment:
#   BUILD        build directory (default build-gpu)
#   OUT          if set, everything printed is also logged to $OUT/gpu_tests.log
#   FP8MOE_DEBS  folder of Debian .debs for libraries the machine lacks (default: ../shared/debs, then
#                shared/debs, then .debs/pkgs); they are unpacked with `dpkg -x` into .debs/ (git-ignored), nothing is installed
#   JOBS         parallel make jobs (default: number of CPUs)
#   EXTRA_CFLAGS, EXTRA_LDLIBS  passed on to make (the .debs paths are appended when they are used)
#   SKIP_CPU_TESTS=1  run only the GPU tests (the CPU unit tests are what CI runs anyway)
#   BUILD_ONLY=1      build, then stop (exit 0 when the full build succeeded): tests/gpu/session.sh uses it
#   MAKE_GOALS        what the full build makes (default all); tests/gpu/ab.sh builds only $BUILD/fp8moe for a
#                     base whose tests/ may not match the working tree's kernels
# Exit status 0 only if every GPU test and every CPU unit test passed. If libinih or HDF5 is missing, the
# full build is impossible: the GPU tests are then built from kernels/ alone, the CPU unit tests are
# skipped, and the run ends INCOMPLETE (exit 2) with the reason.
set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_tests.log") 2>&1
fi
say() { echo "run.sh: $*"; }

# ------------------------------------------------------------------------------ the machine
say "$(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname) ($(uname -m)), repo $ROOT, BUILD=$BUILD"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi 2>&1 | head -n 12
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1
else
  say "WARNING: nvidia-smi not found: this does not look like an NVIDIA GPU machine; test_gpu_ops will fail"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
if ! command -v nvcc >/dev/null 2>&1; then
  say "FAIL: nvcc not found (not on PATH, not in /usr/local/cuda/bin): the Makefile would build CPU-only and no GPU test"
  exit 1
fi
say "nvcc: $(nvcc --version | grep -i release)"
CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
MULTIARCH=$(gcc -print-multiarch 2>/dev/null || true)
MULTIARCH=${MULTIARCH:-x86_64-linux-gnu}

# ------------------------------------------------------------------------------ libraries
# CMocka (and anything else missing) from .debs: unpacked, never installed. The include and library
# paths reach the Makefile as EXTRA_CFLAGS / EXTRA_LDLIBS (it adds them to its own flags).
EXTRA_CFLAGS=${EXTRA_CFLAGS:-} # kept from the environment (e.g. as printed by scripts/fetch-cmocka-debs.sh)
EXTRA_LIBS=${EXTRA_LDLIBS:-}
cmocka_links() {
  printf '#include <stdarg.h>\n#include <stddef.h>\n#include <stdint.h>\n#include <setjmp.h>\n#include <cmocka.h>\nint main(void) { return 0; }\n' |
    gcc -x c - $EXTRA_CFLAGS -o /dev/null $EXTRA_LIBS -lcmocka >/dev/null 2>&1
}
use_unpacked_debs() {
  EXTRA_CFLAGS="$EXTRA_CFLAGS -isystem $ROOT/.debs/usr/include"
  EXTRA_LIBS="$EXTRA_LIBS -L$ROOT/.debs/usr/lib/$MULTIARCH -Wl,-rpath,$ROOT/.debs/usr/lib/$MULTIARCH"
  export PKG_CONFIG_PATH="$ROOT/.debs/usr/lib/$MULTIARCH/pkgconfig:$ROOT/.debs/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$ROOT/.debs/usr/lib/$MULTIARCH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
if cmocka_links; then
  say "cmocka: installed on this machine"
else
  if [ -f .debs/usr/include/cmocka.h ]; then
    say "cmocka: not installed; using the copy already unpacked in .debs/"
  else
    DEBS=""
    for d in "${FP8MOE_DEBS:-}" ../shared/debs shared/debs .debs/pkgs; do
      if [ -n "$d" ] && ls "$d"/libcmocka*.deb >/dev/null 2>&1; then DEBS=$d; break; fi
    done
    if [ -z "$DEBS" ]; then
      say "FAIL: cmocka is not installed and no libcmocka*.deb was found in \$FP8MOE_DEBS (${FP8MOE_DEBS:-unset}), ../shared/debs or shared/debs"
      exit 1
    fi
    if ! command -v dpkg >/dev/null 2>&1; then
      say "FAIL: cmocka is not installed and dpkg is missing, so the .debs in $DEBS cannot be unpacked"
      exit 1
    fi
    mkdir -p .debs
    for deb in "$DEBS"/*.deb; do
      say "unpacking $deb into .debs/"
      dpkg -x "$deb" .debs || { say "FAIL: dpkg -x $deb failed"; exit 1; }
    done
  fi
  use_unpacked_debs
  if ! cmocka_links; then
    say "FAIL: cmocka from .debs/ does not link (headers in .debs/usr/include, library in .debs/usr/lib/$MULTIARCH?)"
    exit 1
  fi
fi

FULL_BUILD=1
for pkg in inih hdf5-serial; do
  if ! pkg-config --exists "$pkg" 2>/dev/null; then
    say "MISSING: pkg-config does not know '$pkg' (Debian/Ubuntu: $([ "$pkg" = inih ] && echo libinih-dev || echo libhdf5-dev)). The full"
    say "         build (config parser, checkpoints) needs it; put its .debs (and their library .debs) into \$FP8MOE_DEBS"
    say "         or install it. Falling back to a kernels-only build of the GPU tests; CPU unit tests are skipped."
    FULL_BUILD=0
  fi
done

# ------------------------------------------------------------------------------ build
mkdir -p "$BUILD/tests"
build_kernels_only() {
  # Mirrors the Makefile's flags for the objects the GPU tests need: kernels/*.c, kernels/cpu/*.c and
  # kernels/cuda/*.cu (the library without train/ data/ optim/ parallel/, which need inih and HDF5).
  local dir="$BUILD/kernels-only" cflags="-O2 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -ffp-contract=off -fopenmp -g -I. -DFP8MOE_CUDA -I$CUDA_HOME/include $EXTRA_CFLAGS"
  mkdir -p "$dir"
  local objs=() f o
  for f in kernels/cuda/*.cu; do
    o="$dir/$(basename "$f").o"
    echo "nvcc $f"
    local arch=-arch=sm_90  # as the Makefile: wgmma needs sm_90a
    case "$f" in kernels/cuda/attention_wgmma.cu | kernels/cuda/fp8_grouped_gemm.cu) arch=-gencode=arch=compute_90a,code=sm_90a ;; esac
    nvcc -O2 "$arch" -std=c++17 -I. -DFP8MOE_CUDA -Xcompiler -Wall,-Wextra,-Werror -c "$f" -o "$o" || return 1
    objs+=("$o")
  done
  for f in kernels/*.c kernels/cpu/*.c; do
    o="$dir/$(basename "$f" .c).o"
    echo "gcc $f"
    gcc $cflags -c "$f" -o "$o" || return 1
    objs+=("$o")
  done
  for f in tests/gpu/test_gpu_*.c; do
    echo "gcc $f"
    gcc $cflags -Itests "$f" "${objs[@]}" -o "$BUILD/tests/$(basename "$f" .c)" $EXTRA_LIBS \
      -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart -lcublasLt -lstdc++ -lcmocka -lm -fopenmp || return 1
  done
}

if [ "$FULL_BUILD" = 1 ]; then
  say "building: make -j$JOBS BUILD=$BUILD EXTRA_CFLAGS='$EXTRA_CFLAGS' EXTRA_LDLIBS='$EXTRA_LIBS' ${MAKE_GOALS:-all}"
  # shellcheck disable=SC2086  # MAKE_GOALS may name several targets
  if ! make -j"$JOBS" BUILD="$BUILD" EXTRA_CFLAGS="$EXTRA_CFLAGS" EXTRA_LDLIBS="$EXTRA_LIBS" ${MAKE_GOALS:-all}; then
    say "FULL BUILD FAILED (see the compiler output above); trying the kernels-only build so the GPU tests still run"
    FULL_BUILD=0
  fi
fi
if [ "$FULL_BUILD" = 0 ]; then
  say "building the GPU tests from kernels/ only, into $BUILD/kernels-only"
  if ! build_kernels_only; then say "FAIL: the kernels-only build failed (see above)"; exit 1; fi
fi

if [ "${BUILD_ONLY:-0}" = 1 ]; then
  if [ "$FULL_BUILD" = 1 ]; then say "built $BUILD (BUILD_ONLY=1: no tests run)"; exit 0; fi
  say "FAIL: only the kernels-only build succeeded; $BUILD/fp8moe was not built"; exit 1
fi

# ------------------------------------------------------------------------------ run
export FP8MOE_CUDA_SYNC=1 # synchronise after each kernel: a CUDA error is reported at the kernel that caused it
gpu_failed=0
ran=0
for t in "$BUILD"/tests/test_gpu_*; do
  [ -x "$t" ] || continue
  ran=$((ran + 1))
  say "== $t"
  if "$t"; then say "PASSED: $t"; else say "FAILED: $t"; gpu_failed=$((gpu_failed + 1)); fi
done
# test_gpu_fp8 again with the routed experts' grouped GEMMs on cuBLASLt (FP8MOE_GROUPED_GEMM=cublaslt), the path the
# default own kernel replaced; its grouped cases compare every grouped call with one plain cuBLASLt call per segment
if [ -x "$BUILD/tests/test_gpu_fp8" ]; then
  ran=$((ran + 1))
  say "== FP8MOE_GROUPED_GEMM=cublaslt $BUILD/tests/test_gpu_fp8"
  if FP8MOE_GROUPED_GEMM=cublaslt "$BUILD/tests/test_gpu_fp8"; then say "PASSED: test_gpu_fp8 (cublaslt)"
  else say "FAILED: test_gpu_fp8 (cublaslt)"; gpu_failed=$((gpu_failed + 1)); fi
fi
if [ "$ran" = 0 ]; then say "FAIL: no $BUILD/tests/test_gpu_* was built (was CUDA >= 12.9 detected? see 'fp8moe:' line of make)"; exit 1; fi

unit_status="skipped (no full build)"
unit_failed=0
if [ "${SKIP_CPU_TESTS:-0}" = 1 ]; then
  unit_status="skipped (SKIP_CPU_TESTS=1)"
elif [ "$FULL_BUILD" = 1 ]; then
  say "== CPU unit tests (tests/run_unit.sh)"
  if BUILD=$BUILD bash tests/run_unit.sh; then unit_status="passed"; else unit_status="FAILED"; unit_failed=1; fi
fi

parity_status="skipped (no full build)"
parity_failed=0
if [ "$FULL_BUILD" = 1 ]; then
  say "== GPU training against the CPU (tests/gpu/train_parity.sh)"
  if BUILD=$BUILD bash tests/gpu/train_parity.sh; then parity_status="passed"; else parity_status="FAILED"; parity_failed=1; fi
fi

mpi_status="skipped (no full build)"
mpi_failed=0
if [ "$FULL_BUILD" = 1 ]; then
  say "== MPI ranks sharing the GPU against one GPU (tests/gpu/mpi_parity.sh)"
  if BUILD=$BUILD bash tests/gpu/mpi_parity.sh; then mpi_status="passed"; else mpi_status="FAILED"; mpi_failed=1; fi
fi

nccl_status="skipped (no full build)"
nccl_failed=0
if [ "$FULL_BUILD" = 1 ]; then
  say "== the NCCL backend under mpirun, one GPU per rank, and its faults (tests/gpu/nccl.sh)"
  if BUILD=$BUILD bash tests/gpu/nccl.sh; then nccl_status="passed"; else nccl_status="FAILED"; nccl_failed=1; fi
fi

say "SUMMARY: GPU tests: $((ran - gpu_failed))/$ran passed; training parity: $parity_status; MPI ranks on one GPU: $mpi_status; NCCL: $nccl_status; CPU unit tests: $unit_status"
if [ "$gpu_failed" -gt 0 ] || [ "$parity_failed" -gt 0 ] || [ "$mpi_failed" -gt 0 ] || [ "$nccl_failed" -gt 0 ] || [ "$unit_failed" -gt 0 ]; then exit 1; fi
if [ "$FULL_BUILD" = 0 ]; then say "INCOMPLETE: GPU tests passed, but the CPU unit tests did not run (see MISSING/FAILED above)"; exit 2; fi
exit 0
