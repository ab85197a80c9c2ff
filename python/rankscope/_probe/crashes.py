"""Crash records: uncaught exceptions written to disk with their locals.

An uncaught exception of the main thread arrives through the audit event
``sys.excepthook`` (``on_uncaught``); those of other threads through a
wrapped ``threading.excepthook`` when the probe started with the interpreter
(``install_thread_hook``). One self-contained JSON file goes into the run
directory (tmp file, fsync, rename, fsync of the directory) *before* the
program's hook runs, so a hook that kills the process afterwards still
leaves the record. Then the program's hook runs: the traceback on stderr and
the exit code stay what they were. Nothing that goes wrong in here reaches the program: at most one line on
stderr. ``KeyboardInterrupt`` is recorded too (a Ctrl-C'd hang is often what
one wants to look at); ``SystemExit`` never reaches these hooks.

``rankscope crashes`` (the CLI) reads the records; its idea of the run
directory (``run_dir()``) must stay the same as this one.
"""

from __future__ import annotations

import json
import linecache
import os
import socket
import sys
import threading
import time

from rankscope._probe.saferepr import Budget
from rankscope._probe.stacks import _locals

RECORD_VERSION = 1
MAX_CHAIN = 16
MAX_FRAMES = 200
MAX_MESSAGE = 4000
_MARK = "__rankscope_recorded__"

_installed = False
_crashed = False
_previous_threading_excepthook = None


def run_dir() -> str:
    """RANKSCOPE_RUN_DIR, else ~/.local/state/rankscope/runs/<job>: the
    probe's and the CLI's idea of it come from the same Rust function."""
    from rankscope import _native

    return _native.run_dir()


def _rank() -> int | None:
    torch_rank = sys.modules.get("rankscope._probe.torch_rank")
    if torch_rank is not None and torch_rank.assigned() is not None:
        return torch_rank.assigned()[0]
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is not None and multiprocessing.parent_process() is not None:
        # A child multiprocessing started (a DataLoader worker): RANK is its
        # parent's (see meta.rs, `multiprocessing_child`).
        return None
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


# A job launcher's own process: torchrun's console script, or the modules
# `python -m` runs for it (argv[0] is then the module's file).
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_LAUNCHER_SCRIPTS = (os.path.join("torch", "distributed", "run.py"), os.path.join("torch", "distributed", "launch.py"))


