"""Expert parallelism over MPI (docs/DIST.md), on this machine's loopback:

parity  `mpirun -np N m3 logits` gives every golden case's files byte for byte as one process does
        (N = 2, 3 over shared memory, and N = 2 over loopback TCP on the first case; the checkpoints
        as they are and one packed q4-mixed).
faults  a rank that cannot open its model, a killed rank and a hung one each end every rank with an
        error naming the rank and its host in under 10 s; `m3 serve` answers 503 while it stops.

Usage: dist_check.py M3 (parity [--first] DATA_DIR... | faults MODEL)
  --first  the first golden case and its packed copy only (tests/sanitize.sh: the sweep is slow there)
"""
import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_util import Server, check, failures  # noqa: E402

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", OMP_WAIT_POLICY="PASSIVE",
           # Containers often forbid the cross-memory attach of Open MPI's shared-memory transport.
           OMPI_MCA_btl_vader_single_copy_mechanism="none")
if "ASAN_OPTIONS" in ENV:
    # Open MPI's plugins leak at MPI_Finalize and are unloaded before LeakSanitizer reports, so their
    # stacks end in "<unknown module>" and no suppression can name them. ASan's other checks stay on.
    ENV["ASAN_OPTIONS"] += ":detect_leaks=0"


def mpirun(ranks):
    return ["mpirun", "--oversubscribe", "-np", str(ranks)]


def logits(m3, case_dir, out, launcher=()):
    case = json.load(open(os.path.join(case_dir, "case.json")))
    ids = ",".join(map(str, case["prompt_ids"]))
    cmd = [*launcher, m3, "logits", "-m", case_dir, "--ids", ids, "-n", str(case["decode_steps"]), "-o", out,
           "--dump-blocks", "-t", "2"]
    if launcher:
        cmd += ["--dist", "mpi"]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


def same_files(a, b):
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
                                                  for n in names)


