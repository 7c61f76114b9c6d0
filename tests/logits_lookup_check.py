#!/usr/bin/env python3
"""`m3 logits --lookup 3` on golden s5, whose greedy output repeats itself: some guesses are
accepted and rejected, and the files (greedy ids, prefill and decode logits, selected blocks) are
byte for byte those of plain decoding. No timing assertions.
Usage: logits_lookup_check.py M3_BINARY SHARED_DIR"""
import json
import os
import re
import subprocess
import sys
import tempfile

m3, shared = sys.argv[1], sys.argv[2]
case = os.path.join(shared, "golden", "s5_realprop_mxfp8_vl")
failures = []
with tempfile.TemporaryDirectory() as tmp:
    ids = os.path.join(tmp, "ids")
    with open(ids, "w") as f:
        f.write(",".join(map(str, json.load(open(os.path.join(case, "case.json")))["prompt_ids"])))
    logs = {}
    for k in ("0", "3"):
        p = subprocess.run([m3, "logits", "-m", case, "--ids", "@" + ids, "-n", "40", "-o", os.path.join(tmp, k),
                            "--dump-blocks", "-t", "2", "--lookup", k], capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            failures.append(f"--lookup {k}: rc {p.returncode}: {p.stderr[-500:]}")
        logs[k] = p.stderr
    m = re.search(r"lookup: (\d+) of (\d+) guesses accepted", logs["3"])
    if not m or not (0 < int(m.group(1)) < int(m.group(2))):
        failures.append(f"--lookup 3: expected guesses both accepted and refused: {logs['3'][-300:]}")
    if "lookup:" in logs["0"]:
        failures.append("--lookup 0 guessed")
    for name in ("greedy_ids.json", "prefill_logits.npy", "decode_logits.npy", "selected_blocks.json"):
        a, b = (os.path.join(tmp, k, name) for k in ("0", "3"))
        if not (os.path.exists(a) and os.path.exists(b) and open(a, "rb").read() == open(b, "rb").read()):
            failures.append(f"{name} differs with --lookup 3")
for f in failures:
    print("FAIL:", f)
print("logits_lookup_check:", "FAIL" if failures else "ok")
sys.exit(1 if failures else 0)
