#!/usr/bin/env python3
"""Smoke test of `m3 bench --quant --quick --json`: every line a JSON object; m3's four formats for
each distribution and weighting, with their bits per weight; errors ordered by bits (q8 < q4 < q3 <
q2) and each lower with the importance it minimises than without it; with llama.cpp's library
(M3_PEER_LIB or the bench/peer/setup.sh cache, when present) its rows and the equal-bits ratios
too. A --peer-lib that is not llama.cpp's library fails with a message. No timing assertions.
Usage: bench_quant_check.py M3_BINARY"""
import json
import os
import subprocess
import sys

m3 = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(*extra):
    p = subprocess.run([m3, "bench", "--quant", "--quick", "--json", *extra], capture_output=True, text=True,
                       timeout=600)
    check(p.returncode == 0, f"exit code {p.returncode}; stderr: {p.stderr.strip()}")
    return [json.loads(line) for line in p.stdout.splitlines()]


rows = run()
ours = {(r["dist"], r["weighted"], r["type"]): r for r in rows if r["engine"] == "m3"}
bits = {"q8": (8.0, 8.2), "q4": (4.5, 4.5), "q3": (3.375, 3.375), "q2": (2.375, 2.375)}
for dist in ("gaussian", "student-t4"):
    for weighted in (False, True):
        errs = []
        for t, (lo, hi) in bits.items():
            r = ours.get((dist, weighted, t))
            check(r is not None, f"no m3 {t} row for {dist} weighted={weighted}")
            if r is None:
                continue
            check(lo <= r["bpw"] <= hi, f"{t} bpw {r['bpw']}")
            errs.append(r["rel_err"])
        check(errs == sorted(errs) and len(set(errs)) == 4, f"{dist} weighted={weighted}: errors not ordered {errs}")
check(all(r["engine"] == "m3" for r in rows), "llama.cpp rows without --peer-lib")

peer = os.environ.get("M3_PEER_LIB") or os.path.expanduser("~/.cache/m3/peer/node-llama-cpp-3.22.1/bins/linux-x64")
if os.path.exists(os.path.join(peer, "libggml-base.so")):
    rows = run("--peer-lib", peer)
    theirs = [r for r in rows if r["engine"] == "llama.cpp"]
    check(len(theirs) >= 20, f"{len(theirs)} llama.cpp rows")
    for r in rows:
        if r["engine"] == "m3":
            check("ratio_to_peer_equal_bits" in r and r["ratio_to_peer_equal_bits"] > 0, f"no equal-bits ratio: {r}")
    print(f"with llama.cpp from {peer}: {len(theirs)} rows")

p = subprocess.run([m3, "bench", "--quant", "--quick", "--peer-lib", "/nonexistent"], capture_output=True, text=True,
                   timeout=60)
check(p.returncode != 0 and "libggml-base.so" in p.stderr, f"a bad --peer-lib: rc {p.returncode}, {p.stderr.strip()}")

if failures:
    print("FAIL:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"PASS: {len(ours)} m3 rows")
