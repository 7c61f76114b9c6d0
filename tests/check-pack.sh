#!/usr/bin/env bash
# `m3 pack` end to end: packs golden cases, checks `m3 inspect --verify` (source and pack), that a
# second pack without --force is refused, that `m3 logits` runs on the packed folder with finite
# logits, and that a damaged pack is refused.
# (How close packed logits are to the fp32 engine is judged elsewhere.)
# Usage: tests/check-pack.sh [BUILD_DIR] [DATA_DIR] [THREADS]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
data=${2:-$here/tests/data}
threads=${3:-0}
m3="$build/bin/m3"
py=/usr/bin/python3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0

check() {  # name type
  local name=$1 type=$2 case_dir="$data/golden/$1" dst="$out/$1-$2"
  "$m3" pack -m "$case_dir" -o "$dst" --type "$type" -t "$threads" >"$out/pack.log" 2>"$out/pack.err" ||
    { cat "$out/pack.log" "$out/pack.err"; echo "FAIL $name $type: pack"; return 1; }
  grep -q "bits per weight" "$out/pack.log" || { echo "FAIL $name $type: no summary"; return 1; }
  grep -q "100.0%" "$out/pack.err" || { echo "FAIL $name $type: no progress"; return 1; }
  "$m3" inspect -m "$case_dir" --verify >"$out/inspect.log" 2>&1 && grep -q "is finite" "$out/inspect.log" ||
    { cat "$out/inspect.log"; echo "FAIL $name: source verify"; return 1; }
  "$m3" inspect -m "$dst" --verify >"$out/inspect.log" 2>&1 || { cat "$out/inspect.log"; echo "FAIL $name $type: verify"; return 1; }
  grep -q "packed           $type" "$out/inspect.log" || { cat "$out/inspect.log"; echo "FAIL $name $type: inspect"; return 1; }
  if "$m3" pack -m "$case_dir" -o "$dst" --type "$type" >/dev/null 2>"$out/again.err"; then
    echo "FAIL $name $type: overwrote without --force"; return 1
  fi
  grep -q -- "--force" "$out/again.err" || { cat "$out/again.err"; echo "FAIL $name $type: refusal message"; return 1; }
  local ids steps
  read -r ids steps < <($py -c "import json,sys; c=json.load(open(sys.argv[1])); print(','.join(map(str,c['prompt_ids'])), c['decode_steps'])" "$case_dir/case.json")
  "$m3" logits -m "$dst" --ids "$ids" -n "$steps" -o "$out/logits-$name-$type" -t "$threads" 2>"$out/logits.log" ||
    { cat "$out/logits.log"; echo "FAIL $name $type: logits"; return 1; }
  $py - "$out/logits-$name-$type" <<'EOF' || { echo "FAIL $name $type: logits not finite"; return 1; }
import sys, numpy as np
d = sys.argv[1]
for f in ("prefill_logits.npy", "decode_logits.npy"):
    a = np.load(f"{d}/{f}")
    assert a.size > 0 and np.isfinite(a).all(), f
EOF
  echo "PASS $name $type: $(grep '^time' "$out/pack.log")"
}

