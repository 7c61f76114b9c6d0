# Every dependency comes from a Debian package (scripts/install-deps.sh installs them).
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(hwy REQUIRED)
# xsimd (libxsimd-dev, header only): the vocabulary-wide loops of sampling and scoring (ops/vocab.h).
# Found by header: Debian's xsimdConfig.cmake links an "xtl" library that does not exist as one.
find_path(M3_XSIMD_INCLUDE_DIR xsimd/xsimd.hpp REQUIRED)
add_library(m3::xsimd INTERFACE IMPORTED)
set_target_properties(m3::xsimd PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${M3_XSIMD_INCLUDE_DIR}")
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(Threads REQUIRED)
# Open MPI (libopenmpi-dev): expert parallelism over several servers (lib/cluster), by M3_MPI.
set(M3_HAVE_MPI OFF)
if(M3_MPI STREQUAL "ON")
  find_package(MPI REQUIRED COMPONENTS C)
  set(M3_HAVE_MPI ON)
elseif(M3_MPI STREQUAL "AUTO")
  find_package(MPI QUIET COMPONENTS C)
  set(M3_HAVE_MPI ${MPI_C_FOUND})
endif()
if(NOT M3_HAVE_MPI)
  message(STATUS "MPI: off (M3_MPI=${M3_MPI}): no expert parallelism over several servers")
endif()
# Tokenizer: PCRE2 runs the pre-tokenizer regex, ICU does the NFC normalization.
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
find_package(ICU REQUIRED COMPONENTS uc)
# m3 serve: cpp-httplib (libcpp-httplib-dev).
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
if(M3_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
endif()
# oneDNN (libdnnl-dev), optional: the int8 matmul peer in `m3 bench --kernels`. Found by header and
# library rather than find_package(dnnl): Debian's dnnl-config.cmake hard-requires OpenCL for its
# GPU runtime, which the CPU engine never uses, and a missing OpenCL would make configure fail.
# The benchmark uses the 2.x API (matmul::desc, output scales), so only major version 2 is taken.
find_path(M3_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
find_library(M3_DNNL_LIBRARY dnnl)
set(M3_HAVE_DNNL OFF)
if(M3_DNNL_INCLUDE_DIR AND M3_DNNL_LIBRARY AND EXISTS "${M3_DNNL_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h")
  file(STRINGS "${M3_DNNL_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h" _m3_dnnl_major REGEX "#define DNNL_VERSION_MAJOR ")
  string(REGEX REPLACE ".*DNNL_VERSION_MAJOR ([0-9]+).*" "\\1" _m3_dnnl_major "${_m3_dnnl_major}")
  if(_m3_dnnl_major STREQUAL "2")
    set(M3_HAVE_DNNL ON)
    add_library(m3::dnnl UNKNOWN IMPORTED)
    set_target_properties(m3::dnnl PROPERTIES IMPORTED_LOCATION "${M3_DNNL_LIBRARY}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${M3_DNNL_INCLUDE_DIR}")
    message(STATUS "oneDNN ${_m3_dnnl_major}.x: ${M3_DNNL_LIBRARY} (benchmark peer)")
  else()
    message(STATUS "oneDNN ${_m3_dnnl_major}.x found; the benchmark peer needs 2.x: onednn rows disabled")
  endif()
else()
  message(STATUS "oneDNN not found (libdnnl-dev): m3 bench --kernels skips its onednn rows")
endif()
# libnuma (libnuma-dev), optional: NUMA topology, node-bound buffers and page-placement checks for
# the split MoE mode. Without it the topology comes from /sys and buffers are not bound to nodes.
find_path(M3_NUMA_INCLUDE_DIR numa.h)
find_library(M3_NUMA_LIBRARY numa)
set(M3_HAVE_NUMA OFF)
if(M3_NUMA_INCLUDE_DIR AND M3_NUMA_LIBRARY AND EXISTS "${M3_NUMA_INCLUDE_DIR}/numaif.h")
  set(M3_HAVE_NUMA ON)
  add_library(m3::numa UNKNOWN IMPORTED)
  set_target_properties(m3::numa PROPERTIES IMPORTED_LOCATION "${M3_NUMA_LIBRARY}"
                                            INTERFACE_INCLUDE_DIRECTORIES "${M3_NUMA_INCLUDE_DIR}")
  message(STATUS "libnuma: ${M3_NUMA_LIBRARY}")
else()
  message(STATUS "libnuma not found (libnuma-dev): NUMA topology from /sys, buffers not node-bound")
endif()
