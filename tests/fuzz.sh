#!/usr/bin/env bash
# Fuzzing of every parser of untrusted input (tests/fuzz/README.md): builds the libFuzzer targets
# with clang, ASan and UBSan in build-fuzz/, seeds each from the repository's own test data,
# replays every saved regression input, then fuzzes each target for SECONDS.
#
#   tests/fuzz.sh [SECONDS]   default 20 a target (CI's smoke run: 10 s each, as many at once as cores)
#   M3_FUZZ_ONLY="gguf npy" tests/fuzz.sh 300   builds and runs only those targets
#
# A crash, leak, UB report or timeout fails the run; its input is copied to
# tests/fuzz/regressions/<target>/ to be committed with the fix. Exit 0 when every target ran clean.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SECONDS_EACH=${1:-20}
BUILD=${M3_FUZZ_BUILD:-$ROOT/build-fuzz}
TARGETS=(json request config safetensors npy pack tokenizer jinja output_parser grammar gguf gguf_model)
if [ -n "${M3_FUZZ_ONLY:-}" ]; then
  read -r -a TARGETS <<<"$M3_FUZZ_ONLY"
fi

if ! command -v clang++ >/dev/null; then
  echo "tests/fuzz.sh: clang++ is missing (scripts/install-deps.sh installs clang and libFuzzer)" >&2
  exit 2
fi
set -e
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DM3_FUZZ=ON -DM3_CUDA=OFF \
  -DM3_BUILD_TESTS=ON -DM3_BUILD_BENCH=OFF >/dev/null
cmake --build "$BUILD" --target $(printf 'fuzz_%s ' "${TARGETS[@]}")
set +e

# Seed corpora, made afresh from the repository's data.
CORPUS=$BUILD/corpus
rm -rf "$CORPUS" && mkdir -p "$CORPUS"
python3 - "$ROOT" "$CORPUS" <<'EOF' || { echo "tests/fuzz.sh: could not make the seed corpora" >&2; exit 2; }
import glob, json, os, struct, sys
root, out = sys.argv[1], sys.argv[2]
tok = os.path.join(root, "tests/data/tokenizer/minimax-m3")
golden = sorted(d for d in glob.glob(os.path.join(root, "tests/data/golden/*")) if os.path.isdir(d))

def put(target, name, data):
    os.makedirs(os.path.join(out, target), exist_ok=True)
    with open(os.path.join(out, target, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))

chats = [json.loads(l) for l in open(os.path.join(tok, "chat_golden.jsonl"), encoding="utf-8") if l.strip()]
texts = [json.loads(l)["text"] for l in open(os.path.join(tok, "golden.jsonl"), encoding="utf-8") if l.strip()]
template = open(os.path.join(tok, "chat_template.jinja"), encoding="utf-8").read()
for i, c in enumerate(chats[:40]):
    body = {"messages": c["messages"], "max_tokens": 16, "temperature": 0.5}
    if c.get("tools"):
        body["tools"] = c["tools"]
    put("request", f"chat{i}", json.dumps(body))
    put("json", f"chat{i}", json.dumps(c))
    data = {"messages": c["messages"], "tools": c.get("tools") or [], "add_generation_prompt": True}
    put("jinja", f"chat{i}", template + "\0" + json.dumps(data))
put("request", "completion", json.dumps({"prompt": ["a", "b"], "max_tokens": 4, "stop": ["x"], "logprobs": 2}))
for i, t in enumerate(texts[:60]):
    put("tokenizer", f"text{i}", t)
for d in golden:
    name = os.path.basename(d)
    put("config", name, open(os.path.join(d, "config.json"), "rb").read())
    put("json", "config_" + name, open(os.path.join(d, "config.json"), "rb").read())
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors")))[:1]:
        raw = open(f, "rb").read(1 << 20)
        (hlen,) = struct.unpack("<Q", raw[:8])
        put("safetensors", name, raw[: 8 + hlen + 256])  # the header and the start of the data
    for f in sorted(glob.glob(os.path.join(d, "*.npy"))):
        put("npy", name + "_" + os.path.basename(f), open(f, "rb").read(512))
ns = "]<]minimax[>["
call = (ns + "<tool_call>\n" + ns + '<invoke name="get_weather">' + ns + "<city>Oslo" + ns + "</city>" + ns
        + "<days>3" + ns + "</days>" + ns + "</invoke>\n" + ns + "</tool_call>")
for i, s in enumerate(["plain answer", "<mm:think>reasoning</mm:think>answer", "reasoning</mm:think>" + call,
                       "text " + call + " more", call + call]):
    put("output_parser", f"seed{i}", bytes([i]) + s.encode("utf-8"))
