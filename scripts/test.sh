#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (its data is in tests/data; ../shared
# beside the clone, when there, is walked as well).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)
# Each phase's time, so a slow CI run says where its minutes went: as it ends, and all together
# in the last line (which a log's tail keeps), however the run ends.
phases=""
phase() {
  phases+=" $1 $(($(date +%s) - start)) s,"
  echo "== $1 done at $(($(date +%s) - start)) s"
}
trap 'echo "== phases (seconds from the start):${phases%,}; ended at $(($(date +%s) - start)) s"' EXIT
# With libm3.a as well, so that the installed-package test (tests/install_check.sh) links it too.
"$here/scripts/build.sh" -DM3_INSTALL_STATIC=ON
phase build
# The real clients the server is tested with (Node.js packages pinned in tests/clients/package-lock.json).
"$here/tests/clients/install.sh"
cd "$here/build"
ctest --output-on-failure -j "$(nproc)"
phase ctest
# 64-bit ARM (issue 51): a cross build run under qemu-aarch64: the kernel tests on three CPUs'
# features, which kernels each takes, the golden cases but s5 (15 min emulated) against this build,
# plain and packed.
"$here/tests/cross_arm64.sh" "$here/build" '^s[1-46]_'
phase arm64
# Every parser of untrusted input under libFuzzer, ASan and UBSan: the saved regression inputs,
# then 10 s a target (tests/fuzz/README.md; longer campaigns are run by hand).
"$here/tests/fuzz.sh" 10
phase fuzz
# The unit tests under ASan + UBSan (in the fuzz build), the scheduler and a serve soak under TSan.
"$here/tests/sanitize.sh"
phase sanitizers
