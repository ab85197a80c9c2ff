"""Every thread's Python stack, read at the moment of the request."""

from __future__ import annotations

import _thread
import json
import os
import sys
import time
import types

from rankscope._probe import mainthread
from rankscope._probe.saferepr import Budget, safe_repr, type_name

MAX_LOCALS_PER_FRAME = 64
_PROBE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_probe_stack(frame) -> bool:
    """A probe thread running eval or a collector: not the user's business."""
    while frame.f_back is not None:
        frame = frame.f_back
    return frame.f_code.co_filename.startswith(_PROBE_DIR)


def _is_noise(name: str, value: object) -> bool:
    """Module-level names that say nothing about the program's state."""
    return name.startswith("__") or isinstance(value, (types.ModuleType, types.FunctionType, type))


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


def _frames(frame, with_locals: bool, budget: Budget, max_depth: int | None = None, fields: frozenset | None = None) -> list[dict]:
    frames = []
    while frame is not None and (max_depth is None or len(frames) < max_depth):
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
        frame = frame.f_back
    return frames


def _depth(frame) -> int:
    depth = 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def collect(
    with_locals: bool = False,
    count_only: bool = False,
    max_depth: int | None = None,
    thread_name: str | None = None,
    thread_id: int | None = None,
    fields: str | None = None,
) -> str:
    """Every thread's stack as JSON. The SQL side pushes what it can down
    to here: `count_only` (a query that reads no per-frame column: only how
    many threads and frames there are), `max_depth` (from `depth < N`), a
    thread, and the frame `fields` it reads."""
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
            frame_count += _depth(frame)
            threads.append(None)
            continue
        threads.append(
            {
                "thread_id": ident,
                "native_id": getattr(thread, "native_id", None),
                "name": name,
                "daemon": bool(thread.daemon) if thread is not None else False,
                "is_main": ident == main_ident,
                "frames": _frames(frame, with_locals, budget, max_depth, wanted_fields),
            }
        )
    if count_only:
        return json.dumps({"taken_at": time.time(), "threads": [], "counts": {"threads": len(threads), "frames": frame_count}})
    threads.sort(key=lambda t: (not t["is_main"], t["name"], t["thread_id"]))
    return json.dumps({"taken_at": time.time(), "threads": threads})
