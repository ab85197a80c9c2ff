"""Stacks read from outside: a process without a probe, and a probed one whose
probe cannot answer because a thread holds the GIL in native code."""

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
