#!/usr/bin/env python3
"""A Node.js client script of tests/clients against `m3 serve`: starts the server on the tiny
real-vocabulary model with an API key and runs `node tests/clients/SCRIPT BASE_URL KEY`. Skipped
(exit 77) when node or the package it needs in tests/clients/node_modules is missing
(tests/clients/install.sh installs them).
Usage: node_client_check.py M3_BINARY REAL_VOCAB_MODEL_DIR SCRIPT.mjs PACKAGE [SCRIPT_ARGS...]
(SCRIPT_ARGS follow BASE_URL and KEY)."""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from serve_util import Server, fixture_env  # noqa: E402

SKIP = 77
m3, model, script, package = sys.argv[1:5]
script_args = sys.argv[5:]
clients = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients")
node = shutil.which("node")
if not node or not os.path.isdir(os.path.join(clients, "node_modules", package)):
    print(f"skipped: node or tests/clients/node_modules/{package} is missing (run tests/clients/install.sh)")
    sys.exit(SKIP)

key = "sdk-k3y"
# Two slots: the n > 1 choices decode together. A context of 1024 holds a prompt with tools.
server = Server(m3, model, "--name", "tiny", "--slots", "2", env=dict(fixture_env(), M3_API_KEY=key), context=1024)
run = None
try:
    run = subprocess.run([node, os.path.join(clients, script), f"http://127.0.0.1:{server.port}", key, *script_args],
                         cwd=clients, capture_output=True, text=True, timeout=1200)
    print(run.stdout, end="")
    print(run.stderr, end="", file=sys.stderr)
finally:
    rc = server.stop()
if run is None or run.returncode != 0 or rc != 0:
    print(f"node exit {run.returncode if run else None}, server exit {rc}\n{server.log()[-3000:]}")
    sys.exit(1)
