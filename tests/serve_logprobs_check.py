#!/usr/bin/env python3
"""Token log-probabilities through `m3 serve` and `m3 batch` on the tiny real-vocabulary model:
- a prompt scored with echo and max_tokens 0 (the lm-eval-harness loglikelihood request: token ids
  in, every prompt token's log-probability out) against the oracle (tests/data/oracle/m3ref.py) on the
  same ids, the most likely tokens among top_logprobs included;
- greedy completions: each token's log-probability is the largest of its alternatives, the tokens
  spell the text, text offsets count its characters; with echo the prompt comes first and the
  generated part is the same; streamed chunks carry the same log-probabilities;
- chat logprobs / top_logprobs, streamed and not;
- several prompts in one request: one choice each, equal to each prompt alone, usage summed;
- `m3 batch` gives serve's log-probabilities; bad requests are refused with a message.
No timing assertions.
Usage: serve_logprobs_check.py M3_BINARY REAL_VOCAB_MODEL_DIR SHARED_DIR"""
import http.client
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

m3, model, shared = sys.argv[1], sys.argv[2], sys.argv[3]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def close(a, b, tol=2e-4):
    return len(a) == len(b) and all((x is None and y is None) or
                                    (x is not None and y is not None and abs(x - y) <= tol) for x, y in zip(a, b))


