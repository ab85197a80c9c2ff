"""Crash records: uncaught exceptions written to disk with their locals.

``install()`` wraps ``sys.excepthook`` and ``threading.excepthook``. The
wrapper writes one self-contained JSON file into the run directory (tmp file,
fsync, rename, fsync of the directory) *before* it calls the previous hook, so
a hook that kills the process afterwards still leaves the record. Then the
previous hook runs: the traceback on stderr and the exit code stay what they
were. Nothing that goes wrong in here reaches the program: at most one line on
stderr. ``KeyboardInterrupt`` is recorded too (a Ctrl-C'd hang is often what
one wants to look at); ``SystemExit`` never reaches these hooks.

``rankscope crashes`` (the CLI) reads the records; its idea of the run
directory (``run_dir()``) must stay the same as this one.
"""

from __future__ import annotations

import faulthandler
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
_previous_excepthook = None
_previous_threading_excepthook = None
# faulthandler writes to this file object's descriptor: it must stay open.
_native_log = None


def run_dir() -> str:
    """RANKSCOPE_RUN_DIR, else ~/.local/state/rankscope/runs/<job>."""
    explicit = os.environ.get("RANKSCOPE_RUN_DIR")
    if explicit:
        return explicit
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "local"
    return os.path.join(os.path.expanduser("~"), ".local", "state", "rankscope", "runs", job)


def _rank() -> int:
    torch_rank = sys.modules.get("rankscope._probe.torch_rank")
    if torch_rank is not None and torch_rank.assigned() is not None:
        return torch_rank.assigned()[0]
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
    }


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


def _excepthook(exc_type, exc, tb):
    if exc is not None:
        record(exc, "excepthook")
        post_mortem(exc)
    previous = _previous_excepthook or sys.__excepthook__
    previous(exc_type, exc, tb)


def _threading_excepthook(args):
    if args.exc_value is not None and not issubclass(args.exc_type, SystemExit):
        name = args.thread.name if args.thread is not None else None
        record(args.exc_value, "threading.excepthook", name)
    previous = _previous_threading_excepthook or threading.__excepthook__
    previous(args)


def _close_native_log() -> None:
    """At a clean exit: an empty native log means no native crash; drop it."""
    global _native_log
    log = _native_log
    if log is None:
        return
    try:
        if faulthandler.is_enabled():
            faulthandler.disable()
        _native_log = None
        path = log.name
        log.close()
        if os.path.getsize(path) == 0:
            os.unlink(path)
    except Exception:  # noqa: BLE001
        pass


def _enable_faulthandler() -> None:
    global _native_log
    if faulthandler.is_enabled():
        return  # the user's own setup wins
    directory = run_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"native-{os.getpid()}.log")
    if os.path.exists(path) and os.path.getsize(path) > 0:
        # An earlier process with this PID crashed here: keep its log.
        path = os.path.join(directory, f"native-{os.getpid()}-{int(time.time() * 1000)}.log")
    log = open(path, "w")  # noqa: SIM115 - kept open on purpose
    faulthandler.enable(file=log, all_threads=True)
    _native_log = log
    import atexit

    atexit.register(_close_native_log)


def _after_fork_in_child() -> None:
    # The parent's native log belongs to the parent; the child gets its own.
    global _native_log
    if _native_log is None:
        return
    _native_log = None
    try:
        faulthandler.disable()
        _enable_faulthandler()
    except Exception:  # noqa: BLE001
        pass


def install() -> None:
    """Wraps the exception hooks and turns on faulthandler (once)."""
    global _installed, _previous_excepthook, _previous_threading_excepthook
    if _installed:
        return
    _installed = True
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    _previous_threading_excepthook = threading.excepthook
    threading.excepthook = _threading_excepthook
    try:
        _enable_faulthandler()
        os.register_at_fork(after_in_child=_after_fork_in_child)
    except Exception as err:  # noqa: BLE001
        sys.stderr.write(f"rankscope: native crash log not enabled: {err}\n")


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
