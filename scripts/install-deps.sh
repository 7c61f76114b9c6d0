#!/usr/bin/env bash
# Installs the Debian 12 packages m3 builds and tests with; does nothing when all are present.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libhwy-dev libomp-dev libdnnl-dev libnuma-dev libxsimd-dev
  nlohmann-json3-dev libcli11-dev libpcre2-dev libicu-dev catch2
  libcpp-httplib-dev # m3 serve
  libopenmpi-dev openmpi-bin  # expert parallelism over several servers (mpirun -np N m3 ...)
  python3-numpy bc   # golden checks: the oracle's check_case.py needs NumPy
  gnuplot-nox        # m3 bench --attention: the plot (optional at run time)
  clang libclang-rt-14-dev  # tests/fuzz.sh: libFuzzer, ASan and UBSan
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