# Grammars: byte 0 picks GBNF (0), a JSON schema (1) or a tool list (2).
for i, g in enumerate(['root ::= "a" b* | [x-z]{2,3}\nb ::= "b" # c', 'root ::= ("x" | [^a-c\\n]+)? <[267]>',
                       'root ::= item*\nitem ::= "(" root ")"']):
    put("grammar", f"gbnf{i}", b"\x00" + g.encode("utf-8"))
for i, c in enumerate(chats[:20]):
    for j, tool in enumerate(c.get("tools") or []):
        fn = tool.get("function", tool)
        put("grammar", f"schema{i}_{j}", b"\x01" + json.dumps(fn.get("parameters", {})).encode("utf-8"))
        put("grammar", f"tools{i}_{j}", b"\x02" + json.dumps([{"name": fn.get("name", "f"), "parameters": fn.get("parameters")}]).encode("utf-8"))
put("grammar", "schema_formats", b"\x01" + json.dumps({"type": "object", "properties": {"d": {"format": "date-time"},
    "p": {"pattern": "^[A-Z]{2}-\\d+$"}, "n": {"type": "number", "minimum": -3, "maximum": 9}}}).encode("utf-8"))

# GGUF (format/gguf.h): small files with metadata of every value type and tensors of the types we
# decode (and one we only list), and ggml's own file (tests/data/gguf).
def gguf_string(x):
    b = x.encode("utf-8") if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b

def gguf(kvs, tensors, alignment=32, version=3):
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, vtype, payload in kvs:
        out += gguf_string(key) + struct.pack("<I", vtype) + payload
    offsets, at = [], 0
    for _, _, _, data in tensors:
        offsets.append(at)
        at += len(data) + (-len(data) % alignment)
    for (name, ttype, ne, _), off in zip(tensors, offsets):
        out += gguf_string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", d) for d in ne)
        out += struct.pack("<IQ", ttype, off)
    if tensors:
        out += b"\0" * (-len(out) % alignment)
        for _, _, _, data in tensors:
            out += data + b"\0" * (-len(data) % alignment)
    return out

def pattern(n, seed):
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))

def arr(element_type, count, payload):
    return struct.pack("<IQ", element_type, count) + payload

every_type = [("u8", 0, struct.pack("<B", 200)), ("i8", 1, struct.pack("<b", -3)), ("u16", 2, struct.pack("<H", 7)),
              ("i16", 3, struct.pack("<h", -7)), ("u32", 4, struct.pack("<I", 4000000000)), ("i32", 5, struct.pack("<i", -9)),
              ("f32", 6, struct.pack("<f", 0.5)), ("bool", 7, b"\x01"), ("general.architecture", 8, gguf_string("minimax-m3")),
              ("u64", 10, struct.pack("<Q", 1 << 63)), ("i64", 11, struct.pack("<q", -1)), ("f64", 12, struct.pack("<d", 1e300)),
              ("tokenizer.ggml.tokens", 9, arr(8, 3, gguf_string("a") + gguf_string("") + gguf_string("<s>"))),
              ("tokenizer.ggml.token_type", 9, arr(5, 3, struct.pack("<3i", 1, 1, 3))),
              ("tokenizer.ggml.scores", 9, arr(6, 2, struct.pack("<2f", -1.0, 0.0))),
              ("nested", 9, arr(9, 2, arr(4, 1, struct.pack("<I", 5)) + arr(8, 1, gguf_string("x"))))]
# (ggml type id, values per block, bytes per block) of each type we decode, and IQ2_XXS.
blocks = [(0, 1, 4), (1, 1, 2), (30, 1, 2), (8, 32, 34), (2, 32, 18), (3, 32, 20), (6, 32, 22), (7, 32, 24),
          (10, 256, 84), (11, 256, 110), (12, 256, 144), (13, 256, 176), (14, 256, 210), (16, 256, 66)]
tensors = [(f"blk.{i}.weight", tid, [n * 2, 2], pattern(4 * size, i)) for i, (tid, n, size) in enumerate(blocks)]
put("gguf", "every_type", gguf(every_type, tensors))
put("gguf", "v2_aligned64", gguf([("general.alignment", 4, struct.pack("<I", 64))], tensors[:4], alignment=64, version=2))
put("gguf", "split_of_one", gguf([("split.no", 2, struct.pack("<H", 0)), ("split.count", 2, struct.pack("<H", 1)),
                                  ("split.tensors.count", 5, struct.pack("<i", 2))], tensors[8:10]))
