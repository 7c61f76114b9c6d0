#!/usr/bin/env python3
"""End-to-end checks of the text commands through the `m3` binary:
tokenize / detokenize every case of golden.jsonl, render + encode every case of
chat_golden.jsonl, and `m3 run` / `m3 chat` on a tiny random model with the real
vocabulary and tokenizer files (ctest's fixture, tests/make_real_vocab_model.sh).
Usage: cli_text_check.py M3_BINARY SHARED_DIR REAL_VOCAB_MODEL_DIR"""
import json
import os
import re
import subprocess
import sys

m3, shared, model = sys.argv[1], sys.argv[2], sys.argv[3]
tok_dir = os.path.join(shared, "tokenizer", "minimax-m3")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(args, stdin=None):
    p = subprocess.run([m3] + args, input=stdin, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


# 1. tokenize / decode
cases = lines(os.path.join(tok_dir, "golden.jsonl"))
rc, out, err = run(["tokenize", "--tokenizer", tok_dir], "\n".join(json.dumps({"text": c["text"]}) for c in cases) + "\n")
check(rc == 0, f"tokenize exit {rc}: {err}")
got = [json.loads(l) for l in out.rstrip("\n").split("\n")]
check(len(got) == len(cases), "tokenize: one output line per request")
for c, g in zip(cases, got):
    check(g.get("ids") == c["ids"], f"tokenize {c['id']}")
for skip, key in ((False, "decoded"), (True, "decoded_skip_special")):
    req = "\n".join(json.dumps({"ids": c["ids"], "skip_special_tokens": skip}) for c in cases) + "\n"
    rc, out, err = run(["tokenize", "--tokenizer", tok_dir, "--decode"], req)
    check(rc == 0, f"decode exit {rc}: {err}")
    for c, g in zip(cases, [json.loads(l) for l in out.rstrip("\n").split("\n")]):
        check(g.get("text") == c[key], f"decode skip={skip} {c['id']}")
rc, out, _ = run(["tokenize", "--tokenizer", tok_dir], "not json\n{\"text\": 5}\n")
check(rc != 0 and out.count("error") == 2, "tokenize reports malformed requests as errors")
# A bad line is reported and the next still served; an id past the vocabulary is an error, not "".
rc, out, _ = run(["tokenize", "--tokenizer", tok_dir, "--decode"],
                 '{"ids": [999999999]}\n{"ids": [1], "skip_special_tokens": "yes"}\n{"ids": "abc"}\n{"ids": [1]}\n')
outs = [json.loads(l) for l in out.rstrip("\n").split("\n") if l]
check(rc == 1 and len(outs) == 4 and "not in the vocabulary" in outs[0].get("error", "")
      and "skip_special_tokens" in outs[1].get("error", "") and "error" in outs[2] and "text" in outs[3],
      f"decode: bad lines reported, the rest served: {outs}")
# 200 KB of nesting is refused by name and the next line still served (it once crashed both).
deep = '{"text": "x", "y": ' + "[" * 100000 + "]" * 100000 + "}\n"
for cmd in (["tokenize"], ["template"]):
    ok_line = json.dumps({"text": "hi"} if cmd == ["tokenize"] else {"messages": [{"role": "user", "content": "hi"}]})
    rc, out, err = run(cmd + ["--tokenizer", tok_dir], deep + ok_line + "\n")
    outs = [json.loads(l) for l in out.rstrip("\n").split("\n") if l]
    check(rc == 1 and len(outs) == 2 and "nested deeper than 256" in outs[0].get("error", "") and "error" not in outs[1],
          f"{cmd[0]}: a deeply nested line: rc {rc}, {out[:300]} {err[-300:]}")

# 2. chat template
chats = lines(os.path.join(tok_dir, "chat_golden.jsonl"))
req = "\n".join(json.dumps({"messages": c["messages"], "tools": c["tools"], "options": c["options"]}) for c in chats) + "\n"
rc, out, err = run(["template", "--tokenizer", tok_dir], req)
check(rc == 0, f"template exit {rc}: {err}")
for c, g in zip(chats, [json.loads(l) for l in out.rstrip("\n").split("\n")]):
    if "error" in c:
        check("error" in g, f"template {c['id']} should be refused")
    else:
        check(g.get("rendered") == c["rendered"], f"template {c['id']} rendered")
        check(g.get("ids") == c["ids"], f"template {c['id']} ids")

# 3. run / chat on a tiny model with the real vocabulary
rc, out1, err = run(["run", "-m", model, "-p", "Hello! Who are you?", "-n", "12", "--seed", "5", "-t", "2"])
check(rc == 0 and len(out1.strip()) > 0, f"run streams text (exit {rc}): {err}")
check(re.search(r"generated 12 tokens at [0-9.]+ tok/s", err) is not None, f"run timing line: {err}")
rc, out2, _ = run(["run", "-m", model, "-p", "Hello! Who are you?", "-n", "12", "--seed", "5", "-t", "1"])
check(out1 == out2, "same seed, same text (any thread count)")
rc, out, err = run(["run", "-m", model, "-p", "x", "--raw", "--temp", "0", "-n", "4", "--think", "sideways"])
check(rc != 0 and "--think" in err, "bad --think is refused")
rc, out, err = run(["run", "-m", model, "-p", "Hello! Who are you?", "--raw", "--temp", "0", "-n", "4", "-t", "2",
                    "--kv-cache", "bf16", "--index-cache", "int8", "--prefill-chunk", "3"])
check(rc == 0 and re.search(r"generated \d+ tokens", err) is not None,
      f"run with --kv-cache bf16 --index-cache int8 --prefill-chunk 3 (exit {rc}): {err}")
rc, out, err = run(["run", "-m", model, "-p", "x", "--raw", "--temp", "0", "-n", "1", "-t", "100000"])
cpus = len(os.sched_getaffinity(0))
check(rc == 0 and f"-t 100000 is more than the {cpus} CPUs this process may run on; using {cpus} threads" in err,
      f"-t above the CPU count is capped, with a note (exit {rc}): {err}")
for flag in ("--kv-cache", "--index-cache"):
    rc, out, err = run(["run", "-m", model, "-p", "x", "--raw", "-n", "1", flag, "fp8"])
    check(rc != 0 and f"{flag} must be f32, bf16 or int8, got 'fp8'" in err, f"bad {flag} is refused: {err}")
rc, out, err = run(["chat", "-m", model, "-n", "6", "--seed", "2"], "Hi there\nAnd a second question?\n")
stats = re.findall(r"prompt (\d+) tokens \((\d+) reused from cache, (\d+) prefilled\)", err)
check(rc == 0 and len(stats) == 2, f"chat ran two turns: {err}")
if len(stats) == 2:
    total, reused, prefilled = map(int, stats[1])
    check(reused > 0 and prefilled == total - reused and prefilled < int(stats[0][0]),
          f"second chat turn reuses the cached prefix: {stats}")

for f in failures[:30]:
    print("FAIL:", f)
print(f"cli text checks: {len(failures)} failed")
sys.exit(1 if failures else 0)
