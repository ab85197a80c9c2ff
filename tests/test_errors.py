"""Bad input: each case gets a one-line error with a hint, a non-zero exit,
and costs the target nothing."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

COUNTER = """
import time
counter = 7
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def assert_hinted_error(result, *fragments):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: "), result.stderr
    assert lines[1].startswith("hint: "), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def free_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_pid_that_does_not_exist(cli):
    assert_hinted_error(cli(free_pid(), "bt"), "no process with PID", "rankscope list")


def test_pid_without_a_probe_names_the_way_in(default_python, spawn, cli):
    target = spawn(default_python, COUNTER, probe=False)
    result = cli(target.pid, "query", "SHOW TABLES")
    assert_hinted_error(result, "has no rankscope probe", "RANKSCOPE=1", "inject")
    assert target.alive()


def test_list_shows_live_probes_and_cleans_dead_sockets(default_python, spawn, cli, endpoint_dir):
    live = spawn(default_python, COUNTER)
    dead = spawn(default_python, COUNTER)
    dead.kill()  # SIGKILL: no chance to remove its socket
    assert Path(endpoint_dir, f"{dead.pid}.sock").exists()
    result = cli("list")
    assert result.returncode == 0, result.stderr
    assert str(live.pid) in result.stdout and "ready" in result.stdout
    # A lone program is no rank of a job: no rank 0 is made up for it.
    [row] = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == [str(live.pid)]]
    assert row[1] == "-", row
    assert str(dead.pid) not in result.stdout
    assert not Path(endpoint_dir, f"{dead.pid}.sock").exists()
    assert "removed 1 stale endpoint" in result.stderr
    # And a command on the dead PID is a clear error, not a hang.
    assert_hinted_error(cli(dead.pid, "bt"), "no process with PID")


def test_list_with_no_probes(cli):
    result = cli("list")
    assert result.returncode == 0
    assert "No probed Python processes" in result.stdout


def raw_exchange(path: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_malformed_and_oversized_requests_are_refused_harmlessly(default_python, spawn, cli, endpoint_dir):
    target = spawn(default_python, COUNTER)
    sock = str(Path(endpoint_dir, f"{target.pid}.sock"))
    assert raw_exchange(sock, b"\x00\xff garbage \r\n\r\n").startswith(b"HTTP/1.1 400")
    big_head = b"GET /v1/meta HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n"
    assert raw_exchange(sock, big_head).startswith(b"HTTP/1.1 431")
    big_body = b"POST /v1/eval HTTP/1.1\r\nContent-Length: 50000000\r\n\r\n"
    assert raw_exchange(sock, big_body).startswith(b"HTTP/1.1 413")
    bad_json = b"POST /v1/eval HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope"
    assert raw_exchange(sock, bad_json).startswith(b"HTTP/1.1 400")
    assert raw_exchange(sock, b"GET /nowhere HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert raw_exchange(sock, b"DELETE /v1/stacks HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
    # A client that connects and says nothing is dropped without blocking others.
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(sock)
    try:
        assert target.alive()
        assert cli(target.pid, "eval", "counter").stdout == "7\n"
    finally:
        idle.close()


def test_bad_timeout_value_is_refused(default_python, spawn, cli):
    target = spawn(default_python, COUNTER)
    assert_hinted_error(cli(target.pid, "eval", "1", "--timeout", "0"), "--timeout")


def test_a_timeout_past_a_day_or_an_argument_that_is_not_utf8_is_refused_not_a_panic(default_python, spawn, cli, rankscope_bin):
    target = spawn(default_python, COUNTER)
    assert_hinted_error(cli(target.pid, "eval", "1", "--timeout", "1e20"), "--timeout")
    result = subprocess.run([rankscope_bin, b"\xff"], capture_output=True)
    assert result.returncode == 2 and b"not valid UTF-8" in result.stderr and b"panicked" not in result.stderr, result.stderr


def test_a_stopped_process_is_said_at_once(default_python, spawn, cli):
    # Each command waited out its deadline (eval 12 s, torch 15 s, memory
    # 60 s), then blamed a thread holding the GIL.
    target = spawn(default_python, COUNTER)
    os.kill(target.pid, signal.SIGSTOP)
    try:
        for args in (["eval", "1"], ["torch"], ["break", "list"]):
            started = time.monotonic()
            result = cli(target.pid, *args)
            assert result.returncode != 0 and "is stopped" in result.stderr and "kill -CONT" in result.stderr, (args, result.stderr)
            assert time.monotonic() - started < 3, args
    finally:
        os.kill(target.pid, signal.SIGCONT)
    assert cli(target.pid, "eval", "counter").stdout == "7\n"


def test_unknown_command_is_a_usage_error(cli):
    result = cli("frobnicate")
    assert result.returncode == 2
    assert "unrecognized subcommand" in result.stderr


def test_list_cleans_a_dead_socket_whose_pid_was_reused(default_python, spawn, cli, endpoint_dir):
    # GIVEN a socket nobody listens on, named after a live process without a
    # probe (what a killed probe leaves when its PID is handed out again)
    bystander = spawn(default_python, COUNTER, probe=False)
    sock_path = Path(endpoint_dir, f"{bystander.pid}.sock")
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(sock_path))
    leftover.close()
    Path(endpoint_dir, f"{bystander.pid}.json").write_text("{}")
    # WHEN the user lists probes
    result = cli("list")
    # THEN the leftover is gone, and the bystander is untouched
    assert result.returncode == 0
    assert str(bystander.pid) not in result.stdout
    assert not sock_path.exists()
    assert bystander.alive()


def test_a_closed_pipe_ends_the_cli_quietly(default_python, spawn, rankscope_bin, endpoint_dir):
    import subprocess

    target = spawn(default_python, "import time\nprint('READY', flush=True)\nwhile True: time.sleep(1)\n")
    env = dict(os.environ, RANKSCOPE_DIR=endpoint_dir)
    pipeline = subprocess.run(
        # 1 MB of output into a reader that leaves after 10 bytes.
        f"""{rankscope_bin} {target.pid} eval "print('x' * 1000000)" | head -c 10""",
        shell=True, capture_output=True, text=True, env=env,
    )
    assert len(pipeline.stdout) == 10
    assert "panicked" not in pipeline.stderr and "Broken pipe" not in pipeline.stderr
