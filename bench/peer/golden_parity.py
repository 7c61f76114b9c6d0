#!/usr/bin/env python3
"""m3 and llama.cpp on the same GGUF: the golden checkpoints that a minimax-m3 GGUF can express
(tests/test_gguf_model.cc writes them the way llama.cpp's converter does, f32), run through
llama.cpp (`llama_peer greedy`) and through m3 (`m3 pack -m FILE.gguf --override '.*=f32'`, then
`m3 logits`), each against the golden data of the case: the greedy ids, and the logits of the
prompt's last row under the golden rule (max |x - golden| <= 1e-3 (1 + max |golden|)).

    bench/peer/golden_parity.py [--build build] [--peer DIR] [-t 2] [--json FILE]

--peer: the folder bench/peer/setup.sh prints (default: $M3_PEER_DIR, else ~/.cache/m3/peer/...). Exits 0 when both
engines reproduce every case, 1 when one does not, 77 when llama.cpp is not set up (ctest skips).
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP = 77


def default_peer():
    # setup.sh's default folder (not under XDG_CACHE_HOME: ctest points that at the build's cache)
    return os.environ.get("M3_PEER_DIR") or os.path.expanduser("~/.cache/m3/peer/node-llama-cpp-3.22.1")


def npy_row(path, row):
    """Row `row` (negative: from the end) of a float32 2-D .npy file."""
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ValueError(f"{path}: not a .npy file")
        major = f.read(2)[0]
        (hlen,) = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))
        header = f.read(hlen).decode("latin1")
        if "'<f4'" not in header or "'fortran_order': False" not in header:
            raise ValueError(f"{path}: not a C-order float32 array")
        shape = tuple(int(v) for v in header.split("'shape': (")[1].split(")")[0].split(",") if v.strip())
        rows, cols = shape
        f.seek(f.tell() + (row % rows) * cols * 4)
        return list(struct.unpack(f"<{cols}f", f.read(cols * 4)))


def logit_error(got, want):
    """Largest |got - want| in units of the golden rule's bound 1e-3 (1 + max |want|)."""
    if len(got) != len(want):
        return float("inf")
    bound = 1e-3 * (1 + max(abs(v) for v in want))
    return max(abs(a - b) for a, b in zip(got, want)) / bound


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({r.returncode}): {r.stderr.strip()[-800:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--peer", default=default_peer())
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here as well")
    args = ap.parse_args()

    harness = os.path.join(args.peer, "llama_peer")
    libs = os.path.join(args.peer, "bins", "linux-x64" if os.uname().machine == "x86_64" else "linux-arm64")
    if not (os.access(harness, os.X_OK) and os.path.isdir(libs)):
        print(f"golden_parity: llama.cpp is not set up in {args.peer} (bench/peer/setup.sh): skipped")
        return SKIP
    m3 = os.path.join(args.build, "bin", "m3")
    writer = os.path.join(args.build, "tests", "test_gguf_model")
    for exe in (m3, writer):
        if not os.access(exe, os.X_OK):
            print(f"golden_parity: {exe} is missing (build with tests)", file=sys.stderr)
            return 2

    results, ok = [], True
    with tempfile.TemporaryDirectory(prefix="m3_golden_parity_") as tmp:
        run([writer, "[.golden-gguf]"], env=dict(os.environ, M3_GOLDEN_GGUF_DIR=tmp))
        cases = sorted(f[:-5] for f in os.listdir(tmp) if f.endswith(".gguf"))
        if len(cases) < 2:
            print(f"golden_parity: expected at least 2 golden GGUFs, got {cases}", file=sys.stderr)
            return 1
        for name in cases:
            gguf = os.path.join(tmp, name + ".gguf")
            golden_dir = os.path.join(ROOT, "tests", "data", "golden", name)
            case = json.load(open(os.path.join(golden_dir, "case.json")))
            prompt, steps, want = case["prompt_ids"], case["decode_steps"], case["greedy_ids"]
            want_last = npy_row(os.path.join(golden_dir, "prefill_logits.npy"), -1)
            ids = ",".join(map(str, prompt))

            peer = json.loads(run([harness, "greedy", "--model", gguf, "--libs", libs, "--ids", ids,
                                   "-n", str(steps), "-t", str(args.threads)]))
            packed, out = os.path.join(tmp, name + "_f32"), os.path.join(tmp, name + "_logits")
            run([m3, "pack", "-m", gguf, "-o", packed, "--type", "q8", "--override", ".*=f32",
                 "-t", str(args.threads)])
            run([m3, "logits", "-m", packed, "--ids", ids, "-n", str(steps), "-o", out, "-t", str(args.threads)])
            ours = json.load(open(os.path.join(out, "greedy_ids.json")))  # a list of ids
            ours_last = npy_row(os.path.join(out, "prefill_logits.npy"), -1)

            r = {"case": name, "prompt_tokens": len(prompt), "decode_steps": steps, "golden": want,
                 "llama_cpp": peer["greedy_ids"], "m3": ours,
                 "llama_cpp_logit_error": logit_error(peer["last_prefill_logits"], want_last),
                 "m3_logit_error": logit_error(ours_last, want_last)}
            r["pass"] = (r["llama_cpp"] == want and r["m3"] == want and r["llama_cpp_logit_error"] <= 1
                         and r["m3_logit_error"] <= 1)
            ok = ok and r["pass"]
            results.append(r)

    print(f"{'case':<32} {'prompt':>6} {'steps':>5} {'llama.cpp ids':>13} {'m3 ids':>7} "
          f"{'llama.cpp logits':>16} {'m3 logits':>10}")
    for r in results:
        print(f"{r['case']:<32} {r['prompt_tokens']:>6} {r['decode_steps']:>5} "
              f"{'= golden' if r['llama_cpp'] == r['golden'] else 'DIFFER':>13} "
              f"{'= golden' if r['m3'] == r['golden'] else 'DIFFER':>7} "
              f"{r['llama_cpp_logit_error']:>16.4f} {r['m3_logit_error']:>10.4f}")
    print("logits: the prompt's last row, max |x - golden| / (1e-3 (1 + max |golden|)); <= 1 passes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