# A NaN row scale in the s1 q8 pack: `m3 logits` fails naming the layer and block (it used to
# write all-zero logits), and `m3 inspect --verify` names the tensor.
check_damaged() {
  local dst="$out/s1_fp32_basic-q8" tensor=model.layers.0.self_attn.o_proj.weight
  $py - "$dst/model.m3w" "$tensor" <<'EOF'
import json, struct, sys
path, name = sys.argv[1], sys.argv[2]
b = bytearray(open(path, "rb").read())
off, n = struct.unpack_from("<QQ", b, 24)
t = next(t for t in json.loads(bytes(b[off:off + n]))["tensors"] if t["name"] == name)
struct.pack_into("<f", b, t["scales_offset"] + 4 * 5, float("nan"))
open(path, "wb").write(b)
EOF
  # Without the background hash check the pass itself must catch the NaN.
  if "$m3" logits -m "$dst" --ids 1,2,3 -o "$out/damaged" -t "$threads" --verify-weights off \
      2>"$out/damaged.err"; then
    echo "FAIL damaged q8: logits succeeded"; return 1
  fi
  grep -q "layer 0's attention gave a non-finite value" "$out/damaged.err" ||
    { cat "$out/damaged.err"; echo "FAIL damaged q8: logits message"; return 1; }
  # With it (the default on a first load) either check may be first; both name what is wrong.
  if XDG_CACHE_HOME="$out/cache" "$m3" logits -m "$dst" --ids 1,2,3 -o "$out/damaged" -t "$threads" \
      2>"$out/damaged.err"; then
    echo "FAIL damaged q8: logits succeeded with the hash check"; return 1
  fi
  grep -qE "layer 0's attention gave a non-finite value|tensor '$tensor' is damaged" "$out/damaged.err" ||
    { cat "$out/damaged.err"; echo "FAIL damaged q8: logits message with the hash check"; return 1; }
  if "$m3" inspect -m "$dst" --verify >/dev/null 2>"$out/damaged.err"; then
    echo "FAIL damaged q8: verify passed"; return 1
  fi
  grep -q "$tensor" "$out/damaged.err" || { cat "$out/damaged.err"; echo "FAIL damaged q8: verify message"; return 1; }
  echo "PASS damaged q8: logits and verify refuse it"
}

# The released model's footprint at the sub-4-bit mixes (printed by m3 pack and m3 inspect when
# m3 was built with the benchmarks, which hold the released shapes): q3-mixed <= 190 GB, q2-mixed
# <= 140 GB.
check_footprint() {  # name type max_gb
  local log="$out/$1-$2.inspect"
  "$m3" inspect -m "$out/$1-$2" >"$log" 2>&1 || { cat "$log"; echo "FAIL $1 $2: inspect"; return 1; }
  grep -q "full model" "$log" || { echo "SKIP $2 footprint: m3 built without benchmarks"; return 0; }
  local gb
  gb=$(sed -n 's/^full model *\([0-9.]*\) GB.*/\1/p' "$log")
  $py -c "import sys; sys.exit(0 if float('$gb') <= $3 else 1)" ||
    { grep "full model" "$log"; echo "FAIL $2: the released model takes $gb GB (at most $3)"; return 1; }
  echo "PASS $2 footprint: $gb GB"
}

for c in "s1_fp32_basic q8" "s5_realprop_mxfp8_vl q4-mixed" "s6_fp16_mha_top1_sharded3 q4" "s2_bf16_sharded_init1 q3-mixed" \
         "s3_mxfp8_mixed_layers_local2 q2-mixed"; do
  # shellcheck disable=SC2086
  check $c || fail=1
done
# --override: the experts' down projections as q8 in a q2-mixed pack, the directory recording the
# override, and a malformed one refused before anything is written.
check_override() {
  local dst="$out/override"
  "$m3" pack -m "$data/golden/s1_fp32_basic" -o "$dst" --type q2-mixed --override 'experts\.[0-9]+\.w2\.weight$=q8' \
    -t "$threads" >"$out/override.log" 2>&1 || { cat "$out/override.log"; echo "FAIL override: pack"; return 1; }
  "$m3" logits -m "$dst" --ids 1,2,3 -o "$out/override-logits" -t "$threads" >/dev/null 2>&1 ||
    { echo "FAIL override: logits"; return 1; }
  $py - "$dst/model.m3w" <<'EOF' || { echo "FAIL override: formats"; return 1; }
import json, re, struct, sys
b = open(sys.argv[1], "rb").read()
off, n = struct.unpack_from("<QQ", b, 24)
d = json.loads(b[off:off + n])
fmt = {t["name"]: t["format"] for t in d["tensors"]}
down = [f for k, f in fmt.items() if re.search(r"experts\.[0-9]+\.w2\.weight$", k)]
rest = [f for k, f in fmt.items() if re.search(r"moe\.experts\.[0-9]+\.w[13]\.weight$", k)]
assert down and set(down) == {"q8"}, set(down)
assert rest and set(rest) == {"q2"}, set(rest)
assert d["overrides"] == [{"pattern": r"experts\.[0-9]+\.w2\.weight$", "format": "q8"}], d["overrides"]
EOF
  if "$m3" pack -m "$data/golden/s1_fp32_basic" -o "$out/override-bad" --override 'experts[=q4' 2>"$out/override.err"; then
    echo "FAIL override: a malformed pattern was taken"; return 1
  fi
  grep -q "not a regular expression" "$out/override.err" || { cat "$out/override.err"; echo "FAIL override: message"; return 1; }
  [ ! -e "$out/override-bad/model.m3w" ] || { echo "FAIL override: wrote a pack"; return 1; }
  echo "PASS override: expert down projections q8 in q2-mixed; a malformed pattern refused"
}

