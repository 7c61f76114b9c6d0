#!/usr/bin/env python3
"""Smoke test of the end-to-end `m3 bench` on the tiny generated model: `--tiny --json -p 16 -n 4`
twice in a fresh cache folder (the second run must reuse the cached model, not regenerate it), one
JSON object with every report field (the batched decode's and the lookup verify steps' included), finite values, positive where
they must be, ratios equal to value / limit. Bad input fails with a message: a missing model folder, -p 0, --layers 0, a damaged
cached model is regenerated. -t with several counts adds the prompt at each (prompt_scaling). No timing assertions.
Usage: bench_model_check.py M3_BINARY"""
import json
import math
import os
import subprocess
import sys
import tempfile

m3 = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(args, timeout=300):
    return subprocess.run([m3, "bench"] + args, capture_output=True, text=True, timeout=timeout)


POSITIVE = ["prefill_tok_s", "decode_tok_s", "decode_tok_s_mean", "ttft_s", "bytes_per_token", "decode_gbps",
            "read_gbps", "prefill_gops", "int8_peak_gops", "peak_rss_bytes",
            "threads", "layers", "projected_full_model_tok_s", "active_params", "weight_bytes", "t_layer_s",
            "layer_bytes_per_token", "lm_head_bytes", "layer_share_of_bytes", "t_last_layer_prefill_s", "t_rest_prefill_s",
            "layer_share_of_bytes_full_model", "layer_gbps", "lm_head_gbps",
            "batch_tok_s", "batch_single_tok_s", "batch_speedup", "batch_bytes_per_step", "batch_gbps",
            "batch_projected_full_model_bytes_per_step", "batch_projected_full_model_speedup",
            "lookup_step_ms", "lookup_single_step_ms", "lookup_step_cost", "lookup_bytes_per_step",
            "lookup_projected_full_model_step_cost", "prefill_chunk", "prefill_chunks", "layer_bytes_per_chunk",
            "full_model_chunk_bytes", "full_model_chunk_bandwidth_floor_s", "full_model_chunk_compute_floor_s",
            "full_model_chunk_s", "t_layer_prefill_attention_s", "moe_routed_share_of_work"]
NON_NEGATIVE = ["disk_read_mbps", "disk_read_bytes", "t_rest_s", "load_s", "routed_expert_bytes_per_token",
                "read_gbps_paired", "read_gbps_best", "t_layer_prefill_s", "layer_prefill_gops",
                "decode_pair_ratio_median", "fast_regime_steps", "fast_regime_ratio", "t_layer_prefill_moe_s"]
STRINGS = ["simd_target", "model_dir", "cpu", "commit", "projection_note", "quant_kernels", "prefill_chunk_choice"]
# Ratios to a machine limit: a number in (0, 1], or null with a note in limit_notes (never above 1).
LIMIT_RATIOS = [("decode_bw_ratio", "decode_gbps", "read_gbps"),
                ("decode_bw_ratio_paired", "decode_gbps", "read_gbps_paired"),
                ("decode_bw_ratio_best", "decode_gbps", "read_gbps_best"),
                ("layer_bw_ratio", "layer_gbps", "read_gbps"),
                ("lm_head_bw_ratio", "lm_head_gbps", "read_gbps"),
                ("prefill_peak_ratio", "prefill_gops", "int8_peak_gops"),
                ("layer_prefill_peak_ratio", "layer_prefill_gops", "int8_peak_gops"),
                ("batch_bw_ratio_best", "batch_gbps", "read_gbps_best")]


