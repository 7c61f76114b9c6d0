"""Tests of the Python module m3 (python/m3) over libm3.

Environment (a test skips, saying which, when its variable is unset):
  M3_GOLDEN_DIR        tests/data/golden: the s1_fp32_basic case (logits, greedy ids)
  M3_REAL_VOCAB_MODEL  a tiny model with the real tokenizer and chat template (build/test_models/real_vocab)
  M3_BIN               the m3 executable, whose `m3 logits` the module must match bit for bit
The module itself is imported from PYTHONPATH, and finds libm3 through M3_LIBRARY or its installed layout.
"""

import gc
import json
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import m3

TOKENIZER_DATA = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "minimax-m3"


_ENV = {"M3_GOLDEN_DIR": "tests/data/golden", "M3_REAL_VOCAB_MODEL": "build/test_models/real_vocab",
        "M3_BIN": "the m3 executable, build/bin/m3"}


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set (it names {_ENV[name]})")
    return value


class Case:
    """A golden case folder (tests/data/golden/README.md)."""

    def __init__(self, path: Path):
        self.dir = str(path)
        spec = json.loads((path / "case.json").read_text())
        self.prompt = spec["prompt_ids"]
        self.greedy = spec["greedy_ids"]
        self.rel = spec["tolerance"]["logits"]["rel"]
        self.prefill = np.load(path / "prefill_logits.npy")
        self.decode = np.load(path / "decode_logits.npy")

    def assert_close(self, got: np.ndarray, golden: np.ndarray) -> None:
        # The golden rule: max_j |engine - golden| <= rel * (1 + max_j |golden|), per row.
        assert got.shape == golden.shape
        assert np.abs(got - golden).max() <= self.rel * (1 + np.abs(golden).max())


@pytest.fixture(scope="module")
def case() -> Case:
    return Case(Path(_env("M3_GOLDEN_DIR")) / "s1_fp32_basic")


@pytest.fixture(scope="module")
def engine(case):
    with m3.Engine(case.dir, threads=1) as e:  # 1 thread: as `m3 logits -t 1` below
        yield e


@pytest.fixture(scope="module")
def real():
    """(engine, tokenizer) of the real-vocabulary model."""
    path = _env("M3_REAL_VOCAB_MODEL")
    with m3.Engine(path, threads=2) as e, m3.Tokenizer(path) as t:
        yield e, t


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


HELLO = [{"role": "user", "content": "Hello! Who are you?"}]


# --- The module ---------------------------------------------------------------------------------------------

def test_import():
    assert os.path.isfile(m3.library_path)
    target = m3.simd_target()
    assert isinstance(target, str) and "fp32" in target
    for cls in (m3.InvalidArgument, m3.NotFound, m3.OutOfMemory, m3.Unavailable, m3.OutOfRange):
        assert issubclass(cls, m3.Error) and cls.status > 0


# --- Golden case: numerics -----------------------------------------------------------------------------------

def test_eval_matches_golden(case, engine):
    assert engine.vocab_size == case.prefill.shape[1]
    with m3.Session(engine) as s:
        logits = s.eval(case.prompt)
        assert logits.dtype == np.float32 and logits.shape == (engine.vocab_size,)
        case.assert_close(logits, case.prefill[-1])
        assert s.position == len(case.prompt)
        for i, token in enumerate(case.greedy[:-1]):  # the decode steps, one token at a time
            case.assert_close(s.eval([token]), case.decode[i])
        assert s.eval([case.greedy[-1]], logits=False) is None
        assert s.position == len(case.prompt) + len(case.greedy)


def test_eval_equals_cli(case, engine, tmp_path):
    out = tmp_path / "logits"
    subprocess.run([_env("M3_BIN"), "logits", "-m", case.dir, "--ids", ",".join(map(str, case.prompt)),
                    "-o", str(out), "-t", "1"], check=True, capture_output=True, timeout=60)
    cli = np.load(out / "prefill_logits.npy")
    assert cli.shape == case.prefill.shape
    with m3.Session(engine) as s:
        assert np.array_equal(s.eval(case.prompt), cli[-1])  # the same code: bit for bit


