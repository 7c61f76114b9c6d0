#!/usr/bin/env bash
# A tiny random MiniMax-M3 model with the real 200,064-id vocabulary and the real tokenizer and chat
# template, so that chat prompts run end to end: made by the oracle's make_tiny.py (~2 s, ~50 MB).
# Usage: make_real_vocab_model.sh OUT_DIR DATA_DIR (tests/data)
set -euo pipefail
out=$1 data=$2
rm -rf "$out"
/usr/bin/python3 "$data/oracle/make_tiny.py" --out "$out" \
  --set vocab_size=200064 --set 'dtype="bf16"' --set seed=11 >/dev/null
cp "$data/tokenizer/minimax-m3/tokenizer.json" "$data/tokenizer/minimax-m3/chat_template.jinja" "$out/"
