#!/usr/bin/env bash
# fetch-cmocka-debs.sh - unpack Debian's CMocka .debs into .debs/ of the checkout, for machines that
# have no libcmocka-dev and cannot install packages (the GPU test machines: Ubuntu 24.04, no network).
#
#   bash scripts/fetch-cmocka-debs.sh [DIR_WITH_DEBS]     default: $FP8MOE_DEBS or ../shared/debs
#
# It copies libcmocka0 and libcmocka-dev .debs from DIR_WITH_DEBS, unpacks them with `dpkg -x` into
# .debs/ (ignored by git; nothing is installed system-wide) and prints the environment that lets the
# Makefile compile and link the tests against them. Run it where the .debs are, then carry .debs/ to
# the machine that builds. With libcmocka-dev already installed it says so and does nothing.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
src=${1:-${FP8MOE_DEBS:-../shared/debs}}
dest=.debs

if dpkg -s libcmocka-dev 2>/dev/null | grep '^Status: install ok installed$' >/dev/null; then
  echo "fetch-cmocka-debs: libcmocka-dev is installed system-wide; nothing to do"
  exit 0
fi

shopt -s nullglob
debs=("$src"/libcmocka0_*.deb "$src"/libcmocka-dev_*.deb)
if [ ${#debs[@]} -lt 2 ]; then
  echo "fetch-cmocka-debs: $src: expected libcmocka0_*.deb and libcmocka-dev_*.deb, found ${#debs[@]} of them" >&2
  exit 1
fi

mkdir -p "$dest/pkgs"
for d in "${debs[@]}"; do
  [ "$d" -ef "$dest/pkgs/$(basename "$d")" ] || cp "$d" "$dest/pkgs/"
  dpkg -x "$d" "$dest"
done

root=$(cd "$dest" && pwd)/usr
libdir=$(dirname "$(find "$root/lib" -name 'libcmocka.so.0*' -type f | head -n 1)")
if [ ! -f "$root/include/cmocka.h" ] || [ ! -e "$libdir/libcmocka.so" ]; then
  echo "fetch-cmocka-debs: unpacked into $dest but $root/include/cmocka.h or $libdir/libcmocka.so is missing" >&2
  exit 1
fi

# The Makefile adds EXTRA_CFLAGS / EXTRA_LDLIBS to its own flags; exported, they also reach the
# sub-makes of make test and make test-gpu.
cat <<EOF
fetch-cmocka-debs: CMocka unpacked into $root. Build and run the tests with:
  export EXTRA_CFLAGS="-I$root/include"
  export EXTRA_LDLIBS="-L$libdir -Wl,-rpath,$libdir"
  export LD_LIBRARY_PATH="$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
(these are this machine's absolute paths; after carrying .debs/ to another machine, run
 "bash scripts/fetch-cmocka-debs.sh .debs/pkgs" there for its paths)
EOF