def test_greedy_generate(case, engine):
    with m3.Session(engine) as s:
        stream = s.generate(case.prompt, temperature=0, max_tokens=len(case.greedy))
        assert stream.stats is None  # not started before iteration
        assert list(stream) == case.greedy
        st = stream.stats
        assert (st.prompt_tokens, st.generated_tokens, st.stop_reason) == (len(case.prompt), len(case.greedy),
                                                                           "length")
        assert st.prefill_seconds >= 0 and st.decode_seconds >= 0
        # The whole sequence again: the session reuses what it holds; a stop id ends it, not passed on.
        stream = s.generate(case.prompt, temperature=0, max_tokens=20, stop_ids=[case.greedy[3]], lookup_tokens=2)
        assert list(stream) == case.greedy[:3]
        assert stream.stats.stop_reason == "stop" and stream.stats.reused_tokens == len(case.prompt) - 1


def test_score_matches_eval(case, engine):
    ids = case.prompt[:12]
    with m3.Session(engine) as scored, m3.Session(engine) as stepped:
        log_probs, top1 = scored.score(ids)
        assert log_probs.dtype == np.float64 and log_probs.shape == (len(ids) - 1,)
        assert top1.dtype == bool and top1.shape == (len(ids) - 1,)
        assert scored.position == len(ids) - 1  # the last id is only a target
        for i in range(len(ids) - 1):
            logits = stepped.eval([ids[i]])
            want = _log_softmax(logits)[ids[i + 1]]
            assert abs(log_probs[i] - want) <= 1e-5 * (1 + abs(want))
            assert top1[i] == (int(np.argmax(logits)) == ids[i + 1])
        empty, empty_top1 = scored.score(ids[:1])
        assert empty.shape == (0,) and empty_top1.shape == (0,) and scored.position == len(ids) - 1


def test_decode_batch_equals_eval(case, engine):
    prompts = [case.prompt[:9], case.prompt[20:25]]
    batched = [m3.Session(engine) for _ in prompts]
    alone = [m3.Session(engine) for _ in prompts]
    for p, b, a in zip(prompts, batched, alone):
        b.eval(p, logits=False)
        a.eval(p, logits=False)
    logits = m3.decode_batch(batched, [42, 7])
    assert logits.shape == (2, engine.vocab_size) and logits.dtype == np.float32
    assert np.array_equal(logits[0], alone[0].eval([42]))
    assert np.array_equal(logits[1], alone[1].eval([7]))
    # Refused batches leave every session as it was.
    with pytest.raises(m3.InvalidArgument):
        m3.decode_batch([batched[0], batched[0]], [1, 2])
    with pytest.raises(m3.InvalidArgument, match="session 1"):
        m3.decode_batch(batched, [1, engine.vocab_size])
    with pytest.raises(ValueError):
        m3.decode_batch(batched, [1])
    with pytest.raises(TypeError):
        m3.decode_batch([batched[0], "session"], [1, 2])
    with m3.Engine(case.dir, threads=1) as other, m3.Session(other) as foreign:
        with pytest.raises(ValueError, match="one engine"):
            m3.decode_batch([batched[0], foreign], [1, 2])
    assert [s.position for s in batched] == [10, 6]
    assert m3.decode_batch(batched, [3, 4], logits=False) is None
    assert [s.position for s in batched] == [11, 7]


def test_rewind(case, engine):
    with m3.Session(engine) as s:
        first = s.eval(case.prompt[:20])
        s.rewind(10)
        assert s.position == 10
        assert np.array_equal(s.eval(case.prompt[10:20]), first)
        with pytest.raises(m3.InvalidArgument, match="cannot rewind"):
            s.rewind(21)
        with pytest.raises(ValueError):
            s.rewind(-1)
        s.rewind(0)
        assert s.position == 0


