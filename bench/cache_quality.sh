#!/usr/bin/env bash
# Table of cache storage type quality on every golden case: bench/cache_quality.sh [BUILD_DIR] [DATA_DIR] [--json]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$here/build}"
data="${2:-$here/tests/data}"
shift $(( $# > 2 ? 2 : $# ))
exec "$build/bench/bench_cache_quality" "$@" "$data"/golden/s*/
