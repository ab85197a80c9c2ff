"""Who can reach a probe: the same user over a 0700 directory, and TCP only
when asked for, with a token, on loopback by default."""

import http.client
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

COUNTER = """
import time
counter = 7
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def test_endpoint_dir_and_socket_are_private(default_python, spawn, endpoint_dir):
    os.chmod(endpoint_dir, 0o755)  # loosened by someone: the probe tightens it
    target = spawn(default_python, COUNTER)
    assert stat.S_IMODE(os.stat(endpoint_dir).st_mode) == 0o700
    sock = Path(endpoint_dir, f"{target.pid}.sock")
    assert stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0


def test_tcp_is_off_by_default(default_python, spawn, endpoint_dir):
    target = spawn(default_python, COUNTER)
    meta = json.loads(Path(endpoint_dir, f"{target.pid}.json").read_text())
    assert meta["tcp"] is None
    assert not Path(endpoint_dir, f"{target.pid}.token").exists()


def _get(addr: str, path: str, token: str | None) -> int:
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request("GET", path, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def test_tcp_needs_the_token_and_binds_loopback(default_python, spawn, endpoint_dir):
    target = spawn(default_python, COUNTER, env={"RANKSCOPE_LISTEN": "0"})
    meta = json.loads(Path(endpoint_dir, f"{target.pid}.json").read_text())
    assert meta["tcp"].startswith("tcp://127.0.0.1:")
    token_file = Path(endpoint_dir, f"{target.pid}.token")
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert _get(meta["tcp"], "/v1/meta", None) == 401
    assert _get(meta["tcp"], "/v1/meta", "wrong-token") == 401
    assert _get(meta["tcp"], "/v1/meta", token) == 200


def test_bad_listen_value_leaves_the_program_running(default_python, spawn, endpoint_dir):
    target = spawn(default_python, COUNTER, env={"RANKSCOPE_LISTEN": "not-an-address"})
    assert target.alive()
    assert not Path(endpoint_dir, f"{target.pid}.sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_peers_of_another_uid_are_refused(default_python, spawn, endpoint_dir):
    target = spawn(default_python, COUNTER)
    sock = Path(endpoint_dir, f"{target.pid}.sock")
    # Open the path to everyone, so that only the uid check stands in the way.
    os.chmod(endpoint_dir, 0o755)
    os.chmod(sock, 0o777)
    client = f"""
import os, socket
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect({str(sock)!r})
# The probe refuses before it reads a byte: the answer comes first, and a
# request sent after it may meet a closed socket (EPIPE), which is fine.
try:
    s.sendall(b"POST /v1/eval HTTP/1.1\\r\\nContent-Length: 2\\r\\n\\r\\n{{}}")
except (BrokenPipeError, ConnectionResetError):
    pass
print(s.recv(100).decode().splitlines()[0])
"""
    out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "HTTP/1.1 403 Forbidden", out.stderr
    assert target.alive()