def check_report(p, label):
    check(p.returncode == 0, f"{label}: exit code {p.returncode}; stderr: {p.stderr.strip()[-2000:]}")
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    check(len(lines) == 1, f"{label}: expected one JSON line on stdout, got {len(lines)}")
    try:
        r = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError as e:
        check(False, f"{label}: stdout is not JSON ({e})")
        return {}
    check(isinstance(r, dict), f"{label}: not a JSON object")
    for f in POSITIVE + NON_NEGATIVE:
        v = r.get(f)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        check(ok, f"{label}: {f} missing or not a finite number: {v!r}")
        if ok:
            check(v > 0 if f in POSITIVE else v >= 0, f"{label}: {f} = {v} out of range")
    for f in STRINGS:
        check(isinstance(r.get(f), str) and r[f] != "", f"{label}: {f} missing or empty")
    check(r.get("prompt_tokens") == 16 and r.get("decode_tokens") == 4, f"{label}: token counts {r.get('prompt_tokens')}, {r.get('decode_tokens')}")
    check(r.get("layers") == 2, f"{label}: layers {r.get('layers')}")
    check(r.get("logits_finite") is True, f"{label}: logits not finite")
    check(r.get("batch") == 4 and r.get("batch_steps") == 4, f"{label}: batched phase {r.get('batch')} x {r.get('batch_steps')}")
    if all(isinstance(r.get(k), (int, float)) for k in ("batch_bytes_per_step", "bytes_per_token")):
        # Four sequences read the weights once, the experts as a union: at least one token's bytes
        # (the fixed ones), at most four tokens'.
        check(r["batch_bytes_per_step"] <= 4 * r["bytes_per_token"] * 1.5, f"{label}: batch bytes per step")
    check(r.get("lookup") == 3 and r.get("lookup_steps") == 4, f"{label}: lookup phase {r.get('lookup')} x {r.get('lookup_steps')}")
    if all(isinstance(r.get(k), (int, float)) for k in ("lookup_bytes_per_step", "bytes_per_token")):
        # A verify step over 1 + 3 tokens reads the weights once, its rows' experts as a union.
        check(r["bytes_per_token"] * 0.5 <= r["lookup_bytes_per_step"] <= 4 * r["bytes_per_token"] * 1.5,
              f"{label}: lookup bytes per step")
    notes = r.get("limit_notes")
    check(isinstance(notes, list) and all(isinstance(n, str) and n for n in notes), f"{label}: limit_notes {notes!r}")
    notes = notes if isinstance(notes, list) else []
    for ratio, value, limit in LIMIT_RATIOS:
        v, work, lim = r.get(ratio, "missing"), r.get(value), r.get(limit)
        if v is None:  # no ratio: the work was above the limit (or there is no limit), and a note says so
            if isinstance(work, (int, float)) and isinstance(lim, (int, float)) and lim > 0:
                check(work > lim, f"{label}: {ratio} is null though {value} {work} <= {limit} {lim}")
                check(any(f"({lim:.4g})" in n for n in notes), f"{label}: {ratio} is null and no note names {lim:.4g}: {notes}")
            continue
        check(isinstance(v, (int, float)) and 0 < v <= 1.0, f"{label}: {ratio} = {v!r} is not a ratio to a limit")
    for ratio, value, limit in LIMIT_RATIOS + [("batch_speedup", "batch_tok_s", "batch_single_tok_s"),
                                               ("lookup_step_cost", "lookup_step_ms", "lookup_single_step_ms")]:
        if all(isinstance(r.get(k), (int, float)) and r.get(k) > 0 for k in (ratio, value, limit)):
            check(math.isclose(r[ratio], r[value] / r[limit], rel_tol=1e-9),
                  f"{label}: {ratio} {r[ratio]} != {value} / {limit} = {r[value] / r[limit]}")
    if all(isinstance(r.get(k), (int, float)) for k in ("read_gbps", "read_gbps_paired", "read_gbps_best")):
        limit = r["read_gbps_paired"] if r["read_gbps_paired"] > 0 else r["read_gbps_best"]
        check(r["read_gbps"] == limit, f"{label}: read_gbps {r['read_gbps']} is neither the paired reads nor the best sample")
    if all(isinstance(r.get(k), (int, float)) for k in ("decode_gbps", "bytes_per_token", "decode_tok_s")):
        check(math.isclose(r["decode_gbps"], r["bytes_per_token"] * r["decode_tok_s"] / 1e9, rel_tol=1e-9),
              f"{label}: decode_gbps != bytes_per_token x decode_tok_s")
    if all(isinstance(r.get(k), (int, float)) for k in ("prefill_tok_s", "ttft_s")):
        check(math.isclose(r["prefill_tok_s"], 16 / r["ttft_s"], rel_tol=1e-9), f"{label}: prefill_tok_s != 16 / ttft_s")
    check(isinstance(r.get("prefill_runs"), int) and 1 <= r["prefill_runs"] <= 3, f"{label}: prefill_runs {r.get('prefill_runs')!r}")
    check(isinstance(r.get("ttft_s_min"), (int, float)) and 0 < r["ttft_s_min"] <= r.get("ttft_s", 0),
          f"{label}: ttft_s_min {r.get('ttft_s_min')!r} vs the median {r.get('ttft_s')!r}")
    parts = ("t_layer_prefill_s", "t_last_layer_prefill_s", "t_rest_prefill_s", "ttft_s", "layers")
    if all(isinstance(r.get(k), (int, float)) for k in parts):
        # The layers are timed inside the pass: full layers + the last layer + what follows add up
        # to a prefill (medians of separate runs: loosely).
        total = r["t_layer_prefill_s"] * (r["layers"] - 1) + r["t_last_layer_prefill_s"] + r["t_rest_prefill_s"]
        check(0.5 * r["ttft_s"] <= total <= r["ttft_s"] * 1.5, f"{label}: prefill parts {total} against ttft {r['ttft_s']}")
        check(r["t_layer_prefill_s"] > 0 if r["layers"] > 1 else r["t_layer_prefill_s"] == 0,
              f"{label}: t_layer_prefill_s {r['t_layer_prefill_s']} with {r['layers']} layers")
        proj = r.get("projected_full_model_prefill_tok_s")
        if r["layers"] > 1:
            want = 16 / (59 * r["t_layer_prefill_s"] + r["t_last_layer_prefill_s"] + r["t_rest_prefill_s"])
            check(isinstance(proj, (int, float)) and math.isclose(proj, want, rel_tol=1e-6), f"{label}: projected prefill {proj} != {want}")
        else:
            check(proj is None, f"{label}: a 1-layer model gives no prefill projection, got {proj!r}")
    check(r.get("prefill_chunk") == 16 and r.get("prefill_chunks") == 1,
          f"{label}: a 16-token prompt is one chunk of 16: {r.get('prefill_chunk')} x {r.get('prefill_chunks')}")
    if all(isinstance(r.get(k), (int, float)) for k in ("t_layer_prefill_attention_s", "t_layer_prefill_s", "t_layer_prefill_moe_s")):
        check(math.isclose(r["t_layer_prefill_attention_s"] + r["t_layer_prefill_moe_s"], r["t_layer_prefill_s"], rel_tol=1e-9),
              f"{label}: a layer's attention and MoE parts do not add up to it")
    check(0 < r.get("moe_routed_share_of_work", 0) < 1, f"{label}: routed share {r.get('moe_routed_share_of_work')!r}")
    check(r.get("prompt_scaling") == [], f"{label}: one thread count gives no prompt scaling rows: {r.get('prompt_scaling')!r}")
    if all(isinstance(r.get(k), (int, float)) for k in ("t_layer_s", "t_rest_s", "decode_step_s_median", "layers")):
        total = r["t_layer_s"] * r["layers"] + r["t_rest_s"]
        check(0.5 * r["decode_step_s_median"] <= total <= 1.5 * r["decode_step_s_median"],
              f"{label}: decode parts {total} against the median step {r['decode_step_s_median']}")
    if all(isinstance(r.get(k), (int, float)) for k in ("layer_bytes_per_token", "lm_head_bytes", "bytes_per_token", "layers")):
        check(r["layer_bytes_per_token"] * r["layers"] + r["lm_head_bytes"] <= r["bytes_per_token"] * (1 + 1e-9),
              f"{label}: layer and lm_head bytes exceed the token's")
    return r


