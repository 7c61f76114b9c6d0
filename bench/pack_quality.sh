#!/usr/bin/env bash
# Table of packed-model quality on every golden case: bench/pack_quality.sh [BUILD_DIR] [SHARED_DIR] [--json]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$here/build}"
shared="${2:-$here/../shared}"
shift $(( $# > 2 ? 2 : $# ))
exec "$build/bench/bench_pack_quality" "$@" "$shared"/golden/s*/
