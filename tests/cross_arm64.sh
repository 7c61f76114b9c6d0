#!/usr/bin/env bash
# 64-bit ARM (issue 51): cross-builds m3 for aarch64 (Debian's crossbuild compiler against the arm64
# packages, cmake/toolchains/aarch64-linux-gnu.cmake) and runs under qemu-aarch64: the kernel tests
# (every kernel against its scalar reference on each target this build has: NEON and the scalar
# fallback) and the golden cases, judged by the oracle and compared with the x86-64 build's files:
# greedy ids and selected blocks equal, logits within 5e-5 (docs/NUMERICS.md: the float sums run in
# the order of each target's vector width, and libm differs; x86's own AVX2 and SSE4 targets differ
# by as much, 9e-6 on s1). Emulated runs take one thread.
# Usage: tests/cross_arm64.sh [X86_BUILD_DIR (default build)] [CASES (a regex, default: all)]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
x86_build=${1:-$here/build}
cases=${2:-.}
"$here/scripts/install-deps.sh" --cross-arm64
build=${M3_ARM64_BUILD:-$here/build-arm64}
# Release (no debug info): half the compile and link time of the x86 build's RelWithDebInfo.
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$here/cmake/toolchains/aarch64-linux-gnu.cmake" -DM3_MPI=OFF -DM3_CUDA=OFF >/dev/null
cmake --build "$build" --target m3_cli test_kernels test_quant_kernels
qemu=(qemu-aarch64 -L /usr/aarch64-linux-gnu)
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
"${qemu[@]}" "$build/tests/test_kernels"
"${qemu[@]}" "$build/tests/test_quant_kernels"
/usr/bin/python3 -u "$here/tests/cross_golden_check.py" "$x86_build/bin/m3" "$build/bin/m3" "$here/tests/data" \
  --emulator "${qemu[*]}" --threads 1 --cases "$cases" --bound 5e-5
