#!/usr/bin/env python3
"""`m3 perplexity` end to end:
- golden s1 in windows of 16 tokens (stride 8, and stride 16 which skips each window's first
  token): every token's NLL against the oracle (tests/data/oracle/m3ref.py) run on that window's
  tokens alone, and the summary (perplexity = exp(mean NLL), counts) against the per-token lines;
- --save-base / --kl-base: the same model gives KL 0, same top-1 1 and ratio 1; a q8 pack gives
  the KL that NumPy computes from the base file and the pack's `m3 logits` rows;
- a text file through the model's tokenizer (tiny real-vocabulary model);
- bad input refused with a message (no timing assertions).
Usage: perplexity_check.py M3_BINARY SHARED_DIR REAL_VOCAB_MODEL"""
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

m3, shared, real_vocab = sys.argv[1], sys.argv[2], sys.argv[3]
case = os.path.join(shared, "golden", "s1_fp32_basic")
oracle = os.path.join(shared, "oracle", "m3ref.py")
ids = json.load(open(os.path.join(case, "case.json")))["prompt_ids"]
rel = json.load(open(os.path.join(case, "case.json")))["tolerance"]["logits"]["rel"]
failures = []


def run(args, ok=True):
    p = subprocess.run([m3, "perplexity", *args], capture_output=True, text=True, timeout=300)
    if ok and p.returncode != 0:
        failures.append(f"m3 perplexity {' '.join(args)}: rc {p.returncode}: {p.stderr[-500:]}")
    return p


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def read_base(path):
    raw = open(path, "rb").read()
    vocab, scored = np.frombuffer(raw[16:32], dtype="<u8")
    return np.frombuffer(raw[128:], dtype="<f4").reshape(int(scored), int(vocab))


