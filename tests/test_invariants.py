"""A probe must not change the program it is in.

GIVEN a program that records what it can see of its world (the invariants
below), WHEN a probe gets in (`rankscope inject`, with the main thread asleep
in C or running bytecode; or `rankscope.start()` from a thread that is not
the main one, then `stop()`), THEN the program sees the same world again:
only rankscope's own modules are new. And a non-daemon thread that the
program starts afterwards still finishes before the interpreter exits (the
data-loss case of the field report).

What is compared (docs/architecture.md, "What a probe leaves alone"):
threading's main thread (the object, its ident, its name, current_thread()
on the main thread) and every thread threading knows; the keys of
sys.modules other than rankscope's; sys.path, its importer cache and
sys.meta_path; every signal's Python handler, and the caught and ignored
signal masks of the process except the fatal signals faulthandler takes for
the native crash log and glibc's own; sys.excepthook, displayhook, breakpointhook,
unraisablehook, threading.excepthook; sys.stdin/stdout/stderr;
sys.gettrace() and getprofile(); sys.monitoring's tool ids; os.environ; the
cwd; the umask; the recursion limit and the switch interval.
"""

import ast
import os
import subprocess
import tempfile

import pytest

TARGET = r"""
import _signal
import _thread
import os
import sys
import time

MODE, PRE, WORKDIR = sys.argv[1], sys.argv[2], sys.argv[3]
if PRE == "threading":
    import threading  # the program's own, before any probe

# faulthandler (the native crash log) catches these; glibc keeps the
# signals between 31 and SIGRTMIN for itself (thread cancellation, setxid).
FATAL = {_signal.SIGSEGV, _signal.SIGFPE, _signal.SIGABRT, _signal.SIGBUS, _signal.SIGILL}
GLIBC = set(range(32, _signal.SIGRTMIN))


def signal_masks():
    masks = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigCgt", "SigIgn"):
                bits = int(value, 16)
                masks[key] = sorted(n for n in range(1, 65) if bits >> (n - 1) & 1 and n not in FATAL | GLIBC)
    return masks


def snapshot():
    threading = sys.modules.get("threading")
    monitoring = getattr(sys, "monitoring", None)
    umask = os.umask(0o022)
    os.umask(umask)
    world = {
        "modules": sorted(m for m in sys.modules if m != "rankscope" and not m.startswith("rankscope.")),
        "path": list(sys.path),
        "path_importer_cache": sorted(sys.path_importer_cache),
        "meta_path": [repr(f) for f in sys.meta_path],
        "signals": {int(s): repr(_signal.getsignal(s)) for s in _signal.valid_signals()},
        "signal_masks": signal_masks(),
        "hooks": [id(h) for h in (sys.excepthook, sys.displayhook, sys.breakpointhook, sys.unraisablehook)],
        "streams": [id(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
        "trace": [repr(sys.gettrace()), repr(sys.getprofile())],
        "monitoring": [monitoring.get_tool(i) for i in range(6)] if monitoring else None,
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "umask": umask,
        "limits": [sys.getrecursionlimit(), sys.getswitchinterval()],
    }
    if threading is not None:
        main = threading.main_thread()
        world["main_thread"] = [id(main), main.ident, main.native_id, main.name, main.is_alive()]
        world["current_is_main"] = threading.current_thread() is main
        world["threads"] = sorted((t.ident, t.name, t.daemon) for t in threading.enumerate())
        world["threading_excepthook"] = id(threading.excepthook)
    return world


def wait(name):
    path = os.path.join(WORKDIR, name)
    if MODE == "busy":
        # Bytecode all the way: the inject's pending call runs between two of them.
        n = 0
        while True:
            n += 1
            if n % 20000 == 0 and os.path.exists(path):
                return
    else:
        # Asleep in C: open() of a FIFO blocks until the test opens it to write.
        fd = os.open(path, os.O_RDONLY)
        os.read(fd, 16)
        os.close(fd)


def start_from_another_thread():
    done = _thread.allocate_lock()
    done.acquire()
    failure = []

    def run():
        try:
            rankscope.start()
        except BaseException as exc:
            failure.append(repr(exc))
        finally:
            done.release()

    _thread.start_new_thread(run, ())
    done.acquire()
    assert not failure, failure


if MODE == "start":
    # The program's own import statement (it caches a finder for the
    # script's folder); what is checked is what start() then does.
    import rankscope
before = snapshot()
print("READY", flush=True)
if MODE == "start":
    start_from_another_thread()
    print("STARTED", repr(snapshot()), flush=True)
    wait("stopped")
    rankscope.stop()
else:
    wait("injected")
print("AFTER", repr(snapshot()), flush=True)
print("BEFORE", repr(before), flush=True)
wait("checked")

# The program goes on as the field report's did: a non-daemon worker, then
# main() returns. The interpreter must wait for the worker.
import threading
main = threading.main_thread()
print("MAIN", repr([main.ident == _thread.get_ident(), threading.current_thread() is main, main.name, main.native_id == os.getpid()]), flush=True)

def worker():
    time.sleep(0.5)
    print("WORKER DONE", flush=True)

threading.Thread(target=worker).start()
"""


