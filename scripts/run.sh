#!/usr/bin/env bash
# The main job: installs what is missing, builds, then
#   scripts/run.sh                      `m3 bench`: generates (once, cached in ~/.cache/m3) a packed
#                                       model with the real MiniMax-M3 layer shapes and random weights,
#                                       then measures prefill and decode against this machine's limits
#   scripts/run.sh MODEL_DIR [PROMPT]   generates text from a model folder (chat-formatted, `m3 run`);
#                                       a folder without tokenizer files (the golden checkpoints) gets a
#                                       summary and a greedy decode from token ids instead
# Extra arguments after the prompt go to `m3 run` / `m3 bench` (e.g. --numa split, -t 8).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/build.sh"
m3="$here/build/bin/m3"
if [ $# -eq 0 ]; then
  exec "$m3" bench
fi
model=$1
shift
prompt=${1:-"Write a haiku about memory bandwidth."}
[ $# -gt 0 ] && shift
if [ -f "$model/tokenizer.json" ] && [ -f "$model/chat_template.jinja" ]; then
  exec "$m3" run -m "$model" -p "$prompt" "$@"
fi
"$m3" inspect -m "$model"
out=$(mktemp -d)
"$m3" logits -m "$model" --ids 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 -n 16 -o "$out" "$@"
echo "greedy ids: $(cat "$out/greedy_ids.json")   (logits written to $out)"
