# tests/gpu/env.sh - sourced (from the repository root) by the GPU scripts that run build-gpu/fp8moe
# (bench.sh, kernel_profile.sh, determinism.sh, convergence.sh): puts the libraries that tests/gpu/run.sh
# unpacked from Debian .debs into .debs/usr (libinih, CMocka) on LD_LIBRARY_PATH. If .debs/usr is gone
# but the packages are still in .debs/pkgs (a copy of the tree that carried only the packages), they are
# unpacked again first (dpkg -x: nothing is installed).
_fp8moe_lib=$PWD/.debs/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
if [ ! -d "$_fp8moe_lib" ] && ls .debs/pkgs/*.deb >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
  for _fp8moe_deb in .debs/pkgs/*.deb; do dpkg -x "$_fp8moe_deb" .debs; done
fi
[ -d "$_fp8moe_lib" ] && export LD_LIBRARY_PATH="$_fp8moe_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _fp8moe_lib _fp8moe_deb
