"""`rankscope inject PID`: the probe started inside a process that never heard
of rankscope, run from a virtual environment that does not have it."""

import ctypes
import json
import os
import subprocess
import time

import pytest

from conftest import line_of

PLAIN = """
import importlib.util, time

assert importlib.util.find_spec("rankscope") is None, "this venv must not have rankscope"
MODEL_CFG = {"layers": 12, "heads": 8, "dim": 512}

def leaf(depth):
    if depth:
        return leaf(depth - 1)  # @recurse
    marker = "set-before-inject"
    print("READY", flush=True)
    while True:
        time.sleep(0.05)  # @leaf

leaf(3)
"""


def test_inject_then_bt_eval_and_query_through_the_injected_probe(python, bare_venvs, spawn, cli):
    target = spawn(bare_venvs(python), PLAIN, probe=False)

    result = cli("inject", target.pid)
    assert result.returncode == 0, result.stderr
    assert f"probe started in process {target.pid}" in result.stdout

    bt = cli(target.pid, "bt", "--locals")
    assert bt.returncode == 0, bt.stderr
    assert "read from outside" not in bt.stderr, "the injected probe should answer itself"
    # Frames that were on the stack before the inject, at the line running now.
    assert f"leaf ({target.script}:{line_of(PLAIN, 'leaf')})" in bt.stdout
    assert bt.stdout.count("leaf (") == 4
    assert "set-before-inject" in bt.stdout

    value = cli(target.pid, "eval", "MODEL_CFG['layers'] * 2")
    assert value.returncode == 0, value.stderr
    assert value.stdout.strip() == "24"
    # The bootstrap took its directory off sys.path again.
    path = cli(target.pid, "eval", "import sys; [p for p in sys.path if 'inject-' in p]")
    assert path.stdout.strip() == "[]", path.stdout

    rows = cli(target.pid, "query", "SELECT func, lineno FROM python.backtrace WHERE func = 'leaf'", "--format", "json")
    assert rows.returncode == 0, rows.stderr
    assert [r["lineno"] for r in json.loads(rows.stdout)] == [line_of(PLAIN, "leaf")] + [line_of(PLAIN, "recurse")] * 3

    # Breakpoints too, into the loop that was running before the inject (3.11: with `bytecode` staged).
    added = cli(target.pid, "break", "add", f"target.py:{line_of(PLAIN, 'leaf')}", "--max", "1")
    assert added.returncode == 0, added.stderr
    deadline = time.monotonic() + 20
    while not json.loads(cli(target.pid, "snapshots", "--format", "json").stdout):
        assert time.monotonic() < deadline, "no snapshot from the injected probe's breakpoint"
        time.sleep(0.05)
    assert target.alive()


def test_a_second_inject_says_the_probe_is_there(default_python, bare_venvs, spawn, cli):
    target = spawn(bare_venvs(default_python), PLAIN, probe=False)
    assert cli("inject", target.pid).returncode == 0
    again = cli("inject", target.pid)
    assert again.returncode == 0, again.stderr
    assert "already has a rankscope probe" in again.stdout


def test_inject_into_a_probed_process_is_a_no_op(default_python, spawn, cli):
    target = spawn(default_python, "import time\nprint('READY', flush=True)\nwhile True: time.sleep(1)\n")
    result = cli("inject", target.pid)
    assert result.returncode == 0, result.stderr
    assert "already has a rankscope probe" in result.stdout


def test_inject_into_a_process_that_is_not_python(cli):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        result = cli("inject", sleeper.pid)
        assert result.returncode == 1
        assert "is not a CPython process" in result.stderr
        assert "hint:" in result.stderr
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_inject_into_a_missing_pid(cli):
    result = cli("inject", "999999999")
    assert result.returncode == 1
    assert "no process with PID 999999999" in result.stderr


EXITS_ON_IMPORT = """
import os, sys, time

class ExitOnRankscope:
    # The target dies the moment the bootstrap imports rankscope: midway
    # through the inject, after the library is in.
    def find_spec(self, name, path=None, target=None):
        if name == "rankscope":
            os._exit(7)
        return None

sys.meta_path.insert(0, ExitOnRankscope())
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_target_that_exits_during_the_inject(default_python, bare_venvs, spawn, cli):
    target = spawn(bare_venvs(default_python), EXITS_ON_IMPORT, probe=False)
    result = cli("inject", target.pid)
    assert result.returncode == 1
    assert f"process {target.pid} exited during the inject" in result.stderr
    assert target.proc.wait(timeout=10) == 7


PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17


def test_inject_refused_when_another_tracer_holds_the_process(default_python, bare_venvs, spawn, cli):
    target = spawn(bare_venvs(default_python), PLAIN, probe=False)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(PTRACE_SEIZE, target.pid, None, None) != 0:
        pytest.skip(f"this test cannot ptrace: errno {ctypes.get_errno()}")
    try:
        result = cli("inject", target.pid)
    finally:
        # Detaching needs a stopped tracee; the seize never stopped it, so
        # the tracer's exit (this test's end) releases it. Kill it instead.
        target.kill()
    assert result.returncode == 1
    assert "ptrace of process" in result.stderr and f"process {os.getpid()} is already tracing it" in result.stderr
    assert "detach the debugger" in result.stderr


GIL_HOLDER = """
import ctypes, time
print("READY", flush=True)
ctypes.PyDLL(None).sleep(4)   # holds the GIL: no bootstrap can run meanwhile
print("AWAKE", flush=True)
while True:
    time.sleep(0.05)
"""


def test_inject_while_the_gil_is_held_waits_then_starts(default_python, bare_venvs, spawn, cli):
    target = spawn(bare_venvs(default_python), GIL_HOLDER, probe=False)
    early = cli("inject", target.pid, "--timeout", "0.5")
    assert early.returncode == 1
    assert "has not started yet" in early.stderr
    assert "GIL" in early.stderr
    # Once the GIL is free the bootstrap that was queued runs by itself.
    target.wait_for_line("AWAKE")
    later = cli("inject", target.pid, "--timeout", "5")
    assert later.returncode == 0, later.stderr
    bt = cli(target.pid, "bt")
    assert bt.returncode == 0 and "read from outside" not in bt.stderr
    assert target.alive()
