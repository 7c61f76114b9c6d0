#!/usr/bin/env python3
"""Smoke test of `m3 bench --kernels --quick --json`: every stdout line is a JSON object with the
report fields, ratio == value / limit, the expected rows are there (limits, GEMV and GEMM for each
type, oneDNN when built in) and every kernel result matched its scalar reference. No timing
assertions. Also checks that `m3 bench` with an unknown option or a bad thread count fails with a
message.
Usage: bench_kernels_check.py M3_BINARY"""
import json
import math
import subprocess
import sys

m3 = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


p = subprocess.run([m3, "bench", "--kernels", "--quick", "--json", "-t", "1,2"], capture_output=True, text=True,
                   timeout=120)
check(p.returncode == 0, f"exit code {p.returncode}; stderr: {p.stderr.strip()}")
required = {"kernel": str, "type": str, "shape": str, "tokens": int, "threads": int, "value": (int, float),
            "unit": str, "limit": (int, float), "limit_kind": str, "cpu": str,
            "simd_target": str, "kernel_impl": str, "commit": str}
rows = []
for n, line in enumerate(p.stdout.splitlines(), 1):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        check(False, f"line {n} is not JSON ({e}): {line[:200]}")
        continue
    if not isinstance(row, dict):
        check(False, f"line {n} is not an object")
        continue
    rows.append(row)
    for field, kind in required.items():
        check(field in row and isinstance(row[field], kind) and not isinstance(row[field], bool),
              f"line {n}: field {field} missing or of the wrong type")
    # A ratio to a machine limit is at most 1; above, it is null and limit_note says the probe is
    # not the limit. Against the peer (oneDNN) it is any positive number.
    ratio = row.get("ratio", "missing")
    if ratio is None:
        check(row.get("limit_kind") != "onednn" and isinstance(row.get("limit_note"), str)
              and "not the limit" in row["limit_note"] and row["value"] > row["limit"],
              f"line {n}: null ratio without a reason: {row.get('limit_note')!r}")
    else:
        check(isinstance(ratio, (int, float)) and not isinstance(ratio, bool), f"line {n}: ratio {ratio!r}")
        if row.get("limit_kind") != "onednn" and isinstance(ratio, (int, float)):
            check(ratio <= 1.0, f"line {n}: ratio {ratio} to the limit {row.get('limit_kind')} is above 1")
    if all(isinstance(row.get(f), (int, float)) for f in ("value", "limit", "ratio")):
        v, lim, r = row["value"], row["limit"], row["ratio"]
        check(math.isfinite(v) and v > 0, f"line {n}: value {v} not positive")
        check(math.isfinite(lim) and lim > 0, f"line {n}: limit {lim} not positive")
        if lim > 0:
            check(math.isclose(r, v / lim, rel_tol=1e-9), f"line {n}: ratio {r} != value/limit {v / lim}")
    check(row.get("unit") in ("GB/s", "GOP/s"), f"line {n}: unit {row.get('unit')}")
    check(row.get("check", "ok") == "ok", f"line {n}: kernel result differs from the reference")
    check(row.get("commit") != "", f"line {n}: empty commit")
    if row.get("kernel") == "gemv":  # limit measured call by call with the kernel, the run's best alongside
        check(row.get("limit_stat") == "median of paired probe reads", f"line {n}: gemv limit_stat")
        check(isinstance(row.get("best_read_bw"), (int, float)) and row["best_read_bw"] > 0, f"line {n}: best_read_bw")
        # Its compute against the peak: GOP/s from its ops and seconds, and compute bound exactly
        # when the products at the peak take longer than reading its bytes at the row's limit.
        ops, secs, peak, nbytes = (row.get(f) for f in ("ops", "seconds", "peak", "bytes"))
        if all(isinstance(x, (int, float)) and x > 0 for x in (ops, secs, peak, nbytes)):
            gops = ops / secs / 1e9
            check(math.isclose(row.get("gops", 0), gops, rel_tol=1e-9), f"line {n}: gops")
            check(math.isclose(row.get("peak_ratio", 0), gops / peak, rel_tol=1e-9), f"line {n}: peak_ratio")
            want = "compute" if ops / peak > nbytes / row["limit"] else "memory"
            check(row.get("bound") == want, f"line {n}: bound {row.get('bound')}, want {want}")
            kinds_ok = ("fma_peak", "fma_peak_x2") if row["type"] == "bf16" else ("int8_peak", "amx_int8_peak")
            check(row.get("peak_kind") in kinds_ok, f"line {n}: peak_kind {row.get('peak_kind')}")
        else:
            check(False, f"line {n}: gemv row without ops, seconds, peak and bytes")

