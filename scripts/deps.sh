#!/usr/bin/env bash
# deps.sh - install the Debian/Ubuntu packages fp8moe needs to build, test and run its default job.
#
#   bash scripts/deps.sh           as root: install the missing packages (apt-get); otherwise say what
#                                  is missing and the command to run, and exit 1
#   bash scripts/deps.sh --check   only check: list the missing packages, exit 1 if any
#
# The README's first commands run the first form directly (`bash scripts/deps.sh && make test`): a bare
# Debian has no make until build-essential is in. `make deps` runs the same form, `make run` the second.
# Every library comes from Debian packages (DESIGN.md section 8); the project vendors none. The CUDA
# toolkit is not a Debian package here: the GPU build needs NVIDIA's CUDA >= 12.9 (Debian's
# nvidia-cuda-toolkit is too old for block-scaled FP8 GEMMs), so this script only reports what nvcc it
# sees; the Makefile decides whether to build CUDA.
# Idempotent: with everything present it installs nothing and prints one line.
set -euo pipefail

# Package -> why fp8moe needs it. hdf5: libhdf5-dev is the serial HDF5 (pkg-config hdf5-serial).
PACKAGES=(
  build-essential   # gcc, make, libc headers
  pkg-config        # the Makefile asks it for inih and hdf5 flags
  libinih-dev       # INI job files
  libhdf5-dev       # checkpoints and weights (serial HDF5)
  libopenmpi-dev    # multi-process jobs and the MPI tests
  openmpi-bin       # mpirun
  libcmocka-dev     # unit tests
  libibverbs-dev    # NIC discovery for the topology
  gnuplot-nox       # loss and benchmark plots
  fortunes          # the text the default job (configs/shakespeare.ini) trains on
  python3           # the script tests (tests/unit/*.sh) read metrics.jsonl with it
)

usage() {
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
}

check_only=0
case "${1:-}" in
  "") ;;
  --check) check_only=1 ;;
  -h|--help) usage; exit 0 ;;
  *) echo "deps.sh: unknown argument '$1'; expected nothing, --check or --help" >&2; exit 2 ;;
esac

if ! command -v dpkg >/dev/null 2>&1; then
  echo "deps.sh: dpkg not found: this script knows Debian/Ubuntu only. Install the equivalents of:" >&2
  echo "  ${PACKAGES[*]}" >&2
  exit 1
fi

# `dpkg -s` also succeeds for a removed package whose config files remain, so read its Status line.
is_installed() {
  # (no grep -q: with pipefail an early exit could SIGPIPE dpkg and turn a match into a failure)
  dpkg -s "$1" 2>/dev/null | grep '^Status: install ok installed$' >/dev/null
}

missing_packages() {
  local p
  for p in "${PACKAGES[@]}"; do
    is_installed "$p" || echo "$p"
  done
}

# nvcc: informational only. Mirrors the Makefile's test (NVCC or nvcc on PATH, release >= 12.9).
report_nvcc() {
  local nvcc=${NVCC:-nvcc} version major minor
  if ! command -v "$nvcc" >/dev/null 2>&1; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then
      echo "no nvcc on PATH (CPU-only build); /usr/local/cuda/bin/nvcc exists: add /usr/local/cuda/bin to PATH for the CUDA build"
    else
      echo "no nvcc on PATH (CPU-only build; the GPU build needs CUDA >= 12.9)"
    fi
    return
  fi
  version=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
  major=${version%%.*}; minor=${version#*.}
  if [ -n "$version" ] && { [ "$major" -gt 12 ] || { [ "$major" -eq 12 ] && [ "$minor" -ge 9 ]; }; }; then
    echo "nvcc $version at $(command -v "$nvcc") (CUDA >= 12.9: the Makefile builds kernels/cuda)"
  else
    echo "nvcc ${version:-of unknown version} at $(command -v "$nvcc") is older than CUDA 12.9 (CPU-only build)"
  fi
}

mapfile -t missing < <(missing_packages)

if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#PACKAGES[@]} packages present; $(report_nvcc)"
  exit 0
fi

install_cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y -q ${missing[*]}"
if [ "$check_only" -eq 1 ] || [ "$(id -u)" -ne 0 ]; then
  echo "deps: missing ${#missing[@]} of ${#PACKAGES[@]} packages: ${missing[*]}" >&2
  if [ "$(id -u)" -eq 0 ]; then
    echo "deps: install them with: make deps   (or: $install_cmd)" >&2
  else
    echo "deps: install them as root with: sudo sh -c '$install_cmd'" >&2
  fi
  echo "deps: $(report_nvcc)" >&2
  exit 1
fi

echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q </dev/null
# Dpkg::Use-Pty=0: no progress bars in CI logs.
apt-get install -y -q -o Dpkg::Use-Pty=0 "${missing[@]}" </dev/null

mapfile -t still_missing < <(missing_packages)
if [ ${#still_missing[@]} -gt 0 ]; then
  echo "deps: apt-get finished but these packages are still not installed: ${still_missing[*]}" >&2
  exit 1
fi
echo "deps: installed ${missing[*]}; $(report_nvcc)"