def _line(target, prefix: str):
    line = target.wait_for_line(prefix + " ")
    return ast.literal_eval(line[len(prefix) + 1 :])


def _compare(before: dict, after: dict, label: str) -> None:
    differs = {key: (before.get(key), after.get(key)) for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    assert not differs, f"{label}: the program's world changed: {differs}"


def _finish(target):
    """The program exits by itself, and only after its non-daemon worker printed."""
    out, err = target.proc.communicate(timeout=30)
    out = "".join(target.output) + out.decode()
    assert target.proc.returncode == 0, err.decode()
    main = _line_from(out, "MAIN")
    assert main == [True, True, "MainThread", True], f"threading's main thread is wrong after the probe: {main}"
    assert "WORKER DONE" in out, f"the non-daemon worker was cut off at exit (data loss):\n{out}\n{err.decode()}"


def _line_from(text: str, prefix: str):
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            return ast.literal_eval(line[len(prefix) + 1 :])
    raise AssertionError(f"no {prefix} line in {text!r}")


def _spawn_target(spawn, python, mode, pre, env=None):
    # The FIFOs must exist before the program reaches them: the workdir is
    # made here and handed over.
    workdir = tempfile.mkdtemp(prefix="rs-inv-", dir="/tmp")
    if mode != "busy":
        for name in ("injected", "stopped", "checked"):
            os.mkfifo(os.path.join(workdir, name))
    target = spawn(python, TARGET, probe=False, args=[mode, pre, workdir], env=env)
    target.workdir = workdir
    return target


def _release_in(target, name: str, mode: str) -> None:
    path = os.path.join(target.workdir, name)
    if mode == "busy":
        open(path, "w").close()
    else:
        with open(path, "w") as fifo:
            fifo.write("go\n")


@pytest.mark.parametrize("pre", ["bare", "threading"])
@pytest.mark.parametrize("mode", ["sleep", "busy"])
def test_inject_leaves_the_programs_world_as_it_was(python, bare_venvs, spawn, cli, mode, pre):
    """GIVEN a program that never heard of rankscope (its venv lacks it),
    WHEN it is injected while its main thread sleeps in C or runs bytecode,
    THEN it sees the same world, bt and python.threads name its real main
    thread, and a non-daemon worker it starts afterwards finishes before exit."""
    target = _spawn_target(spawn, bare_venvs(python), mode, pre)

    result = cli("inject", target.pid)
    assert result.returncode == 0, result.stderr

    _release_in(target, "injected", mode)
    after = _line(target, "AFTER")
    before = _line(target, "BEFORE")
    _compare(before, after, f"inject ({mode}, {pre})")
    if pre == "bare":
        assert "threading" not in after["modules"], "the probe imported threading into a program that had not"

    # The probe answers, and knows which thread is the main one.
    # The first bt imports only rankscope's own stack helpers: with a busy
    # 3.11 main thread taking the GIL back for 5 ms after each file read of
    # an import, importing `json` and what it pulls in took 15-20 s. It now
    # answers in well under a second; 10 s leaves room for a loaded machine.
    bt = cli(target.pid, "bt", "--timeout", "10")
    assert bt.returncode == 0, bt.stderr
    assert "read from outside" not in bt.stderr, bt.stderr
    assert "MainThread" in bt.stdout, bt.stdout
    threads = cli(target.pid, "query", "SELECT thread_name, is_main FROM python.threads WHERE is_main", "--format", "csv")
    assert threads.returncode == 0, threads.stderr
    assert "MainThread,true" in threads.stdout, threads.stdout

    _release_in(target, "checked", mode)
    _finish(target)


def test_start_from_another_thread_then_stop_leaves_the_world_as_it_was(python, spawn):
    """GIVEN a program that imported neither rankscope nor threading,
    WHEN it calls rankscope.start() from a thread made with _thread, and
    later stop() on its main thread, THEN it sees the same world after
    each, and its non-daemon worker still finishes before exit."""
    target = _spawn_target(spawn, python, "start", "bare")

    started = _line(target, "STARTED")
    _release_in(target, "stopped", "start")
    after = _line(target, "AFTER")
    before = _line(target, "BEFORE")
    _compare(before, started, "start() from a non-main thread")
    _compare(before, after, "stop()")

    _release_in(target, "checked", "start")
    _finish(target)


VECTOR_TARGET = r"""
import hashlib
import os
import sys

# OpenSSL's SHA-256 keeps its state in vector registers for a whole
# buffer, with no call in its loop: a thread borrowed in the middle of it
# and given back with other vector registers computes another digest (and
# CPython's eval loop, which copies pairs of stack values through xmm
# registers, crashed).
blob = bytes(range(256)) * 4096
expected = hashlib.sha256(blob).digest()
path = sys.argv[1]
print("READY", flush=True)
n = 0
while True:
    digest = hashlib.sha256(blob).digest()
    if digest != expected:
        print("CHANGED", digest.hex(), expected.hex(), flush=True)
        sys.exit(3)
    n += 1
    if n % 20 == 0 and os.path.exists(path):
        break
print("SAME", n, flush=True)
"""


def test_inject_into_a_thread_busy_in_vector_code_keeps_its_numbers(python, bare_venvs, spawn, cli):
    """GIVEN programs whose only thread is busy in vector code (so inject
    borrows it in the middle of user code, not at a syscall),
    WHEN each is injected, THEN each still computes the same digest, bit
    for bit, and exits cleanly: the thread's vector registers come back as
    they were, not only its general ones."""
    bare = bare_venvs(python)
    for attempt in range(6):
        workdir = tempfile.mkdtemp(prefix="rs-vector-", dir="/tmp")
        target = spawn(bare, VECTOR_TARGET, probe=False, args=[os.path.join(workdir, "stop")])
        result = cli("inject", target.pid)
        assert result.returncode == 0, f"attempt {attempt}: {result.stderr} (target exit {target.proc.poll()})"
        open(os.path.join(workdir, "stop"), "w").close()
        out, err = target.proc.communicate(timeout=30)
        out = "".join(target.output) + out.decode()
        assert target.proc.returncode == 0, f"attempt {attempt}: exit {target.proc.returncode}\n{out}\n{err.decode()}"
        assert "SAME" in out, out


CLOSES_ITS_FILES = """
import os, sys, time
from rankscope import _native

# Rows on their way to the run store: its files are open by now.
_native.table_append("python.torch_steps", [time.time(), 1, False, 1.0, None, None, None, None, None, None, None])
time.sleep(1.5)
# A daemon's start: every descriptor from 3 up closed, its own files opened.
os.closerange(3, 65536)
folder = sys.argv[1]
logs = [open(os.path.join(folder, f"log{i}.txt"), "w") for i in range(8)]
for n in range(5):
    _native.table_append("python.torch_steps", [time.time(), n + 2, False, 1.0, None, None, None, None, None, None, None])
    for log in logs:
        log.write(f"line {n}\\n")
        log.flush()
    time.sleep(0.4)
print("DONE", flush=True)
"""


def test_a_program_that_closes_its_descriptors_keeps_its_own_files_to_itself(python, spawn, tmp_path):
    """GIVEN a probed program whose run store has its files open, WHEN it
    closes every descriptor from 3 up and opens files of its own (which
    take the same numbers), THEN the probe writes nothing into them (the
    store's Arrow batches went into its logs) and closes none of them, and
    the program ends as it would."""
    target = spawn(python, CLOSES_ITS_FILES, args=[str(tmp_path)], wait=False)
    assert target.proc.wait(timeout=60) == 0, target.proc.stderr.read().decode()
    for i in range(8):
        assert (tmp_path / f"log{i}.txt").read_text() == "".join(f"line {n}\n" for n in range(5)), i


def test_a_setting_too_large_for_a_duration_leaves_the_program_as_it_was(python, tmp_path):
    """A memory interval of 1e20 s panicked in the probe's start, in the
    program's `site` import: the program never ran."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env.update(RANKSCOPE="1", RANKSCOPE_MEMORY_INTERVAL_S="1e20", RANKSCOPE_STORE_FLUSH_S="1e20",
               RANKSCOPE_RUN_DIR=str(tmp_path / "run"), RANKSCOPE_DIR=str(tmp_path / "ep"))
    result = subprocess.run([python, "-c", "print(sum(range(1000)))\nraise SystemExit(3)"], env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "499500\n", ""), result.stderr
