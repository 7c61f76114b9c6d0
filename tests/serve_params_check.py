#!/usr/bin/env python3
"""Walks the request-parameter table of docs/REQUESTS.md over every endpoint of `m3 serve`
(issue 46), the generation endpoints, count_tokens, /tokenize and /detokenize: each `yes` cell is checked for its effect, each `label` for changing nothing, each `no`
for a 400 that names the field, each `only V` for both sides. The table's fields and this file's
checks must be the same set, so neither can grow alone.
Usage: serve_params_check.py M3_BINARY REAL_VOCAB_MODEL_DIR REQUESTS_MD"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from serve_util import Server, check, failures, fixture_env  # noqa: E402

m3, model, doc = sys.argv[1:4]
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
             "count_tokens": "/v1/messages/count_tokens", "tokenize": "/tokenize", "detokenize": "/detokenize"}


def read_table(path):
    text = open(path, encoding="utf-8").read()
    block = text.split("<!-- parameters -->")[1].split("<!-- /parameters -->")[0]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    table = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        table[cells[0].strip("`")] = dict(zip(header[1:-1], cells[1:-1]))
    return table


table = read_table(doc)
check(set(next(iter(table.values())).keys()) == set(ENDPOINTS), f"the table's columns: {list(table.values())[0]}")

USER = [{"role": "user", "content": "Tell me a long story about a dragon."}]
BASE = {
    "chat": {"messages": USER, "max_tokens": 16, "temperature": 0},
    "completions": {"prompt": "Once upon a time there was a dragon", "max_tokens": 16, "temperature": 0},
    "messages": {"model": "m3", "max_tokens": 16, "messages": USER, "temperature": 0},
    "count_tokens": {"model": "m3", "messages": USER},
    "tokenize": {"messages": USER},
    "detokenize": {"tokens": [1000, 2000, 3000]},
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}]


def body(ep, **fields):
    b = dict(BASE[ep])
    b.update(fields)
    return {k: v for k, v in b.items() if v is not None}


def post(ep, b):
    status, headers, text = server.request("POST", ENDPOINTS[ep], b)
    try:
        reply = json.loads(text)
    except ValueError:
        reply = text
    return status, headers, reply, text


def ok(ep, **fields):
    """The reply of a request that must succeed (None, recorded as a failure, when it did not)."""
    status, headers, reply, text = post(ep, body(ep, **fields))
    check(status == 200, f"{ep} {sorted(fields)}: {status} {text[:300]}")
    if status != 200:
        return None
    reply_headers[0] = headers
    return reply


reply_headers = [{}]


def text_of(ep, r):
    if r is None:
        return None
    if ep == "chat":
        m = r["choices"][0]["message"]
        return (m.get("reasoning_content") or "") + "|" + (m.get("content") or "")
    if ep == "completions":
        return r["choices"][0]["text"]
    if ep == "messages":
        return "|".join(b.get("text", b.get("thinking", json.dumps(b.get("input")))) for b in r["content"])
    if ep == "tokenize":
        return r["tokens"]
    if ep == "detokenize":
        return r["content"]
    return r["input_tokens"]


def prompt_tokens(ep, r):
    if r is None:
        return None
    if ep == "count_tokens":
        return r["input_tokens"]
    if ep == "tokenize":
        return r["count"]
    if ep == "messages":  # the tokens not read from the cache, and those read
        return r["usage"]["input_tokens"] + r["usage"]["cache_read_input_tokens"]
    return r["usage"]["prompt_tokens"]


def out_tokens(ep, r):
    return r["usage"]["output_tokens"] if ep == "messages" else r["usage"]["completion_tokens"]


def differs(ep, same=None, **fields):
    """The field changes the greedy reply (or the count) from the base request's (both with `same`)."""
    same = same or {}
    base, changed = text_of(ep, ok(ep, **same)), text_of(ep, ok(ep, **same, **fields))
    return base is not None and changed is not None and base != changed, f"{base!r} vs {changed!r}"


def greedy_at_t1(ep, **fields):
    """At temperature 1 the field leaves only the likeliest token: the greedy text, whatever the seed."""
    greedy = text_of(ep, ok(ep))
    seeds = {"seed": 7} if ep != "messages" else {}
    got = text_of(ep, ok(ep, temperature=1.0, **seeds, **fields))
    unfiltered = text_of(ep, ok(ep, temperature=1.0, **seeds))  # differs, or the check proves nothing
    return greedy is not None and got == greedy != unfiltered, f"greedy {greedy!r}, got {got!r}"