with tempfile.TemporaryDirectory() as tmp:
    id_file = os.path.join(tmp, "ids")
    with open(id_file, "w") as f:
        f.write(",".join(map(str, ids)))

    # Windows against the oracle on each window's tokens.
    for stride in (8, 16):
        per_token = os.path.join(tmp, f"tokens{stride}.jsonl")
        p = run(["-m", case, "--ids", "@" + id_file, "-c", "16", "--stride", str(stride), "--per-token", per_token,
                 "--json", "-t", "2"])
        if p.returncode != 0:
            continue
        summary = json.loads(p.stdout)
        lines = [json.loads(line) for line in open(per_token)]
        want_index, prev_end, begin = [], 0, 0
        while True:
            end = min(begin + 16, len(ids))
            first = max(prev_end, begin + 1)
            subprocess.run([sys.executable, oracle, "--model", case, "--ids", ",".join(map(str, ids[begin:end])),
                            "--out", os.path.join(tmp, "w.npy")], check=True, capture_output=True, timeout=120)
            logits = np.load(os.path.join(tmp, "w.npy"))
            for t in range(first, end):
                row = logits[t - 1 - begin]
                want_index.append((t, float(-log_softmax(row)[ids[t]]), 2 * rel * (1 + np.abs(row).max())))
            prev_end = end
            if end == len(ids):
                break
            begin += stride
        if [line["index"] for line in lines] != [t for t, _, _ in want_index]:
            failures.append(f"stride {stride}: scored indices {[line['index'] for line in lines]}")
            continue
        for line, (t, nll, tol) in zip(lines, want_index):
            if line["id"] != ids[t] or abs(line["nll"] - nll) > tol:
                failures.append(f"stride {stride} token {t}: nll {line['nll']} id {line['id']}, oracle {nll} id {ids[t]}")
        mean = sum(line["nll"] for line in lines) / len(lines)
        if summary["scored"] != len(lines) or summary["tokens"] != len(ids) or abs(summary["nll_mean"] - mean) > 1e-9:
            failures.append(f"stride {stride}: summary {summary} against {len(lines)} lines of mean {mean}")
        if abs(summary["perplexity"] - math.exp(mean)) > 1e-9 * math.exp(mean):
            failures.append(f"stride {stride}: perplexity {summary['perplexity']} != exp({mean})")
        top1 = sum(line["top1"] for line in lines) / len(lines)
        if abs(summary["top1_accuracy"] - top1) > 1e-12:
            failures.append(f"stride {stride}: top1_accuracy {summary['top1_accuracy']} != {top1}")

    # KL from a saved base: itself, then a q8 pack checked with NumPy.
    base = os.path.join(tmp, "base.m3lp")
    run(["-m", case, "--ids", "@" + id_file, "--save-base", base, "-t", "2"])
    p = run(["-m", case, "--ids", "@" + id_file, "--kl-base", base, "--json"])
    if p.returncode == 0:
        s = json.loads(p.stdout)
        if s["kl_mean"] != 0 or s["kl_max"] != 0 or s["same_top1"] != 1 or s["perplexity_ratio"] != 1:
            failures.append(f"the base against itself: {s}")
    q8 = os.path.join(tmp, "q8")
    subprocess.run([m3, "pack", "-m", case, "-o", q8, "--type", "q8"], check=True, capture_output=True, timeout=300)
    q8_tokens = os.path.join(tmp, "q8.jsonl")
    p = run(["-m", q8, "--ids", "@" + id_file, "--kl-base", base, "--per-token", q8_tokens, "--json"])
    if p.returncode == 0:
        s = json.loads(p.stdout)
        subprocess.run([m3, "logits", "-m", q8, "--ids", "@" + id_file, "-o", os.path.join(tmp, "q8_logits")],
                       check=True, capture_output=True, timeout=300)
        q8_lp = log_softmax(np.load(os.path.join(tmp, "q8_logits", "prefill_logits.npy"))[:-1])
        base_lp = read_base(base).astype(np.float64)
        kl = (np.exp(base_lp) * (base_lp - q8_lp)).sum(axis=1)
        got = np.array([json.loads(line)["kl"] for line in open(q8_tokens)])
        if got.shape != kl.shape or np.abs(got - kl).max() > 1e-5 * (1 + kl.max()):
            failures.append(f"q8 per-token KL {got[:4]}... against NumPy {kl[:4]}...")
        if not (0 < s["kl_mean"] < 0.1) or abs(s["kl_mean"] - kl.mean()) > 1e-5 * (1 + kl.mean()):
            failures.append(f"q8 kl_mean {s['kl_mean']}, NumPy {kl.mean()}")
        same = float((base_lp.argmax(axis=1) == q8_lp.argmax(axis=1)).mean())
        if abs(s["same_top1"] - same) > 1e-12:
            failures.append(f"q8 same_top1 {s['same_top1']}, NumPy {same}")
        ratio = math.exp(s["nll_mean"] - np.mean([-base_lp[t - 1][ids[t]] for t in range(1, len(ids))]))
        if abs(s["perplexity_ratio"] - ratio) > 1e-6 * ratio:
            failures.append(f"q8 perplexity_ratio {s['perplexity_ratio']}, NumPy {ratio}")

    # A text file through the tokenizer.
    text_file = os.path.join(tmp, "text.txt")
    text = "The quick brown fox jumps over the lazy dog. " * 6 + "Perplexity, once more: ünïcödé ✓\n"
    with open(text_file, "w", encoding="utf-8") as f:
        f.write(text)
    tok = subprocess.run([m3, "tokenize", "--tokenizer", real_vocab], input=json.dumps({"text": text}) + "\n",
                         capture_output=True, text=True, timeout=60)
    n_text = len(json.loads(tok.stdout)["ids"]) if tok.returncode == 0 else -1
    p = run(["-m", real_vocab, "-f", text_file, "-c", "32", "--json"])
    if p.returncode == 0:
        s = json.loads(p.stdout)
        if s["tokens"] != n_text or s["scored"] != n_text - 1 or not math.isfinite(s["perplexity"]):
            failures.append(f"text file: {s}, tokenizer gives {n_text} tokens")
    p = subprocess.run([m3, "perplexity", "-m", real_vocab, "-f", "-", "-c", "32", "--json"], input=text,
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0 or json.loads(p.stdout)["nll_mean"] != s["nll_mean"]:
        failures.append(f"-f - (stdin): rc {p.returncode} {p.stdout} {p.stderr[-300:]}")
    p = run(["-m", real_vocab, "-f", text_file, "--max-tokens", "20", "--json"])
    if p.returncode == 0 and json.loads(p.stdout)["scored"] != 19:
        failures.append(f"--max-tokens 20: {p.stdout}")

    # Bad input: a clear message, no crash.
    empty = os.path.join(tmp, "empty.txt")
    open(empty, "w").close()
    truncated = os.path.join(tmp, "truncated.m3lp")
    with open(truncated, "wb") as f:
        f.write(open(base, "rb").read()[:-3])
    for args, message in [
        (["-m", case], "-f FILE or --ids"),
        (["-m", case, "--ids", "1,2", "-f", text_file], "one of them"),
        (["-m", case, "--ids", "1,x"], "'x' is not a token id"),
        (["-m", case, "--ids", "1,99999"], "token id 99999 at index 1 is outside the vocabulary [0, 512)"),
        (["-m", case, "--ids", "7"], "at least 2 tokens"),
        (["-m", real_vocab, "-f", empty], "at least 2 tokens, got 0"),
        (["-m", real_vocab, "-f", os.path.join(tmp, "missing.txt")], "cannot read"),
        (["-m", case, "--ids", "@" + id_file, "-c", "100000"], "exceeds the model's context"),
        (["-m", case, "--ids", "@" + id_file, "-c", "16", "--stride", "17"], "stride must be 1 to the context"),
        (["-m", case, "--ids", "@" + id_file, "--save-base", base], "pass --force"),
        (["-m", case, "--ids", "@" + id_file, "--save-base", base, "--kl-base", base, "--force"], "the same file"),
        (["-m", case, "--ids", "@" + id_file, "--kl-base", base, "-c", "32"], "a context of 2048, this run has 32"),
        (["-m", case, "--ids", "1,2,3", "--kl-base", base], "a token count of 64"),
        (["-m", case, "--ids", "@" + id_file, "--kl-base", truncated], "truncated or damaged"),
        (["-m", case, "--ids", "@" + id_file, "--kl-base", id_file], "not a log-probability file"),
    ]:
        p = run(args, ok=False)
        if p.returncode == 0 or message not in p.stderr or "m3 perplexity:" not in p.stderr:
            failures.append(f"{args[2:]}: rc {p.returncode}, expected '{message}' in: {p.stderr[-300:]}")
    # A base whose checksum fails at its last row: the run fails and leaves no --save-base file.
    damaged = os.path.join(tmp, "damaged.m3lp")
    raw = bytearray(open(base, "rb").read())
    raw[200] ^= 1
    with open(damaged, "wb") as f:
        f.write(raw)
    partial = os.path.join(tmp, "partial.m3lp")
    p = run(["-m", case, "--ids", "@" + id_file, "--kl-base", damaged, "--save-base", partial], ok=False)
    if p.returncode == 0 or "checksum mismatch" not in p.stderr:
        failures.append(f"damaged base: rc {p.returncode}: {p.stderr[-300:]}")
    if os.path.exists(partial) or os.path.exists(partial + ".tmp"):
        failures.append("a failed run left its --save-base file")

for f in failures:
    print("FAIL:", f)
print("perplexity_check:", "FAIL" if failures else "ok")
sys.exit(1 if failures else 0)