def _is_launcher() -> bool:
    """torchrun's own process (the elastic agent) or torch.distributed.launch:
    no rank, and its exit (a SIGTERM that ends the job, the echo of a worker's
    failure) is no crash of the user's program. Its command line decides: a
    worker never runs the launcher's module, and a RANK exported into the
    launcher's environment (multi-node scripts do) does not make it a rank."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", None) in _LAUNCHER_MODULES:
        return True
    argv0 = sys.argv[0] if sys.argv else ""
    return os.path.basename(argv0) == "torchrun" or argv0.endswith(_LAUNCHER_SCRIPTS)


def _frames(tb, budget: Budget) -> tuple[list[dict], int]:
    """The frames of `tb`, outermost first, and how many were left out: a
    deep recursion keeps its innermost MAX_FRAMES, where it went wrong."""
    entries = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:  # on_error's own wrapper
            entries.append(tb)
        tb = tb.tb_next
    omitted = max(0, len(entries) - MAX_FRAMES)
    frames = []
    for tb in entries[omitted:]:
        frame = tb.tb_frame
        code = frame.f_code
        lineno = tb.tb_lineno
        if lineno is None or lineno < 0:
            lineno = code.co_firstlineno
        source = linecache.getline(code.co_filename, lineno, frame.f_globals).strip()
        frames.append(
            {
                "func": code.co_name,
                "qualname": getattr(code, "co_qualname", code.co_name),
                "file": code.co_filename,
                "lineno": lineno,
                "source": source or None,
                "locals": _locals(frame, budget),
            }
        )
    return frames, omitted


def _message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except BaseException as err:  # noqa: BLE001
        return f"<exception str() failed: {type(err).__name__}>"
    if len(text) > MAX_MESSAGE:
        return f"{text[:MAX_MESSAGE]}... ({len(text) - MAX_MESSAGE} more chars)"
    return text


def _chain(exc: BaseException, budget: Budget) -> list[dict]:
    """The exceptions in the order Python prints them: the last one raised last.

    Each entry's ``via`` says how it follows the one before it: "cause"
    (``raise ... from``) or "context" (raised while handling it).
    """
    links: list[tuple[BaseException, str | None]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    via: str | None = None
    while current is not None and id(current) not in seen and len(links) < MAX_CHAIN:
        seen.add(id(current))
        links.append((current, via))
        if current.__cause__ is not None:
            current, via = current.__cause__, "cause"
        elif current.__context__ is not None and not current.__suppress_context__:
            current, via = current.__context__, "context"
        else:
            current = None
    links.reverse()
    out = []
    for i, (e, _) in enumerate(links):
        # `via` was recorded on the later exception of each pair; after the
        # reverse it belongs to the entry that follows.
        following_via = links[i - 1][1] if i > 0 else None
        frames, omitted = _frames(e.__traceback__, budget)
        out.append(
            {
                "type": _type_name(type(e)),
                "message": _message(e),
                "via": following_via,
                "frames": frames,
                "frames_omitted": omitted,
            }
        )
    return out


def _type_name(t: type) -> str:
    module = getattr(t, "__module__", "") or ""
    name = getattr(t, "__qualname__", None) or t.__name__
    return name if module in ("builtins", "__main__") else f"{module}.{name}"


def build_record(exc: BaseException, source: str, thread_name: str | None = None) -> dict:
    now = time.time()
    if thread_name is None:
        thread_name = threading.current_thread().name
    launcher = _is_launcher()
    return {
        "version": RECORD_VERSION,
        "source": source,
        "time": now,
        "host": socket.gethostname(),
        "rank": None if launcher else _rank(),
        "launcher": launcher,
        "pid": os.getpid(),
        "thread": thread_name,
        "argv": [str(a) for a in sys.argv],
        "python_version": sys.version.split()[0],
        "exceptions": _chain(exc, Budget(tensor_stats=True)),
        "memory": _memory_picture(exc),
    }


# The memory timeline's rows an out-of-memory record keeps.
TIMELINE_ROWS_KEPT = 30


def _memory_picture(exc: BaseException) -> dict | None:
    """The process's memory at the crash (RSS, its peak and swap); for an
    out-of-memory error also USS and PSS, CUDA's allocator and the largest tensors with
    their holders (``_probe/memory.py``)."""
    # torch says a CPU allocation failed with a plain RuntimeError.
    out_of_memory = (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (type(exc) is RuntimeError and "DefaultCPUAllocator: can't allocate memory" in str(exc))
    )
    try:
        from rankscope import _native

        # USS and PSS only for a memory error: smaps_rollup takes 10-15 ms
        # with torch loaded, and the traceback waits for the record (under
        # torchrun, the other ranks' SIGTERM cut it short more often).
        now = _native.memory_now(out_of_memory)
        picture = {key + "_mb": value / float(1 << 20) for key, value in now.items()}
    except Exception:  # noqa: BLE001 - a record without it is still a record
        return None
    if out_of_memory:
        try:
            import json

            # How it got here: the timeline's last rows (one a second, or a
            # step's), oldest first.
            tail = json.loads(_native.table_tail("memory", TIMELINE_ROWS_KEPT))
            picture["timeline"] = [dict(zip(tail["columns"], row)) for row in tail["rows"]]
        except Exception as err:  # noqa: BLE001
            picture["timeline_error"] = f"{type(err).__name__}: {err}"
        try:
            from rankscope._probe import memory

            torch = memory._torch()
            picture["cuda"] = memory._cuda(torch)
            if torch is not None and torch.cuda.is_initialized():
                # The caching allocator's own account: what is allocated,
                # reserved and cached, per pool (no device sync).
                # Of the device that ran out, not the current one: the
                # thread writing this record may not be the one whose
                # device failed.
                device = _oom_device(str(exc), picture["cuda"])
                picture["cuda_summary"] = torch.cuda.memory_summary(device=device, abbreviated=True)
            if torch is not None:
                from rankscope._probe.torch import tensors

                scan = tensors.scan(budget_s=0.5)
                largest = sorted(scan["rows"], key=lambda r: -r[5])[:10]
                picture["largest_tensors"] = [dict(zip(memory.TENSOR_COLUMNS, row[1:])) for row in largest]
        except Exception as err:  # noqa: BLE001
            picture["error"] = f"{type(err).__name__}: {err}"
    return picture


def _oom_device(message: str, devices: list) -> int | None:
    """The index of the CUDA device that ran out: the one the allocator's
    message names ("... GPU 3 has a total capacity of ..."), else the one
    with the most OOMs, then the most reserved. The counts are the
    process's since it began, so an earlier OOM on another device, caught
    by the program, would outweigh this one: the message comes first."""
    import re

    indices = [int(d["device"].split(":")[1]) for d in devices]
    named = re.search(r"\bGPU (\d+) has a total capacity", message)
    if named and int(named.group(1)) in indices:
        return int(named.group(1))
    worst = max(devices, key=lambda d: (d["ooms"], d["reserved_mb"]), default=None)
    return int(worst["device"].split(":")[1]) if worst else None


def _write_atomically(directory: str, name: str, data: bytes) -> str:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def record(exc: BaseException, source: str, thread_name: str | None = None) -> str | None:
    """Writes one crash record for `exc`, once per exception object.

    Returns the file written, or None (already recorded, or it failed; a
    failure is one line on stderr and nothing else).
    """
    try:
        if getattr(exc, _MARK, False):
            return None
        try:
            setattr(exc, _MARK, True)
        except Exception:  # noqa: BLE001 - an exception type without a __dict__
            pass
        rec = build_record(exc, source, thread_name)
        global _crashed
        _crashed = True
        from rankscope import _native

        _native.mark_crashed()
        name = f"crash-{int(rec['time'] * 1000)}-rank{rec['rank']}-pid{rec['pid']}.json"
        data = json.dumps(rec, ensure_ascii=False, default=str).encode("utf-8", "backslashreplace")
        return _write_atomically(run_dir(), name, data)
    except BaseException as err:  # noqa: BLE001 - the user's crash must stay the user's
        try:
            sys.stderr.write(f"rankscope: crash not recorded: {type(err).__name__}: {err}\n")
        except BaseException:  # noqa: BLE001
            pass
        return None


def crashed() -> bool:
    """Whether this process recorded a crash."""
    return _crashed


def _threading_excepthook(args):
    if args.exc_value is not None and not issubclass(args.exc_type, SystemExit):
        name = args.thread.name if args.thread is not None else None
        record(args.exc_value, "threading.excepthook", name)
    previous = _previous_threading_excepthook or threading.__excepthook__
    previous(args)


def on_uncaught(args) -> None:
    """The audit event ``sys.excepthook``, raised by CPython just before it
    calls the program's hook: ``(hook, type, value, traceback)``. The hook
    itself is never replaced (``crash_hook.rs`` says why)."""
    exc = args[2]
    if isinstance(exc, BaseException) and not isinstance(exc, SystemExit):
        if record(exc, "excepthook") is not None:
            post_mortem(exc)


def install_thread_hook() -> None:
    """Wraps ``threading.excepthook``, for a probe started with the
    interpreter (``RANKSCOPE=1``), before the program has run: a probe
    started later leaves the program's hooks as they are."""
    global _installed, _previous_threading_excepthook
    if _installed:
        return
    _installed = True
    _previous_threading_excepthook = threading.excepthook
    threading.excepthook = _threading_excepthook


def post_mortem(exc: BaseException) -> None:
    """Opens the post-mortem RANKSCOPE_ON_ERROR asks for, at most once per
    exception; "record" (the default) opens none."""
    try:
        from rankscope._probe import postmortem

        postmortem.open_for(exc)
    except BaseException as err:  # noqa: BLE001 - the user's crash must stay the user's
        try:
            sys.stderr.write(f"rankscope: post-mortem not opened: {type(err).__name__}: {err}\n")
        except BaseException:  # noqa: BLE001
            pass


class on_error:  # noqa: N801 - used like a function: @rankscope.on_error()
    """Records an exception that leaves the block or function, then re-raises it.

    ``@rankscope.on_error()`` or ``with rankscope.on_error():``. The same
    exception reaching ``sys.excepthook`` afterwards is not recorded twice.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and not issubclass(exc_type, (SystemExit, GeneratorExit)):
            if record(exc, "on_error") is not None:
                post_mortem(exc)
        return False

    def __call__(self, func):
        import functools

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with self:
                return func(*args, **kwargs)

        return wrapper
