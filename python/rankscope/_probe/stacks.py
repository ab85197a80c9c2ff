"""Every thread's Python stack, read at the moment of the request.

It imports nothing the interpreter has not loaded at start (its replies are
plain dicts, made into JSON in Rust): the first `bt` after an inject would
otherwise import `json` (and `re`, `enum`...) into the program from a probe
thread, and on 3.11, with the main thread running bytecode, every file read
of those imports hands the GIL over and waits a switch interval for it back:
seconds in all.
"""

from __future__ import annotations

import _thread
import os
import sys
import time

from rankscope._probe import mainthread
from rankscope._probe.saferepr import Budget, safe_repr, type_name

MAX_LOCALS_PER_FRAME = 64
_PROBE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames of code under the rankscope package (the init_process_group
# wrapper, on_error's wrapper, breakpoint hooks) are ours, not the user's:
# stacks leave them out unless asked for all frames. The package is named
# both as it was imported (an injected target imports it through a link in
# the staging directory) and as it lies on disk. `demo.py` is the sample
# program `rankscope demo` runs: there it is the user's code.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_PREFIXES = tuple({_PACKAGE_DIR + os.sep, os.path.realpath(_PACKAGE_DIR) + os.sep})
_SAMPLE = os.sep + "rankscope" + os.sep + "demo.py"


def _is_probe_stack(frame) -> bool:
    """A probe thread running eval or a collector: not the user's business."""
    while frame.f_back is not None:
        frame = frame.f_back
    return frame.f_code.co_filename.startswith(_PROBE_DIR)


def is_own(frame) -> bool:
    filename = frame.f_code.co_filename
    return filename.startswith(_OWN_PREFIXES) and not filename.endswith(_SAMPLE)


def visible(frame, all_frames: bool = False):
    """The frames of a stack, innermost first, as `bt` shows and numbers
    them: the position in this walk is the `depth` that `--frame` takes."""
    while frame is not None:
        if all_frames or not is_own(frame):
            yield frame
        frame = frame.f_back


_NOISE_TYPES = (type(sys), type(_is_probe_stack), type)


def _is_noise(name: str, value: object) -> bool:
    """Module-level names that say nothing about the program's state
    (modules, functions, classes)."""
    return name.startswith("__") or isinstance(value, _NOISE_TYPES)


def _locals(frame, budget: Budget) -> list[dict]:
    try:
        items = list(frame.f_locals.items())
    except Exception as exc:  # noqa: BLE001
        return [{"name": "<locals>", "repr": f"<unavailable: {type(exc).__name__}>", "type": ""}]
    if frame.f_code.co_name == "<module>":
        # A module frame's locals are its globals: keep the data, drop the
        # imports, functions, classes and dunders that would bury it.
        items = [(name, value) for name, value in items if not _is_noise(str(name), value)]
    out = []
    for name, value in items[:MAX_LOCALS_PER_FRAME]:
        out.append({"name": str(name), "repr": safe_repr(value, budget), "type": type_name(value)})
    if len(items) > MAX_LOCALS_PER_FRAME:
        more = len(items) - MAX_LOCALS_PER_FRAME
        out.append({"name": "...", "repr": f"{more} more locals", "type": ""})
    return out


def _frames(
    frame, with_locals: bool, budget: Budget, max_depth: int | None = None, fields: frozenset | None = None, all_frames: bool = False
) -> list[dict]:
    frames = []
    for frame in visible(frame, all_frames):
        if max_depth is not None and len(frames) >= max_depth:
            break
        code = frame.f_code
        lineno = frame.f_lineno
        entry = {"func": code.co_name, "lineno": lineno if lineno is not None else code.co_firstlineno}
        # Columns the query does not read stay home (projection push-down).
        if fields is None or "qualname" in fields:
            entry["qualname"] = getattr(code, "co_qualname", code.co_name)
        if fields is None or "file" in fields:
            entry["file"] = code.co_filename
        if with_locals:
            entry["locals"] = _locals(frame, budget)
        frames.append(entry)
    return frames


def _depth(frame, all_frames: bool) -> int:
    return sum(1 for _ in visible(frame, all_frames))


def collect(
    with_locals: bool = False,
    count_only: bool = False,
    max_depth: int | None = None,
    thread_name: str | None = None,
    thread_id: int | None = None,
    fields: str | None = None,
    all_frames: bool = False,
) -> dict:
    """Every thread's stack (the reply of `GET /v1/stacks`). The SQL side pushes what it can down
    to here: `count_only` (a query that reads no per-frame column: only how
    many threads and frames there are), `max_depth` (from `depth < N`), a
    thread, and the frame `fields` it reads. rankscope's own frames are left
    out (and not counted in `depth`) unless `all_frames`."""
    threading = sys.modules.get("threading")
    me = _thread.get_ident()
    current = sys._current_frames()
    known = {t.ident: t for t in threading.enumerate()} if threading else {}
    main_ident = threading.main_thread().ident if threading else mainthread.main_ident()
    wanted_fields = frozenset(fields.split(",")) if fields else None
    budget = Budget()
    threads = []
    frame_count = 0
    for ident, frame in current.items():
        if ident == me or _is_probe_stack(frame):
            continue
        if thread_id is not None and ident != thread_id:
            continue
        thread = known.get(ident)
        # A program that never imported threading still has a main thread.
        name = thread.name if thread is not None else ("MainThread" if ident == main_ident else "")
        if thread_name is not None and name != thread_name:
            continue
        if count_only:
            frame_count += _depth(frame, all_frames)
            threads.append(None)
            continue
        threads.append(
            {
                "thread_id": ident,
                "native_id": getattr(thread, "native_id", None),
                "name": name,
                "daemon": bool(thread.daemon) if thread is not None else False,
                "is_main": ident == main_ident,
                "frames": _frames(frame, with_locals, budget, max_depth, wanted_fields, all_frames),
            }
        )
    if count_only:
        return {"taken_at": time.time(), "threads": [], "counts": {"threads": len(threads), "frames": frame_count}}
    threads.sort(key=lambda t: (not t["is_main"], t["name"], t["thread_id"]))
    return {"taken_at": time.time(), "threads": threads}


class NoSuchFrame(Exception):
    """The thread or frame an eval asked for is not there (one line, and a hint)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


def _user_threads() -> list[tuple[int, object, object]]:
    """(ident, Thread or None, innermost frame) of the threads `bt` shows,
    main thread first."""
    threading = sys.modules.get("threading")
    me = _thread.get_ident()
    known = {t.ident: t for t in threading.enumerate()} if threading else {}
    main_ident = threading.main_thread().ident if threading else None
    found = [(ident, known.get(ident), frame) for ident, frame in sys._current_frames().items() if ident != me and not _is_probe_stack(frame)]
    found.sort(key=lambda t: (t[0] != main_ident, getattr(t[1], "name", ""), t[0]))
    return found


def _thread_label(ident: int, thread) -> str:
    name = getattr(thread, "name", None) or "<no name>"
    return f'"{name}" ({ident:#x})'


def find_frame(thread_spec: str | None, depth: int):
    """The frame an eval runs in, and where that is in words.

    `thread_spec` is a thread's name, its ident (`0x...` as `bt` prints it,
    or decimal) or its kernel tid; None is the main thread. `depth` counts
    the frames `bt` shows, 0 = innermost. The caller must drop the frame
    when its request ends."""
    threads = _user_threads()
    listing = ", ".join(_thread_label(ident, thread) for ident, thread, _ in threads) or "none"
    if thread_spec is None:
        threading = sys.modules.get("threading")
        main_ident = threading.main_thread().ident if threading else None
        chosen = [t for t in threads if t[0] == main_ident] or (threads if len(threads) == 1 else [])
        if not chosen:
            raise NoSuchFrame("the main thread runs no Python code now", f"name a thread with --thread; threads: {listing}")
    else:
        spec = thread_spec.strip()
        chosen = [t for t in threads if getattr(t[1], "name", None) == spec]
        if not chosen:
            try:
                number = int(spec, 0)
            except ValueError:
                number = None
            chosen = [t for t in threads if number is not None and number in (t[0], getattr(t[1], "native_id", None))]
        if not chosen:
            raise NoSuchFrame(f"no thread {spec!r} runs Python code in this process", f"threads: {listing} (`rankscope PID bt` shows them)")
        if len(chosen) > 1:
            ids = ", ".join(f"{ident:#x}" for ident, _, _ in chosen)
            raise NoSuchFrame(f"{len(chosen)} threads are named {spec!r}", f"name one by its id: --thread {ids.split(', ')[0]} (ids: {ids})")
    ident, thread, innermost = chosen[0]
    label = _thread_label(ident, thread)
    for number, frame in enumerate(visible(innermost)):
        if number == depth:
            code = frame.f_code
            where = f"frame {depth}: {getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{frame.f_lineno}) in thread {label}"
            return frame, where
    count = sum(1 for _ in visible(innermost))
    has = f"frames 0-{count - 1}" if count > 1 else ("only frame 0" if count == 1 else "no frames of its own")
    raise NoSuchFrame(
        f"thread {label} has {has}; there is no frame {depth}",
        "`rankscope PID bt` numbers each thread's frames, innermost first",
    )
