#!/usr/bin/env python3
"""Golden cases on a second build (an aarch64 cross build run under qemu-aarch64, issue 51):
each case's `m3 logits` through that build is judged by the oracle (tests/data/oracle/check_case.py)
and compared with the reference build's files: greedy ids and selected blocks equal, and logits
bit-identical, or within BOUND (the largest difference allowed, printed either way).
--packed CASE:TYPE,... also packs those cases (`m3 pack --type TYPE` with the reference build) and
runs the pack through both builds, which puts the integer matmul kernels (q8/q4/q3/q2) under the
model: greedy ids and blocks equal and logits within BOUND again (no oracle: the pack is lossy).
Usage: cross_golden_check.py REF_M3 OTHER_M3 DATA_DIR [--emulator CMD] [--bound X] [--threads N]
       [--cases REGEX] [--packed CASE:TYPE,...]"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("ref_m3")
ap.add_argument("other_m3")
ap.add_argument("data")
ap.add_argument("--emulator", default="", help="a command the other build runs under, e.g. 'qemu-aarch64 -L /usr/aarch64-linux-gnu'")
ap.add_argument("--bound", type=float, default=0.0, help="largest logit difference allowed (0: bit-identical)")
ap.add_argument("--threads", default="2")
ap.add_argument("--cases", default=".", help="a regular expression: the cases whose names match it")
ap.add_argument("--packed", default="", help="CASE:TYPE,... cases also run packed as TYPE (e.g. s1_fp32_basic:q4-mixed)")
args = ap.parse_args()

failures = []


def run_both(name, model, case, out):
    """Both builds' `m3 logits` of the case's prompt on model: {which: output folder}, or None."""
    ids_file = os.path.join(out, name + ".ids")
    open(ids_file, "w").write(",".join(map(str, case["prompt_ids"])))
    runs = {}
    for which, cmd in (("ref", [args.ref_m3]), ("other", shlex.split(args.emulator) + [args.other_m3])):
        d = os.path.join(out, f"{name}.{which}")
        r = subprocess.run(cmd + ["logits", "-m", model, "--ids", "@" + ids_file, "-n", str(case["decode_steps"]),
                                  "-o", d, "--dump-blocks", "-t", args.threads, "--verify-weights", "off"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"{name}: {which} build failed: {r.stderr[-2000:]}")
            return None
        runs[which] = d
    return runs


def compare(name, runs, oracle_ok):
    """Greedy ids and blocks equal, logits within the bound; prints a line."""
    other = runs["other"]
    same = {f: open(os.path.join(runs["ref"], f)).read() == open(os.path.join(other, f)).read()
            for f in ("greedy_ids.json", "selected_blocks.json")}
    worst = 0.0
    for f in ("prefill_logits.npy", "decode_logits.npy"):
        a, b = np.load(os.path.join(runs["ref"], f)), np.load(os.path.join(other, f))
        worst = max(worst, float(np.abs(a.astype(np.float64) - b).max()))
    print(f"{name:45s} oracle {oracle_ok}  greedy ids {'equal' if same['greedy_ids.json'] else 'DIFFER'}"
          f"  blocks {'equal' if same['selected_blocks.json'] else 'DIFFER'}  logits "
          + ("bit-identical" if worst == 0 else f"differ by up to {worst:.3g}"), flush=True)
    if not all(same.values()):
        failures.append(f"{name}: greedy ids or selected blocks differ between the builds")
    if worst > args.bound:
        failures.append(f"{name}: logits differ by {worst:.3g} > the bound {args.bound:g}")


with tempfile.TemporaryDirectory() as out:
    for name in sorted(os.listdir(os.path.join(args.data, "golden"))):
        case_dir = os.path.join(args.data, "golden", name)
        if not os.path.isfile(os.path.join(case_dir, "case.json")) or not re.search(args.cases, name):
            continue
        case = json.load(open(os.path.join(case_dir, "case.json")))
        runs = run_both(name, case_dir, case, out)
        if runs is None:
            continue
        other = runs["other"]
        greedy = json.load(open(os.path.join(other, "greedy_ids.json")))
        verdict = subprocess.run(
            [sys.executable, os.path.join(args.data, "oracle", "check_case.py"), "--case", case_dir,
             "--prefill", os.path.join(other, "prefill_logits.npy"), "--decode", os.path.join(other, "decode_logits.npy"),
             "--greedy", ",".join(map(str, greedy)), "--selected", os.path.join(other, "selected_blocks.json")],
            capture_output=True, text=True)
        if verdict.returncode != 0:
            failures.append(f"{name}: the oracle's judgement of the other build: {verdict.stdout[-1500:]}")
        compare(name, runs, "PASS" if verdict.returncode == 0 else "FAIL")
    for item in filter(None, args.packed.split(",")):
        name, kind = item.split(":")
        case_dir = os.path.join(args.data, "golden", name)
        case = json.load(open(os.path.join(case_dir, "case.json")))
        pack = os.path.join(out, f"{name}.{kind}.pack")
        r = subprocess.run([args.ref_m3, "pack", "-m", case_dir, "-o", pack, "--type", kind, "-t", args.threads],
                           capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"{name} {kind}: m3 pack failed: {r.stderr[-2000:]}")
            continue
        runs = run_both(f"{name}.{kind}", pack, case, out)
        if runs is not None:
            compare(f"{name} packed {kind}", runs, "-   ")
for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