server = subprocess.Popen([m3, "serve", "-m", model, "--port", "0", "-t", "2", "-c", "400", "--slots", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
try:
    line = server.stdout.readline()
    port = int(line.split("http://127.0.0.1:")[1].split()[0])

    def post(path, body):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8")
        conn.close()
        return resp.status, text

    def ok(path, body):
        status, text = post(path, body)
        check(status == 200, f"{path} {body}: {status} {text[:300]}")
        return json.loads(text) if status == 200 else None

    def stream(path, body):
        status, text = post(path, dict(body, stream=True))
        check(status == 200, f"{path} stream {body}: {status} {text[:300]}")
        out = []
        for block in text.split("\n\n"):
            if block.startswith("data: ") and block != "data: [DONE]":
                out.append(json.loads(block[len("data: "):]))
        return out

    def joined(chunks):  # completions chunks' logprobs lists joined, and their text
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        text = ""
        for c in chunks:
            for ch in c.get("choices", []):
                text += ch.get("text", "")
                if ch.get("logprobs"):
                    for k in lp:
                        lp[k] += ch["logprobs"][k]
        return text, lp

    # 1. Scoring a prompt given as token ids: every token but the first, against the oracle.
    ids = [758, 137454, 101443, 1439, 4520, 1278, 12385, 1044, 2049, 1307, 1261, 4990, 3926]
    r = ok("/v1/completions", {"prompt": [ids], "echo": True, "max_tokens": 0, "logprobs": 3, "temperature": 0})
    if r:
        choice = r["choices"][0]
        lp = choice["logprobs"]
        check(len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None,
              f"echo: one entry per prompt token, the first unscored: {lp['token_logprobs']}")
        check(choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0,
              f"echo, max_tokens 0: nothing generated: {choice['finish_reason']} {r['usage']}")
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["/usr/bin/python3", os.path.join(shared, "oracle", "m3ref.py"), "--model", model, "--ids",
                            ",".join(map(str, ids)), "--out", os.path.join(tmp, "o.npy")],
                           check=True, capture_output=True, timeout=300)
            logits = np.load(os.path.join(tmp, "o.npy"))
        for t in range(1, len(ids)):
            row = logits[t - 1]
            want = log_softmax(row)
            tol = 2e-5 * (1 + np.abs(row).max())  # fp32 against float64: ~1e-6 seen
            got = lp["token_logprobs"][t]
            check(got is not None and abs(got - want[ids[t]]) <= tol, f"echo token {t}: {got} vs oracle {want[ids[t]]}")
            top = lp["top_logprobs"][t]
            order = np.argsort(-want)
            check(len(top) in (3, 4) and abs(max(top.values()) - want[order[0]]) <= tol,
                  f"echo token {t}: top {top} vs oracle best {want[order[0]]}")
        check(lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"]),
              f"echo: offsets {lp['text_offset']}")

    # 2. Greedy completions: the sampled token is the most likely one; tokens spell the text.
    prompt = "The lighthouse keeper walked"
    body = {"prompt": prompt, "max_tokens": 8, "logprobs": 2, "temperature": 0}
    ok("/v1/completions", dict(body, max_tokens=1))  # the prompt cached: the requests below evaluate the same rows
    plain = ok("/v1/completions", body)
    if plain:
        c = plain["choices"][0]
        lp = c["logprobs"]
        n = plain["usage"]["completion_tokens"] - (1 if c["finish_reason"] == "stop" else 0)
        check(len(lp["tokens"]) == n, f"one entry per generated token: {len(lp['tokens'])} vs {n}")
        for t, (x, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"])):
            check(x <= 0 and abs(max(top.values()) - x) <= 1e-6 and len(top) in (2, 3), f"greedy token {t}: {x} {top}")
        if all(not s.startswith("bytes:") for s in lp["tokens"]):
            check("".join(lp["tokens"]) == c["text"], f"tokens spell the text: {lp['tokens']} vs {c['text']!r}")
        offsets = [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        check(lp["text_offset"] == offsets, f"offsets count characters: {lp['text_offset']} vs {offsets}")

        echoed = ok("/v1/completions", dict(body, echo=True))
        if echoed:
            e = echoed["choices"][0]
            elp = e["logprobs"]
            k = len(elp["tokens"]) - len(lp["tokens"])
            check(e["text"] == prompt + c["text"], f"echo text: {e['text']!r}")
            check(elp["tokens"][k:] == lp["tokens"] and close(elp["token_logprobs"][k:], lp["token_logprobs"], 1e-3),
                  f"echo: the generated part as without: {elp['token_logprobs'][k:]} vs {lp['token_logprobs']}")
            check(elp["text_offset"][k] == len(prompt), f"echo: the completion's offset {elp['text_offset'][k]}")

        text, slp = joined(stream("/v1/completions", body))
        check(text == c["text"] and slp["tokens"] == lp["tokens"] and
              close(slp["token_logprobs"], lp["token_logprobs"]) and slp["text_offset"] == lp["text_offset"],
              f"stream: the same log-probabilities: {slp} vs {lp}")
        text, slp = joined(stream("/v1/completions", dict(body, echo=True)))
        check(echoed and text == echoed["choices"][0]["text"] and slp["tokens"] == echoed["choices"][0]["logprobs"]["tokens"],
              f"stream with echo: {text!r} {slp['tokens']}")

    # 3. Chat: logprobs.content, one entry per generated token with its top_logprobs.
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 10, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    ok("/v1/chat/completions", dict(chat, max_tokens=1))
    r = ok("/v1/chat/completions", chat)
    if r:
        c = r["choices"][0]
        content = c["logprobs"]["content"]
        n = r["usage"]["completion_tokens"] - (1 if c["finish_reason"] in ("stop", "tool_calls") else 0)
        check(len(content) == n, f"chat: {len(content)} entries for {n} tokens")
        for e in content:
            check(len(e["top_logprobs"]) == 2 and abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) <= 1e-6 and
                  isinstance(e["bytes"], list), f"chat entry {e}")
        raw = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace")
        check((c["message"]["content"] or "") in raw, f"chat: the tokens hold the content: {raw!r}")
        chunks = stream("/v1/chat/completions", chat)
        streamed = [e for ch in chunks for x in ch.get("choices", []) if x.get("logprobs")
                    for e in x["logprobs"]["content"]]
        check([e["token"] for e in streamed] == [e["token"] for e in content] and
              close([e["logprob"] for e in streamed], [e["logprob"] for e in content]),
              f"chat stream: the same entries: {streamed} vs {content}")
    r = ok("/v1/chat/completions", dict(chat, logprobs=False, top_logprobs=None))
    check(r and r["choices"][0]["logprobs"] is None, "chat without logprobs: null")

    # 4. Several prompts: one choice each, as each alone.
    many = {"prompt": ["The sea", ids[:5]], "max_tokens": 3, "temperature": 0, "logprobs": 1}
    r = ok("/v1/completions", many)
    alone = [ok("/v1/completions", dict(many, prompt=p)) for p in many["prompt"]]
    if r and all(alone):
        check([c["index"] for c in r["choices"]] == [0, 1], f"choices indexed: {r['choices']}")
        for i in range(2):
            check(r["choices"][i]["text"] == alone[i]["choices"][0]["text"] and
                  r["choices"][i]["logprobs"]["tokens"] == alone[i]["choices"][0]["logprobs"]["tokens"],
                  f"choice {i} as alone: {r['choices'][i]} vs {alone[i]['choices'][0]}")
        check(r["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone),
              f"usage summed: {r['usage']}")
        # Streamed: each choice's chunks by "index", the same tokens and log-probabilities.
        chunks = stream("/v1/completions", many)
        for i in range(2):
            mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
            text, lp = joined(mine)
            check(text == r["choices"][i]["text"] and lp["tokens"] == r["choices"][i]["logprobs"]["tokens"],
                  f"streamed choice {i}: {text!r} {lp['tokens']} vs {r['choices'][i]}")
            check(sum(1 for c in mine if c["choices"][0]["finish_reason"]) == 1, f"choice {i}: one finish chunk")

    # 5. Bad requests.
    for path, bad, want in [("/v1/completions", {"prompt": "a", "logprobs": 21}, "0..20"),
                            ("/v1/completions", {"prompt": "a", "logprobs": True}, "is a number"),
                            ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "echo"),
                            ("/v1/completions", {"prompt": ["a", "b"], "n": 17}, "\"n\" must be 1..16"),
                            ("/v1/completions", {"prompt": [1, 999999]}, "outside the vocabulary"),
                            ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
                            ("/v1/chat/completions", dict(chat, logprobs=False), "needs \"logprobs\": true")]:
        status, text = post(path, bad)
        check(status == 400 and want in json.loads(text)["error"]["message"], f"{bad}: {status} {text[:300]}")

    # 6. m3 batch: serve's log-probabilities.
    served = ok("/v1/completions", body)
finally:
    server.terminate()
    server.communicate(timeout=30)

with tempfile.TemporaryDirectory() as tmp:
    requests = os.path.join(tmp, "r.jsonl")
    with open(requests, "w") as f:
        f.write(json.dumps(body) + "\n" + json.dumps(dict(body, echo=True, max_tokens=0)) + "\n")
    p = subprocess.run([m3, "batch", "-m", model, "-i", requests, "-t", "2", "-c", "400"], capture_output=True,
                       text=True, timeout=300)
    check(p.returncode == 0, f"m3 batch: rc {p.returncode} {p.stderr[-300:]}")
    if p.returncode == 0 and served:
        lines = [json.loads(x) for x in p.stdout.splitlines()]
        got = lines[0]["response"]["choices"][0]["logprobs"]
        want = served["choices"][0]["logprobs"]
        check(got["tokens"] == want["tokens"] and close(got["token_logprobs"], want["token_logprobs"], 1e-3),
              f"m3 batch: serve's log-probabilities: {got} vs {want}")
        scored = lines[1]["response"]["choices"][0]["logprobs"]
        check(scored["token_logprobs"][0] is None and len(scored["tokens"]) > 1 and
              all(x is not None and x <= 0 for x in scored["token_logprobs"][1:]), f"m3 batch, echo: {scored}")

for f in failures:
    print("FAIL:", f)
print(f"serve logprobs: {len(failures)} failures")
sys.exit(1 if failures else 0)
