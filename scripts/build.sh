#!/usr/bin/env bash
# Configures and builds m3 (RelWithDebInfo) into ./build. Usage: scripts/build.sh [extra cmake args]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/install-deps.sh"
cmake -S "$here" -B "$here/build" -G Ninja "$@" >/dev/null
cmake --build "$here/build" -j "$(nproc)"
