"""Getting in at start: the .pth hook, `rankscope run`, start() and stop()."""

import os
import subprocess
from pathlib import Path


def test_no_probe_without_rankscope_in_the_environment(python, spawn, endpoint_dir):
    target = spawn(python, "print('READY', flush=True)\nimport time\ntime.sleep(60)\n", probe=False)
    assert not Path(endpoint_dir, f"{target.pid}.sock").exists()
    assert "rankscope._native" not in "".join(target.output)


def test_pth_hook_starts_the_probe_before_user_code(python, spawn, endpoint_dir):
    source = """
    import os, sys
    print("READY", os.path.exists(os.path.join(os.environ["RANKSCOPE_DIR"], f"{os.getpid()}.sock")), "rankscope._native" in sys.modules, flush=True)
    import time; time.sleep(60)
    """
    target = spawn(python, source)
    assert target.output[-1].split() == ["READY", "True", "True"]


def test_rankscope_run_probes_the_command_and_its_python_children(python, cli, spawn, endpoint_dir, rankscope_bin):
    import subprocess

    source = f"""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; print('CHILD', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    child.stdout.readline()
    print("READY", child.pid, flush=True)
    time.sleep(60)
    """
    # Started through `rankscope run`, not with RANKSCOPE=1.
    workdir = Path(endpoint_dir).parent / f"rs-run-{os.getpid()}"
    workdir.mkdir(exist_ok=True)
    script = workdir / "target.py"
    import textwrap

    script.write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    env["RANKSCOPE_RUN_DIR"] = str(workdir / "run")
    proc = subprocess.Popen([rankscope_bin, "run", "--", python, "-u", str(script)], stdout=subprocess.PIPE, env=env)
    try:
        line = proc.stdout.readline().decode().split()
        assert line[0] == "READY", line
        child_pid = int(line[1])
        # `run` execs the command: the parent is the very process we started.
        for pid in (proc.pid, child_pid):
            result = cli(pid, "eval", "import os; os.getpid()")
            assert result.returncode == 0, result.stderr
            assert result.stdout == f"{pid}\n"
    finally:
        proc.kill()
        proc.wait()
        try:
            os.kill(child_pid, 9)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_start_and_stop_from_code_release_socket_and_thread(python, spawn, endpoint_dir):
    source = """
    import os, sys, time
    import rankscope

    # Thread count, not names: a new thread names itself a moment after it exists.
    def threads():
        return len(os.listdir("/proc/self/task"))

    base = threads()

    def probe_threads():
        return threads() - base

    before = probe_threads()
    info = rankscope.start()
    started = os.path.exists(info["socket"]), probe_threads()
    again = rankscope.start()["socket"] == info["socket"]
    rankscope.stop()
    # stop() joins the thread, but the kernel drops a joined thread from
    # /proc a moment later: give it up to 2 s before counting.
    deadline = time.monotonic() + 2
    while probe_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    stopped = os.path.exists(info["socket"]), probe_threads()
    print("READY", before, started, again, stopped, flush=True)
    time.sleep(60)
    """
    target = spawn(python, source, probe=False)
    # Two threads while it runs (the server's, the memory sampler's), none after.
    assert target.output[-1].strip() == "READY 0 (True, 2) True (False, 0)"


def test_the_probe_ends_cleanly_with_the_process(python, spawn, endpoint_dir):
    source = """
    print("READY", flush=True)
    total = sum(range(10**6))
    """
    target = spawn(python, source)
    assert target.proc.wait(timeout=30) == 0
    assert target.proc.stderr.read() == b""
    assert not Path(endpoint_dir, f"{target.pid}.sock").exists()
    assert not Path(endpoint_dir, f"{target.pid}.json").exists()


def test_a_run_directory_that_cannot_be_made_is_said_once(python, spawn):
    # `site` may read a venv's site-packages twice, and with it the .pth
    # that starts the probe: each of its warnings came twice.
    target = spawn(python, 'print("READY", flush=True)', env={"RANKSCOPE_RUN_DIR": "/proc/no-such-dir"})
    assert target.proc.wait(timeout=30) == 0
    err = target.proc.stderr.read().decode()
    assert err.count("rankscope: crash recording not enabled") == 1, err


def test_a_request_on_python_as_the_program_exits_does_not_abort_it(python, spawn, rankscope_bin, endpoint_dir):
    """GIVEN an eval that keeps letting the GIL go and taking it back (each
    `os.stat` does, as an import's file reads or a torch call do) WHEN the
    program ends while it runs THEN the program exits 0 with nothing on
    stderr, and the eval is told why it ended. Before, the interpreter
    finalized under it and ended its thread where it stood, which aborted
    the process (exit code 134) every time."""
    source = """
    import time
    print("READY", flush=True)
    while not globals().get("go"):
        time.sleep(0.01)
    print("EXITING", flush=True)
    """
    target = spawn(python, source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    code = "import os\ngo = True\nfor _ in range(10**8): os.stat('.')"
    evaluating = subprocess.Popen([rankscope_bin, str(target.pid), "eval", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        target.wait_for_line("EXITING")
        assert target.proc.wait(timeout=30) == 0
        assert target.proc.stderr.read() == b""
        out, err = evaluating.communicate(timeout=30)
        assert "the program is exiting" in out + err, (out, err)
    finally:
        evaluating.kill()


# The probe's Python locks that its own threads take (turning torch
# features on and off, a reader's hand-over of rows, breakpoints, the
# debugger, pauses), each held by another thread while the program forks:
# the child, which has only the forking thread, must find every one free.
HELD_ACROSS_FORK = """
import json, os, threading
import torch
from rankscope._probe import breakpoints, debugger, pause
from rankscope._probe.torch import tables, trace

locks = {"trace": trace.TRACER.lock, "tables": tables._outbox_lock, "breakpoints": breakpoints._lock,
         "debugger": debugger._lock, "pause": pause._lock}
hooks = breakpoints._line_hooks()
if hasattr(hooks, "_lock"):  # 3.11's line hooks (3.12 and later use sys.monitoring)
    locks["linehooks"] = hooks._lock
held, done = threading.Event(), threading.Event()

def hold():
    for lock in locks.values():
        lock.acquire()
    held.set()
    done.wait()
    for lock in locks.values():
        lock.release()

threading.Thread(target=hold).start()
held.wait()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    free = {name: lock.acquire(timeout=2) for name, lock in locks.items()}
    os.write(write, json.dumps(free).encode())
    os._exit(0)
os.close(write)
os.waitpid(pid, 0)
done.set()
print("READY " + os.read(read, 4096).decode(), flush=True)
"""


def test_a_forked_child_finds_the_probes_locks_free(python, spawn):
    import json

    from conftest import require_torch

    require_torch(python)
    target = spawn(python, HELD_ACROSS_FORK)
    free = json.loads(target.output[-1].split(" ", 1)[1])
    assert len(free) >= 5 and all(free.values()), free