kinds = {(r.get("kernel"), r.get("type"), r.get("limit_kind"), r.get("threads")) for r in rows}
# Rows run on AMX (q8 and q4 prompts where the CPU has it) are measured against AMX's own peak, in the run.
for n, row in enumerate(rows):
    if row.get("kernel_impl") == "amx-int8" and row.get("kernel") in ("gemv", "gemm") and row.get("limit_kind") != "onednn":
        check(row.get("type") in ("q8", "q4") and row.get("limit_kind") in ("read_bw", "amx_int8_peak"),
              f"line {n}: amx-int8 row {row.get('type')} {row.get('limit_kind')}")
        check(any(r.get("kernel") == "amx_int8_peak" and r.get("threads") == row.get("threads") for r in rows),
              f"line {n}: no amx_int8_peak row for {row.get('threads')} threads")
for t in (1, 2):
    for k in ("read_bw", "int8_peak", "fma_peak"):
        check(any(x[0] == k and x[3] == t for x in kinds), f"no {k} row for {t} threads")
    for ty in ("q4", "q8", "bf16"):
        check(("gemv", ty, "read_bw", t) in kinds, f"no gemv {ty} row for {t} threads")
        gemv_tokens = sorted(r.get("tokens") for r in rows
                             if r.get("kernel") == "gemv" and r.get("type") == ty and r.get("threads") == t)
        check(len(gemv_tokens) >= 2 and gemv_tokens[0] == 1, f"gemv {ty} token counts for {t} threads: {gemv_tokens}")
        check(any(x[0] == "gemm" and x[1] == ty and x[3] == t for x in kinds), f"no gemm {ty} row for {t} threads")
if "onednn rows skipped" not in p.stderr:
    check(("onednn_int8", "q8", "int8_peak", 1) in kinds or ("onednn_int8", "q8", "amx_int8_peak", 1) in kinds,
          "no onednn_int8 row")
    check(("gemm", "q8", "onednn", 1) in kinds, "no gemm q8 vs onednn row")
    # Against oneDNN at both GEMM sizes: the prompt on one matrix, the expert share on cold copies.
    vs = [r for r in rows if r.get("kernel") == "gemm" and r.get("limit_kind") == "onednn"]
    for t in (1, 2):
        sizes = {(r.get("tokens"), r.get("weights", "").split(",")[0]) for r in vs if r.get("threads") == t}
        check(sorted(w for _, w in sizes) == ["cold", "one matrix"],
              f"gemm vs onednn rows for {t} threads: {sorted(sizes)}")
    for n, row in enumerate(rows):
        if row.get("kernel") == "gemm" and row.get("limit_kind") == "onednn":
            q, mm, s, mr = (row.get(f) for f in ("quantize_seconds", "matmul_seconds", "seconds", "matmul_ratio"))
            check(all(isinstance(x, (int, float)) and x > 0 for x in (q, mm, s, mr)), f"gemm vs onednn row {n}: parts")
            if all(isinstance(x, (int, float)) and x > 0 for x in (q, mm, s, mr)):
                # The matmul alone is faster than quantization + matmul (medians of the same calls).
                check(mm < s and mr > row["ratio"], f"gemm vs onednn row {n}: matmul {mm} vs total {s}")

p = subprocess.run([m3, "bench", "--bogus"], capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "--bogus" in p.stderr, f"`m3 bench --bogus`: rc {p.returncode}, {p.stderr!r}")
for bad in ("0", "abc", "1,-2", "2x"):  # thread counts: a short message naming the bad value
    p = subprocess.run([m3, "bench", "--kernels", "-t", bad], capture_output=True, text=True, timeout=60)
    shown = bad.split(",")[-1]
    check(p.returncode != 0 and f"1 or more, got '{shown}'" in p.stderr and len(p.stderr) < 300,
          f"`m3 bench --kernels -t {bad}`: rc {p.returncode}, {p.stderr!r}")

for f in failures:
    print("FAIL:", f)
print(f"{len(rows)} rows, {len(failures)} failures")
sys.exit(1 if failures else 0)
