# Cross-compiling for 64-bit ARM on Debian 12 (tests/cross_arm64.sh): the crossbuild compilers
# (g++-aarch64-linux-gnu) against the arm64 packages of the dependencies (multiarch:
# dpkg --add-architecture arm64), tests run under qemu-aarch64 (qemu-user).
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake -DM3_MPI=OFF
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Multiarch: headers in /usr/include, libraries and CMake packages under the lib/aarch64-linux-gnu
# folders; the host's programs (python3, pkg-config) run as they are.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
# ctest and Catch's test discovery run the test executables through the emulator.
find_program(M3_QEMU_AARCH64 qemu-aarch64)
if(M3_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${M3_QEMU_AARCH64} -L /usr/aarch64-linux-gnu)
endif()
