#!/usr/bin/env bash
# The test suite under sanitizers (issue 35), with clang:
#  1. ASan + UBSan: every ctest test but the slow end-to-end model checks, in the fuzz build
#     (build-fuzz, shared with tests/fuzz.sh: every library is instrumented there already);
#  2. ThreadSanitizer: the scheduler's tests and a soak of `m3 serve` (build-tsan), one engine
#     thread, so that the threads seen are the scheduler's, the server's and the clients'.
# A report fails the run (UBSan and TSan halt on the first). Exit 0 when both are clean.
#
#   tests/sanitize.sh [asan|tsan|all]   (default all)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHAT=${1:-all}
if ! command -v clang++ >/dev/null; then
  echo "tests/sanitize.sh: clang++ is missing (scripts/install-deps.sh installs it)" >&2
  exit 2
fi
export OMP_WAIT_POLICY=PASSIVE
fail=0

if [ "$WHAT" = all ] || [ "$WHAT" = asan ]; then
  BUILD=${M3_FUZZ_BUILD:-$ROOT/build-fuzz}
  CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DM3_FUZZ=ON -DM3_CUDA=OFF \
    -DM3_BUILD_TESTS=ON -DM3_BUILD_BENCH=OFF >/dev/null
  cmake --build "$BUILD"
  # Left to the regular build: the model-level sweeps that take 25-150 s each here (they run the
  # code the rest reach: every golden case still runs once, through the library and the CLI), the
  # reference device's offloaded passes (16 min here), and the layering checks (compiler messages).
  slow='cli_golden_logits|cli_serve_soak|cli_bench|variants|cli_pack|perplexity|cli_logits_lookup|layering_'
  slow+='|offloaded|gpu dense|simulated NUMA|batched decode|packed models decode a batch|with the same bits'
  slow+='|over several prompts|prefilled in chunks|prompt lookup verifies|scored|Session::Score|large flat vocabulary'
  # ASan makes mlock a no-op, so the test of --mlock-dense cannot see locked pages here.
  slow+='|mlock-dense'
  # Constrained output's long sweeps (80 client replies; every schema with and without reasoning):
  # the engine's own tests, the tight-budget, tool-call and grammar turns and the SDK checks stay.
  slow+='|cli_structured_output|every schema'
  # Expert parallelism's parity sweep (every golden case at -np 2 and 3: ~190 s here): one case and
  # its packed copy run below instead, so MPI's exchanges still run under ASan.
  slow+='|cli_dist_parity'
  start=$(date +%s)
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:suppressions="$ROOT/tests/ubsan.supp"
  if ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)" -E "$slow" >"$BUILD/sanitize_asan.log" 2>&1 &&
     /usr/bin/python3 tests/dist_check.py "$BUILD/bin/m3" parity --first tests/data >>"$BUILD/sanitize_asan.log" 2>&1; then
    echo "ASan+UBSan: $(grep -o 'out of [0-9]*' "$BUILD/sanitize_asan.log" | tail -1 | grep -o '[0-9]*' || true) tests and -np 2/3 parity on one case in $(($(date +%s) - start)) s, clean"
  else
    echo "ASan+UBSan: FAILED ($BUILD/sanitize_asan.log)"
    grep -E 'FAILED|FAIL:|\(Failed\)|\(Timeout\)|\(SEGFAULT\)|Exception|ERROR: AddressSanitizer|runtime error|LeakSanitizer' \
      "$BUILD/sanitize_asan.log" | head -20
    fail=1
  fi
fi

if [ "$WHAT" = all ] || [ "$WHAT" = tsan ]; then
  BUILD=${M3_TSAN_BUILD:-$ROOT/build-tsan}
  # (M3_TSAN builds at -O1 with line tables only: enough for TSan's stacks, and a faster build.)
  CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3_TSAN=ON -DM3_CUDA=OFF -DM3_BUILD_TESTS=ON -DM3_BUILD_BENCH=OFF >/dev/null
  cmake --build "$BUILD" --target test_scheduler m3_cli
  start=$(date +%s)
  # Debian's libraries (libstdc++, libgomp, cpp-httplib) are not instrumented: TSan sees their
  # allocations and memcmp through its interceptors but not their synchronization, and reports
  # races between them that are not there (cpp-httplib's request parsing on two connections).
  # Our code, which is instrumented, is checked in full.
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1"
  # The fixture model first (ctest runs it for the tests that need it).
  if ctest --test-dir "$BUILD" --output-on-failure -R '^scheduler:' >"$BUILD/sanitize_tsan.log" 2>&1 &&
     /usr/bin/python3 tests/serve_soak.py "$BUILD/bin/m3" "$BUILD/test_models/real_vocab" 80 >>"$BUILD/sanitize_tsan.log" 2>&1; then
    echo "TSan: the scheduler's tests and an 80-request serve soak in $(($(date +%s) - start)) s, clean"
  else
    echo "TSan: FAILED ($BUILD/sanitize_tsan.log)"
    grep -E 'FAILED|FAIL:|WARNING: ThreadSanitizer|SUMMARY' "$BUILD/sanitize_tsan.log" | head -20
    fail=1
  fi
fi
exit $fail
