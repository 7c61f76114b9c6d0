#!/usr/bin/env bash
# The installed package as an application sees it (issue 50): `cmake --install` into a fresh
# prefix, moved elsewhere before use (every installed file finds the others by relative paths),
# then: libm3.so's SONAME and exports (the C API's functions, nothing else); a C program built
# with pkg-config and a C++ one with find_package(m3), each running a golden case (its greedy
# ids) and a chat turn on the tiny real-vocabulary model; libm3.a through both, where the build
# has it (-DM3_INSTALL_STATIC=ON); the Python module's tests (tests/python) against the
# installed module and library. Nothing here reads the build tree but to install from it.
# Usage: install_check.sh BUILD_DIR SOURCE_DIR GOLDEN_CASE_DIR REAL_VOCAB_MODEL_DIR
set -euo pipefail
abs() { (cd "$1" && pwd); }
build=$(abs "$1") src=$(abs "$2") case_dir=$(abs "$3") vocab_model=$(abs "$4")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}

cmake --install "$build" --prefix "$work/staged" >/dev/null
mv "$work/staged" "$work/prefix"
prefix=$work/prefix
pc=$(find "$prefix" -name m3.pc)
[ -n "$pc" ] || fail "no m3.pc installed"
export PKG_CONFIG_PATH=$(dirname "$pc")
libdir=$(pkg-config --variable=libdir m3)
[ -f "$libdir/libm3.so.0" ] || fail "pkg-config's libdir $libdir has no libm3.so.0"
grep -rl "$build" "$prefix" --include='*.pc' --include='*.cmake' --include='*.py' && fail "installed files name the build tree"

# The library: SONAME, and exactly the functions m3.h declares exported.
# Each tool's output taken whole before grep -q reads it: grep -q stops at its first match, and under
# pipefail the writer's SIGPIPE would fail the pipeline (seen under load with ldd).
dynamic=$(readelf -d "$libdir/libm3.so")
grep -q 'SONAME.*\[libm3\.so\.0\]' <<<"$dynamic" || fail "SONAME is not libm3.so.0: $dynamic"
nm -D --defined-only "$libdir/libm3.so" | awk '{print $NF}' | sed 's/@.*//' | sort -u >"$work/exported"
grep -o '\bm3_[a-z0-9_]*(' "$prefix/include/m3/m3.h" | tr -d '(' | sort -u >"$work/declared"
diff "$work/declared" "$work/exported" >"$work/symbols.diff" || fail "exports differ from m3.h's functions: $(cat "$work/symbols.diff")"
echo "libm3.so: SONAME libm3.so.0, exports the $(wc -l <"$work/exported") functions of m3.h and nothing else"

ids=$(/usr/bin/python3 -c "import json, sys; print(','.join(map(str, json.load(open(sys.argv[1]))['prompt_ids'])))" "$case_dir/case.json")
steps=$(/usr/bin/python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['decode_steps'])" "$case_dir/case.json")
want=$(/usr/bin/python3 -c "import json, sys; print(' '.join(map(str, json.load(open(sys.argv[1]))['greedy_ids'])))" "$case_dir/case.json")
check_app() {  # NAME BINARY: the golden case's greedy ids, then a chat turn that returns a message
  local got message
  got=$("$2" "$case_dir" "$ids" "$steps") || fail "$1: the golden case failed"
  [ "$got" = "$want" ] || fail "$1: greedy ids $got, the golden case has $want"
  message=$("$2" --chat "$vocab_model" "Hello from $1" 2>/dev/null) || fail "$1: the chat turn failed"
  /usr/bin/python3 -c "import json, sys; m = json.loads(sys.argv[1]); assert m['role'] == 'assistant' and m['content'], m" \
    "$message" || fail "$1: the chat turn's message: $message"
  "$2" /nonexistent-model 1,2 2>"$work/err" && fail "$1: a missing model folder succeeded"
  grep -q "nonexistent-model" "$work/err" || fail "$1: the error does not name the folder: $(cat "$work/err")"
  echo "$1: golden $(basename "$case_dir") greedy ids equal, a chat turn, a clear error"
}

# C through pkg-config, run as built (the .pc's rpath finds the library outside the loader's path).
cc "$src/examples/c/m3_example.c" $(pkg-config --cflags --libs m3) -Wall -Wextra -Werror -o "$work/c_example"
loaded=$(ldd "$work/c_example")
grep -q "$libdir/libm3.so.0" <<<"$loaded" || fail "the C example does not load the installed libm3.so: $loaded"
check_app "C (pkg-config)" "$work/c_example"
if [ -f "$libdir/libm3.a" ]; then
  cc "$src/examples/c/m3_example.c" $(pkg-config --cflags m3) $(pkg-config --variable=static_libs m3) -o "$work/c_static"
  loaded=$(ldd "$work/c_static")
  grep -q libm3 <<<"$loaded" && fail "the static C example loads libm3.so: $loaded"
  check_app "C (libm3.a)" "$work/c_static"
fi

# C++ through the CMake package.
cmake -S "$src/examples/cmake" -B "$work/cmake-app" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/cmake-app" >/dev/null
check_app "C++ (find_package)" "$work/cmake-app/m3_cmake_example"
if [ -f "$libdir/libm3.a" ]; then
  [ -x "$work/cmake-app/m3_cmake_example_static" ] || fail "the CMake package has no m3::m3_static beside libm3.a"
  check_app "C++ (m3::m3_static)" "$work/cmake-app/m3_cmake_example_static"
fi

# Python: the installed module, which loads the installed library.
site=$(dirname "$(find "$prefix" -path '*site-packages/m3' -type d)")
cd "$work"
env -u M3_LIBRARY PYTHONPATH="$site" /usr/bin/python3 -c "
import m3, sys
assert m3.__file__.startswith(sys.argv[1]), m3.__file__
print('python: import m3 from', m3.__file__)" "$prefix"
env -u M3_LIBRARY PYTHONPATH="$site" M3_GOLDEN_DIR="$(dirname "$case_dir")" M3_REAL_VOCAB_MODEL="$vocab_model" \
  M3_BIN="$prefix/bin/m3" /usr/bin/python3 -m pytest -q -p no:cacheprovider "$src/tests/python"
echo "install check: all passed"
