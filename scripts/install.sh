#!/usr/bin/env bash
# Builds m3 (installing missing Debian packages, as scripts/build.sh) and installs it into PREFIX
# (default ~/.local: no root needed): libm3.so, the headers m3/m3.h and m3/m3.hpp, the m3
# executable, the CMake package (find_package(m3)), m3.pc for pkg-config and the Python module.
# Usage: scripts/install.sh [PREFIX [extra cmake args, e.g. -DM3_INSTALL_STATIC=ON for libm3.a]]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
prefix=${1:-$HOME/.local}
[ $# -gt 0 ] && shift
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
"$here/scripts/build.sh" "$@"
cmake --install "$here/build" --prefix "$prefix" | grep -v "^-- Up-to-date" || true
pc_dir=$(dirname "$(find "$prefix" -path '*pkgconfig/m3.pc' | head -1)")
site=$(dirname "$(find "$prefix" -path '*site-packages/m3' -type d | head -1)")
cat <<MSG
m3 installed in $prefix. To use it:
  C (pkg-config):  export PKG_CONFIG_PATH=$pc_dir:\${PKG_CONFIG_PATH:-}
                   cc app.c \$(pkg-config --cflags --libs m3)
  CMake:           cmake -DCMAKE_PREFIX_PATH=$prefix ...   with find_package(m3 CONFIG REQUIRED), m3::m3
  Python:          PYTHONPATH=$site python3 -c "import m3"   (a ~/.local prefix is on Python's path already)
  The tool:        $prefix/bin/m3 --help
MSG
