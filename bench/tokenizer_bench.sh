#!/usr/bin/env bash
# Tokenizer encode MB/s: m3 against the HuggingFace tokenizers library in the same run, on a
# few MB of mixed text built from the tokenizer goldens (prose, code, CJK, emoji, numbers, ...).
# Usage: bench/tokenizer_bench.sh [BUILD_DIR] [DATA_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
data=${2:-$here/tests/data}
tok=$data/tokenizer/minimax-m3
work=$build/bench-tokenizer
mkdir -p "$work"
# ~3 MB corpus: golden texts joined into ~16 KB documents, repeated.
/usr/bin/python3 - "$tok/golden.jsonl" "$work/corpus.jsonl" <<'PY'
import json, sys
texts = [json.loads(l)["text"] for l in open(sys.argv[1], encoding="utf-8") if l.strip()]
docs, cur, total = [], [], 0
while total < 3_000_000:
    for t in texts:
        cur.append(t)
        if sum(len(x) for x in cur) > 16_000:
            d = "\n".join(cur); docs.append(d); total += len(d.encode()); cur = []
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for d in docs: f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
PY
ours=$("$build/bench/bench_tokenizer" "$tok" "$work/corpus.jsonl" 3)
echo "$ours"
peer=""
if command -v npm >/dev/null && (cd "$work" && [ -d node_modules/@anush008/tokenizers ] || npm install --silent --no-save @anush008/tokenizers >/dev/null 2>&1); then
  peer=$(cd "$work" && NODE_PATH=$work/node_modules node "$here/bench/tokenizer_peer.js" "$tok/tokenizer.json" "$work/corpus.jsonl" 3)
  echo "$peer"
else
  echo "peer: @anush008/tokenizers could not be installed from npm; skipped" >&2
fi
/usr/bin/python3 - "$ours" "$peer" <<'PY'
import json, sys
o = json.loads(sys.argv[1]); p = json.loads(sys.argv[2]) if sys.argv[2] else None
print(f"{'impl':<16}{'MB/s':>8}{'tokens':>10}")
print(f"{'m3':<16}{o['value']:>8.2f}{o['tokens']:>10}")
if p:
    print(f"{'hf-tokenizers':<16}{p['value']:>8.2f}{p['tokens']:>10}")
    print(f"ratio m3 / hf = {o['value'] / p['value']:.2f}   (same token count: {o['tokens'] == p['tokens']})")
PY
