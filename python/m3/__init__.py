"""m3: MiniMax-M3 inference on CPUs, from Python.

A ctypes binding of the C API (``lib/include/m3/m3.h``); it needs NumPy and ``libm3.so``, found through
the ``M3_LIBRARY`` environment variable (a path to ``libm3.so*``) or, once installed, beside the package::

    import m3

    engine = m3.Engine("MODEL_DIR", threads=16)
    tokenizer = m3.Tokenizer("MODEL_DIR")
    session = m3.Session(engine, tokenizer)
    logits = session.eval(tokenizer.encode("Hello"))          # float32 [vocab] of the last token
    for part in session.chat([{"role": "user", "content": "Hi"}], max_tokens=64):
        print(part.text, end="", flush=True)                   # Part(kind, text), streamed

Sampling keywords, taken by ``Session.generate``, ``Session.chat``, ``Session.complete``, ``Scheduler.submit``
and ``Scheduler.chat_many`` (omitted or None: the library's default, the model's recommended settings):
``max_tokens`` (512), ``temperature`` (1.0; 0 is greedy), ``top_k`` (40; 0 off), ``top_p`` (0.95),
``min_p`` (0), ``repetition_penalty`` (1), ``presence_penalty`` (0), ``frequency_penalty`` (0, -2..2),
``seed`` (0), ``stop_ids`` (ids that end generation), ``lookup_tokens`` (prompt-lookup speculation, 0 off).

Errors: every failing C call raises an ``m3.Error`` subclass (``InvalidArgument``, ``NotFound``, ...) with the
library's message; arguments of the wrong type or sign raise TypeError or ValueError before any C call.

Thread safety: every object may be used from several threads. A Tokenizer is immutable. Every computation
on an engine (``eval``, ``score``, ``generate``, ``chat``, ``rewind``, ``position``, ``decode_batch``,
``Scheduler.run``) holds that engine's lock for the duration of its C call, so sessions of one engine used
from several threads take turns instead of racing; the GIL is released inside C calls, so other engines and
Python code run meanwhile. A streamed generation holds the lock on its worker thread until it ends. Calling
into an engine from a Scheduler callback of the same engine raises RuntimeError (it would deadlock).

Lifetimes: a Session keeps its Engine alive, a Scheduler its Engine and Tokenizer. ``close()`` (or leaving a
``with`` block, or garbage collection) frees a handle once no call runs on it and no handle made from it is
left, so closing an engine with live sessions frees it with the last of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import json
import numbers
import os
import queue
import threading
from collections.abc import Callable, Iterable
from ctypes import POINTER, byref, c_char_p, c_double, c_float, c_int, c_int32, c_size_t, c_uint64, c_void_p
from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = [
    "Error", "InvalidArgument", "NotFound", "IoError", "Corrupt", "Unsupported", "OutOfRange", "OutOfMemory",
    "Internal", "Unavailable", "Engine", "Tokenizer", "Session", "Scheduler", "Request", "Part", "Stats",
    "TokenStream", "ChatStream", "decode_batch", "simd_target", "library_path",
]


# --- The library ----------------------------------------------------------------------------------------------

def _find_library() -> str:
    env = os.environ.get("M3_LIBRARY")
    if env:
        if os.path.isfile(env):
            return env
        raise ImportError(f"m3: M3_LIBRARY is {env!r}, which is not a file: set it to the path of libm3.so.0, or "
                          "unset it to use the library of an installed m3 (m3/_library.py)")
    tried = ""
    try:
        from . import _library  # written at install time from _library.py.in
    except ImportError:
        _library = None
    if _library is not None:
        path = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             _library.LIBRARY_RELATIVE_PATH))
        if os.path.isfile(path):
            return path
        tried = f" (the installed m3/_library.py names {path}, which does not exist)"
    raise ImportError("m3: cannot find libm3: set M3_LIBRARY to the path of libm3.so.0 (e.g. build/lib/libm3.so.0), "
                      "or install m3 (cmake --install), which writes m3/_library.py naming it" + tried)


library_path = _find_library()
_lib = ctypes.CDLL(library_path)


class _EngineOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("threads", c_int32), ("numa_mode", c_int32), ("mlock_dense", c_int32),
                ("kv_cache", c_int32), ("index_cache", c_int32), ("gpu_mode", c_int32), ("gpu_device", c_int32)]


class _GenerateOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("max_tokens", c_int32), ("temperature", c_float), ("top_k", c_int32),
                ("top_p", c_float), ("min_p", c_float), ("repetition_penalty", c_float),
                ("presence_penalty", c_float), ("seed", c_uint64), ("stop_ids", POINTER(c_int32)),
                ("n_stop_ids", c_size_t), ("lookup_tokens", c_int32), ("frequency_penalty", c_float)]


class _GenerateStats(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("prompt_tokens", c_size_t), ("reused_tokens", c_size_t),
                ("generated_tokens", c_size_t), ("prefill_seconds", c_double), ("decode_seconds", c_double),
                ("stop_reason", c_int32), ("drafted_tokens", c_size_t), ("accepted_tokens", c_size_t)]


_TokenCallback = ctypes.CFUNCTYPE(c_int, c_int32, c_void_p)
_ChatCallback = ctypes.CFUNCTYPE(c_int, c_int, c_void_p, c_size_t, c_void_p)  # text is not NUL-terminated
_EndCallback = ctypes.CFUNCTYPE(None, c_int, c_char_p, POINTER(_GenerateStats), c_void_p)

_S, _P = c_int, c_void_p  # m3_status; an opaque handle or a buffer
for _name, _restype, _argtypes in [
    ("m3_last_error", c_char_p, []),
    ("m3_simd_target", c_char_p, []),
    ("m3_engine_options_init", None, [POINTER(_EngineOptions)]),
    ("m3_engine_open", _S, [c_char_p, POINTER(_EngineOptions), POINTER(c_void_p)]),
    ("m3_engine_free", None, [_P]),
    ("m3_engine_vocab_size", c_int32, [_P]),
    ("m3_session_new", _S, [_P, POINTER(c_void_p)]),
    ("m3_session_free", None, [_P]),
    ("m3_session_eval", _S, [_P, _P, c_size_t, _P]),
    ("m3_decode_batch", _S, [POINTER(c_void_p), _P, c_size_t, _P]),
    ("m3_session_score", _S, [_P, _P, c_size_t, _P, _P]),
    ("m3_session_position", c_size_t, [_P]),
    ("m3_session_rewind", _S, [_P, c_size_t]),
    ("m3_generate_options_init", None, [POINTER(_GenerateOptions)]),
    ("m3_session_generate", _S, [_P, _P, c_size_t, POINTER(_GenerateOptions), _TokenCallback, _P,
                                 POINTER(_GenerateStats)]),
    ("m3_tokenizer_open", _S, [c_char_p, POINTER(c_void_p)]),
    ("m3_tokenizer_free", None, [_P]),
    ("m3_tokenizer_vocab_size", c_size_t, [_P]),
    ("m3_tokenizer_token_id", c_int32, [_P, c_char_p]),
    ("m3_tokenize", _S, [_P, c_char_p, c_size_t, _P, c_size_t, POINTER(c_size_t)]),
    ("m3_detokenize", _S, [_P, _P, c_size_t, c_int, _P, c_size_t, POINTER(c_size_t)]),
    ("m3_chat_render", _S, [_P, c_char_p, _P, c_size_t, POINTER(c_size_t)]),
    ("m3_session_chat", _S, [_P, _P, c_char_p, POINTER(_GenerateOptions), _ChatCallback, _P, POINTER(c_char_p),
                             POINTER(_GenerateStats)]),
    ("m3_scheduler_new", _S, [_P, _P, c_size_t, POINTER(c_void_p)]),
    ("m3_scheduler_free", None, [_P]),
    ("m3_scheduler_submit", _S, [_P, c_char_p, POINTER(_GenerateOptions), _ChatCallback, _EndCallback, _P]),
    ("m3_scheduler_run", _S, [_P]),
]:
    getattr(_lib, _name).restype = _restype
    getattr(_lib, _name).argtypes = _argtypes


def _check_layout() -> None:
    # The init functions write sizeof() of the C structs: a mismatch means m3.h changed under this module.
    for struct, init in [(_EngineOptions, _lib.m3_engine_options_init),
                         (_GenerateOptions, _lib.m3_generate_options_init)]:
        value = struct()
        init(byref(value))
        if value.struct_size != ctypes.sizeof(struct):
            raise ImportError(f"m3: {library_path} has a {struct.__name__} of {value.struct_size} bytes, this module "
                              f"{ctypes.sizeof(struct)}: the library and the module are of different versions")


_check_layout()


def simd_target() -> str:
    """The kernels this CPU runs by default, in words (e.g. "auto: q8/q4 avx2, bf16 avx2, fp32 AVX2")."""
    return _lib.m3_simd_target().decode()


# --- Errors ---------------------------------------------------------------------------------------------------

class Error(Exception):
    """A failed C call: ``status`` is its m3_status code, ``message`` the library's message."""
    status = 0

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


