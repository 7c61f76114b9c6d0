#!/usr/bin/env bash
# Golden parity beyond the shared cases: builds the configurations of tests/golden_variants.json
# (no shared expert or two, sizes that are not multiples of 32, MXFP8 partial blocks, init/local
# blocks, 1 to 8 index heads, MHA, no sparse layer or no MoE, a one-token prompt, a prompt over two
# prefill chunks...) with the oracle's own generator, then judges `m3 logits` on each with
# check-golden.sh (the oracle's check_case.py), and checks that every one packs as q4-mixed and
# runs with finite logits.
# Usage: tests/check-variants.sh [BUILD_DIR] [DATA_DIR] [THREADS]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
data=$(cd "${2:-$here/tests/data}" && pwd)
threads=${3:-0}
py=/usr/bin/python3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/data"
ln -s "$data/oracle" "$out/data/oracle"
$py "$data/oracle/make_golden.py" --cases "$here/tests/golden_variants.json" --out "$out/data/golden" >"$out/make.log" 2>&1 ||
  { cat "$out/make.log"; echo "FAIL: the oracle could not build the variant cases"; exit 1; }
fail=0
"$here/tests/check-golden.sh" "$build" "$out/data" "$threads" || fail=1
for case_dir in "$out"/data/golden/*/; do
  case_dir=${case_dir%/}
  name=$(basename "$case_dir")
  ids=$($py -c "import json,sys; print(','.join(map(str,json.load(open(sys.argv[1]))['prompt_ids'])))" "$case_dir/case.json")
  if "$build/bin/m3" pack -m "$case_dir" -o "$out/$name-q4-mixed" --type q4-mixed -t "$threads" >/dev/null 2>"$out/pack.err" &&
     "$build/bin/m3" logits -m "$out/$name-q4-mixed" --ids "$ids" -n 2 -o "$out/logits-$name" -t "$threads" 2>"$out/logits.err" &&
     $py -c "import numpy as np,sys; assert all(np.isfinite(np.load(sys.argv[1]+f)).all() for f in ('/prefill_logits.npy','/decode_logits.npy'))" "$out/logits-$name"; then
    echo "PASS $name q4-mixed: packs and runs, finite logits"
  else
    cat "$out/pack.err" "$out/logits.err" 2>/dev/null; echo "FAIL $name q4-mixed"; fail=1
  fi
done
exit $fail
