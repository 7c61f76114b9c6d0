#!/usr/bin/env bash
# 64-bit ARM (issue 51): cross-builds m3 for aarch64 (Debian's crossbuild compiler against the arm64
# packages, cmake/toolchains/aarch64-linux-gnu.cmake) and runs under qemu-aarch64: the kernel tests
# (every kernel against its scalar reference: the sdot and usmmla kernels of quant_kernels_arm.cc,
# Highway's NEON and scalar targets; again on a CPU with sdot but no i8mm), which kernels `auto`
# takes per CPU, and the golden cases (also packed q4-mixed / q3-mixed / q2-mixed, so the int8
# kernels run under the model), judged by the oracle and compared with the x86-64 build's files:
# greedy ids and selected blocks equal, logits within 5e-5 (docs/NUMERICS.md: the float sums run in
# the order of each target's vector width, and libm differs; x86's own AVX2 and SSE4 targets differ
# by as much, 9e-6 on s1). Emulated runs take one thread.
# Usage: tests/cross_arm64.sh [X86_BUILD_DIR (default build)] [CASES (a regex, default: all)]
# (s5, a 2300-token prompt, takes ~15 min emulated; scripts/test.sh leaves it out.)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
x86_build=${1:-$here/build}
cases=${2:-.}
"$here/scripts/install-deps.sh" --cross-arm64
build=${M3_ARM64_BUILD:-$here/build-arm64}
# Release (no debug info): half the compile and link time of the x86 build's RelWithDebInfo.
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$here/cmake/toolchains/aarch64-linux-gnu.cmake" -DM3_MPI=OFF -DM3_CUDA=OFF >/dev/null
cmake --build "$build" --target m3_cli test_kernels test_quant_kernels test_bench_limits
qemu=(qemu-aarch64 -L /usr/aarch64-linux-gnu)
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
"${qemu[@]}" "$build/tests/test_kernels"
# qemu's default CPU ("max") has sdot and i8mm: every kernel runs; Neoverse N1 has sdot only.
"${qemu[@]}" "$build/tests/test_quant_kernels"
"${qemu[@]}" -cpu neoverse-n1 "$build/tests/test_quant_kernels" "QuantMatMul*,quant kernel registry"
# The kernels `auto` takes, from the hwcaps of each CPU (m3 inspect prints them), and the int8 peak
# probe's instruction on each (m3 bench's limit: usmmla, sdot, or Highway's multiply-add).
for pair in cortex-a72:highway-NEON neoverse-n1:neon-dotprod max:neon-i8mm; do
  cpu=${pair%%:*} want=${pair#*:}
  line=$("${qemu[@]}" -cpu "$cpu" "$build/bin/m3" inspect -m "$here/tests/data/golden/s1_fp32_basic" | grep '^kernels')
  [[ $line == *"q8/q4 $want,"* ]] || { echo "FAIL: on $cpu auto took: $line (wanted q8/q4 $want)"; exit 1; }
  echo "$cpu: $line"
  "${qemu[@]}" -cpu "$cpu" "$build/tests/test_bench_limits" "the int8 peak probes*"
done
/usr/bin/python3 -u "$here/tests/cross_golden_check.py" "$x86_build/bin/m3" "$build/bin/m3" "$here/tests/data" \
  --emulator "${qemu[*]}" --threads 1 --cases "$cases" --bound 5e-5 \
  --packed s1_fp32_basic:q4-mixed,s1_fp32_basic:q2-mixed,s6_fp16_mha_top1_sharded3:q4-mixed,s6_fp16_mha_top1_sharded3:q3-mixed
