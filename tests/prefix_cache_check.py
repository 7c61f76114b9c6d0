#!/usr/bin/env python3
"""The shared prefix cache of `m3 serve` (issue 36) on the tiny real-vocabulary model: a second
conversation with the same ~2,000-token system prompt and another user message, sent after the
first, lands in another slot and still reports >= 1,900 cached prompt tokens
(usage.prompt_tokens_details.cached_tokens), and answers exactly what a fresh server (nothing
cached) answers; /metrics shows the store (m3_prefix_cache_bytes, _hits_total, _lookups_total).
Prints the prefill seconds of the second request with and without the store (no timing assertion).
Usage: prefix_cache_check.py M3_BINARY REAL_VOCAB_MODEL_DIR"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve_util import Server, check, failures, fixture_env, metric  # noqa: E402

m3, model = sys.argv[1], sys.argv[2]

# ~2,000 tokens of tool definitions, as agents send them.
tools = []
for i in range(48):
    tools.append(f"Tool {i}: fetch_record_{i}(id: string, fields: list[string], limit: int = {i + 5}) returns "
                 f"the record's fields as JSON; errors: NotFound, Timeout{i}.")
system = "You are an agent. You may call these tools:\n" + "\n".join(tools)


def chat(server, user):
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    start = time.time()
    status, _, text = server.request("POST", "/v1/chat/completions", body)
    seconds = time.time() - start
    check(status == 200, f"chat: {status} {text[:300]}")
    whole = json.loads(text) if status == 200 else {"usage": {}, "choices": [{"message": {"content": None}}]}
    return whole, seconds


# 2 slots: the second conversation does not continue the first, so it goes to the other slot.
CONTEXT = 2400
cached = Server(m3, model, "--slots", "2", "--name", "tiny", env=fixture_env(), context=CONTEXT)
try:
    first, _ = chat(cached, "Look up record 7.")
    second, cached_seconds = chat(cached, "Which tool returns Timeout3?")
    third, _ = chat(cached, "List the fields of record 12.")
    usage = second["usage"]
    prompt_tokens = usage.get("prompt_tokens", 0)
    check(1950 <= prompt_tokens <= CONTEXT - 20, f"the system prompt should be ~2,000 tokens: {usage}")
    check(first["usage"].get("prompt_tokens_details", {}).get("cached_tokens") == 0, f"first: {first['usage']}")
    check(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) >= 1900, f"second: cached tokens {usage}")
    check(third["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) >= 1900,
          f"third: cached tokens {third['usage']}")
    check((metric(cached, "m3_prefix_cache_bytes") or 0) > 0, "m3_prefix_cache_bytes")
    # The second adopts the store's pages; the third goes to the first one's slot (least recently
    # used), whose own cache holds the system prompt already.
    check(metric(cached, "m3_prefix_cache_hits_total") >= 1, f"hits {metric(cached, 'm3_prefix_cache_hits_total')}")
    check(metric(cached, "m3_prefix_cache_lookups_total") == 3,
          f"lookups {metric(cached, 'm3_prefix_cache_lookups_total')}")
finally:
    check(cached.stop() == 0, "the cached server's exit code")

# The same second and third requests on fresh servers: nothing cached, the same output.
for user, want in (("Which tool returns Timeout3?", second), ("List the fields of record 12.", third)):
    fresh = Server(m3, model, "--slots", "2", "--name", "tiny", env=fixture_env(), context=CONTEXT)
    try:
        got, fresh_seconds = chat(fresh, user)
        check(got["usage"].get("prompt_tokens_details", {}).get("cached_tokens") == 0, f"fresh: {got['usage']}")
        check(got["choices"][0]["message"] == want["choices"][0]["message"],
              f"output with the store {want['choices'][0]['message']} vs fresh {got['choices'][0]['message']}")
        check(got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], "completion tokens")
    finally:
        check(fresh.stop() == 0, "the fresh server's exit code")
    if user.startswith("Which"):
        print(f"second conversation ({prompt_tokens} prompt tokens): {cached_seconds:.3f} s with the shared prefix, "
              f"{fresh_seconds:.3f} s fresh")

if failures:
    print("FAIL:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("prefix cache check: ok")
