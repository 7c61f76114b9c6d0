#!/usr/bin/env bash
# Installs the peer of bench/peer/peer_bench.py, llama.cpp, the way this project's registries allow
# (npm; idempotent), and builds its timing harness against it:
#   - node-llama-cpp@3.22.1 ships llama.cpp v0.5.0 as prebuilt CPU libraries in
#     @node-llama-cpp/<platform> (one libggml-cpu-*.so per x86 CPU generation, picked at run time)
#     and the llama.cpp source as a git bundle inside the package (its headers);
#   - both come as npm tarballs (`npm pack`: no install scripts, no dependencies);
#   - llama_peer.cc is built with g++ against those headers and libraries (rpath to them).
# Prints the folder that holds llama_peer and the libraries. Usage: setup.sh [DIR]
# (default: $M3_PEER_DIR, else $XDG_CACHE_HOME/m3/peer or ~/.cache/m3/peer).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=3.22.1
dir=${1:-${M3_PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/m3/peer}}
case "$(uname -m)" in
  x86_64) platform=linux-x64 ;;
  aarch64) platform=linux-arm64 ;;
  *) echo "setup.sh: no prebuilt llama.cpp for $(uname -m)" >&2; exit 1 ;;
esac

missing=()
command -v npm >/dev/null || missing+=(nodejs npm)
command -v git >/dev/null || missing+=(git)
command -v g++ >/dev/null || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}" >&2
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

root="$dir/node-llama-cpp-$version"
libs="$root/bins/$platform"
if [ ! -f "$root/.complete" ]; then
  echo "setup.sh: fetching node-llama-cpp@$version and @node-llama-cpp/$platform@$version (npm)" >&2
  rm -rf "$root" "$root.partial"
  mkdir -p "$root.partial/tgz"
  (cd "$root.partial/tgz" && npm pack --silent "node-llama-cpp@$version" "@node-llama-cpp/$platform@$version" >/dev/null)
  tar -xzf "$root.partial/tgz/node-llama-cpp-$version.tgz" -C "$root.partial" package/llama/gitRelease.bundle \
    package/llama/llama.cpp.info.json
  tar -xzf "$root.partial/tgz/node-llama-cpp-$platform-$version.tgz" -C "$root.partial" "package/bins/$platform"
  git clone -q "$root.partial/package/llama/gitRelease.bundle" "$root.partial/llama.cpp" 2>/dev/null
  mkdir -p "$root.partial/include" "$root.partial/bins"
  cp "$root.partial/llama.cpp/include/"*.h "$root.partial/llama.cpp/ggml/include/"*.h "$root.partial/include/"
  mv "$root.partial/package/bins/$platform" "$root.partial/bins/$platform"
  cp "$root.partial/package/llama/llama.cpp.info.json" "$root.partial/"
  rm -rf "$root.partial/tgz" "$root.partial/package" "$root.partial/llama.cpp"
  touch "$root.partial/.complete"
  mv "$root.partial" "$root"
fi

# The harness, rebuilt when its source changes.
harness="$root/llama_peer"
if [ ! -x "$harness" ] || [ "$here/llama_peer.cc" -nt "$harness" ]; then
  llama_lib=$(cd "$libs" && ls libllama.*so | head -1)
  ggml_lib=$(cd "$libs" && ls libggml.*so | grep -v base | head -1)
  g++ -O2 -std=c++17 -Wall -Wextra -I"$root/include" "$here/llama_peer.cc" -o "$harness.tmp" -L"$libs" \
    -l:"$llama_lib" -l:"$ggml_lib" -l:libggml-base.so -Wl,-rpath,"$libs" -lpthread
  mv "$harness.tmp" "$harness"
fi
echo "$root"
