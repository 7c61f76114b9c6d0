option(M3_BUILD_TESTS "Build the Catch2 test suite" ON)
option(M3_BUILD_BENCH "Build the benchmarks" ON)
option(M3_SANITIZE "Build with address and undefined-behaviour sanitizers" OFF)
set(M3_SHARED_DIR "${CMAKE_SOURCE_DIR}/../shared" CACHE PATH
    "Folder with the golden data, oracle and tokenizer (shared/ beside the clone)")
