#!/usr/bin/env python3
"""`m3 serve`'s Anthropic Messages API end to end on the tiny real-vocabulary model (ctest's
fixture): a whole reply and the same reply streamed as Anthropic's events (message_start, the
content blocks, message_delta, message_stop), thinking on and off, the same text and prompt as the
OpenAI endpoint gives, a stop sequence, count_tokens, tools with a tool_use / tool_result round
trip, refusals in Anthropic's error shape (unknown fields, images, server tools, a prefill), 404 and
405, and the API key as "x-api-key". No timing assertions.
Usage: anthropic_check.py M3_BINARY REAL_VOCAB_MODEL_DIR"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from serve_util import Server, check, failures, fixture_env  # noqa: E402

m3, model = sys.argv[1], sys.argv[2]


def sse(text):
    """[(event name, data)] of an Anthropic stream; every block must be `event:` then `data:`."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        if len(lines) != 2 or not lines[0].startswith("event: ") or not lines[1].startswith("data: "):
            failures.append(f"stream framing: {block[:200]!r}")
            continue
        out.append((lines[0][len("event: "):], json.loads(lines[1][len("data: "):])))
    return out


def joined(events):
    """The message a client assembles from the events (as the SDKs do)."""
    message = None
    for name, data in events:
        check(data.get("type") == name, f"event {name} has type {data.get('type')}")
        if name == "message_start":
            message = json.loads(json.dumps(data["message"]))
        elif name == "content_block_start":
            check(data["index"] == len(message["content"]), f"block index: {data}")
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                block["_json"] = block.get("_json", "") + delta["partial_json"]
            else:
                failures.append(f"unknown delta {delta}")
        elif name == "content_block_stop":
            block = message["content"][data["index"]]
            if "_json" in block:
                block["input"] = json.loads(block.pop("_json"))
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    return message


server = Server(m3, model, "--name", "tiny", env=dict(fixture_env(), M3_API_KEY="k3y"), context=1024)
key = {"x-api-key": "k3y", "anthropic-version": "2023-06-01"}


def post(path, body, headers=key, raw=None):
    status, hdrs, text = server.request("POST", path, body, raw=raw, headers=headers)
    try:
        return status, hdrs, json.loads(text)
    except ValueError:
        return status, hdrs, text


def refused(body, want, status=400, path="/v1/messages", err_type="invalid_request_error", headers=key):
    got_status, _, reply = post(path, body, headers=headers)
    ok = (got_status == status and isinstance(reply, dict) and reply.get("type") == "error"
          and reply["error"]["type"] == err_type and want in reply["error"]["message"])
    check(ok, f"refusal {want!r}: {got_status} {reply}")