with tempfile.TemporaryDirectory() as cache:
    args = ["--tiny", "--json", "-p", "16", "-n", "4", "-t", "2", "--cache-dir", cache]
    first = run(args)
    r1 = check_report(first, "first run")
    check(r1.get("generated_now") is True, "first run: the model was not generated")
    check("generating" in first.stderr, "first run: no generation progress on stderr")
    model_dir = r1.get("model_dir", "")
    check(model_dir.startswith(cache), f"model_dir {model_dir!r} is not under --cache-dir")

    second = run(args)
    r2 = check_report(second, "second run")
    check(r2.get("generated_now") is False and "using the cached" in second.stderr,
          f"second run did not reuse the cache: {second.stderr.strip()[-500:]}")

    # The human table.
    p = run(["--tiny", "-p", "16", "-n", "4", "--cache-dir", cache])
    check(p.returncode == 0 and "decode bandwidth" in p.stdout and "read_bw" in p.stdout
          and "decode, 4 sequences" in p.stdout and "lookup verify, 1 + 3 tokens" in p.stdout,
          f"table run: rc {p.returncode}, stdout {p.stdout[:500]!r}")

    # A damaged cached model is regenerated, not used and not a crash.
    if model_dir and os.path.exists(os.path.join(model_dir, "model.m3w")):
        with open(os.path.join(model_dir, "model.m3w"), "r+b") as f:
            f.write(b"garbage!")
        p = run(args)
        r3 = check_report(p, "damaged cache run")
        check(r3.get("generated_now") is True and "cannot be used" in p.stderr,
              f"damaged cache was not regenerated: {p.stderr.strip()[-500:]}")

    # The NUMA split path on two simulated nodes (the same dispatch as on a 2-socket server).
    p = subprocess.run([m3, "bench"] + args + ["--numa", "split"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, M3_FAKE_NUMA="2"))
    r5 = check_report(p, "--numa split run")
    check("split" in str(r5.get("numa", "")), f"--numa split run: numa field {r5.get('numa')!r}")

    # Several thread counts: the whole run on the largest, the prompt again at each.
    p = run(["--tiny", "--json", "-p", "16", "-n", "4", "-t", "2,1", "--cache-dir", cache])
    check(p.returncode == 0, f"-t 2,1 run: exit code {p.returncode}; {p.stderr.strip()[-1000:]}")
    try:
        rs = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
    except (json.JSONDecodeError, IndexError):
        rs = {}
        check(False, "-t 2,1 run: no JSON")
    rows = rs.get("prompt_scaling", [])
    check(rs.get("threads") == 2 and [row.get("threads") for row in rows] == [1, 2],
          f"-t 2,1 run: threads {rs.get('threads')}, rows {[row.get('threads') for row in rows]}")
    for row in rows:
        for k in ("ttft_s", "prefill_tok_s", "prefill_gops", "int8_peak_gops", "t_layer_s", "t_layer_attention_s",
                  "projected_full_model_prefill_tok_s"):
            check(isinstance(row.get(k), (int, float)) and row[k] > 0, f"-t 2,1 run: row {row.get('threads')}: {k} = {row.get(k)!r}")
        if all(isinstance(row.get(k), (int, float)) for k in ("prefill_gops", "int8_peak_gops", "peak_ratio")):
            check(math.isclose(row["peak_ratio"], row["prefill_gops"] / row["int8_peak_gops"], rel_tol=1e-9),
                  f"-t 2,1 run: row {row.get('threads')}: peak_ratio")
    p = run(["--tiny", "-p", "16", "-n", "4", "-t", "1,2", "--cache-dir", cache])
    check(p.returncode == 0 and "prompt of 16 tokens by threads" in p.stdout and "attention" in p.stdout,
          f"-t 1,2 table: rc {p.returncode}, {p.stdout[-800:]!r}")

    # Other pack types: their own cached models, the type in the report.
    for t in ("q4", "q8"):
        p = run(args + ["--type", t])
        rt = check_report(p, f"--type {t} run")
        check(rt.get("pack_type") == t and f"-{t}-" in rt.get("model_dir", ""), f"--type {t}: {rt.get('pack_type')}, {rt.get('model_dir')}")
    check(r1.get("pack_type") == "q4-mixed", f"default pack type {r1.get('pack_type')}")

    # -m on the generated folder benchmarks it as a given model.
    if model_dir:
        p = run(["-m", model_dir, "--json", "-p", "16", "-n", "4"])
        r4 = check_report(p, "-m run")
        check(r4.get("model_kind") == "given", f"-m run: model_kind {r4.get('model_kind')}")

    # Bad input: a clear message and a non-zero exit, never a crash.
    bad = [(["-m", "/nonexistent/m3-model"], "/nonexistent/m3-model"),
           (["--tiny", "-p", "0", "--cache-dir", cache], "-p"),
           (["--tiny", "-n", "0", "--cache-dir", cache], "-n"),
           (["--layers", "0", "--cache-dir", cache], "--layers"),
           (["--tiny", "-p", "5000", "-n", "4", "--cache-dir", cache], "context"),
           (["-m", cache, "--tiny"], "-m"),
           (["-m", cache, "--type", "q4"], "--type"),
           (["--tiny", "--type", "q3", "--cache-dir", cache], "--type"),
           (["--kernels", "-p", "16"], "end-to-end"),
           (["--tiny", "--batch", "0", "--cache-dir", cache], "--batch"),
           (["--tiny", "--lookup", "-1", "--cache-dir", cache], "--lookup"),
           (["--kernels", "--lookup", "2"], "end-to-end")]
    for extra, needle in bad:
        p = run(extra, timeout=120)
        check(p.returncode not in (0,) and p.returncode > 0 and needle in p.stderr,
              f"`m3 bench {' '.join(extra)}`: rc {p.returncode}, stderr {p.stderr.strip()[-300:]!r}")

for f in failures:
    print("FAIL:", f)
print(f"{len(failures)} failures")
sys.exit(1 if failures else 0)
