#!/usr/bin/env bash
# Installs the Debian 12 packages m3 builds and tests with; does nothing when all are present.
# With --cross-arm64: those of the aarch64 cross build instead (tests/cross_arm64.sh): the cross
# compiler, qemu-user and the arm64 packages of the libraries (multiarch; no Open MPI, whose arm64
# package cannot sit beside the amd64 one: that build has M3_MPI=OFF).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libhwy-dev libomp-dev libdnnl-dev libnuma-dev libxsimd-dev
  nlohmann-json3-dev libcli11-dev libpcre2-dev libicu-dev catch2
  libcpp-httplib-dev # m3 serve
  libopenmpi-dev openmpi-bin  # expert parallelism over several servers (mpirun -np N m3 ...)
  python3-numpy bc   # golden checks: the oracle's check_case.py needs NumPy
  python3-pytest     # the Python module's tests (tests/python)
  gnuplot-nox        # m3 bench --attention: the plot (optional at run time)
  clang libclang-rt-14-dev  # tests/fuzz.sh: libFuzzer, ASan and UBSan
)
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
if [ "${1:-}" = --cross-arm64 ]; then
  packages=(g++-aarch64-linux-gnu qemu-user libhwy-dev:arm64 libnuma-dev:arm64 libpcre2-dev:arm64 libicu-dev:arm64
            libcpp-httplib-dev:arm64 libxsimd-dev:arm64 nlohmann-json3-dev libcli11-dev catch2)
  foreign=$'\n'$(dpkg --print-foreign-architectures)$'\n'
  [[ $foreign == *$'\n'arm64$'\n'* ]] || "${sudo_cmd[@]}" dpkg --add-architecture arm64
fi
missing=()
for p in "${packages[@]}"; do
  # Compared whole, not piped into grep -q: under pipefail its early exit can fail the writer (SIGPIPE).
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == *"install ok installed"* ]] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
