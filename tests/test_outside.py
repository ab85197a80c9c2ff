"""Stacks read from outside: a process without a probe, and a probed one whose
probe cannot answer because a thread holds the GIL in native code."""

import os
import signal
import time

import pytest
from conftest import line_of

PLAIN = """
import threading, time

def waiting_room(event):
    event.wait()  # @worker

def leaf(depth):
    if depth:
        return leaf(depth - 1)
    marker = "visible-local"
    print("READY", flush=True)
    while True:
        time.sleep(0.05)  # @leaf

threading.Thread(target=waiting_room, args=(threading.Event(),), name="waiter", daemon=True).start()
leaf(3)
"""

GIL_HOLDER = """
import ctypes
print("READY", flush=True)

def stuck_in_c():
    ctypes.PyDLL(None).sleep(30)  # @stuck

stuck_in_c()
"""


def test_bt_without_a_probe_reads_from_outside(python, spawn, cli):
    target = spawn(python, PLAIN, probe=False)
    result = cli(target.pid, "bt")
    assert result.returncode == 0, result.stderr
    assert "no probe in this process; stacks were read from outside" in result.stderr
    out = result.stdout
    script = str(target.script)
    assert f"leaf ({script}:{line_of(PLAIN, 'leaf')})" in out
    assert out.count("leaf (") == 4
    assert f"waiting_room ({script}:{line_of(PLAIN, 'worker')})" in out
    assert '"MainThread" (main' in out
    assert target.alive()


def test_bt_locals_from_outside(python, spawn, cli):
    target = spawn(python, PLAIN, probe=False)
    result = cli(target.pid, "bt", "--locals")
    assert result.returncode == 0, result.stderr
    assert "marker = \"visible-local\"" in result.stdout or "marker = 'visible-local'" in result.stdout, result.stdout


def test_bt_falls_back_when_the_gil_is_held(python, spawn, cli):
    target = spawn(python, GIL_HOLDER)
    result = cli(target.pid, "bt", timeout=30)
    assert result.returncode == 0, result.stderr
    assert "the probe did not answer" in result.stderr
    assert "read from outside" in result.stderr
    assert f"stuck_in_c ({target.script}:{line_of(GIL_HOLDER, 'stuck')})" in result.stdout
    assert "holds the GIL" in result.stdout
    assert "<no name>" not in result.stdout, "the probe's own waiting thread leaked into the output"
    assert target.alive()


def test_eval_without_a_probe_still_explains(default_python, spawn, cli):
    target = spawn(default_python, PLAIN, probe=False)
    result = cli(target.pid, "eval", "1")
    assert result.returncode != 0
    assert "has no rankscope probe" in result.stderr


def wait_until_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until /proc says the process is stopped (state T): a SIGSTOP lands
    asynchronously."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"PID {pid} did not stop within {timeout}s")


@pytest.mark.parametrize("probe", [False, True], ids=["no-probe", "probe"])
def test_bt_reads_a_stopped_process_without_pausing_it(python, spawn, cli, probe):
    """GIVEN a process stopped by SIGSTOP (Ctrl-Z), WHEN its stacks are
    asked for, THEN they are read from outside without pausing it (it cannot
    be paused again), with a note that it is stopped; --native, which must
    pause its threads, is a one-line error with a hint."""
    target = spawn(python, PLAIN, probe=probe)
    leaf = f"leaf ({target.script}:{line_of(PLAIN, 'leaf')})"
    # READY comes just before the loop: stop it once it is in it.
    deadline = time.monotonic() + 10
    while leaf not in cli(target.pid, "bt").stdout:
        assert time.monotonic() < deadline, "the target never reached its loop"
    os.kill(target.pid, signal.SIGSTOP)
    try:
        wait_until_stopped(target.pid)
        result = cli(target.pid, "bt", "--timeout", "1", timeout=30)
        assert result.returncode == 0, result.stderr
        assert f"PID {target.pid} is stopped" in result.stderr, result.stderr
        assert leaf in result.stdout, result.stdout
        native = cli(target.pid, "bt", "--native", timeout=30)
        assert native.returncode != 0
        lines = native.stderr.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), native.stderr
        assert "is stopped" in lines[0] or "without native unwinding" in lines[0], native.stderr
    finally:
        os.kill(target.pid, signal.SIGCONT)
    assert target.alive()