def more_prompt(ep, **fields):
    base, more = prompt_tokens(ep, ok(ep)), prompt_tokens(ep, ok(ep, **fields))
    return base is not None and more is not None and more > base, f"prompt tokens {base} -> {more}"


def longer_text(ep, field):
    """A longer text in `field` is more tokens (tokenize: instead of its conversation)."""
    drop = {"messages": None} if ep == "tokenize" else {}
    short = prompt_tokens(ep, ok(ep, **drop, **{field: "Once upon a time"}))
    longer = prompt_tokens(ep, ok(ep, **drop, **{field: "Once upon a time" * 3}))
    return short is not None and longer is not None and longer > short, f"{short} -> {longer}"


def caps_tokens(ep, field):
    free, capped = ok(ep), ok(ep, **{field: 3})
    if free is None or capped is None:
        return False, "no reply"
    return out_tokens(ep, free) > 3 and out_tokens(ep, capped) == 3, f"{out_tokens(ep, free)} -> {out_tokens(ep, capped)}"


def temperature(ep):
    seeds = [{"seed": 1}, {"seed": 2}] if ep != "messages" else [{}, {}]
    cold = [text_of(ep, ok(ep, temperature=0, max_tokens=24, **s)) for s in seeds]
    hot = [text_of(ep, ok(ep, temperature=1.0, max_tokens=24, **s)) for s in seeds]
    return cold[0] == cold[1] and hot[0] != hot[1], f"t=0 {cold}, t=1 {hot}"


def seed(ep):
    a, b = ok(ep, temperature=1.0, seed=1234), ok(ep, temperature=1.0, seed=1234)
    other = ok(ep, temperature=1.0, seed=4321)
    same = text_of(ep, a) == text_of(ep, b) and text_of(ep, a) != text_of(ep, other)
    return same and reply_headers[0].get("X-Seed") == "4321", f"{text_of(ep, a)!r} {text_of(ep, other)!r}"


def penalty(field, value):
    # The random model seldom repeats a token of its own accord: a grammar of two letters makes it
    # choose among a few tokens again and again, which the penalties then steer away from.
    return lambda ep: differs(ep, same={"max_tokens": 48, "grammar": "root ::= [ab]{32}"}, **{field: value})


def n_choices(ep):
    r = ok(ep, n=2, temperature=1.0, seed=3)
    return r is not None and len(r["choices"]) == 2, str(r)[:200]


def stream(ep):
    status, headers, _, text = post(ep, body(ep, stream=True))
    return status == 200 and headers.get("Content-Type", "").startswith("text/event-stream") and "data: " in text, text[:200]


def stream_options(ep):
    with_usage = post(ep, body(ep, stream=True, stream_options={"include_usage": True}))[3]
    without = post(ep, body(ep, stream=True))[3]
    return '"usage":{' in with_usage.replace(" ", "") and '"usage":{' not in without.replace(" ", ""), with_usage[-300:]


def stop(ep, field="stop"):
    full = text_of(ep, ok(ep, max_tokens=24))
    if not full:
        return False, "no text"
    words = full.split("|")[-1]
    cut = next((i for i in range(3, len(words) - 2) if words[i:i + 2] not in words[:i + 1]), None)
    if cut is None:
        return False, f"no stop string in {words!r}"
    r = ok(ep, max_tokens=24, **{field: [words[cut:cut + 2]]})
    got = text_of(ep, r).split("|")[-1] if r else None
    return got == words[:cut], f"stop {words[cut:cut + 2]!r}: {words!r} -> {got!r}"


def logprobs(ep):
    r = ok(ep, logprobs=True if ep == "chat" else 2)
    if r is None:
        return False, "no reply"
    lp = r["choices"][0]["logprobs"]
    return bool(lp["content"] if ep == "chat" else lp["top_logprobs"]), str(lp)[:200]


def top_logprobs(ep):
    r = ok(ep, logprobs=True, top_logprobs=3)
    entries = r["choices"][0]["logprobs"]["content"] if r else []
    return bool(entries) and all(len(e["top_logprobs"]) == 3 for e in entries), str(entries)[:200]


def echo(ep):
    r = ok(ep, echo=True)
    return r is not None and r["choices"][0]["text"].startswith(BASE[ep]["prompt"]), str(r)[:200]


