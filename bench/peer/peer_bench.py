#!/usr/bin/env python3
"""m3 against llama.cpp on the same machine, model shapes, layer count and quant mix, both engines
alternating in one invocation (bench/peer/README.md).

For each pack type and thread count, `--reps` rounds of `m3 bench` on its generated model (the real
MiniMax-M3 layer shapes, random weights) and llama.cpp's harness (llama_peer) on a GGUF of the same
shapes and layers (llama.cpp's `minimax-m3` architecture) whose quant mix mirrors the pack type:
  q4-mixed  routed experts Q4_0, every other matrix Q8_0   (m3: routed experts q4, the rest q8)
  q3-mixed  routed experts Q3_K, every other matrix Q8_0   (m3: routed experts q3, the rest q8)
  q2-mixed  routed experts Q2_K, every other matrix Q8_0   (m3: routed experts q2, the rest q8)
  q4        all matrices Q4_0                             (m3: all q4)
  q8        all matrices Q8_0                             (m3: all q8)
Norms, router and its bias stay F32 in both. The engines take turns within a round, and which goes
first alternates from round to round. Each reads its weights into memory before timing; llama.cpp
runs as its users run it (mmap, its own thread pool, flash attention on, its CPU backend's weight
repacking at load). Reported per engine: prefill and decode tok/s, bytes read per decode token, the
per-layer and lm_head times and the 60-layer projection they give; and the ratios m3 / llama.cpp.
Medians over the rounds; every run's own JSON is kept in the JSON output.

Usage: bench/peer/peer_bench.py [-t 1,2] [--types q4-mixed,q4] [--layers N] [-p 512] [-n 64]
                                [--reps 2] [--json FILE] [--cache-dir DIR] [--no-build]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PEER_VERSION = "node-llama-cpp@3.22.1"


def log(msg):
    print(f"peer bench: {msg}", file=sys.stderr, flush=True)


def run_json(cmd, what):
    """Runs cmd, passes its stderr through on failure, returns the last stdout line as JSON."""
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"peer bench: {what} failed (exit {p.returncode}): {' '.join(cmd)}")
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    if not lines:
        raise SystemExit(f"peer bench: {what} printed no result")
    r = json.loads(lines[-1])
    r["wall_s"] = time.time() - t0
    return r


def median(runs, key):
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return statistics.median(vals) if vals else None


def ratio(a, b):
    return a / b if a and b else None


def ms(v):
    return None if v is None else v * 1e3


def fmt(v, digits=3):
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:.1f}"
    if abs(v) >= 10:
        return f"{v:.2f}"
    return f"{v:.{digits}f}"


def print_table(headers, rows):
    """Columns as wide as their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(headers))
    print("-" * len(line(headers)))
    for r in rows:
        print(line(r))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", default=None, help="thread counts, e.g. 1,2 (default: 1 and all cores)")
    ap.add_argument("--types", default="q4-mixed",
                    help="pack types: q4-mixed, q4, q8, q3-mixed, q2-mixed (comma-separated)")
    ap.add_argument("--layers", type=int, default=None, help="layers of both models (default: m3 bench's default)")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=512)
    ap.add_argument("-n", "--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="rounds per type and thread count (default 2)")
    ap.add_argument("--json", default=None, help="write the whole result as JSON to this file")
    ap.add_argument("--cache-dir", default=None, help="folder for both generated models (default ~/.cache/m3)")
    ap.add_argument("--no-build", action="store_true", help="use build/bin/m3 as it is")
    a = ap.parse_args()

    types = [t for t in a.types.split(",") if t]
    for t in types:
        if t not in ("q4-mixed", "q4", "q8", "q3-mixed", "q2-mixed"):
            ap.error(f"--types: unknown pack type {t!r} (q4-mixed, q4, q8, q3-mixed or q2-mixed)")
    cpus = len(os.sched_getaffinity(0))
    threads = [int(x) for x in a.threads.split(",")] if a.threads else sorted({1, cpus})
    if any(t < 1 for t in threads):
        ap.error("-t: thread counts are 1 or more")
    if a.reps < 1 or a.prompt_tokens < 1 or a.decode_tokens < 1:
        ap.error("--reps, -p and -n must be 1 or more")
    if a.layers is not None and not 1 <= a.layers <= 60:
        ap.error("--layers must be 1..60")
    cache = a.cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "m3")

    if not a.no_build:
        subprocess.run([os.path.join(REPO, "scripts", "build.sh")], check=True, stdout=subprocess.DEVNULL)
    m3 = os.path.join(REPO, "build", "bin", "m3")
    peer_root = subprocess.run([os.path.join(HERE, "setup.sh"), os.path.join(cache, "peer")], check=True,
                               capture_output=True, text=True).stdout.strip().splitlines()[-1]
    harness = os.path.join(peer_root, "llama_peer")
    libs = [os.path.join(peer_root, "bins", d) for d in os.listdir(os.path.join(peer_root, "bins"))][0]
    with open(os.path.join(peer_root, "llama.cpp.info.json")) as f:
        peer_tag = json.load(f).get("tag", "?")

    runs, summary = [], []
    for t_i, ptype in enumerate(types):
        layers = a.layers
        gguf = None
        for threads_i, t in enumerate(threads):
            m3_runs, peer_runs = [], []
            for rep in range(a.reps):
                order = ["m3", "llama.cpp"] if (rep + threads_i) % 2 == 0 else ["llama.cpp", "m3"]
                if gguf is None:
                    order = ["m3", "llama.cpp"]  # m3 first: it settles the layer count when none is given
                for engine in order:
                    if engine == "m3":
                        cmd = [m3, "bench", "--json", "--type", ptype, "-t", str(t), "-p", str(a.prompt_tokens),
                               "-n", str(a.decode_tokens), "--batch", "1", "--lookup", "0", "--cache-dir", cache]
                        if layers is not None:
                            cmd += ["--layers", str(layers)]
                        log(f"{ptype}, {t} threads, round {rep + 1}/{a.reps}: m3")
                        r = run_json(cmd, "m3 bench")
                        layers = r["layers"]
                        m3_runs.append(r)
                    else:
                        if gguf is None:
                            gguf = os.path.join(cache, "peer", f"minimax-m3-{ptype}-{layers}L-v1.gguf")
                            if not os.path.exists(gguf):
                                log(f"writing {gguf} ({layers} layers, {ptype} mix)")
                                subprocess.run([harness, "gen", "--out", gguf, "--layers", str(layers), "--type",
                                                ptype], check=True)
                        log(f"{ptype}, {t} threads, round {rep + 1}/{a.reps}: llama.cpp")
                        r = run_json([harness, "bench", "--model", gguf, "--libs", libs, "-t", str(t), "-p",
                                      str(a.prompt_tokens), "-n", str(a.decode_tokens)], "llama.cpp harness")
                        r["version"] = f"{peer_tag} ({PEER_VERSION} prebuilt CPU libraries)"
                        peer_runs.append(r)
                    r.update({"pack_type": ptype, "round": rep + 1, "engine": engine})
                    runs.append(r)
            s = {"pack_type": ptype, "threads": t, "layers": layers, "rounds": a.reps}
            for engine, rs in (("m3", m3_runs), ("llama.cpp", peer_runs)):
                s[engine] = {k: median(rs, k) for k in (
                    "prefill_tok_s", "decode_tok_s", "bytes_per_token", "layer_bytes_per_token", "t_layer_s",
                    "t_rest_s", "t_layer_prefill_s", "t_last_layer_prefill_s", "t_rest_prefill_s",
                    "projected_full_model_tok_s", "projected_full_model_prefill_tok_s")}
                s[engine]["prefill_tok_s_all"] = [r["prefill_tok_s"] for r in rs]
                s[engine]["decode_tok_s_all"] = [r["decode_tok_s"] for r in rs]
            m, l = s["m3"], s["llama.cpp"]
            s["ratio"] = {
                "prefill": ratio(m["prefill_tok_s"], l["prefill_tok_s"]),
                "decode": ratio(m["decode_tok_s"], l["decode_tok_s"]),
                "layer_decode": ratio(l["t_layer_s"], m["t_layer_s"]),
                "lm_head": ratio(l["t_rest_s"], m["t_rest_s"]),
                "layer_prefill": ratio(l["t_layer_prefill_s"], m["t_layer_prefill_s"]),
                "projected_full_model_decode": ratio(m["projected_full_model_tok_s"], l["projected_full_model_tok_s"]),
                "projected_full_model_prefill": ratio(m["projected_full_model_prefill_tok_s"],
                                                      l["projected_full_model_prefill_tok_s"]),
            }
            summary.append(s)

    cpu = runs[0].get("cpu", "?") if runs else "?"
    print(f"m3 vs llama.cpp {peer_tag} ({PEER_VERSION}), cpu {cpu}, prompt {a.prompt_tokens} + decode "
          f"{a.decode_tokens} tokens, medians of {a.reps} alternating rounds; ratios are m3 / llama.cpp "
          f"(per-layer and lm_head times: llama.cpp / m3)")
    print("Layers are timed inside each pass. A prompt's last layer runs past attention only for the row "
          "that gives logits (both engines), so prefill per layer is the mean of the others (none with "
          "1 layer), and the 60-layer prefill is 59 of them + the last layer + lm_head.")
    def pair(m_value, l_value, r_value):  # "m3 / llama.cpp" and the ratio
        return f"{fmt(m_value)} / {fmt(l_value)}", fmt(r_value)

    rows_totals, rows_layers = [], []
    for s in summary:
        m, l, r = s["m3"], s["llama.cpp"], s["ratio"]
        rows_totals.append([s["pack_type"], str(s["threads"]), str(s["layers"]),
                            *pair(m["prefill_tok_s"], l["prefill_tok_s"], r["prefill"]),
                            *pair(m["decode_tok_s"], l["decode_tok_s"], r["decode"]),
                            f"{(m['bytes_per_token'] or 0) / 1e6:.0f} / {(l['bytes_per_token'] or 0) / 1e6:.0f}"])
        rows_layers.append([s["pack_type"], str(s["threads"]),
                            *pair(ms(m["t_layer_s"]), ms(l["t_layer_s"]), r["layer_decode"]),
                            *pair(ms(m["t_rest_s"]), ms(l["t_rest_s"]), r["lm_head"]),
                            *pair(ms(m["t_layer_prefill_s"]), ms(l["t_layer_prefill_s"]), r["layer_prefill"]),
                            *pair(m["projected_full_model_tok_s"], l["projected_full_model_tok_s"],
                                  r["projected_full_model_decode"]),
                            *pair(m["projected_full_model_prefill_tok_s"], l["projected_full_model_prefill_tok_s"],
                                  r["projected_full_model_prefill"])])
    print()
    print_table(["type", "thr", "L", "prefill tok/s", "ratio", "decode tok/s", "ratio", "MB/token"], rows_totals)
    print()
    print_table(["type", "thr", "layer decode ms", "ratio", "lm_head ms", "ratio", "layer prefill ms", "ratio",
                 "60-layer decode tok/s", "ratio", "60-layer prefill tok/s", "ratio"], rows_layers)
    result = {"peer": {"engine": "llama.cpp", "tag": peer_tag, "package": PEER_VERSION}, "cpu": cpu,
              "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens, "rounds": a.reps,
              "summary": summary, "runs": runs}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {a.json}")
    print()
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