def _error_class(name: str, status: int, doc: str) -> type:
    return type(name, (Error,), {"status": status, "__doc__": doc, "__module__": __name__})


# One class per m3_status code of m3.h.
InvalidArgument = _error_class("InvalidArgument", 1, "A bad argument, option or request (M3_ERR_INVALID_ARGUMENT).")
NotFound = _error_class("NotFound", 2, "A missing model folder, file or template (M3_ERR_NOT_FOUND).")
IoError = _error_class("IoError", 3, "A file could not be read (M3_ERR_IO).")
Corrupt = _error_class("Corrupt", 4, "A damaged file, or NaN/inf in a forward pass (M3_ERR_CORRUPT).")
Unsupported = _error_class("Unsupported", 5, "Not supported by this model or build (M3_ERR_UNSUPPORTED).")
OutOfRange = _error_class("OutOfRange", 6, "A value or context past its limit (M3_ERR_OUT_OF_RANGE).")
OutOfMemory = _error_class("OutOfMemory", 7, "The caches would not fit in memory (M3_ERR_OUT_OF_MEMORY).")
Internal = _error_class("Internal", 8, "A bug in m3 (M3_ERR_INTERNAL).")
Unavailable = _error_class("Unavailable", 9, "Transient: the same call may succeed later (M3_ERR_UNAVAILABLE).")