def tools(ep):
    return more_prompt(ep, tools=OPENAI_TOOLS if ep in ("chat", "tokenize") else ANTHROPIC_TOOLS)


def add_generation_prompt(ep):
    with_opening, without = prompt_tokens(ep, ok(ep)), prompt_tokens(ep, ok(ep, add_generation_prompt=False))
    return with_opening is not None and without is not None and without < with_opening, f"{with_opening} {without}"


def with_pieces(ep):
    r = ok(ep, with_pieces=True)
    tokens = r["tokens"] if r else []
    return bool(tokens) and all(isinstance(t, dict) and {"id", "piece"} <= set(t) for t in tokens), str(tokens)[:200]


def return_token_strs(ep):
    r = ok(ep, return_token_strs=True)
    return r is not None and len(r.get("token_strs", [])) == r["count"] > 0, str(r)[:200]


def tokens(ep):
    text = "Hello, dragon of the north!"
    ids = ok("tokenize", messages=None, content=text)
    r = ok(ep, tokens=ids["tokens"] if ids else [])
    return r is not None and r["content"] == text, str(r)[:200]


def tool_choice(ep):
    if ep == "count_tokens":  # none: the tools are not offered, so not counted
        with_tools = prompt_tokens(ep, ok(ep, tools=ANTHROPIC_TOOLS))
        offered_none = prompt_tokens(ep, ok(ep, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}))
        return with_tools is not None and offered_none is not None and offered_none < with_tools, f"{with_tools} {offered_none}"
    if ep == "chat":
        r = ok(ep, tools=OPENAI_TOOLS, tool_choice="required", max_tokens=64)
        return r is not None and r["choices"][0]["finish_reason"] == "tool_calls", str(r)[:300]
    r = ok(ep, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, max_tokens=64)
    return r is not None and r["stop_reason"] == "tool_use", str(r)[:300]


def parallel_tool_calls(ep):
    counts = []
    for s in range(3):
        r = ok(ep, tools=OPENAI_TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=96,
               temperature=1.0, seed=s)
        counts.append(len(r["choices"][0]["message"].get("tool_calls") or []) if r else -1)
    return counts == [1, 1, 1], f"calls per reply {counts}"


def json_answer(ep, **fields):
    r = ok(ep, max_tokens=64, **fields)
    text = text_of(ep, r).split("|")[-1] if r else ""
    try:
        value = json.loads(text)
    except ValueError:
        return False, f"not JSON: {text!r}"
    return isinstance(value, dict), text


def response_format(ep):
    good, detail = json_answer(ep, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                                             "strict": True}})
    return good, detail


def grammar(ep):
    texts = {text_of(ep, ok(ep, grammar='root ::= "yes" | "no"', temperature=1.0, seed=s)).split("|")[-1] for s in range(3)}
    return texts <= {"yes", "no"}, str(texts)


def output_config(ep):
    return json_answer(ep, output_config={"format": {"type": "json_schema", "schema": SCHEMA}})


def thinking(ep):
    return differs(ep, thinking={"type": "enabled", "budget_tokens": 1024})


