#!/usr/bin/env bash
# Table of cache storage type quality on every golden case: bench/cache_quality.sh [BUILD_DIR] [SHARED_DIR] [--json]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$here/build}"
shared="${2:-$here/../shared}"
shift $(( $# > 2 ? 2 : $# ))
exec "$build/bench/bench_cache_quality" "$@" "$shared"/golden/s*/
