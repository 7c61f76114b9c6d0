#!/usr/bin/env bash
# Runs `m3 logits` on every golden case and judges it with the oracle's check_case.py.
# Usage: tests/check-golden.sh [BUILD_DIR] [DATA_DIR] [THREADS] [m3 logits options...]
# (e.g. --lookup 3: the decode rows then come from prompt-lookup verify passes where guesses hold)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
data=${2:-$here/tests/data}
threads=${3:-0}
shift $(( $# < 3 ? $# : 3 ))
py=/usr/bin/python3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
for case_dir in "$data"/golden/*/; do
  case_dir=${case_dir%/}
  [ -f "$case_dir/case.json" ] || continue
  name=$(basename "$case_dir")
  read -r ids steps < <($py -c "import json,sys; c=json.load(open(sys.argv[1])); print(','.join(map(str,c['prompt_ids'])), c['decode_steps'])" "$case_dir/case.json")
  echo "$ids" > "$out/$name.ids"
  start=$(date +%s.%N)
  "$build/bin/m3" logits -m "$case_dir" --ids "@$out/$name.ids" -n "$steps" -o "$out/$name" --dump-blocks -t "$threads" "$@" 2>"$out/$name.log" || { cat "$out/$name.log"; fail=1; continue; }
  end=$(date +%s.%N)
  greedy=$($py -c "import json,sys; print(','.join(map(str,json.load(open(sys.argv[1])))))" "$out/$name/greedy_ids.json")
  if $py "$data/oracle/check_case.py" --case "$case_dir" --prefill "$out/$name/prefill_logits.npy" \
      --decode "$out/$name/decode_logits.npy" --greedy "$greedy" --selected "$out/$name/selected_blocks.json" > "$out/$name.verdict"; then
    status=PASS
  else
    status=FAIL; fail=1
  fi
  printf '%-45s %s  wall %.2fs  %s  %s\n' "$name" "$status" "$(echo "$end - $start" | bc)" "$(cat "$out/$name.verdict")" \
    "$(grep -o 'lookup: [0-9]* of [0-9]* guesses accepted' "$out/$name.log" || true)"
done
exit $fail