try:
    hello = [{"role": "user", "content": "Hello! Who are you?"}]
    base = {"model": "tiny", "max_tokens": 10, "temperature": 0, "messages": hello}

    # Thinking on: the reply starts in a thinking block; streamed, the same blocks, text and usage.
    thinking = dict(base, thinking={"type": "enabled", "budget_tokens": 1024})
    post("/v1/messages", dict(thinking, max_tokens=1))  # caches the prompt (same arithmetic below)
    status, hdrs, whole = post("/v1/messages", thinking)
    check(status == 200 and hdrs.get("Content-Type", "").startswith("application/json"), f"whole: {status} {whole}")
    check(whole["type"] == "message" and whole["role"] == "assistant" and whole["model"] == "tiny"
          and whole["id"].startswith("msg_"), f"envelope: {whole}")
    check(whole["content"] and whole["content"][0]["type"] == "thinking" and whole["content"][0]["signature"] == "",
          f"thinking block first: {whole['content']}")
    check(whole["stop_reason"] == "max_tokens" and whole["stop_sequence"] is None, f"stop: {whole}")
    usage = whole["usage"]
    check(usage["output_tokens"] == 10 and usage["cache_creation_input_tokens"] == 0
          and usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] == 1, f"usage: {usage}")
    status, hdrs, counted = post("/v1/messages/count_tokens",
                                 {"model": "tiny", "messages": hello, "thinking": thinking["thinking"]})
    check(status == 200 and counted == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]},
          f"count_tokens: {status} {counted} vs {usage}")

    status, hdrs, text = server.request("POST", "/v1/messages", dict(thinking, stream=True), headers=key)
    check(status == 200 and hdrs.get("Content-Type", "").startswith("text/event-stream"), f"stream: {status}")
    events = sse(text)
    names = [n for n, _ in events]
    check(names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"],
          f"stream order: {names}")
    streamed = joined(events)
    check(streamed["content"] == whole["content"], f"streamed == whole: {streamed['content']} vs {whole['content']}")
    check(streamed["stop_reason"] == "max_tokens" and streamed["usage"] == usage,
          f"stream end: {streamed} vs {usage}")
    check(events[0][1]["message"]["usage"]["input_tokens"] == counted["input_tokens"], f"message_start: {events[0]}")

    # The same conversation on the OpenAI endpoint: the same prompt and the same greedy text.
    status, _, text = server.request("POST", "/v1/chat/completions",
                                     {"messages": hello, "max_tokens": 10, "temperature": 0,
                                      "chat_template_kwargs": {"thinking_mode": "enabled"}}, headers=key)
    chat = json.loads(text)
    msg = chat["choices"][0]["message"]
    check(chat["usage"]["prompt_tokens"] == counted["input_tokens"], f"same prompt: {chat['usage']} vs {counted}")
    check(msg.get("reasoning_content") == whole["content"][0]["thinking"]
          and (msg["content"] or "") == "".join(b.get("text", "") for b in whole["content"]),
          f"same text: {msg} vs {whole['content']}")

    # Thinking off (also Anthropic's default): no thinking block; a stop sequence cuts the text.
    status, _, plain = post("/v1/messages", base)
    check(status == 200 and all(b["type"] == "text" for b in plain["content"]), f"no thinking: {plain}")
    status, _, off = post("/v1/messages", dict(base, thinking={"type": "disabled"}))
    check(off["content"] == plain["content"], f"disabled == default: {off} vs {plain}")
    text = "".join(b["text"] for b in plain["content"])
    if len(text) >= 4:
        stop = text[2:4]
        status, _, cut = post("/v1/messages", dict(base, stop_sequences=["\x01never", stop]))
        check(status == 200 and cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
              and "".join(b["text"] for b in cut["content"]) == text[:text.find(stop)], f"stop sequence: {cut}")
        status, _, stream_text = server.request("POST", "/v1/messages", dict(base, stream=True, stop_sequences=[stop]),
                                                headers=key)
        end = joined(sse(stream_text))
        check(end["stop_reason"] == "stop_sequence" and end["stop_sequence"] == stop, f"streamed stop sequence: {end}")
    else:
        failures.append(f"the greedy text is too short for a stop sequence: {text!r}")
    status, _, adaptive = post("/v1/messages", dict(base, thinking={"type": "adaptive"}, system="Be brief.",
                                                    metadata={"user_id": "u1"}, top_k=5, top_p=0.9))
    check(status == 200 and adaptive["stop_reason"] in ("max_tokens", "end_turn"), f"adaptive: {status} {adaptive}")

    # Tools: a conversation with a tool_use and its tool_result, and the tools offered again.
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    round_trip = hello + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Weather needed.", "signature": ""},
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": [{"type": "text", "text": "Rain, 12 C"}]},
            {"type": "text", "text": "Thanks. And Rome?"}]}]
    status, _, reply = post("/v1/messages", dict(base, tools=tools, messages=round_trip,
                                                 tool_choice={"type": "auto"}))
    check(status == 200 and reply["stop_reason"] in ("max_tokens", "end_turn", "tool_use"), f"round trip: {reply}")
    for block in reply.get("content", []):
        if block["type"] == "tool_use":
            check(block["id"].startswith("toolu_") and isinstance(block["input"], dict), f"tool_use block: {block}")
    # A forced call (tool_choice any, or the tool by name: lib/constrain makes the model write it):
    # tool_use blocks, whole and streamed alike, and their ids answered in the next turn.
    forced = dict(base, tools=tools, messages=hello, max_tokens=60, tool_choice={"type": "any"})
    status, _, call = post("/v1/messages", forced)
    uses = [b for b in call.get("content", []) if b["type"] == "tool_use"] if status == 200 else []
    check(status == 200 and call["stop_reason"] == "tool_use" and uses
          and all(u["name"] == "get_weather" and u["id"].startswith("toolu_msg_") and isinstance(u["input"], dict)
                  for u in uses), f"forced tool call: {status} {call}")
    status, _, text = server.request("POST", "/v1/messages", dict(forced, stream=True), headers=key)
    streamed_call = joined(sse(text))
    check([(b["type"], b.get("name"), b.get("input")) for b in streamed_call["content"]]
          == [(b["type"], b.get("name"), b.get("input")) for b in call.get("content", [])]
          and streamed_call["stop_reason"] == "tool_use", f"streamed forced call: {streamed_call} vs {call}")
    named = dict(forced, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    status, _, one = post("/v1/messages", named)
    check(status == 200 and [b["type"] for b in one["content"]].count("tool_use") == 1, f"one named call: {one}")
    if uses:
        answered = hello + [{"role": "assistant", "content": call["content"]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u["id"], "content": "ok"}
                                                         for u in uses]}]
        status, _, after = post("/v1/messages", dict(base, tools=tools, messages=answered))
        check(status == 200 and after["type"] == "message", f"the model's calls answered: {status} {after}")
    refused(dict(forced, tool_choice={"type": "tool", "name": "nope"}), "'nope' is not one of the tools")

    status, _, with_tools = post("/v1/messages/count_tokens", {"model": "tiny", "messages": round_trip, "tools": tools})
    status2, _, without = post("/v1/messages/count_tokens", {"model": "tiny", "messages": round_trip})
    check(status == 200 and status2 == 200 and with_tools["input_tokens"] > without["input_tokens"],
          f"tools count: {with_tools} vs {without}")
    status, _, none = post("/v1/messages/count_tokens", {"model": "tiny", "messages": round_trip, "tools": tools,
                                                         "tool_choice": {"type": "none"}})
    check(none == without, f"tool_choice none offers no tools: {none} vs {without}")

    # Refusals, by name, in Anthropic's shape.
    refused(dict(base, max_tokens=None), "\"max_tokens\" is required")
    refused(dict(base, frequency_penalty=1), "\"frequency_penalty\" is not supported")
    refused(dict(base, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
        "\"messages[0].content[0].type\" 'image' is not supported")
    refused(dict(base, tools=[{"type": "web_search_20250305", "name": "web_search"}]), "\"tools[0].type\"")
    refused(dict(base, messages=hello + [{"role": "assistant", "content": "I am"}]), "prefill")
    refused(dict(base, messages=round_trip[:2] + [{"role": "user", "content": "skip the result"}]),
            "need their tool_result blocks")
    refused(dict(base, messages=hello + [{"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "abc"}]}, {"role": "user", "content": "go on"}]),
        "'redacted_thinking' is not supported")
    refused({"model": "tiny", "messages": hello, "max_tokens": 5}, "\"max_tokens\" is not supported",
            path="/v1/messages/count_tokens")
    status, _, reply = post("/v1/messages", None, raw="{not json")
    check(status == 400 and reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error",
          f"bad JSON: {status} {reply}")
    long_text = "word " * 2000
    refused(dict(base, messages=[{"role": "user", "content": long_text}]), "context limit")
    status, _, reply = server.request("GET", "/v1/messages", headers=key)
    reply = json.loads(reply)
    check(status == 405 and reply["type"] == "error" and "takes POST" in reply["error"]["message"], f"GET: {reply}")

    # The key: x-api-key or a Bearer token; without either, Anthropic's authentication_error.
    refused(base, "API key", status=401, err_type="authentication_error", headers={})
    refused(base, "API key", status=401, err_type="authentication_error", headers={"x-api-key": "wrong"})
    status, _, reply = post("/v1/messages", dict(base, max_tokens=2), headers={"Authorization": "Bearer k3y"})
    check(status == 200 and reply["type"] == "message", f"Bearer on /v1/messages: {status} {reply}")
    status, _, reply = post("/v1/chat/completions", {"messages": hello, "max_tokens": 2}, headers={"x-api-key": "k3y"})
    check(status == 200 and reply["object"] == "chat.completion", f"x-api-key on the OpenAI side: {status} {reply}")
    status, _, reply = post("/v1/chat/completions", {"messages": hello, "max_tokens": 2}, headers={})
    check(status == 401 and reply["error"]["code"] == "invalid_api_key", f"OpenAI errors keep their shape: {reply}")
finally:
    rc = server.stop()
    check(rc == 0, f"server exit code {rc}: {server.log()[-2000:]}")

for f in failures:
    print("FAIL:", f)
print(f"anthropic checks: {len(failures)} failed")
sys.exit(1 if failures else 0)
