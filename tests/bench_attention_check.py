#!/usr/bin/env python3
"""Smoke test of `m3 bench --attention --quick --json`: every stdout line is a JSON object with the
report fields, times positive and finite, prefill_speedup > 0, one row per (context, index-key type),
index_scan_gbps / index_scan_ratio(_best) / index_scan_pair_ratio_median present exactly where the decode scan reads keys (more than 16
blocks visible), attention_ms_ratio_4k == 1 at 4K, every check "ok"; a PNG written with --plot when
gnuplot is installed (skipped otherwise; never a failure of the bench). Also: an --attention option
without --attention and a bad --index-cache are refused with a message. No timing assertions.
Usage: bench_attention_check.py M3_BINARY"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

m3 = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def positive(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


tmp = tempfile.mkdtemp(prefix="m3-attn-check-")
png = os.path.join(tmp, "attention.png")
p = subprocess.run([m3, "bench", "--attention", "--quick", "--json", "--index-cache", "f32,int8", "--plot", png],
                   capture_output=True, text=True, timeout=120)
check(p.returncode == 0, f"exit code {p.returncode}; stderr: {p.stderr.strip()}")

times = ("indexer_ms", "attention_ms", "dense_attention_ms", "prefill_ms", "prefill_indexer_ms",
         "prefill_attention_ms", "dense_prefill_ms", "prefill_speedup", "decode_speedup", "read_gbps",
         "read_gbps_best")
counts = ("context", "chunk", "threads", "decode_calls", "dense_decode_calls", "prefill_calls",
          "dense_prefill_calls", "kv_bytes", "index_bytes", "evict_bytes")
strings = ("index_key_type", "kv_type", "cpu", "simd_target", "commit", "check")
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
    check(row.get("bench") == "attention", f"line {n}: bench {row.get('bench')}")
    for f in times:
        check(positive(row.get(f)), f"line {n}: {f} = {row.get(f)!r} not positive and finite")
    for f in counts:
        check(isinstance(row.get(f), int) and row[f] > 0, f"line {n}: {f} = {row.get(f)!r}")
    for f in strings:
        check(isinstance(row.get(f), str) and row[f] != "", f"line {n}: {f} = {row.get(f)!r}")
    check(row.get("check") == "ok", f"line {n}: check {row.get('check')!r}")
    for f in ("prefill_speedup", "decode_speedup"):
        check(f in row and positive(row[f]), f"line {n}: {f} = {row.get(f)!r}")
    if positive(row.get("dense_prefill_ms")) and positive(row.get("prefill_ms")):
        check(math.isclose(row["prefill_speedup"], row["dense_prefill_ms"] / row["prefill_ms"], rel_tol=1e-9),
              f"line {n}: prefill_speedup != dense_prefill_ms / prefill_ms")
    ctx = row.get("context", 0)
    scans = isinstance(ctx, int) and ctx > 16 * 128
    check(isinstance(row.get("fast_regime_pairs"), int) and row["fast_regime_pairs"] >= 0,
          f"line {n}: fast_regime_pairs {row.get('fast_regime_pairs')!r}")
    for f in ("index_scan_gbps", "index_scan_ratio", "index_scan_ratio_best", "index_scan_pair_ratio_median"):
        check(f in row, f"line {n}: no {f}")
        limit = {"index_scan_ratio": "read_gbps", "index_scan_ratio_best": "read_gbps_best"}.get(f)
        if scans and limit and row.get(f) is None:
            # No ratio to a limit the scan beat (the probe is then not its limit).
            check(positive(row.get("index_scan_gbps")) and row["index_scan_gbps"] > row.get(limit, 0),
                  f"line {n}: {f} is null though the scan stayed under {limit}")
        elif scans:
            check(positive(row.get(f)), f"line {n}: {f} = {row.get(f)!r} at context {ctx}")
            if limit:
                check(row[f] <= 1.0, f"line {n}: {f} = {row[f]} is above 1")
        else:
            check(row.get(f) is None, f"line {n}: {f} = {row.get(f)!r} though nothing is scanned at context {ctx}")
    check(isinstance(row.get("index_scan_bytes"), int) and (row["index_scan_bytes"] > 0) == scans,
          f"line {n}: index_scan_bytes {row.get('index_scan_bytes')!r}")
    if scans and positive(row.get("index_scan_gbps")) and positive(row.get("read_gbps")) and row.get("index_scan_ratio") is not None:
        check(math.isclose(row["index_scan_ratio"], row["index_scan_gbps"] / row["read_gbps"], rel_tol=1e-9),
              f"line {n}: index_scan_ratio != index_scan_gbps / read_gbps")
    if scans and positive(row.get("index_scan_gbps")) and positive(row.get("read_gbps_best")) and row.get("index_scan_ratio_best") is not None:
        check(math.isclose(row["index_scan_ratio_best"], row["index_scan_gbps"] / row["read_gbps_best"], rel_tol=1e-9),
              f"line {n}: index_scan_ratio_best != index_scan_gbps / read_gbps_best")
    check((row.get("fast_regime_ratio") is None) == (not scans or row.get("fast_regime_pairs") == 0),
          f"line {n}: fast_regime_ratio {row.get('fast_regime_ratio')!r} with {row.get('fast_regime_pairs')!r} pairs")
    check("attention_ms_ratio_4k" in row, f"line {n}: no attention_ms_ratio_4k")
    if ctx == 4096:
        check(row.get("attention_ms_ratio_4k") == 1, f"line {n}: attention_ms_ratio_4k at 4K = {row.get('attention_ms_ratio_4k')!r}")
    elif row.get("attention_ms_ratio_4k") is not None:
        check(positive(row["attention_ms_ratio_4k"]), f"line {n}: attention_ms_ratio_4k {row['attention_ms_ratio_4k']!r}")

keys = sorted((r.get("context"), r.get("index_key_type")) for r in rows)
check(keys == [(512, "f32"), (512, "int8"), (4096, "f32"), (4096, "int8")], f"rows {keys}")

if shutil.which("gnuplot"):
    check(os.path.isfile(png) and os.path.getsize(png) > 0, f"no plot at {png} (stderr: {p.stderr.strip()})")
    if os.path.isfile(png):
        with open(png, "rb") as f:
            check(f.read(8) == b"\x89PNG\r\n\x1a\n", "the plot is not a PNG")
else:
    print("gnuplot not installed: plot check skipped")
    check("gnuplot not found" in p.stderr, "no note that the plot was skipped")
# `--plot none` writes no plot and no file named "none"; nor does a table run without --plot.
p = subprocess.run([m3, "bench", "--attention", "--quick", "--contexts", "1K", "--plot", "none"], cwd=tmp,
                   capture_output=True, text=True, timeout=120)
check(p.returncode == 0 and "plot written" not in p.stderr + p.stdout and not os.path.exists(os.path.join(tmp, "none")),
      f"--plot none: rc {p.returncode}, files {os.listdir(tmp)}, stderr {p.stderr.strip()!r}")
before = set(os.listdir(tmp))
p = subprocess.run([m3, "bench", "--attention", "--quick", "--contexts", "1K"], cwd=tmp, capture_output=True, text=True,
                   timeout=120)
check(p.returncode == 0 and set(os.listdir(tmp)) == before,
      f"a table run without --plot wrote into the current folder: {sorted(set(os.listdir(tmp)) - before)}")
shutil.rmtree(tmp, ignore_errors=True)

p = subprocess.run([m3, "bench", "--kernels", "--chunk", "8"], capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "--attention" in p.stderr, f"`m3 bench --kernels --chunk 8`: rc {p.returncode}, {p.stderr!r}")
p = subprocess.run([m3, "bench", "--attention", "--index-cache", "f16"], capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "f16" in p.stderr, f"`m3 bench --attention --index-cache f16`: rc {p.returncode}, {p.stderr!r}")

for f in failures:
    print("FAIL:", f)
print(f"{len(rows)} rows, {len(failures)} failures")
sys.exit(1 if failures else 0)