_ERRORS = {cls.status: cls for cls in Error.__subclasses__()}
_OUT_OF_RANGE = OutOfRange.status


def _error(status: int, message: str) -> Error:
    return _ERRORS.get(status, Error)(message, status)


def _check(status: int) -> None:
    """Raises the error of a failed call; to be called right after it, on its thread (m3_last_error)."""
    if status != 0:
        raise _error(status, _lib.m3_last_error().decode("utf-8", "replace"))


# --- Argument checks ------------------------------------------------------------------------------------------

_INT32 = (-2**31, 2**31 - 1)


def _int(name: str, value: Any, lo: Optional[int] = None, hi: int = _INT32[1]) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    value = int(value)
    if (lo is not None and value < lo) or value > hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], not {value}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    return float(value)


def _choice(name: str, value: Any, choices: dict) -> int:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")
    return choices[value]


def _ids(ids: Any, name: str = "ids") -> np.ndarray:
    """Token ids (a sequence or a 1-D integer array) as a contiguous int32 array."""
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, (np.ndarray, Iterable)):
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer array, not {type(ids).__name__}")
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(list(ids))
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, not of shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold ints, not {arr.dtype} values")
    if int(arr.min()) < _INT32[0] or int(arr.max()) > _INT32[1]:
        raise ValueError(f"{name} must be int32 values")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _buffer(arr: Optional[np.ndarray]) -> Optional[int]:
    return None if arr is None or arr.size == 0 else arr.ctypes.data


# Sampling keywords: how each is checked, and its field of m3_generate_options.
_SAMPLING: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": lambda n, v: _int(n, v, 0),
    "temperature": _float, "top_k": lambda n, v: _int(n, v, 0), "top_p": _float, "min_p": _float,
    "repetition_penalty": _float, "presence_penalty": _float, "frequency_penalty": _float,
    "seed": lambda n, v: _int(n, v, 0, 2**64 - 1),
    "stop_ids": lambda n, v: _ids(v, n),
    "lookup_tokens": lambda n, v: _int(n, v, 0),
}


class _Options:
    """An m3_generate_options with only the given fields set, and the stop_ids array it points to."""

    def __init__(self, sampling: dict):
        self.struct = _GenerateOptions()
        _lib.m3_generate_options_init(byref(self.struct))
        self.stop_ids = None
        for key, value in sampling.items():
            if value is None:
                continue
            value = _SAMPLING[key](key, value)
            if key == "stop_ids":
                self.stop_ids = value  # kept alive with the struct, which points into it
                self.struct.stop_ids = value.ctypes.data_as(POINTER(c_int32)) if value.size else None
                self.struct.n_stop_ids = value.size
            else:
                setattr(self.struct, key, value)


def _split(kwargs: dict, caller: str, template: bool) -> tuple[dict, dict]:
    """Sampling keywords, and the rest (template options where the caller takes them)."""
    sampling = {k: v for k, v in kwargs.items() if k in _SAMPLING}
    rest = {k: v for k, v in kwargs.items() if k not in _SAMPLING}
    if rest and not template:
        raise TypeError(f"{caller}() got an unexpected keyword argument {next(iter(rest))!r}")
    return sampling, rest


def _request(request: Any, tools: Any = None, stop: Any = None, options: Optional[dict] = None) -> bytes:
    """A chat request's JSON: messages (a list) or a request dict ({"messages"...} or {"prompt"...}), with
    tools, stop strings and template options merged in."""
    if isinstance(request, dict):
        req = dict(request)
    elif isinstance(request, (list, tuple)):
        req = {"messages": list(request)}
    else:
        raise TypeError(f"a chat request is a list of messages or a dict, not {type(request).__name__}")
    if tools is not None:
        if "tools" in req:
            raise ValueError("tools are given twice: in the request and as an argument")
        req["tools"] = list(tools)
    if stop is not None:
        if not isinstance(stop, str) and not (isinstance(stop, (list, tuple)) and
                                              all(isinstance(s, str) for s in stop)):
            raise TypeError("stop must be a string or a list of strings")
        req["stop"] = stop if isinstance(stop, str) else list(stop)
    if options:
        if "prompt" in req:
            raise ValueError(f"template options ({', '.join(options)}) do not apply to a plain prompt")
        req["options"] = {**req.get("options", {}), **options}
    return json.dumps(req, ensure_ascii=False).encode("utf-8")


