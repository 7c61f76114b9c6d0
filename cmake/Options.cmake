option(M3_BUILD_TESTS "Build the Catch2 test suite" ON)
option(M3_BUILD_BENCH "Build the benchmarks" ON)
option(M3_SANITIZE "Build with address and undefined-behaviour sanitizers" OFF)
# ThreadSanitizer (clang): the scheduler and server tests of tests/sanitize.sh.
option(M3_TSAN "Build with the thread sanitizer" OFF)
# The libFuzzer targets of tests/fuzz (clang only; implies the sanitizers): tests/fuzz.sh.
option(M3_FUZZ "Build the libFuzzer targets (clang, with ASan and UBSan)" OFF)
# The tests' data lives in the repository (tests/data: golden cases, the oracle, tokenizer files,
# copied from the project's shared data). ../shared beside the clone, when there, is walked too:
# its golden and tokenizer cases may be more than the copy's.
set(M3_TEST_DATA_DIR "${CMAKE_SOURCE_DIR}/tests/data")
set(M3_SHARED_DIR "${CMAKE_SOURCE_DIR}/../shared" CACHE PATH
    "The project's shared data beside the clone (optional: an extra cross-check of the tests)")
get_filename_component(M3_SHARED_DIR "${M3_SHARED_DIR}" ABSOLUTE)
if(EXISTS "${M3_SHARED_DIR}/golden")
  set(M3_HAVE_SHARED ON)
else()
  set(M3_HAVE_SHARED OFF)
endif()
# The optional CUDA module (lib/offload/cuda): AUTO builds it where the CUDA toolkit (nvcc) is found,
# ON requires it, OFF never builds it. A fresh Debian 12 has no CUDA: AUTO builds without.
set(M3_CUDA AUTO CACHE STRING "Build the CUDA offload module: AUTO, ON or OFF")
set_property(CACHE M3_CUDA PROPERTY STRINGS AUTO ON OFF)
# Open MPI for expert parallelism over several servers (lib/cluster): AUTO uses it where
# libopenmpi-dev is found, ON requires it, OFF builds without (a process is then always alone).
set(M3_MPI AUTO CACHE STRING "Build expert parallelism over MPI: AUTO, ON or OFF")
set_property(CACHE M3_MPI PROPERTY STRINGS AUTO ON OFF)
