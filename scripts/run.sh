#!/usr/bin/env bash
# The main job: installs what is missing, builds, then runs the model in MODEL_DIR (default: the
# real-proportions golden checkpoint in ../shared) — a summary, then prefill + greedy decode with
# timings. Usage: scripts/run.sh [MODEL_DIR] [comma-separated prompt ids]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/build.sh"
model=${1:-$here/../shared/golden/s5_realprop_mxfp8_vl}
ids=${2:-1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}
"$here/build/bin/m3" inspect -m "$model"
out=$(mktemp -d)
"$here/build/bin/m3" logits -m "$model" --ids "$ids" -n 16 -o "$out"
echo "greedy ids: $(cat "$out/greedy_ids.json")   (logits written to $out)"