def _text_out(call: Callable, capacity: int) -> str:
    """m3.h's variable-size text: a first call with `capacity` bytes (0: NULL, asking for the size), a second
    at the full length when the first did not fit."""
    length = c_size_t()
    buf = ctypes.create_string_buffer(capacity) if capacity else None
    status = call(buf, capacity, byref(length))
    if status == _OUT_OF_RANGE:
        buf = ctypes.create_string_buffer(length.value + 1)
        status = call(buf, length.value + 1, byref(length))
    _check(status)
    return buf.raw[:length.value].decode("utf-8", "replace") if buf is not None else ""


# --- Handles --------------------------------------------------------------------------------------------------

class _Handle:
    """A C handle, freed once closed and no longer used: by a call running on it, or by a handle made from it
    (its children), which count as users of it until they are freed. This keeps frees in order whatever
    order the garbage collector finalizes objects in, and never frees a handle under a running call."""
    _ptr = None  # for __del__ after a failed __init__

    def _init_handle(self, ptr: int, free: Callable, parents: tuple = ()) -> None:
        self._mutex = threading.Lock()
        self._users = 0
        self._closed = False
        self._free = free
        self._parents = parents  # acquired by the caller before it made ptr
        self._ptr = ptr

    def _acquire(self) -> int:
        with self._mutex:
            if self._closed:
                raise ValueError(f"this m3.{type(self).__name__} is closed")
            self._users += 1
            return self._ptr

    def _release(self) -> None:
        with self._mutex:
            self._users -= 1
            ptr = self._take_if_done()
        self._destroy(ptr)

    def _take_if_done(self) -> Optional[int]:
        if self._closed and self._users == 0 and self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            return ptr
        return None

    def _destroy(self, ptr: Optional[int]) -> None:
        if ptr is not None:
            self._free(ptr)
            for parent in self._parents:
                parent._release()

    @contextlib.contextmanager
    def _use(self):
        ptr = self._acquire()
        try:
            yield ptr
        finally:
            self._release()

    @property
    def closed(self) -> bool:
        return self._ptr is None or self._closed

    def close(self) -> None:
        """Frees the handle (now, or when the last call running on it or handle made from it ends)."""
        if self._ptr is None:
            return
        with self._mutex:
            self._closed = True
            ptr = self._take_if_done()
        self._destroy(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if self._ptr is not None:
            self.close()


def _open(parents: tuple, make: Callable[[Any], int]) -> int:
    """Makes a handle from its parents (held as users of them from then on); `make(out)` is the C call."""
    acquired = []
    try:
        for parent in parents:
            parent._acquire()
            acquired.append(parent)
        out = c_void_p()
        _check(make(out))
        return out.value
    except BaseException:
        for parent in acquired:
            parent._release()
        raise


_NUMA = {"off": 0, "distribute": 1, "split": 2}
_CACHE = {"f32": 0, "bf16": 1, "int8": 2}
_GPU = {"none": 0, "dense": 1}


class Engine(_Handle):
    """A loaded model (a HuggingFace MiniMax-M3 checkpoint folder, or one made by ``m3 pack``).

    threads: 0 for every core the process may use. numa: "off", "distribute" or "split". mlock_dense: lock
    all weights but the routed experts in memory. kv_cache, index_cache: "f32" (exact), "bf16" or "int8",
    the storage of its sessions' caches. gpu: "none" or "dense" (a build with CUDA), on GPU gpu_device.
    """

    def __init__(self, model_dir: str | os.PathLike, threads: int = 0, numa: str = "off", mlock_dense: bool = False,
                 kv_cache: str = "f32", index_cache: str = "f32", gpu: str = "none", gpu_device: int = 0):
        self.model_dir = os.fspath(model_dir)
        if not isinstance(self.model_dir, str):
            raise TypeError("model_dir must be a str or os.PathLike of a str")
        options = _EngineOptions()
        _lib.m3_engine_options_init(byref(options))
        options.threads = _int("threads", threads, 0)
        options.numa_mode = _choice("numa", numa, _NUMA)
        options.mlock_dense = bool(mlock_dense)
        options.kv_cache = _choice("kv_cache", kv_cache, _CACHE)
        options.index_cache = _choice("index_cache", index_cache, _CACHE)
        options.gpu_mode = _choice("gpu", gpu, _GPU)
        options.gpu_device = _int("gpu_device", gpu_device, 0)
        path = os.fsencode(self.model_dir)
        ptr = _open((), lambda out: _lib.m3_engine_open(path, byref(options), byref(out)))
        self._lock = threading.Lock()
        self._owner: Optional[int] = None  # the thread holding _lock
        self._init_handle(ptr, _lib.m3_engine_free)
        self.vocab_size: int = _lib.m3_engine_vocab_size(ptr)

    def _refuse_reentry(self) -> None:
        if self._owner == threading.get_ident():
            raise RuntimeError("m3: a call into an engine from a callback of a call running on it (it would "
                               "deadlock); make it after Scheduler.run returns")

    @contextlib.contextmanager
    def _locked(self):
        """Holds the engine's compute lock (see the module's notes on thread safety)."""
        self._refuse_reentry()
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def session(self, tokenizer: Optional[Tokenizer] = None) -> Session:
        """A new Session of this engine (``Session(self, tokenizer)``)."""
        return Session(self, tokenizer)

    def __repr__(self) -> str:
        return f"<m3.Engine {self.model_dir!r} vocab_size={self.vocab_size}{' closed' if self.closed else ''}>"


class Tokenizer(_Handle):
    """The tokenizer (tokenizer.json) and chat template of a folder. Immutable: threads may share one."""

    def __init__(self, dir: str | os.PathLike):
        self.dir = os.fspath(dir)
        path = os.fsencode(self.dir)
        self._init_handle(_open((), lambda out: _lib.m3_tokenizer_open(path, byref(out))), _lib.m3_tokenizer_free)
        self.vocab_size: int = _lib.m3_tokenizer_vocab_size(self._ptr)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`; special-token strings become their ids, as HuggingFace does."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        data = text.encode("utf-8")
        capacity = 3 * len(data) + 16  # always enough (m3.h)
        ids = np.empty(capacity, np.int32)
        n = c_size_t()
        with self._use() as ptr:
            _check(_lib.m3_tokenize(ptr, data, len(data), ids.ctypes.data, capacity, byref(n)))
        return ids[:n.value].tolist()

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (bytes that do not form UTF-8 become U+FFFD)."""
        arr = _ids(ids)
        with self._use() as ptr:
            return _text_out(lambda buf, cap, length: _lib.m3_detokenize(
                ptr, _buffer(arr), arr.size, int(bool(skip_special_tokens)), buf, cap, length), 0)

    def token_id(self, token: str) -> Optional[int]:
        """The id of a token given as its string (e.g. "]~b]" or "<mm:think>"), or None."""
        if not isinstance(token, str):
            raise TypeError(f"token must be a str, not {type(token).__name__}")
        with self._use() as ptr:
            found = _lib.m3_tokenizer_token_id(ptr, token.encode("utf-8"))
        return None if found < 0 else found

    def render_chat(self, messages: Any, tools: Optional[list] = None, **template_options: Any) -> str:
        """The chat template applied to a conversation, as HuggingFace's apply_chat_template does.

        messages: a list of OpenAI-style messages (tool-call arguments as objects), or a request dict
        {"messages", "tools"?, "options"?}; template_options are template variables such as
        add_generation_prompt=True or thinking_mode="enabled".
        """
        req = _request(messages, tools, None, template_options)
        with self._use() as ptr:
            return _text_out(lambda buf, cap, length: _lib.m3_chat_render(ptr, req, buf, cap, length),
                             2 * len(req) + 4096)

    def __repr__(self) -> str:
        return f"<m3.Tokenizer {self.dir!r} vocab_size={self.vocab_size}{' closed' if self.closed else ''}>"


# --- Results --------------------------------------------------------------------------------------------------

class Part(NamedTuple):
    """A piece of a chat turn: kind is "reasoning", "content" or "tool_call" (one whole call as JSON)."""
    kind: str
    text: str


_PART_KINDS = {0: "reasoning", 1: "content", 2: "tool_call"}
_STOP_REASONS = {0: "stop", 1: "length", 2: "context", 3: "caller"}


@dataclasses.dataclass(frozen=True)
class Stats:
    """m3_generate_stats. stop_reason: "stop" (a stop id or string), "length" (max_tokens), "context" (the
    context is full) or "caller" (the consumer stopped it)."""
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str
    drafted_tokens: int
    accepted_tokens: int


def _new_stats() -> _GenerateStats:
    stats = _GenerateStats()
    stats.struct_size = ctypes.sizeof(_GenerateStats)
    return stats


def _stats(st: _GenerateStats) -> Stats:
    return Stats(st.prompt_tokens, st.reused_tokens, st.generated_tokens, st.prefill_seconds, st.decode_seconds,
                 _STOP_REASONS.get(st.stop_reason, str(st.stop_reason)), st.drafted_tokens, st.accepted_tokens)


def _text(text: Optional[int], length: int) -> str:
    return ctypes.string_at(text, length).decode("utf-8", "replace") if length else ""


# What the C callbacks' user_data keys stand for (a stream's state, or a scheduler request). The callbacks are
# module-level, so ctypes keeps them alive for good; dict operations are atomic under the GIL.
_registry: dict[int, Any] = {}
_keys = itertools.count(1)


# --- Streams --------------------------------------------------------------------------------------------------

class _StreamState:
    """What a stream's worker and its iterator share (the iterator is not referenced by the worker, so that
    dropping it finalizes it and stops the generation)."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = False
        self.stats: Optional[Stats] = None
        self.message: Optional[dict] = None


class _End:
    def __init__(self, error: Optional[BaseException] = None):
        self.error = error


def _put(key: int, make: Callable[[], Any]) -> int:
    """Queues an item for a stream's consumer; nonzero (stop) once the consumer has gone."""
    try:
        state = _registry[key]
        state.queue.put(make())
        return 1 if state.stop else 0
    except BaseException:  # nothing may unwind into C; stop instead
        return 1


_on_token = _TokenCallback(lambda token_id, key: _put(key, lambda: token_id))
_on_stream_part = _ChatCallback(lambda kind, text, length, key: _put(
    key, lambda: Part(_PART_KINDS.get(kind, str(kind)), _text(text, length))))


def _run_stream(state: _StreamState, call: Callable[[int, _StreamState], None]) -> None:
    key = next(_keys)
    _registry[key] = state
    try:
        call(key, state)
        state.queue.put(_End())
    except BaseException as exc:  # re-raised by the consumer
        state.queue.put(_End(exc))
    finally:
        _registry.pop(key, None)


class _Stream:
    """An iterator over what a C call streams from a worker thread; started by the first ``next()``.

    Breaking out of a ``for`` loop over it (when nothing else holds it), ``close()``, or leaving a ``with``
    block stops the C call at its next item. The call's error, if any, is raised by ``next()``.
    """

    def __init__(self, engine: Engine, call: Callable[[int, _StreamState], None]):
        self._engine = engine
        self._state = _StreamState()
        self._call: Optional[Callable[[int, _StreamState], None]] = call  # call(key, state): the C call
        self._thread: Optional[threading.Thread] = None
        self._done = False
        self.stats: Optional[Stats] = None  # set once the stream has ended

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._engine._refuse_reentry()  # the worker would wait for this thread, which would wait for it
            # Not a daemon: the interpreter waits for the C call at exit instead of finalizing under it.
            self._thread = threading.Thread(target=_run_stream, args=(self._state, self._call), name="m3-stream")
            self._call = None
            self._thread.start()
        item = self._state.queue.get()
        if isinstance(item, _End):
            self._finish()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def _finish(self) -> None:
        self._done = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.stats = self._state.stats

    def close(self) -> None:
        """Stops the C call at its next item and waits for it to end (its error, if any, is dropped)."""
        if self._done:
            return
        self._state.stop = True
        if self._thread is None:
            self._done = True
            return
        while not isinstance(self._state.queue.get(), _End):
            pass
        self._finish()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        state = getattr(self, "_state", None)
        if state is not None:
            state.stop = True  # no join: this may run on any thread, the worker's included


class TokenStream(_Stream):
    """The sampled ids of ``Session.generate`` (a stop id not included); ``stats`` once it has ended."""


class ChatStream(_Stream):
    """The Parts of a chat turn; once it has ended, ``message`` is the assistant message (a dict to append
    to the conversation: role, content, reasoning_content?, tool_calls?) and ``stats`` its Stats."""

    message: Optional[dict] = None

    def _finish(self) -> None:
        super()._finish()
        self.message = self._state.message

    def result(self) -> dict:
        """Reads the rest of the turn and returns the assistant message."""
        for _ in self:
            pass
        return self.message


# --- Sessions -------------------------------------------------------------------------------------------------

class Session(_Handle):
    """A sequence over an engine: its caches and position. tokenizer: the one ``chat`` and ``complete`` use
    unless given theirs."""

    def __init__(self, engine: Engine, tokenizer: Optional[Tokenizer] = None):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an m3.Engine, not {type(engine).__name__}")
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be an m3.Tokenizer, not {type(tokenizer).__name__}")
        ptr = _open((engine,), lambda out: _lib.m3_session_new(engine._ptr, byref(out)))
        self._init_handle(ptr, _lib.m3_session_free, (engine,))
        self.engine = engine
        self.tokenizer = tokenizer

    @contextlib.contextmanager
    def _compute(self):
        with self._use() as ptr, self.engine._locked():
            yield ptr

    @property
    def position(self) -> int:
        """How many tokens the session holds."""
        with self._compute() as ptr:
            return _lib.m3_session_position(ptr)

    def eval(self, ids: Iterable[int], logits: bool = True) -> Optional[np.ndarray]:
        """Appends `ids`; returns the last token's logits (float32 [vocab_size]) if `logits`, else None.
        On an error the session is as it was."""
        arr = _ids(ids)
        out = np.empty(self.engine.vocab_size, np.float32) if logits else None
        with self._compute() as ptr:
            _check(_lib.m3_session_eval(ptr, _buffer(arr), arr.size, _buffer(out)))
        return out

    def score(self, ids: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """Appends ids[:-1] and returns (log_probs, is_top1), each [len(ids) - 1]: log_probs[i] is
        log P(ids[i + 1] | the session's earlier tokens, ids[:i + 1]) in nats (float64), is_top1[i] whether
        ids[i + 1] is the most likely token (bool). For a continuation x after a context c: eval(c[:-1]), then
        score(c[-1:] + x)."""
        arr = _ids(ids)
        n = max(arr.size - 1, 0)
        log_probs = np.empty(n, np.float64)
        top1 = np.empty(n, np.int32)
        with self._compute() as ptr:
            _check(_lib.m3_session_score(ptr, _buffer(arr), arr.size, _buffer(log_probs), _buffer(top1)))
        return log_probs, top1.astype(bool)

    def rewind(self, position: int) -> None:
        """Forgets every position >= `position`."""
        position = _int("position", position, 0, 2**63 - 1)
        with self._compute() as ptr:
            _check(_lib.m3_session_rewind(ptr, position))

    def generate(self, prompt_ids: Iterable[int], **sampling: Any) -> TokenStream:
        """Samples a continuation of `prompt_ids`, the whole sequence so far (the session keeps the longest
        prefix it holds and evaluates the rest). Returns a TokenStream of the sampled ids; takes the
        sampling keywords of the module's notes. The session ends holding the prompt and the evaluated ids."""
        sampling, _ = _split(sampling, "generate", template=False)
        prompt = _ids(prompt_ids, "prompt_ids")
        if prompt.size == 0:
            raise ValueError("prompt_ids is empty")
        options = _Options(sampling)

        def call(key: int, state: _StreamState) -> None:
            stats = _new_stats()
            with self._compute() as ptr:
                _check(_lib.m3_session_generate(ptr, _buffer(prompt), prompt.size, byref(options.struct), _on_token,
                                                key, byref(stats)))
            state.stats = _stats(stats)

        return TokenStream(self.engine, call)

    def chat(self, request: Any, tools: Optional[list] = None, *, stop: Any = None,
             tokenizer: Optional[Tokenizer] = None, **kwargs: Any) -> ChatStream:
        """One assistant turn, streamed as Parts (a ChatStream; its ``message`` and ``stats`` once ended).

        request: a list of OpenAI-style messages, or a request dict ({"messages", "tools"?, "options"?} or
        {"prompt": text}). The conversation is the whole one: the session reuses the prefix it holds from the
        previous turn. stop: a string or strings that end the turn (cut before). kwargs: the sampling keywords
        of the module's notes, and template options (e.g. thinking_mode="enabled"). The tokenizer's
        end-of-turn ids are added to stop_ids.
        """
        sampling, template = _split(kwargs, "chat", template=True)
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError("chat needs a tokenizer: Session(engine, tokenizer) or chat(..., tokenizer=...)")
        req = _request(request, tools, stop, template)
        options = _Options(sampling)

        def call(key: int, state: _StreamState) -> None:
            stats, message = _new_stats(), c_char_p()
            with tokenizer._use() as tok, self._compute() as ptr:
                _check(_lib.m3_session_chat(ptr, tok, req, byref(options.struct), _on_stream_part, key,
                                            byref(message), byref(stats)))
                text = message.value  # owned by the session until its next chat: copied under the lock
            state.message = json.loads(text)
            state.stats = _stats(stats)

        return ChatStream(self.engine, call)

    def complete(self, text: str, *, stop: Any = None, tokenizer: Optional[Tokenizer] = None,
                 **sampling: Any) -> ChatStream:
        """A plain completion of `text` ({"prompt": text}), streamed as content Parts (a ChatStream)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        _split(sampling, "complete", template=False)
        return self.chat({"prompt": text}, stop=stop, tokenizer=tokenizer, **sampling)

    def __repr__(self) -> str:
        return f"<m3.Session of {self.engine!r}{' closed' if self.closed else ''}>"


def decode_batch(sessions: Iterable[Session], ids: Iterable[int], logits: bool = True) -> Optional[np.ndarray]:
    """One decode step of several sessions of one engine in a single forward pass: ids[i] is appended to
    sessions[i]. Returns the logits, float32 [len(sessions), vocab_size] (each row equal to that session's own
    ``eval``), or None without `logits`. On an error no session changes."""
    sessions = list(sessions)
    for s in sessions:
        if not isinstance(s, Session):
            raise TypeError(f"sessions must be m3.Session objects, not {type(s).__name__}")
    arr = _ids(ids)
    if not sessions or arr.size != len(sessions):
        raise ValueError(f"decode_batch needs one id per session and at least one: {len(sessions)} sessions, "
                         f"{arr.size} ids")
    engine = sessions[0].engine
    if any(s.engine is not engine for s in sessions):
        raise ValueError("decode_batch: the sessions must be of one engine")
    out = np.empty((len(sessions), engine.vocab_size), np.float32) if logits else None
    with contextlib.ExitStack() as stack:
        ptrs = (c_void_p * len(sessions))(*[stack.enter_context(s._use()) for s in sessions])
        stack.enter_context(engine._locked())
        _check(_lib.m3_decode_batch(ptrs, _buffer(arr), arr.size, _buffer(out)))
    return out


# --- Scheduler ------------------------------------------------------------------------------------------------

class Request:
    """A request queued on a Scheduler: ``parts`` as they arrive, then ``done``, with ``message`` (the assistant
    message dict), ``stats``, and ``error``: an m3.Error if it failed, or what its on_part callback raised."""

    def __init__(self, on_part: Optional[Callable[[Part], Any]]):
        self.parts: list[Part] = []
        self.message: Optional[dict] = None
        self.error: Optional[Error] = None
        self.stats: Optional[Stats] = None
        self.done = False
        self._on_part = on_part
        self._cancelled = False
        self._errors: list[BaseException] = []  # the scheduler's, for exceptions raised in callbacks

    def cancel(self) -> None:
        """Stops the request at its next part (it then ends with stop_reason "caller")."""
        self._cancelled = True

    def __repr__(self) -> str:
        state = "error" if self.error else "done" if self.done else "pending"
        return f"<m3.Request {state}, {len(self.parts)} parts>"


@_ChatCallback
def _on_request_part(kind: int, text: Optional[int], length: int, key: int) -> int:
    request = _registry.get(key)
    if request is None:
        return 1
    try:
        part = Part(_PART_KINDS.get(kind, str(kind)), _text(text, length))
        request.parts.append(part)
        if request._on_part is not None and request._on_part(part) is False:
            return 1
        return 1 if request._cancelled else 0
    except BaseException as exc:  # raised by Scheduler.run
        request.error = request.error or exc
        request._errors.append(exc)
        return 1


@_EndCallback
def _on_request_end(status: int, text: Optional[bytes], stats, key: int) -> None:
    request = _registry.pop(key, None)
    if request is None:
        return
    try:
        message = (text or b"").decode("utf-8", "replace")
        request.stats = _stats(stats.contents) if stats else None
        if status == 0:
            request.message = json.loads(message)
        elif request.error is None:
            request.error = _error(status, message)
    except BaseException as exc:
        request.error = request.error or exc
        request._errors.append(exc)
    finally:
        request.done = True


class Scheduler(_Handle):
    """Continuous batching of chat requests over `slots` sessions of an engine, as ``m3 serve`` runs them:
    ``submit`` queues requests (from any thread), ``run`` steps them all together until every one has ended,
    one forward pass per step for all running ones."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, slots: int):
        if not isinstance(engine, Engine) or not isinstance(tokenizer, Tokenizer):
            raise TypeError("Scheduler(engine, tokenizer, slots) takes an m3.Engine and an m3.Tokenizer")
        slots = _int("slots", slots, 1)
        ptr = _open((engine, tokenizer), lambda out: _lib.m3_scheduler_new(engine._ptr, tokenizer._ptr, slots,
                                                                           byref(out)))
        self._init_handle(ptr, _lib.m3_scheduler_free, (engine, tokenizer))
        self.engine = engine
        self.tokenizer = tokenizer
        self._errors: list[BaseException] = []

    def submit(self, request: Any, tools: Optional[list] = None, *, stop: Any = None,
               on_part: Optional[Callable[[Part], Any]] = None, **kwargs: Any) -> Request:
        """Queues a chat request (as ``Session.chat`` takes it, with its sampling keywords and template
        options); returns its Request. on_part(part) is called on the thread in ``run`` with each Part as it is
        decoded; returning False stops the request, and an exception it raises stops it and comes out of
        ``run``. A malformed request or bad options raise here."""
        sampling, template = _split(kwargs, "submit", template=True)
        req = _request(request, tools, stop, template)
        options = _Options(sampling)  # read by the C call: not needed after it
        handle = Request(on_part)
        handle._errors = self._errors
        key = next(_keys)
        _registry[key] = handle
        try:
            with self._use() as ptr:
                _check(_lib.m3_scheduler_submit(ptr, req, byref(options.struct), _on_request_part, _on_request_end,
                                                key))
        except BaseException:
            _registry.pop(key, None)  # no callback comes for a refused request
            raise
        return handle

    def run(self) -> None:
        """Runs steps on this thread until every queued request has ended; then raises the first exception a
        callback raised, if any. Holds the engine's lock throughout."""
        with self._use() as ptr, self.engine._locked():
            _check(_lib.m3_scheduler_run(ptr))
        if self._errors:
            error = self._errors[0]
            self._errors.clear()
            raise error

    def chat_many(self, requests: Iterable[Any], **kwargs: Any) -> list[dict]:
        """Submits every request (with the same keywords), runs them, and returns their assistant messages
        in order; raises the first request's error if any failed."""
        handles = [self.submit(r, **kwargs) for r in requests]
        self.run()
        for h in handles:
            if h.error is not None:
                raise h.error
        return [h.message for h in handles]

    def __repr__(self) -> str:
        return f"<m3.Scheduler of {self.engine!r}{' closed' if self.closed else ''}>"
