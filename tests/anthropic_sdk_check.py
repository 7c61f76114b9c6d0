#!/usr/bin/env python3
"""The official Anthropic SDK against `m3 serve` (tests/clients/anthropic_sdk_check.mjs): starts the
server on the tiny real-vocabulary model with an API key and runs the script with node. Skipped
(exit 77) when node or tests/clients/node_modules is missing (tests/clients/install.sh installs it).
Usage: anthropic_sdk_check.py M3_BINARY REAL_VOCAB_MODEL_DIR"""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from serve_util import Server, fixture_env  # noqa: E402

SKIP = 77
m3, model = sys.argv[1], sys.argv[2]
clients = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients")
node = shutil.which("node")
if not node or not os.path.isdir(os.path.join(clients, "node_modules", "@anthropic-ai", "sdk")):
    print("skipped: node or tests/clients/node_modules/@anthropic-ai/sdk is missing (run tests/clients/install.sh)")
    sys.exit(SKIP)

key = "sdk-k3y"
server = Server(m3, model, "--name", "tiny", env=dict(fixture_env(), M3_API_KEY=key), context=1024)
try:
    run = subprocess.run([node, os.path.join(clients, "anthropic_sdk_check.mjs"), f"http://127.0.0.1:{server.port}", key],
                         cwd=clients, capture_output=True, text=True, timeout=600)
    print(run.stdout, end="")
    print(run.stderr, end="", file=sys.stderr)
finally:
    rc = server.stop()
if run.returncode != 0 or rc != 0:
    print(f"node exit {run.returncode}, server exit {rc}\n{server.log()[-3000:]}")
    sys.exit(1)
