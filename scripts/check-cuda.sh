#!/usr/bin/env bash
# The GPU checks of --gpu dense (issue 34) in one call of a lent GPU machine, which has CUDA's
# driver but none of our Debian libraries:
#
#   scripts/check-cuda.sh pack   here: builds with CUDA (build-cuda/), strips m3 and the two test
#                                binaries, and bundles them with every shared library ldd lists
#                                (the C library and its loader too, so the GPU machine's own
#                                glibc does not matter) into .cuda-check/bundle.tar.xz (git-ignored)
#                                (CUDA_BUILD_DIR=DIR: from that build tree, already configured with CUDA)
#   scripts/check-cuda.sh run    there (carry .cuda-check): the device operations against their host
#                                references, every golden case with --gpu dense on the GPU, then
#                                m3 bench --gpu dense on a generated model of the real shapes;
#                                logs to $OUT (or .cuda-check/out). Under 6 minutes on an H100.
#
# BENCH_LAYERS (default 2), BENCH_DECODE (default 24) and BENCH_PROMPT (default 256) size the bench.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUNDLE=.cuda-check/bundle.tar.xz

pack() {
  set -e
  # CUDA_BUILD_DIR: a build tree already configured with CUDA (M3_CUDA found nvcc) to take the
  # binaries from instead of a Release build of its own in build-cuda.
  local build=${CUDA_BUILD_DIR:-build-cuda}
  [ -n "${CUDA_BUILD_DIR:-}" ] || cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3_CUDA=ON >/dev/null
  cmake --build "$build" --target m3 test_offload test_golden
  rm -rf .cuda-check/stage && mkdir -p .cuda-check/stage/lib
  for bin in "$build/bin/m3" "$build/tests/test_offload" "$build/tests/test_golden"; do
    strip -o ".cuda-check/stage/$(basename "$bin")" "$bin"
    ldd "$bin" | awk '/=> \// {print $3} /^\t\/lib/ {print $1}' | while read -r so; do
      cp -L -n "$so" .cuda-check/stage/lib/
    done
  done
  # glibc's other parts, which the driver's libcuda asks for: ours, to match the libc above.
  for so in libdl.so.2 libpthread.so.0 librt.so.1; do cp -L "/lib/x86_64-linux-gnu/$so" .cuda-check/stage/lib/; done
  tar -C .cuda-check/stage -cJf "$BUNDLE" .
  rm -rf .cuda-check/stage
  ls -la "$BUNDLE"
}

run() {
  local out=${OUT:-$ROOT/.cuda-check/out}
  mkdir -p "$out"
  local dir=/tmp/m3-cuda-check
  rm -rf "$dir" && mkdir -p "$dir" && tar -C "$dir" -xJf "$BUNDLE" || exit 1
  # The driver's libcuda where the machine keeps it, after our libraries.
  local cuda_dir
  cuda_dir=$(dirname "$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')" 2>/dev/null)
  local path="$dir/lib:${cuda_dir:-/usr/lib/x86_64-linux-gnu}:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"
  local x=("$dir/lib/ld-linux-x86-64.so.2" --library-path "$path")  # our loader, our libc
  exec > >(tee "$out/check-cuda.log") 2>&1
  local rc=0
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  echo "cpus: $(nproc)"
  echo "== device operations against the host reference"
  timeout 60 "${x[@]}" "$dir/test_offload" || rc=1
  echo "== golden cases with --gpu dense on the GPU (single and batched decode)"
  M3_TEST_DATA_DIR="$ROOT/tests/data" M3_TEST_OFFLOAD_DEVICES=cuda timeout 100 "${x[@]}" "$dir/test_golden" "[offload]" || rc=1
  echo "== m3 bench --gpu dense (CPU-only and hybrid, same model, same run)"
  timeout 240 "${x[@]}" "$dir/m3" bench --gpu dense --layers "${BENCH_LAYERS:-2}" -p "${BENCH_PROMPT:-256}" \
    -n "${BENCH_DECODE:-24}" --batch 1 --lookup 0 --cache-dir /tmp/m3-bench-model || rc=1
  echo "rc=$rc"
  return $rc
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