# What each `yes` cell's check is.
HONOURED = {
    "messages": lambda ep: more_prompt(ep, messages=[{"role": "user", "content": USER[0]["content"] * 3}]),
    "prompt": lambda ep: longer_text(ep, "prompt"),
    "content": lambda ep: longer_text(ep, "content"),
    "add_generation_prompt": add_generation_prompt,
    "with_pieces": with_pieces,
    "return_token_strs": return_token_strs,
    "tokens": tokens,
    "system": lambda ep: more_prompt(ep, system="You are a dragon who tells stories."),
    "max_tokens": lambda ep: caps_tokens(ep, "max_tokens"),
    "max_completion_tokens": lambda ep: caps_tokens(ep, "max_completion_tokens"),
    "temperature": temperature,
    "top_p": lambda ep: greedy_at_t1(ep, top_p=1e-6),
    "top_k": lambda ep: greedy_at_t1(ep, top_k=1),
    "min_p": lambda ep: greedy_at_t1(ep, min_p=1.0),
    "presence_penalty": penalty("presence_penalty", 2.0),
    "frequency_penalty": penalty("frequency_penalty", 2.0),
    "repetition_penalty": penalty("repetition_penalty", 3.0),
    "seed": seed,
    "n": n_choices,
    "stream": stream,
    "stream_options": stream_options,
    "stop": stop,
    "stop_sequences": lambda ep: stop(ep, "stop_sequences"),
    "logprobs": logprobs,
    "top_logprobs": top_logprobs,
    "echo": echo,
    "tools": tools,
    "tool_choice": tool_choice,
    "parallel_tool_calls": parallel_tool_calls,
    "chat_template_kwargs": lambda ep: differs(ep, chat_template_kwargs={"thinking_mode": "enabled"}),
    "thinking": thinking,
    "response_format": response_format,
    "grammar": grammar,
    "output_config": output_config,
}
# A plausible value of each field, for the cells that accept it as a label or refuse it.
VALUE = {
    "model": "anything-at-all", "messages": USER, "prompt": "Once", "system": "Be brief.", "max_tokens": 8,
    "max_completion_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.1, "seed": 5, "n": 2, "stream": True,
    "stream_options": {"include_usage": True}, "stop": ["x"], "stop_sequences": ["x"], "logprobs": True,
    "top_logprobs": 2, "echo": True, "suffix": "the end", "best_of": 2, "logit_bias": {"100": 5}, "user": "u-1",
    "metadata": {"user_id": "u-1"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"},
    "tools": OPENAI_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
    "chat_template_kwargs": {"thinking_mode": "enabled"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
    "response_format": {"type": "json_object"}, "grammar": 'root ::= "a"',
    "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
    "content": "Once", "add_generation_prompt": False, "add_special": True, "add_special_tokens": True,
    "with_pieces": True, "return_token_strs": True, "tokens": [1, 2, 3],
}
ONLY = {"null": None, "1": 1, "{}": {}}

# The fields that no endpoint honours: labels, and those accepted with one value only.
NEVER_HONOURED = {"model", "suffix", "best_of", "logit_bias", "user", "metadata", "service_tier", "cache_control",
                  "add_special", "add_special_tokens"}
check(set(table) == set(HONOURED) | NEVER_HONOURED,
      f"the table's fields and this check's differ: {sorted(set(table) ^ (set(HONOURED) | NEVER_HONOURED))}")
check(set(table) <= set(VALUE), f"fields without a value: {sorted(set(table) - set(VALUE))}")


def refused(ep, field, value):
    b = body(ep)
    b[field] = value
    status, _, _, text = post(ep, b)
    return status == 400 and field in text, f"{status} {text[:200]}"


server = Server(m3, model, "--name", "tiny", "--slots", "2", env=fixture_env(), context=1024)
walked = 0
try:
    for field, cells in table.items():
        if field not in VALUE:
            continue  # reported above
        for ep, cell in cells.items():
            walked += 1
            if cell == "yes":
                if field not in HONOURED:
                    continue  # reported above
                good, detail = HONOURED[field](ep)
            elif cell == "label":
                b = body(ep)
                b[field] = VALUE[field]
                status, _, reply, text = post(ep, b)
                same = status == 200 and text_of(ep, reply) == text_of(ep, ok(ep))
                good, detail = same, f"{status} {text[:200]}"
            elif cell == "no":
                good, detail = refused(ep, field, VALUE[field])
            elif cell.startswith("only "):
                allowed = ONLY[cell[len("only "):]]
                b = body(ep)
                b[field] = allowed
                status, _, _, text = post(ep, b)
                good, detail = refused(ep, field, VALUE[field])
                good = good and status == 200
                detail = f"{status} {text[:150]}; {detail}"
            else:
                good, detail = False, f"unknown cell {cell!r}"
            print(f"  {field:22} {ep:13} {cell:10} {'ok' if good else 'FAILED'}"
                  + (f": {detail}" if os.environ.get("M3_PARAMS_VERBOSE") else ""))
            check(good, f"{field} on {ep} ({cell}): {detail}")
    # A field in no row is refused everywhere.
    for ep in ENDPOINTS:
        good, detail = refused(ep, "frobnicate", 1)
        check(good, f"an unknown field on {ep}: {detail}")
finally:
    rc = server.stop()
check(rc == 0, f"server exit {rc}")
if failures:
    print(f"{len(failures)} failures:\n" + "\n".join(failures) + f"\n{server.log()[-2000:]}")
    sys.exit(1)
print(f"serve parameters: {len(table)} fields x {len(ENDPOINTS)} endpoints ({walked} cells) as documented")
