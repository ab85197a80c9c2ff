"""Every thread's Python stack, read at the moment of the request."""

from __future__ import annotations

import _thread
import json
import os
import sys
import time
import types

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


def _frames(frame, with_locals: bool, budget: Budget) -> list[dict]:
    frames = []
    while frame is not None:
        code = frame.f_code
        lineno = frame.f_lineno
        entry = {
            "func": code.co_name,
            "qualname": getattr(code, "co_qualname", code.co_name),
            "file": code.co_filename,
            "lineno": lineno if lineno is not None else code.co_firstlineno,
        }
        if with_locals:
            entry["locals"] = _locals(frame, budget)
        frames.append(entry)
        frame = frame.f_back
    return frames


def collect(with_locals: bool = False) -> str:
    threading = sys.modules.get("threading")
    me = _thread.get_ident()
    current = sys._current_frames()
    known = {t.ident: t for t in threading.enumerate()} if threading else {}
    main_ident = threading.main_thread().ident if threading else None
    budget = Budget()
    threads = []
    for ident, frame in current.items():
        if ident == me or _is_probe_stack(frame):
            continue
        thread = known.get(ident)
        threads.append(
            {
                "thread_id": ident,
                "native_id": getattr(thread, "native_id", None),
                "name": thread.name if thread is not None else "",
                "daemon": bool(thread.daemon) if thread is not None else False,
                "is_main": ident == main_ident,
                "frames": _frames(frame, with_locals, budget),
            }
        )
    threads.sort(key=lambda t: (not t["is_main"], t["name"], t["thread_id"]))
    return json.dumps({"taken_at": time.time(), "threads": threads})