# m3 imatrix on calibration ids, then a q2-mixed pack weighted by it that runs; an importance
# matrix of another model and a file that is not one are refused by name before anything is written.
check_imatrix() {
  local src="$data/golden/s1_fp32_basic" im="$out/imatrix.safetensors" ids
  ids=$($py -c "print(','.join(str((i * 37 + 5) % 512) for i in range(256)))")
  "$m3" imatrix -m "$src" --ids "$ids" -c 64 -o "$im" -t "$threads" >"$out/imatrix.log" 2>&1 ||
    { cat "$out/imatrix.log"; echo "FAIL imatrix: collect"; return 1; }
  grep -q "4 chunk(s) of 64 tokens" "$out/imatrix.log" && grep -q "perplexity" "$out/imatrix.log" ||
    { cat "$out/imatrix.log"; echo "FAIL imatrix: summary"; return 1; }
  "$m3" pack -m "$src" -o "$out/imatrix-pack" --type q2-mixed --imatrix "$im" -t "$threads" >"$out/impack.log" 2>&1 ||
    { cat "$out/impack.log"; echo "FAIL imatrix: pack"; return 1; }
  grep -Eq "imatrix .*: [1-9][0-9]* q4/q3/q2 matrices weighted" "$out/impack.log" ||
    { cat "$out/impack.log"; echo "FAIL imatrix: pack summary"; return 1; }
  "$m3" logits -m "$out/imatrix-pack" --ids 1,2,3 -o "$out/imatrix-logits" -t "$threads" >/dev/null 2>&1 ||
    { echo "FAIL imatrix: logits"; return 1; }
  if "$m3" pack -m "$data/golden/s2_bf16_sharded_init1" -o "$out/imatrix-other" --imatrix "$im" 2>"$out/imatrix.err"; then
    echo "FAIL imatrix: another model's importance matrix was taken"; return 1
  fi
  grep -Eq "is not a matrix of this model|inputs in the importance matrix" "$out/imatrix.err" ||
    { cat "$out/imatrix.err"; echo "FAIL imatrix: message (other model)"; return 1; }
  [ ! -e "$out/imatrix-other/model.m3w" ] || { echo "FAIL imatrix: wrote a pack"; return 1; }
  if "$m3" pack -m "$src" -o "$out/imatrix-bad" --imatrix "$src/model.safetensors" 2>"$out/imatrix.err"; then
    echo "FAIL imatrix: a checkpoint was taken as an importance matrix"; return 1
  fi
  grep -q "not an importance matrix" "$out/imatrix.err" || { cat "$out/imatrix.err"; echo "FAIL imatrix: message (not one)"; return 1; }
  if "$m3" imatrix -m "$src" --ids 1,2,3 -c 64 -o "$out/short.safetensors" 2>"$out/imatrix.err"; then
    echo "FAIL imatrix: a text shorter than a chunk was taken"; return 1
  fi
  grep -q "fewer than one chunk" "$out/imatrix.err" || { cat "$out/imatrix.err"; echo "FAIL imatrix: message (short)"; return 1; }
  if "$m3" imatrix -m "$src" --ids "$ids" -c 64 -o "$out/split.safetensors" --numa split 2>"$out/imatrix.err"; then
    echo "FAIL imatrix: --numa split was taken"; return 1
  fi
  grep -q "numa split" "$out/imatrix.err" || { cat "$out/imatrix.err"; echo "FAIL imatrix: message (numa)"; return 1; }
  echo "PASS imatrix: collected, a q2-mixed pack weighted by it runs; foreign and bad files refused"
}

check_override || fail=1
check_imatrix || fail=1
check_footprint s2_bf16_sharded_init1 q3-mixed 190 || fail=1
check_footprint s3_mxfp8_mixed_layers_local2 q2-mixed 140 || fail=1
check_damaged || fail=1
exit $fail