def test_concurrent_sessions_equal_sequential(case, engine):
    def work(session: m3.Session, prompt: list) -> list:
        results = []
        for _ in range(3):
            session.rewind(0)
            results.append(session.eval(prompt))
            results.append(np.array(list(session.generate(prompt, max_tokens=24, seed=5))))
        return results

    prompts = [case.prompt[:30], case.prompt[5:50]]
    sequential = [work(m3.Session(engine), p) for p in prompts]
    concurrent = [None, None]
    errors = []

    def run(i: int) -> None:
        try:
            concurrent[i] = work(m3.Session(engine), prompts[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for seq, con in zip(sequential, concurrent):
        assert len(seq) == len(con) and all(np.array_equal(a, b) for a, b in zip(seq, con))

    # A running generation holds the engine: another session's eval waits for it (it would take ~1 ms).
    with m3.Session(engine) as a, m3.Session(engine) as b:
        stream = a.generate(case.prompt, max_tokens=8000 - len(case.prompt), seed=1)
        next(stream)
        waiter = threading.Thread(target=b.eval, args=(case.prompt,))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()
        stream.close()
        waiter.join(10)
        assert not waiter.is_alive() and b.position == len(case.prompt)
        assert stream.stats.stop_reason == "caller"


def test_generate_early_stop(case, engine):
    with m3.Session(engine) as s:
        n = 8000 - len(case.prompt)  # all of it would take seconds
        stream = s.generate(case.prompt, max_tokens=n, seed=1)
        first = [next(stream) for _ in range(3)]
        stream.close()
        assert stream.stats.stop_reason == "caller" and 3 <= stream.stats.generated_tokens < n
        assert len(case.prompt) + 3 <= s.position < len(case.prompt) + n
        # Dropped by `break`: the C call ends at its next token and the session is ready.
        for token in s.generate(case.prompt, max_tokens=n, seed=1):
            break
        assert token == first[0]
        assert s.position < len(case.prompt) + n
        with s.generate(case.prompt, max_tokens=n, seed=1) as stream:
            next(stream)
        assert stream.stats.stop_reason == "caller"
        s.rewind(0)
        case.assert_close(s.eval(case.prompt), case.prefill[-1])


def test_cache_types(case, engine):
    with m3.Session(engine) as exact, m3.Engine(case.dir, threads=1, kv_cache="bf16", index_cache="int8") as small:
        want = exact.eval(case.prompt)
        with m3.Session(small) as s:
            got = s.eval(case.prompt)
        assert not np.array_equal(got, want)  # the caches are rounded...
        assert np.abs(got - want).max() < 0.02 * (1 + np.abs(want).max())  # ...not much


def test_lifetimes(case):
    e = m3.Engine(case.dir, threads=1)
    s = m3.Session(e)
    e.close()  # the session keeps it
    assert s.eval([1, 2, 3]).shape == (e.vocab_size,)
    with pytest.raises(ValueError, match="closed"):
        m3.Session(e)
    assert e._ptr is not None
    s.close()
    assert e._ptr is None and s.closed  # freed with its last session
    with pytest.raises(ValueError, match="closed"):
        s.eval([1])
    # A session in a cycle with its engine: whichever the collector finalizes first, the session is freed first.
    freed = []
    e = m3.Engine(case.dir, threads=1)
    s = m3.Session(e)
    e.cycle = s
    for handle, name in [(e, "engine"), (s, "session")]:
        handle._free = lambda ptr, free=handle._free, name=name: (freed.append(name), free(ptr))
    del e, s, handle
    gc.collect()
    assert freed == ["session", "engine"]


# --- Errors --------------------------------------------------------------------------------------------------

def test_errors(case, engine):
    with pytest.raises(m3.NotFound, match="/nonexistent/m3-model") as info:
        m3.Engine("/nonexistent/m3-model")
    assert isinstance(info.value, m3.Error) and info.value.status == 2
    assert "/nonexistent/m3-model" in info.value.message
    with pytest.raises(m3.NotFound):
        m3.Tokenizer("/nonexistent/m3-tokenizer")
    for kwargs, exc in [({"threads": -1}, ValueError), ({"threads": "2"}, TypeError), ({"numa": "on"}, ValueError),
                        ({"kv_cache": "fp8"}, ValueError), ({"index_cache": None}, ValueError)]:
        with pytest.raises(exc):
            m3.Engine(case.dir, **kwargs)
    with m3.Session(engine) as s:
        s.eval(case.prompt[:4], logits=False)
        with pytest.raises(m3.InvalidArgument, match="outside the vocabulary"):
            s.eval([engine.vocab_size])
        with pytest.raises(m3.InvalidArgument):
            s.eval([])
        for bad, exc in [([1.5], TypeError), ("12", TypeError), ([[1, 2]], ValueError), ([2**40], ValueError),
                         ([True], TypeError), (7, TypeError), ([1, None], TypeError)]:
            with pytest.raises(exc):
                s.eval(bad)
        assert s.position == 4  # nothing changed
        for kwargs, exc in [({"temperature": "hot"}, TypeError), ({"max_tokens": -1}, ValueError),
                            ({"bogus": 1}, TypeError), ({"top_k": 2.0}, TypeError), ({"seed": -1}, ValueError),
                            ({"stop_ids": [0.5]}, TypeError)]:
            with pytest.raises(exc):
                s.generate(case.prompt, **kwargs)
        with pytest.raises(ValueError):
            s.generate([])
        with pytest.raises(ValueError, match="tokenizer"):
            s.chat(HELLO)
        # Refused by the library on the worker thread: raised by the iteration, the session usable after.
        stream = s.generate(case.prompt, frequency_penalty=2.5)
        with pytest.raises(m3.InvalidArgument, match="frequency_penalty"):
            next(stream)
        assert list(stream) == [] and stream.stats is None
        assert list(s.generate(case.prompt, temperature=0, max_tokens=2)) == case.greedy[:2]


# --- Text: the real-vocabulary model ------------------------------------------------------------------------

def test_tokenizer_goldens(real):
    _, tok = real
    assert tok.vocab_size == 200061
    # split("\n"), not splitlines(): the texts hold other line breaks (U+2028, U+0085).
    rows = [json.loads(line) for line in (TOKENIZER_DATA / "golden.jsonl").read_text().split("\n") if line]
    for row in rows:
        assert tok.encode(row["text"]) == row["ids"], row["id"]
        assert tok.decode(row["ids"]) == row["decoded"], row["id"]
        assert tok.decode(np.array(row["ids"]), skip_special_tokens=True) == row["decoded_skip_special"], row["id"]
        if row["category"] == "special":
            assert tok.token_id(row["text"]) == row["ids"][0], row["id"]
    assert tok.token_id("]~b]") == tok.encode("]~b]")[0]
    assert tok.token_id("no such token, surely") is None
    text = "Grüße, 世界! 🙂 <mm:think>x</mm:think>"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("") == [] and tok.decode([]) == ""
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(TypeError):
        tok.token_id(5)


def test_render_chat_goldens(real):
    _, tok = real
    for line in (TOKENIZER_DATA / "chat_golden.jsonl").read_text().split("\n"):
        if not line:
            continue
        row = json.loads(line)
        if "error" in row:
            with pytest.raises(m3.InvalidArgument, match=row["error"][:40]):
                tok.render_chat(row["messages"], row["tools"], **row["options"])
            continue
        assert tok.render_chat(row["messages"], row["tools"], **row["options"]) == row["rendered"], row["id"]
        request = {"messages": row["messages"], "options": row["options"]}
        if row["tools"] is not None:
            request["tools"] = row["tools"]
        assert tok.render_chat(request) == row["rendered"], row["id"]


def test_chat(real):
    engine, tok = real
    with m3.Session(engine, tok) as s:
        stream = s.chat(HELLO, max_tokens=12, seed=3, thinking_mode="disabled")
        parts = list(stream)
        assert parts and all(isinstance(p, m3.Part) and p.kind in ("reasoning", "content", "tool_call")
                             for p in parts)
        message = stream.message
        assert message["role"] == "assistant"
        assert message["content"] == "".join(p.text for p in parts if p.kind == "content") != ""
        assert stream.stats.generated_tokens <= 12 and stream.stats.prompt_tokens > 100
        # The next turn: the session holds the conversation's prefix.
        turn = s.chat(HELLO + [message, {"role": "user", "content": "And?"}], max_tokens=4, seed=3,
                      thinking_mode="enabled")
        parts = list(turn)
        assert turn.message.get("reasoning_content", "") == "".join(p.text for p in parts if p.kind == "reasoning")
        assert turn.stats.reused_tokens > 100
        completion = s.complete("Once upon a time", max_tokens=5, seed=1)
        parts = list(completion)
        assert {p.kind for p in parts} == {"content"}
        assert completion.message["content"] == "".join(p.text for p in parts)
        assert completion.stats.prompt_tokens == len(tok.encode("Once upon a time"))
        # Early stop: `with` ends the turn at its next part; the session is then ready.
        with s.chat(HELLO, max_tokens=300, seed=3, thinking_mode="disabled") as stream:
            next(stream)
        assert stream.stats.stop_reason == "caller" and stream.stats.generated_tokens < 300
        # Errors: malformed requests from the library, bad Python input before it.
        with pytest.raises(m3.InvalidArgument, match="messages"):
            next(s.chat({"messages": 1}))
        with pytest.raises(TypeError):
            s.chat("Hi")
        with pytest.raises(TypeError):
            s.chat(HELLO, stop=3)
        with pytest.raises(TypeError):
            s.complete("x", thinking_mode="enabled")
        with pytest.raises(ValueError, match="plain prompt"):
            s.chat({"prompt": "x"}, thinking_mode="enabled")
        assert s.chat(HELLO, max_tokens=1, thinking_mode="disabled").result()["role"] == "assistant"


def test_scheduler(real):
    engine, tok = real
    requests = [{"messages": HELLO, "options": {"thinking_mode": "disabled"}},
                [{"role": "user", "content": "Name a color."}], {"prompt": "The sky is"}]
    options = {"max_tokens": 6, "seed": 11}
    with m3.Scheduler(engine, tok, 2) as scheduler:
        messages = scheduler.chat_many(requests, **options)
        assert len(messages) == 3 and all(m["role"] == "assistant" for m in messages)
        with m3.Session(engine, tok) as alone:  # scheduled equals alone
            assert alone.chat(requests[0], **options).result() == messages[0]
        # Parts through a callback; one that raises stops its request and comes out of run().
        seen = []
        good = scheduler.submit(requests[0], on_part=seen.append, **options)
        bad = scheduler.submit(HELLO, on_part=lambda part: 1 / 0, max_tokens=50, thinking_mode="disabled")
        reentrant = scheduler.submit(HELLO, on_part=lambda part: engine.session().position, max_tokens=50)
        with pytest.raises(ZeroDivisionError):  # the first of them (reentrant waits for a slot)
            scheduler.run()
        assert good.done and good.error is None and good.message == messages[0] and seen == good.parts
        assert good.message["content"] == "".join(p.text for p in good.parts)
        assert isinstance(bad.error, ZeroDivisionError) and bad.stats.stop_reason == "caller"
        assert bad.stats.generated_tokens < 50
        # Calling into the engine from its own callback would deadlock: refused.
        assert isinstance(reentrant.error, RuntimeError) and "callback" in str(reentrant.error)
        assert reentrant.stats.stop_reason == "caller"
        with pytest.raises(RuntimeError):
            scheduler.chat_many([HELLO], on_part=lambda part: engine.session().position)
        with pytest.raises(RuntimeError):  # a stream's worker thread would wait for run() too
            scheduler.chat_many([HELLO], on_part=lambda part: next(engine.session().generate([1])))
        # Stopped by its callback's False, or by cancel(): ended early, without an error.
        refused = scheduler.submit(HELLO, on_part=lambda part: False, max_tokens=50)
        cancelled = scheduler.submit(HELLO, on_part=lambda part: cancelled.cancel(), max_tokens=50)
        scheduler.run()
        for r in (refused, cancelled):
            assert r.done and r.error is None and r.message["role"] == "assistant"
            assert r.stats.stop_reason == "caller" and len(r.parts) == 1
        with pytest.raises(m3.InvalidArgument, match="messages"):
            scheduler.submit({"messages": 1})
        with pytest.raises(ValueError):
            m3.Scheduler(engine, tok, 0)
