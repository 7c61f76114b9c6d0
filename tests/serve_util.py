"""Helpers of the `m3 serve` checks: start a server, talk HTTP to it, and read its log."""
import http.client
import json
import os
import socket
import subprocess
import threading
import time


# The failures of a check script (`check`); it prints them and exits 1 when there are any.
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


class Server:
    """`m3 serve` on a free port; its stderr is collected as it runs (`log()`)."""

    def __init__(self, m3, model, *extra, env=None, threads=2, context=400, launcher=()):
        # launcher: what runs m3 (e.g. mpirun and its options), nothing for m3 alone.
        self.proc = subprocess.Popen([*launcher, m3, "serve", "-m", model, "--port", "0", "-t", str(threads), "-c", str(context),
                                      *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if "http://127.0.0.1:" not in line:
            self.proc.kill()
            raise RuntimeError(f"m3 serve did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
        self._lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self._lines.append(line)

    def log(self):
        return "".join(self._lines)

    def request(self, method, path, body=None, raw=None, headers=None, timeout=120):
        """(status, headers dict, text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", errors="replace")
        conn.close()
        return resp.status, dict(resp.getheaders()), text

    def connect(self, timeout=60):
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def send_request(self, body, path="/v1/chat/completions", timeout=60):
        """A socket that has sent a whole POST of `body` (a dict) and not read anything."""
        sock = self.connect(timeout)
        data = json.dumps(body).encode()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        return sock

    def wait_log(self, needle, count=1, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            if self.log().count(needle) >= count:
                return True
            time.sleep(0.05)
        return False

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def stop(self, timeout=60):
        """SIGTERM; the exit code (the log stays readable)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(timeout=5)
        return rc


def read_all(sock):
    """Everything until the server closes the connection (or it times out)."""
    out = b""
    try:
        while True:
            part = sock.recv(65536)
            if not part:
                break
            out += part
    except OSError:
        pass
    return out


def events(text):
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(server, name, headers=None):
    status, _, text = server.request("GET", "/metrics", headers=headers)
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def fixture_env():
    return dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
