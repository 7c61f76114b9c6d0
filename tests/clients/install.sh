#!/usr/bin/env bash
# Installs the real clients of tests/clients (package-lock.json) into tests/clients/node_modules,
# and Node.js and npm from Debian when they are missing. Does nothing when the installed tree was
# made from the same lock (its hash is kept in node_modules/.m3-lock-sha256).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "installing: nodejs npm"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends nodejs npm
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 18 ]; then
  echo "tests/clients needs Node.js 18 or newer, found $(node --version)" >&2
  exit 1
fi
want=$(sha256sum "$here/package-lock.json" | cut -d' ' -f1)
stamp="$here/node_modules/.m3-lock-sha256"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "tests/clients: npm ci"
# --ignore-scripts: none of these packages needs an install script, and none should run.
(cd "$here" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error)
echo "$want" >"$stamp"
