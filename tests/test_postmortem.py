"""Post-mortem modes: a crashed process held for pdb on a socket
(`rankscope debug`, or any unix-socket client), and pdb on the console."""

import os
import pty
import select
import socket
import subprocess
import time

import pytest

from test_crashes import CRASH, _line

HELD = "is held for a debugger"


def start_crashing(python, tmp_path, endpoint_dir, **env):
    script = tmp_path / "target.py"
    script.write_text(CRASH)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    full_env.update(RANKSCOPE="1", RANKSCOPE_DIR=endpoint_dir, RANKSCOPE_RUN_DIR=str(tmp_path / "run"), **env)
    proc = subprocess.Popen([python, "-u", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, text=True)
    return proc, script


def wait_for_stderr(proc, wanted, timeout=30):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if wanted in line:
            return line
    proc.kill()
    raise AssertionError(f"no {wanted!r} on stderr: {''.join(seen)}")


def test_socket_mode_holds_the_rank_for_rankscope_debug(python, cli, endpoint_dir, tmp_path):
    proc, script = start_crashing(python, tmp_path, endpoint_dir, RANKSCOPE_ON_ERROR="socket", RANKSCOPE_HOLD_TIMEOUT="60")
    try:
        wait_for_stderr(proc, HELD)
        session = cli("debug", "--pid", proc.pid, input="p batch_size\nw\nu\nll\np paths\nq\n", env={"RANKSCOPE_RUN_DIR": str(tmp_path / "run")})
        assert session.returncode == 0, session.stderr
        out = session.stdout
        assert "post-mortem of rank 0" in out and "KeyError" in out
        assert "(Pdb rank 0) 4096" in out
        assert f"-> return table[path]  # @raise" in out  # w: the crash frame
        assert "['missing.pt']" in out  # after u, main()'s locals
        # After the session the process exits as it would have: traceback, code 1.
        assert proc.wait(timeout=30) == 1
        assert "KeyError: 'missing.pt'" in proc.stderr.read()
        assert not list((tmp_path / "run").glob("debug-*.sock"))
    finally:
        proc.kill()


def test_a_plain_unix_socket_client_gets_a_pdb_prompt(default_python, endpoint_dir, tmp_path):
    proc, _ = start_crashing(default_python, tmp_path, endpoint_dir, RANKSCOPE_ON_ERROR="socket")
    try:
        line = wait_for_stderr(proc, HELD)
        path = line.split("nc -U ")[1].split("`")[0]
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.settimeout(20)
            data = b""
            while b"(Pdb rank 0) " not in data:
                data += s.recv(4096)
            s.sendall(b"p path\n")
            while b"'missing.pt'" not in data:
                data += s.recv(4096)
            s.sendall(b"q\n")
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()


def test_the_hold_times_out_and_the_process_exits_as_it_would_have(default_python, endpoint_dir, tmp_path):
    proc, _ = start_crashing(default_python, tmp_path, endpoint_dir, RANKSCOPE_ON_ERROR="socket", RANKSCOPE_HOLD_TIMEOUT="0.5")
    try:
        assert proc.wait(timeout=30) == 1
        err = proc.stderr.read()
        assert HELD in err and "no debugger came within 0.5 s" in err
        assert "KeyError: 'missing.pt'" in err
    finally:
        proc.kill()


def test_debug_without_a_held_process_is_a_hinted_error(cli, tmp_path):
    result = cli("debug", "--rank", "3", env={"RANKSCOPE_RUN_DIR": str(tmp_path)})
    assert result.returncode == 1
    assert "no crashed process is waiting for a debugger as rank 3" in result.stderr
    assert "RANKSCOPE_ON_ERROR=socket" in result.stderr


def test_console_mode_opens_pdb_on_the_terminal(default_python, endpoint_dir, tmp_path):
    (tmp_path / "target.py").write_text(CRASH)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env.update(RANKSCOPE="1", RANKSCOPE_DIR=endpoint_dir, RANKSCOPE_RUN_DIR=str(tmp_path / "run"), RANKSCOPE_ON_ERROR="console")
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(default_python, [default_python, "-u", str(tmp_path / "target.py")], env)
    out = b""

    def read_until(wanted: bytes, timeout=30):
        nonlocal out
        deadline = time.monotonic() + timeout
        while wanted not in out and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    out += os.read(fd, 4096)
                except OSError:
                    break
        assert wanted in out, out.decode(errors="replace")

    try:
        read_until(b"(Pdb) ")
        os.write(fd, b"p batch_size\n")
        read_until(b"4096")
        os.write(fd, b"q\n")
        read_until(b"KeyError: 'missing.pt'")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 1
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
