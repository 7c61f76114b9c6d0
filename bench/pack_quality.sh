#!/usr/bin/env bash
# Table of packed-model quality on every golden case: bench/pack_quality.sh [BUILD_DIR] [DATA_DIR] [--json]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$here/build}"
data="${2:-$here/tests/data}"
shift $(( $# > 2 ? 2 : $# ))
exec "$build/bench/bench_pack_quality" "$@" "$data"/golden/s*/