put("gguf", "metadata_only", gguf(every_type, []))
put("gguf", "ggml_reference", open(os.path.join(root, "tests/data/gguf/ggml_reference.gguf"), "rb").read())

# A tiny minimax-m3 model as llama.cpp's converter writes one (model/gguf_source.h): a dense block
# and a MoE block with sparse attention, F32 with a Q8_0 and a Q4_0 tensor, and a tokenizer.
def u32(key, v):
    return ("minimax-m3." + key, 4, struct.pack("<I", v))
hp = [("general.architecture", 8, gguf_string("minimax-m3"))] + [u32(k, v) for k, v in [
    ("block_count", 2), ("context_length", 4096), ("embedding_length", 64), ("feed_forward_length", 32),
    ("expert_feed_forward_length", 32), ("attention.head_count", 2), ("attention.head_count_kv", 1),
    ("attention.key_length", 32), ("attention.value_length", 32), ("rope.dimension_count", 16), ("expert_count", 4),
    ("expert_used_count", 2), ("expert_shared_count", 1), ("expert_gating_func", 2), ("leading_dense_block_count", 1),
    ("attention.indexer.head_count", 1), ("attention.indexer.key_length", 32), ("attention.indexer.top_k", 2),
    ("attention.indexer.block_size", 8), ("attention.indexer.local_blocks", 1)]] + [
    ("minimax-m3.rope.freq_base", 6, struct.pack("<f", 5e6)),
    ("minimax-m3.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-6)),
    ("minimax-m3.expert_weights_scale", 6, struct.pack("<f", 2.0)), ("minimax-m3.expert_weights_norm", 7, b"\x01"),
    ("tokenizer.ggml.model", 8, gguf_string("gpt2")), ("tokenizer.ggml.pre", 8, gguf_string("minimax-m2")),
    ("tokenizer.ggml.tokens", 9, arr(8, 16, b"".join(gguf_string(t) for t in
        ["a", "b", "c", "ab", "\u0120", "\u0120a", "<s>", "</s>", "x", "y", "z", "xy", "1", "2", "[PAD14]", "[PAD15]"]))),
    ("tokenizer.ggml.token_type", 9, arr(5, 16, struct.pack("<16i", *([1] * 6 + [3, 3] + [1] * 6 + [5, 5])))),
    ("tokenizer.ggml.merges", 9, arr(8, 3, b"".join(gguf_string(m) for m in ["a b", "\u0120 a", "x y"]))),
    ("tokenizer.ggml.eos_token_id", 4, struct.pack("<I", 7)),
    ("tokenizer.chat_template", 8, gguf_string("{% for m in messages %}{{ m.content }}{% endfor %}"))]
def f32(*ne, seed=0):
    n = 1
    for d in ne:
        n *= d
    return (0, list(ne), struct.pack(f"<{n}f", *[((i * 37 + seed * 11) % 97 - 48) / 97.0 for i in range(n)]))
def ones(n):
    return (0, [n], struct.pack(f"<{n}f", *([1.0] * n)))
def q8_0(cols, rows):
    return (8, [cols, rows], b"".join(struct.pack("<e", 0.01) + pattern(32, r) for r in range(rows * cols // 32)))
def q4_0(*ne):
    n = ne[0] * ne[1] * (ne[2] if len(ne) > 2 else 1)
    return (2, list(ne), b"".join(struct.pack("<e", 0.02) + pattern(16, b) for b in range(n // 32)))
mt = [("token_embd.weight",) + f32(64, 16, seed=1), ("output.weight",) + f32(64, 16, seed=2),
      ("output_norm.weight",) + ones(64)]
for l in range(2):
    b = f"blk.{l}."
    mt += [(b + "attn_norm.weight",) + ones(64), (b + "attn_q.weight",) + q8_0(64, 64),
           (b + "attn_k.weight",) + f32(64, 32, seed=3), (b + "attn_v.weight",) + f32(64, 32, seed=4),
           (b + "attn_output.weight",) + f32(64, 64, seed=5), (b + "attn_q_norm.weight",) + ones(32),
           (b + "attn_k_norm.weight",) + ones(32), (b + "ffn_norm.weight",) + ones(64)]
    if l == 0:
        mt += [(b + "ffn_gate.weight",) + f32(64, 32, seed=6), (b + "ffn_up.weight",) + f32(64, 32, seed=7),
               (b + "ffn_down.weight",) + f32(32, 64, seed=8)]
    else:
        mt += [(b + "ffn_gate_inp.weight",) + f32(64, 4, seed=9), (b + "exp_probs_b.bias",) + f32(4),
               (b + "ffn_gate_exps.weight",) + q4_0(64, 32, 4), (b + "ffn_up_exps.weight",) + f32(64, 32, 4, seed=10),
               (b + "ffn_down_exps.weight",) + f32(32, 64, 4, seed=11), (b + "ffn_gate_shexp.weight",) + f32(64, 32),
               (b + "ffn_up_shexp.weight",) + f32(64, 32, seed=12), (b + "ffn_down_shexp.weight",) + f32(32, 64),
               (b + "indexer.q_proj.weight",) + f32(64, 32, seed=13), (b + "indexer.k_proj.weight",) + f32(64, 32),
               (b + "indexer.q_norm.weight",) + ones(32), (b + "indexer.k_norm.weight",) + ones(32)]
put("gguf_model", "tiny", gguf(hp, mt))
put("gguf_model", "tiny_no_tokenizer", gguf([kv for kv in hp if not kv[0].startswith("tokenizer.")], mt))
EOF
# A packed model (the regular build's m3, when there is one), when the pack target runs.
if [[ " ${TARGETS[*]} " == *" pack "* ]] && [ -x build/bin/m3 ]; then
  rm -rf "$BUILD/packed" && mkdir -p "$CORPUS/pack"
  build/bin/m3 pack -m tests/data/golden/s1_fp32_basic -o "$BUILD/packed" --type q8 >/dev/null 2>&1 &&
    cp "$BUILD/packed/model.m3w" "$CORPUS/pack/s1_q8"
fi

# One target: its saved regressions, then SECONDS_EACH of fuzzing. Its one-line verdict goes to
# fuzz_<t>.result; crash inputs go to a folder of its own, as targets run side by side.
fuzz_one() {
  local t=$1 bin=$BUILD/tests/fuzz/fuzz_$1 regressions=tests/fuzz/regressions/$1 artifacts=$BUILD/artifacts_$1
  local result=$BUILD/fuzz_$1.result
  mkdir -p "$CORPUS/$t"
  rm -rf "$artifacts" && mkdir -p "$artifacts"
  if [ -d "$regressions" ] && [ -n "$(ls -A "$regressions")" ]; then
    if ! "$bin" "$regressions"/* >"$BUILD/fuzz_$t.regressions.log" 2>&1; then
      echo "fuzz_$t: a saved regression input fails again ($BUILD/fuzz_$t.regressions.log)" >"$result"
      return
    fi
  fi
  # The grammar compilers are bounded (docs/CONSTRAIN.md "Limits": 2,000,000 elements, 2 s), so
  # their target runs under tighter limits than the rest: any one allocation past 128 MB, an
  # input past 5 s (ASan's slowdown on top of the 2 s budget) or 1 GB in all is a failure.
  local limits="-timeout=10 -rss_limit_mb=2048"
  [ "$t" = grammar ] && limits="-timeout=5 -rss_limit_mb=1024 -malloc_limit_mb=128"
  # shellcheck disable=SC2086
  "$bin" "$CORPUS/$t" -max_total_time="$SECONDS_EACH" $limits -max_len=1048576 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 >"$BUILD/fuzz_$t.log" 2>&1
  local rc=$? runs cov
  runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$BUILD/fuzz_$t.log" | grep -o '[0-9]*$')
  cov=$(grep -o 'cov: [0-9]*' "$BUILD/fuzz_$t.log" | tail -1 | grep -o '[0-9]*$')
  if [ $rc -ne 0 ]; then
    mkdir -p "$regressions"
    for f in "$artifacts"/*; do
      [ -e "$f" ] && mv "$f" "$regressions/"
    done
    { echo "fuzz_$t: FAILED (rc $rc) after ${runs:-?} runs; input saved in $regressions; log $BUILD/fuzz_$t.log"
      grep -m3 -E 'ERROR|SUMMARY' "$BUILD/fuzz_$t.log"; } >"$result"
  else
    echo "fuzz_$t: ${runs:-?} runs in ${SECONDS_EACH} s, coverage ${cov:-?} edges, clean" >"$result"
  fi
}

# As many targets at once as there are cores.
for t in "${TARGETS[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do wait -n; done
  fuzz_one "$t" &
done
wait
fail=0
for t in "${TARGETS[@]}"; do
  cat "$BUILD/fuzz_$t.result"
  grep -q ', clean$' "$BUILD/fuzz_$t.result" || fail=1
done
exit $fail