def parity(m3, data_dirs, first_only=False):
    tmp = tempfile.mkdtemp()
    try:
        cases = []
        for data in data_dirs:
            golden = os.path.join(data, "golden")
            cases += [os.path.join(golden, c) for c in sorted(os.listdir(golden))
                      if os.path.isfile(os.path.join(golden, c, "case.json"))]
        check(cases, "no golden cases found")
        if first_only:
            cases = cases[:1]
        # One packed q4-mixed model too: tiled weights, slices of packed experts.
        packed = os.path.join(tmp, "packed")
        src = next((c for c in cases if "mxfp8_mixed" in c), cases[0] if cases else None)
        if src:
            r = subprocess.run([m3, "pack", "-m", src, "-o", packed, "--type", "q4-mixed"], env=ENV,
                               capture_output=True, text=True, timeout=300)
            check(r.returncode == 0, f"m3 pack failed: {r.stderr[-500:]}")
            for f in ("case.json",):
                shutil.copy(os.path.join(src, f), packed)
            cases.append(packed)
        for case in cases:
            alone = os.path.join(tmp, "alone")
            shutil.rmtree(alone, ignore_errors=True)
            r = logits(m3, case, alone)
            check(r.returncode == 0, f"{case}: m3 logits failed: {r.stderr[-500:]}")
            # Shared memory at 2 and 3 ranks; the first case over loopback TCP too.
            runs = [(2, ()), (3, ())] + ([(2, ("--mca", "btl", "self,tcp"))] if case == cases[0] else [])
            for ranks, mca in runs:
                how = f"-np {ranks}" + (" over TCP" if mca else "")
                out = os.path.join(tmp, f"np{ranks}")
                shutil.rmtree(out, ignore_errors=True)
                r = logits(m3, case, out, mpirun(ranks) + list(mca))
                transport = "loopback (btl self,tcp)" if mca else "shared memory"
                ok = (r.returncode == 0 and f"split over {ranks} ranks" in r.stderr and transport in r.stderr
                      and same_files(alone, out))
                check(ok, f"{os.path.basename(case)}: {how} differs from one process or failed "
                          f"(rc {r.returncode}): {r.stderr[-800:]}")
                print(f"{os.path.basename(case):45s} {how}: {'bit for bit' if ok else 'FAIL'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rank_pids():
    """pid of each rank's `m3 serve` started by mpirun, by OMPI_COMM_WORLD_RANK."""
    ranks = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"serve" not in cmd or b"mpirun" in cmd:
            continue
        for e in env:
            if e.startswith(b"OMPI_COMM_WORLD_RANK="):
                ranks[int(e.split(b"=")[1])] = int(pid)
    return ranks


def wait_exit(proc, limit):
    start = time.time()
    try:
        proc.wait(timeout=limit + 20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None
    return time.time() - start


def faults(m3, model):
    env = dict(ENV, M3_DIST_TIMEOUT="3")
    # 1. A rank that cannot open its model (it runs in a folder where the relative path is not).
    tmp = tempfile.mkdtemp()
    try:
        good, bad = os.path.join(tmp, "good"), os.path.join(tmp, "bad")
        os.makedirs(good)
        os.makedirs(bad)
        os.symlink(os.path.abspath(model), os.path.join(good, "model"))
        args = [m3, "logits", "-m", "model", "--ids", "1,2,3", "-n", "2", "-o", os.path.join(tmp, "out")]
        start = time.time()
        r = subprocess.run(["mpirun", "--oversubscribe", "-np", "1", "-wdir", good, *args, ":", "-np", "1", "-wdir", bad,
                            *args], env=env, capture_output=True, text=True, timeout=60)
        took = time.time() - start
        check(r.returncode != 0 and "rank 1 (host " in r.stderr and "not a model folder" in r.stderr,
              f"a rank without its model: rc {r.returncode}, {r.stderr[-800:]}")
        check(took < 10, f"a rank without its model took {took:.1f} s to end the job")
        check(not os.path.exists(os.path.join(tmp, "out")), "files written although a rank failed")
        print(f"a rank that cannot open its model: ended in {took:.1f} s: "
              f"{next((l for l in r.stderr.splitlines() if 'rank 1 (host' in l), '')}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    # 2. A killed rank (SIGKILL) and 3. a hung one (SIGSTOP) under `m3 serve`.
    for how, sig in (("killed", signal.SIGKILL), ("hung", signal.SIGSTOP)):
        server = Server(m3, model, "--dist", "mpi", env=env, threads=1, launcher=mpirun(2))
        status, _, _ = server.request("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3})
        check(status == 200, f"{how}: the server did not answer before the fault: {status}")
        victim = rank_pids().get(1)
        check(victim is not None, f"{how}: rank 1 not found")
        if victim is None:
            server.proc.kill()
            continue
        start = time.time()
        os.kill(victim, sig)
        codes = set()
        while server.proc.poll() is None and time.time() - start < 30:
            try:
                status, _, _ = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=1)
                codes.add(status)
            except OSError:
                pass
            time.sleep(0.1)
        took = wait_exit(server.proc, 10)
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass
        log = server.log()
        check(took is not None and time.time() - start < 10, f"{how} rank: the job took {time.time() - start:.1f} s "
                                                             "to end")
        named = "rank 1 (host " in log if sig == signal.SIGSTOP else "rank 1" in log
        check(named, f"{how} rank: no error naming rank 1 and its host: {log[-1500:]}")
        if sig == signal.SIGSTOP:
            check(503 in codes, f"hung rank: the server did not answer 503 while it stopped (got {sorted(codes)})")
        line = next((l for l in log.splitlines() if "rank 1" in l), "")
        print(f"a {how} rank under m3 serve: every rank ended in {time.time() - start:.1f} s; answers while stopping: "
              f"{sorted(codes)}; {line.strip()}")


def main():
    m3, mode = os.path.abspath(sys.argv[1]), sys.argv[2]
    if shutil.which("mpirun") is None:
        print("mpirun not found (scripts/install-deps.sh installs openmpi-bin)")
        sys.exit(1)
    if mode == "parity":
        args = sys.argv[3:]
        parity(m3, [a for a in args if a != "--first"], "--first" in args)
    else:
        faults(m3, sys.argv[3])
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
