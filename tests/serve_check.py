#!/usr/bin/env python3
"""`m3 serve` end to end over HTTP on the tiny real-vocabulary model (ctest's fixture): health and
models; a chat completion streamed and not streamed gives the same text and usage; a plain
completion, cut by a stop string; two conversations taking turns keep their caches in two slots; the cached prefix of the previous request is reused; bad requests get OpenAI-style
errors with a message; a context overflow is a 400; a client that leaves a stream stops it; two
concurrent requests both complete; a folder without a chat template serves completions only;
requests that generate at the same time are decoded in one batch and give the same greedy text as
each alone, and so does `m3 batch` on a file of them (also with --lookup); --cache-memory releases idle conversations' caches before refusing a request. No
timing assertions.
Usage: serve_check.py M3_BINARY REAL_VOCAB_MODEL_DIR"""
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(__file__))
from serve_util import check, events, failures  # noqa: E402

m3, model = sys.argv[1], sys.argv[2]

server = subprocess.Popen([m3, "serve", "-m", model, "--port", "0", "-t", "2", "-c", "400", "--name", "tiny",
                           "--slots", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
try:
    line = server.stdout.readline()
    check("http://127.0.0.1:" in line, f"start line: {line!r}")
    port = int(line.split("http://127.0.0.1:")[1].split()[0])

    def request(method, path, body=None, raw=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8")
        conn.close()
        return resp.status, resp.getheader("Content-Type", ""), text

    status, _, text = request("GET", "/health")
    check(status == 200 and json.loads(text) == {"status": "ok"}, f"/health: {status} {text}")
    status, _, text = request("GET", "/v1/models")
    check(status == 200 and json.loads(text)["data"][0]["id"] == "tiny", f"/v1/models: {status} {text}")
    status, _, text = request("GET", "/v1/models/tiny")
    check(status == 200 and json.loads(text)["id"] == "tiny", f"/v1/models/tiny: {status} {text}")
    status, _, text = request("GET", "/v1/models/other")
    check(status == 404 and "'other'" in text, f"/v1/models/other: {status} {text}")
    # A route under another method: 405 with the one it takes; no route at all: 404.
    for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("POST", "/health", "GET"),
                                ("DELETE", "/v1/models", "GET")):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(method, path, body="{}" if method == "POST" else None, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        check(resp.status == 405 and resp.getheader("Allow") == allow and "takes " + allow in text,
              f"{method} {path}: {resp.status} {resp.getheader('Allow')} {text}")
    status, _, text = request("GET", "/v2/nothing")
    check(status == 404 and "no such endpoint" in text, f"/v2/nothing: {status} {text}")

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 10,
            "temperature": 0, "chat_template_kwargs": {"thinking_mode": "enabled"}}
    # A first request puts the prompt in the session's cache, so that the two compared below both
    # evaluate only its last token (the same arithmetic, hence the same greedy tokens).
    request("POST", "/v1/chat/completions", dict(chat, max_tokens=1))
    status, ctype, text = request("POST", "/v1/chat/completions", chat)
    check(status == 200 and ctype.startswith("application/json"), f"chat: {status} {ctype} {text}")
    whole = json.loads(text)
    msg = whole["choices"][0]["message"]
    check(whole["object"] == "chat.completion" and whole["model"] == "tiny", f"chat envelope: {whole}")
    check(msg["role"] == "assistant" and len(msg.get("reasoning_content", "")) > 0,
          f"thinking enabled: the reply starts in reasoning: {msg}")
    usage = whole["usage"]
    check(usage["completion_tokens"] == 10 and whole["choices"][0]["finish_reason"] == "length", f"usage: {whole}")
    check(usage["total_tokens"] == usage["prompt_tokens"] + 10, f"total tokens: {usage}")
    check(usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, f"prefix reuse: {usage}")
    # The prompt is what `m3 template` renders for the same conversation.
    rendered = subprocess.run([m3, "template", "--tokenizer", model], capture_output=True, text=True,
                              input=json.dumps({"messages": chat["messages"], "tools": None,
                                                "options": {"add_generation_prompt": True,
                                                            "thinking_mode": "enabled"}}) + "\n")
    check(len(json.loads(rendered.stdout)["ids"]) == usage["prompt_tokens"], "prompt tokens == m3 template's ids")

    status, ctype, text = request("POST", "/v1/chat/completions",
                                  dict(chat, stream=True, stream_options={"include_usage": True}))
    check(status == 200 and ctype.startswith("text/event-stream"), f"stream: {status} {ctype}")
    ev = events(text)
    check(len(ev) >= 4 and ev[-1] == "[DONE]", f"stream ends with [DONE]: {text[-200:]}")
    chunks = [e for e in ev if isinstance(e, dict)]
    check(chunks[0]["choices"][0]["delta"].get("role") == "assistant", f"first chunk: {chunks[0]}")
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    check(reasoning == msg.get("reasoning_content", "") and content == (msg["content"] or ""),
          f"streamed text == whole text: {reasoning!r} {content!r} vs {msg}")
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    check(len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length", f"one finish chunk: {finals}")
    check(chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage, f"usage chunk: {chunks[-1]} vs {usage}")

    # Two conversations take turns: with two slots each keeps its cache (the other one, which
    # shares only the system prompt, goes to the unused slot instead of evicting it).
    other = dict(chat, messages=[{"role": "user", "content": "Tell me about the sea, please."}], max_tokens=2)
    status, _, text = request("POST", "/v1/chat/completions", other)
    check(status == 200, f"other conversation: {status} {text}")
    status, _, text = request("POST", "/v1/chat/completions", dict(chat, max_tokens=2))
    back = json.loads(text)["usage"]
    check(back["prompt_tokens_details"]["cached_tokens"] == back["prompt_tokens"] - 1,
          f"back to the first conversation: its cache was kept: {back}")

    # n = 3 choices (seeds seed, seed + 1, seed + 2), whole and streamed: the same three replies;
    # each streamed choice has its chunks ("index"), one finish chunk, and the usage sums them.
    sampled = dict(chat, n=3, seed=11, temperature=1.0, max_tokens=5)
    request("POST", "/v1/chat/completions", sampled)  # both slots then hold the prompt: the same passes below
    status, headers, text = request("POST", "/v1/chat/completions", sampled)
    three = json.loads(text)
    check(status == 200 and [c["index"] for c in three["choices"]] == [0, 1, 2], f"n=3: {status} {text[:300]}")
    status, _, text = request("POST", "/v1/chat/completions",
                              dict(sampled, stream=True, stream_options={"include_usage": True}))
    chunks = [e for e in events(text) if isinstance(e, dict)]
    per = {}
    for c in chunks:
        for ch in c["choices"]:
            got = per.setdefault(ch["index"], {"text": "", "finish": []})
            got["text"] += ch["delta"].get("reasoning_content", "") + ch["delta"].get("content", "")
            if ch["finish_reason"]:
                got["finish"].append(ch["finish_reason"])
    check(sorted(per) == [0, 1, 2] and all(len(v["finish"]) == 1 for v in per.values()),
          f"n=3 streamed: one finish chunk per choice: {per}")
    if status == 200 and len(three.get("choices", [])) == 3 and sorted(per) == [0, 1, 2]:
        check([per[i]["text"] for i in range(3)] ==
              [(c["message"].get("reasoning_content") or "") + (c["message"]["content"] or "") for c in three["choices"]],
              f"n=3 streamed == whole: {per} vs {three['choices']}")
        check(chunks[-1]["usage"]["completion_tokens"] == three["usage"]["completion_tokens"]
              and three["usage"]["prompt_tokens"] == usage["prompt_tokens"], f"n=3 usage: {chunks[-1]} {three['usage']}")

    # /tokenize and /detokenize: the ids of a chat completion's prompt; back to text; bad ids 400.
    status, _, text = request("POST", "/tokenize", {"messages": chat["messages"],
                                                    "chat_template_kwargs": chat["chat_template_kwargs"]})
    tok = json.loads(text)
    check(status == 200 and tok["count"] == usage["prompt_tokens"] == len(tok["tokens"]) and tok["max_model_len"] == 400,
          f"/tokenize messages: {status} {text[:300]} vs {usage}")
    status, _, text = request("POST", "/tokenize", {"content": "Hello world", "with_pieces": True})
    pieces = json.loads(text)["tokens"]
    check(status == 200 and "".join(p["piece"] for p in pieces) == "Hello world", f"/tokenize pieces: {text}")
    status, _, text = request("POST", "/detokenize", {"tokens": [p["id"] for p in pieces]})
    check(status == 200 and json.loads(text)["content"] == "Hello world", f"/detokenize: {status} {text}")
    for path, body, want in (("/detokenize", {"tokens": [1, 10**9]}, "\"tokens[1]\""),
                             ("/tokenize", {"content": 5}, "\"content\""), ("/tokenize", {"prompt": "a", "x": 1}, "\"x\"")):
        status, _, text = request("POST", path, body)
        check(status == 400 and want in json.loads(text)["error"]["message"], f"{path} {body}: {status} {text}")

    comp = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    request("POST", "/v1/completions", dict(comp, max_tokens=1))
    status, _, text = request("POST", "/v1/completions", comp)
    check(status == 200, f"completion: {status} {text}")
    whole = json.loads(text)
    check(whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] == 6, f"completion: {whole}")
    status, _, text = request("POST", "/v1/completions", dict(comp, stream=True))
    streamed = "".join(e["choices"][0]["text"] for e in events(text) if isinstance(e, dict))
    check(streamed == whole["choices"][0]["text"], f"streamed completion {streamed!r} vs {whole['choices'][0]['text']!r}")

    # A stop string from the middle of that text: the reply ends before it, finish_reason "stop".
    text = whole["choices"][0]["text"]
    stop = text[len(text) // 3: len(text) // 3 + 2]
    cut = text[:text.find(stop)]
    for stream in (False, True):
        status, _, body = request("POST", "/v1/completions", dict(comp, stop=stop, stream=stream))
        if stream:
            ev = [e for e in events(body) if isinstance(e, dict)]
            got = "".join(e["choices"][0]["text"] for e in ev)
            reason = ev[-1]["choices"][0]["finish_reason"]
        else:
            got, reason = json.loads(body)["choices"][0]["text"], json.loads(body)["choices"][0]["finish_reason"]
        check(status == 200 and got == cut and reason == "stop",
              f"stop {stop!r} (stream {stream}): {got!r}, {reason} vs {cut!r} from {text!r}")

    def error(status_want, path, body=None, raw=None, want=""):
        status, _, text = request("POST", path, body, raw)
        try:
            err = json.loads(text)["error"]
        except (ValueError, KeyError):
            err = {}
        check(status == status_want and want in err.get("message", ""), f"{body or raw}: {status} {text}")

    error(400, "/v1/chat/completions", raw="{not json", want="not valid JSON")
    # 200 KB of nesting (it once crashed the server: nlohmann copies recurse) is refused by name.
    error(400, "/v1/chat/completions", raw='{"messages": [], "x": ' + "[" * 100000 + "]" * 100000 + "}",
          want="nested deeper than 256 levels")
    status, _, text = request("GET", "/health")
    check(status == 200, f"/health after a deeply nested request: {status} {text}")

    # The 64 MiB body limit holds after the encodings are undone: a 64 KB gzip body that inflates
    # to 65 MiB and a chunked body of 65 MiB are refused with 413; a small gzip body is served.
    def raw_post(headers, chunks):
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Connection: close\r\n")
        sock.sendall((head + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode())
        try:
            for c in chunks:
                sock.sendall(c)
        except OSError:
            pass  # the server stopped reading: its answer is what counts (a half-closed client
            # would read as one that left, and be cancelled)
        reply = b""
        try:
            while True:
                part = sock.recv(65536)
                if not part:
                    break
                reply += part
        except OSError:
            pass
        sock.close()
        status_line = reply.split(b"\r\n", 1)[0].decode(errors="replace")
        return status_line, reply.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")

    import gzip
    bomb = gzip.compress(b" " * (65 << 20), compresslevel=9)
    line, text = raw_post({"Content-Encoding": "gzip", "Content-Length": str(len(bomb))}, [bomb])
    check(" 413 " in line and "larger than 64 MiB" in text, f"gzip bomb of {len(bomb)} bytes: {line} {text[:200]}")
    big = b" " * (1 << 20)
    chunked = [b"%x\r\n%s\r\n" % (len(big), big) for _ in range(65)] + [b"0\r\n\r\n"]
    line, text = raw_post({"Transfer-Encoding": "chunked"}, chunked)
    check(" 413 " in line and "larger than 64 MiB" in text, f"65 MiB chunked body: {line} {text[:200]}")
    small = gzip.compress(json.dumps(dict(chat, max_tokens=2)).encode())
    line, text = raw_post({"Content-Encoding": "gzip", "Content-Length": str(len(small))}, [small])
    check(" 200 " in line and "chat.completion" in text, f"small gzip body: {line} {text[:200]}")
    status, _, text = request("GET", "/health")
    check(status == 200, f"/health after oversized bodies: {status} {text}")

    # A request without a seed gets a fresh one, reported in X-Seed; one with a seed keeps it.
    def seed_of(body):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        return resp.getheader("X-Seed")
    unseeded = [seed_of(dict(chat, max_tokens=1, temperature=1.0)) for _ in range(2)]
    check(None not in unseeded and unseeded[0] != unseeded[1], f"fresh seeds: {unseeded}")
    check(seed_of(dict(chat, max_tokens=1, seed=1234)) == "1234", "a given seed is kept")

    # Not reachable from a web page: a Host that is not loopback (DNS rebinding) gets 403, a body
    # that is not application/json (a form or text/plain needs no CORS preflight) 415.
    def with_headers(method, path, headers, data=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.putrequest(method, path, skip_host=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        body = data.encode() if data is not None else None
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, text, resp.getheader("WWW-Authenticate", "")

    body = json.dumps(dict(chat, max_tokens=2))
    status, text, _ = with_headers("POST", "/v1/chat/completions",
                                   {"Host": "attacker.example:%d" % port, "Content-Type": "application/json"}, body)
    check(status == 403 and "attacker.example" in text, f"foreign Host: {status} {text[:200]}")
    status, text, _ = with_headers("GET", "/health", {"Host": "attacker.example"})
    check(status == 403, f"foreign Host on /health: {status}")
    status, text, _ = with_headers("POST", "/v1/chat/completions", {"Host": "localhost:%d" % port, "Content-Type": "text/plain"}, body)
    check(status == 415 and "application/json" in text, f"text/plain body: {status} {text[:200]}")
    status, text, _ = with_headers("POST", "/v1/chat/completions",
                                   {"Host": "[::1]:%d" % port, "Content-Type": "application/json; charset=utf-8"}, body)
    check(status == 200, f"[::1] Host, JSON with a charset: {status} {text[:200]}")
    error(400, "/v1/chat/completions", {"model": "tiny"}, want="\"messages\"")
    # OpenAI's error shape: param names the field, code is a string or null.
    status, _, text = request("POST", "/v1/chat/completions", dict(chat, n=17))
    err = json.loads(text)["error"]
    check(status == 400 and err.get("param") == "n" and "code" in err and err["code"] is None
          and err.get("type") == "invalid_request_error", f"error shape: {text}")
    error(400, "/v1/chat/completions", dict(chat, n=17), want="\"n\"")
    error(400, "/v1/chat/completions", dict(chat, stop=["a", "b", "c", "d", "e"]), want="\"stop\"")
    error(400, "/v1/chat/completions", dict(chat, temperature=-2), want="temperature")
    error(400, "/v1/chat/completions",
          {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "orphan"}]},
          want="Message has tool role")
    error(400, "/v1/chat/completions", dict(chat, stream=True, n=0), want="\"n\"")  # before the stream starts
    error(400, "/v1/completions", {"prompt": 5}, want="prompt")
    error(400, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]},
          want="context limit")
    error(400, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}], "stream": True},
          want="context limit")
    status, _, text = request("GET", "/v1/nothing")
    check(status == 404 and "no such endpoint" in text, f"unknown path: {status} {text}")

    # A client that reads one event and hangs up: the server stops and serves the next request.
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    body = json.dumps(dict(chat, stream=True, max_tokens=300)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    check(b"data: " in got, f"a streamed event before hanging up: {got[:300]!r}")
    sock.close()

    results = []

    def one():
        results.append(request("POST", "/v1/chat/completions", dict(chat, max_tokens=3))[0])

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(results == [200, 200], f"two concurrent requests: {results}")
finally:
    server.terminate()
    _, err = server.communicate(timeout=30)

# A folder without a chat template: completions work, chat says what is missing.
bare = tempfile.mkdtemp(prefix="m3-serve-bare-")
for f in ("config.json", "model.safetensors", "tokenizer.json"):
    os.symlink(os.path.abspath(os.path.join(model, f)), os.path.join(bare, f))
server2 = subprocess.Popen([m3, "serve", "-m", bare, "--port", "0", "-t", "1"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
try:
    line = server2.stdout.readline()
    port = int(line.split("http://127.0.0.1:")[1].split()[0])
    status, _, text = request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    check(status == 200, f"completion without a template: {status} {text}")
    # One slot, three requests at once: they wait their turn in the queue and all complete.
    queued = []
    threads = [threading.Thread(target=lambda: queued.append(
        request("POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0})))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    texts = [json.loads(q[2])["choices"][0]["text"] if q[0] == 200 else None for q in queued]
    check(len(texts) == 3 and None not in texts and len(set(texts)) == 1, f"three queued requests on one slot: {queued}")
    status, _, text = request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    check(status == 500 and "chat_template.jinja" in text and bare not in text,
          f"chat without a template (named, without the server's paths): {status} {text}")
finally:
    server2.terminate()
    _, err2 = server2.communicate(timeout=30)
    for f in os.listdir(bare):
        os.unlink(os.path.join(bare, f))
    os.rmdir(bare)
check("no chat template" in err2, f"a note at start that chat is refused: {err2}")


def start_server(slots, *extra):
    proc = subprocess.Popen([m3, "serve", "-m", model, "--port", "0", "-t", "2", "-c", "400", "--slots", str(slots),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    return proc, int(line.split("http://127.0.0.1:")[1].split()[0])


# Batching: a long streamed reply (A) and, once it is under way, a short one (B) on a fresh server
# run their decode steps together, B's prompt in chunks of 8 tokens riding along A's decode
# steps; each equals its reply on another fresh server, alone and with its prompt in one pass.
long_req = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 120, "temperature": 0}
short_req = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0}
server3, port = start_server(2, "--prefill-chunk", "8")
try:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(long_req, stream=True)),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()  # the role chunk; A is generating
    check(first.startswith(b"data: "), f"batched: A's stream starts: {first!r}")
    status, _, text = request("POST", "/v1/chat/completions", short_req)
    check(status == 200, f"batched: B {status} {text}")
    b_batched = json.loads(text)["choices"][0]["message"]
    rest = (first + resp.read()).decode()
    conn.close()
    ev = [e for e in events(rest) if isinstance(e, dict)]
    a_batched = ("".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in ev),
                 "".join(e["choices"][0]["delta"].get("content", "") for e in ev))
finally:
    server3.terminate()
    _, err3 = server3.communicate(timeout=30)
server4, port = start_server(2)
try:
    status, _, text = request("POST", "/v1/chat/completions", long_req)
    a_alone = json.loads(text)["choices"][0]["message"]
    status, _, text = request("POST", "/v1/chat/completions", short_req)
    b_alone = json.loads(text)["choices"][0]["message"]
finally:
    server4.terminate()
    server4.communicate(timeout=30)
check(a_batched == (a_alone.get("reasoning_content", ""), a_alone["content"] or ""),
      f"batched A == A alone: {a_batched!r} vs {a_alone!r}")
check(b_batched == b_alone, f"batched B == B alone: {b_batched!r} vs {b_alone!r}")
log3 = [l for l in err3.splitlines() if l.startswith("m3 serve: /v1/")]
check(len(log3) == 2 and all("in batches of up to 2" in l for l in log3),
      "A and B decoded in one batch: " + "\n".join(log3))

# `m3 batch`: the same two requests from a file, decoded together, equal to each alone; bad lines
# get their error in place; results in input order.
with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
    f.write(json.dumps(long_req) + "\n" + "{not json\n" + json.dumps(short_req) + "\n"
            + json.dumps({"prompt": "x", "n": 17}) + "\n" + "[" * 100000 + "]" * 100000 + "\n")
    requests_file = f.name
p = subprocess.run([m3, "batch", "-m", model, "-i", requests_file, "--slots", "2", "-t", "2", "-c", "400"],
                   capture_output=True, text=True, timeout=300)
os.unlink(requests_file)
results = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
check(p.returncode == 0 and [r.get("index") for r in results] == [0, 1, 2, 3, 4],
      f"m3 batch: rc {p.returncode}, {p.stdout[:500]} {p.stderr[-500:]}")
if len(results) == 5:
    check(results[0].get("response", {}).get("choices", [{}])[0].get("message") == a_alone,
          f"m3 batch: A == A alone: {results[0]} vs {a_alone}")
    check(results[2].get("response", {}).get("choices", [{}])[0].get("message") == b_alone,
          f"m3 batch: B == B alone: {results[2]} vs {b_alone}")
    check("not valid JSON" in results[1].get("error", {}).get("message", "")
          and "\"n\"" in results[3].get("error", {}).get("message", "")
          and "nested deeper than 256" in results[4].get("error", {}).get("message", ""),
          f"m3 batch: errors in place: {results}")
check("5 requests (3 failed)" in p.stderr, f"m3 batch: summary line: {p.stderr[-300:]}")
# With prompt lookup (--lookup: guesses verified in the batched steps) the greedy replies are the same.
p = subprocess.run([m3, "batch", "-m", model, "--slots", "2", "-t", "2", "-c", "400", "--lookup", "4"],
                   input=json.dumps(long_req) + "\n" + json.dumps(short_req) + "\n", capture_output=True, text=True,
                   timeout=300)
results = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
check(p.returncode == 0 and len(results) == 2, f"m3 batch --lookup 4: rc {p.returncode} {p.stderr[-500:]}")
if len(results) == 2:
    check([r.get("response", {}).get("choices", [{}])[0].get("message") for r in results] == [a_alone, b_alone],
          f"m3 batch --lookup 4: same replies as without: {results}")
p = subprocess.run([m3, "batch", "-m", model, "--lookup", "-1"], input="\n", capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "lookup" in p.stderr, f"m3 batch --lookup -1 refused: {p.stderr[-300:]}")
p = subprocess.run([m3, "batch", "-m", model, "-i", "/nonexistent/requests.jsonl"], capture_output=True, text=True,
                   timeout=60)
check(p.returncode != 0 and "/nonexistent/requests.jsonl" in p.stderr, f"m3 batch, missing file: {p.stderr[-300:]}")
p = subprocess.run([m3, "batch", "-m", model], input="\n", capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "no requests" in p.stderr, f"m3 batch, empty input: {p.stderr[-300:]}")

# --cache-memory: room for one conversation of ~300 tokens (the template adds ~180 to each). A second one releases the idle first
# one's cache instead of failing; the first one then comes back without its cache; a prompt that
# cannot fit even alone is a 400 that says so.
cfg = json.load(open(os.path.join(model, "config.json")))
sparse = cfg["sparse_attention_config"]
page = sparse["sparse_block_size"]
per_token = sum(2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4 + (sparse["sparse_index_dim"] * 4 if flag else 0)
                for flag in sparse["sparse_attention_freq"])
budget = (300 + page - 1) // page * page * per_token
server5, port = start_server(2, "--cache-memory", str(budget))
try:
    alpha = {"messages": [{"role": "user", "content": "alpha " * 60}], "max_tokens": 3, "temperature": 0}
    beta = {"messages": [{"role": "user", "content": "beta " * 60}], "max_tokens": 3, "temperature": 0}
    status_a, _, text_a = request("POST", "/v1/chat/completions", alpha)
    status_b, _, text_b = request("POST", "/v1/chat/completions", beta)
    status_a2, _, text_a2 = request("POST", "/v1/chat/completions", alpha)
    big = request("POST", "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "gamma " * 150}], "max_tokens": 2})
finally:
    server5.terminate()
    _, err5 = server5.communicate(timeout=30)
prompt_a = json.loads(text_a)["usage"]["prompt_tokens"] if status_a == 200 else 0
check(status_a == 200 and 200 < prompt_a < 290, f"--cache-memory: first conversation {status_a} {text_a[:300]}")
check(status_b == 200, f"--cache-memory: a second conversation releases the idle first: {status_b} {text_b[:300]}")
# Its slot's cache was released; what the prefix store still holds of it (the store's pages count
# once in the budget, however many hold them) may serve it: the same reply either way.
check(status_a2 == 200 and status_a == 200 and
      json.loads(text_a2)["choices"][0]["message"] == json.loads(text_a)["choices"][0]["message"],
      f"--cache-memory: the first conversation again, its slot's cache released: {status_a2} {text_a2[:300]}")
check(err5.count("released an idle conversation") >= 2, f"--cache-memory: releases logged: {err5[-800:]}")
# Permanent (the prompt alone needs more than the whole budget): a 4xx, not a retryable 503.
check(big[0] == 400 and "KV cache" in big[2] and "can never run" in big[2],
      f"--cache-memory: a prompt past the budget: {big[0]} {big[2][:300]}")
p = subprocess.run([m3, "serve", "-m", model, "--cache-memory", "lots"], capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "--cache-memory" in p.stderr, f"--cache-memory lots: {p.returncode} {p.stderr[-300:]}")

log = [l for l in err.splitlines() if l.startswith("m3 serve: /v1/")]
check(any("| caller" in l for l in log), "the hung-up stream was stopped (stop reason caller): " + "\n".join(log[-4:]))
# An API key (from the environment here): every route but /health needs it as a Bearer token.
env = dict(os.environ, M3_API_KEY="s3cret-key")
keyed = subprocess.Popen([m3, "serve", "-m", model, "--port", "0", "-t", "2", "-c", "400"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
try:
    port = int(keyed.stdout.readline().split("http://127.0.0.1:")[1].split()[0])

    def keyed_request(method, path, auth=None, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = auth
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, text, resp.getheader("WWW-Authenticate", "")

    small_chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    check(keyed_request("GET", "/health")[0] == 200, "/health needs no key")
    for auth in (None, "Bearer wrong", "Bearer s3cret-ke", "Bearer s3cret-keyy", "s3cret-key", "Basic s3cret-key"):
        status, text, www = keyed_request("POST", "/v1/chat/completions", auth, small_chat)
        check(status == 401 and www == "Bearer" and "API key" in text
              and json.loads(text)["error"]["code"] == "invalid_api_key", f"auth {auth!r}: {status} {www!r} {text[:120]}")
    check(keyed_request("GET", "/v1/models")[0] == 401, "/v1/models needs the key")
    check(keyed_request("GET", "/v1/models", "Bearer s3cret-key")[0] == 200, "/v1/models with the key")
    status, text, _ = keyed_request("POST", "/v1/chat/completions", "Bearer s3cret-key", small_chat)
    check(status == 200 and "chat.completion" in text, f"with the key: {status} {text[:200]}")
finally:
    keyed.terminate()
    keyed.wait(timeout=30)

for f in failures:
    print("FAIL:", f)
print(f"serve checks: {len(failures)} failed")
sys.exit(1 if failures else 0)
