#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (needs ../shared beside the clone).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/build.sh"
cd "$here/build"
ctest --output-on-failure -j "$(nproc)"
