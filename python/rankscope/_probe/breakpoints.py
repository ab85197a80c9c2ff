"""Breakpoints that record and go on, set from outside into a live process.

CPython 3.12+: ``sys.monitoring`` under a tool id of our own. ``LINE`` events
are enabled only on the code objects that hold a breakpoint, and every other
line of those returns ``DISABLE``, so the rest of the program runs untouched,
and frames that are already running see the breakpoint too (a ``while True``
loop in ``train()``). A hit evaluates the condition (compiled once, when the
breakpoint is set), counts, and records a snapshot (the stack with safe-repr
locals, the same code as crash records) or a log line into a bounded table.
Nothing raised here reaches user code: a failing condition is counted, and
after MAX_ERRORS the breakpoint disables itself and says why.

A breakpoint in a file that is not imported yet stays pending: a meta-path
finder that only watches wraps that module's loader, and arms the breakpoint
once the module has executed (module-level lines of that first run are not
seen; functions are).

Not built yet: 3.11 (no sys.monitoring there; it needs code-object
instrumentation), pause sessions, watches.
"""

from __future__ import annotations

import collections
import gc
import importlib.machinery
import itertools
import json
import os
import sys
import threading
import time
import types

from rankscope._probe.saferepr import Budget, safe_repr
from rankscope._probe.stacks import _locals

MAX_ERRORS = 5
MAX_SNAPSHOTS = 1000
MAX_SNAPSHOT_FRAMES = 30
# Snapshots also go, one JSON line each, to <run dir>/snapshots/pid<P>.jsonl
# so that they outlive the process; past this size the spill stops.
MAX_SPILL_BYTES = 64 << 20
TOOL_NAME = "rankscope"

_lock = threading.RLock()
_ids = itertools.count(1)
_breakpoints: dict[int, "Breakpoint"] = {}
# code object -> line -> breakpoints there
_by_code: dict[types.CodeType, dict[int, list["Breakpoint"]]] = {}
_snapshots: collections.deque = collections.deque(maxlen=MAX_SNAPSHOTS)
_snapshot_ids = itertools.count(1)
_tool_id: int | None = None
_spill_fd: int | None = None
_spilled = 0
_spill_off = False


class UserError(Exception):
    """Bad input: reported to the CLI, nothing changed."""


class _NotLoaded(Exception):
    """No loaded code comes from this file (yet)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


class _Pending:
    """A breakpoint in a file not imported yet: armed when a module whose
    file matches finishes executing (functions exist then)."""

    def __init__(self, spec: str, path: str, options: dict):
        self.id = next(_ids)
        self.spec, self.path, self.options = spec, path, options
        self.note = None

    def describe(self) -> dict:
        file, _, line = self.spec.rpartition(":")
        return {
            "id": self.id,
            "file": file,
            "line": int(line) if line.isdigit() else line,
            "condition": self.options.get("condition"),
            "log": self.options.get("log"),
            "max": self.options.get("max_hits"),
            "every": self.options.get("every"),
            "hit_from": self.options.get("from_hit"),
            "passes": 0,
            "hits": 0,
            "errors": 0,
            "enabled": True,
            "pending": True,
            "note": self.note or f"pending: {self.path} is not imported yet; armed on import",
        }


_pending: dict[int, _Pending] = {}


def _matches(filename: str | None, path: str) -> bool:
    return bool(filename) and (filename == path or os.path.basename(filename) == path or filename.endswith("/" + path))


class _ArmOnImport:
    """A meta-path finder that only watches: it asks the other finders, and
    wraps the loader of a module whose file a pending breakpoint names."""

    _busy = threading.local()

    def find_spec(self, name, path=None, target=None):
        # Never in the way of an import: no recursion into ourselves, and
        # any failure here means "not mine", so the normal finders go on.
        if not _pending or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            return self._watch(name, path, target)
        except Exception:  # noqa: BLE001
            return None
        finally:
            self._busy.active = False

    def _watch(self, name, path, target):
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not any(_matches(spec.origin, p.path) for p in _pending.values()):
            return None
        if not hasattr(spec.loader, "exec_module"):
            return None
        original = spec.loader.exec_module

        def exec_module(module, _original=original):
            _original(module)
            try:
                _arm_pending(spec.origin)
            except Exception:  # noqa: BLE001 - the import itself succeeded; keep it that way
                pass

        spec.loader.exec_module = exec_module
        return spec


_finder = _ArmOnImport()


def _arm_pending(filename: str) -> None:
    with _lock:
        for pending in [p for p in _pending.values() if _matches(filename, p.path)]:
            try:
                file, line, codes, note = _resolve(pending.spec)
                bp = Breakpoint(file, line, codes, **_breakpoint_options(pending.options))
            except Exception as err:  # noqa: BLE001 - reported in break list, never raised into the import
                pending.note = f"could not arm on import: {err}"
                continue
            del _pending[pending.id]
            bp.id = pending.id
            bp.note = note
            _arm(bp)
        if not _pending and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def _breakpoint_options(options: dict) -> dict:
    return {k: options.get(k) for k in ("condition", "log", "max_hits", "every", "from_hit")}


class Breakpoint:
    def __init__(
        self,
        file: str,
        line: int,
        codes: list,
        condition: str | None,
        log: str | None,
        max_hits: int | None,
        every: int | None,
        from_hit: int | None = None,
    ):
        self.id = next(_ids)
        self.file, self.line, self.codes = file, line, codes
        self.condition_source, self.log_source = condition, log
        self.condition = compile(condition, "<breakpoint condition>", "eval") if condition else None
        self.log = compile("f" + repr(log), "<logpoint>", "eval") if log is not None else None
        self.max_hits, self.every, self.from_hit = max_hits, every, from_hit
        self.passes = self.hits = self.errors = 0
        self.enabled, self.note = True, None

    def describe(self) -> dict:
        return {
            "id": self.id,
            "file": self.file,
            "line": self.line,
            "condition": self.condition_source,
            "log": self.log_source,
            "max": self.max_hits,
            "every": self.every,
            "hit_from": self.from_hit,
            "passes": self.passes,
            "hits": self.hits,
            "errors": self.errors,
            "enabled": self.enabled,
            "note": self.note,
        }

    def on_line(self, frame) -> None:
        if not self.enabled:
            return
        self.passes += 1
        if self.every and self.passes % self.every:
            return
        if self.from_hit and self.passes < self.from_hit:
            return
        message = None
        try:
            if self.condition is not None and not eval(self.condition, frame.f_globals, frame.f_locals):
                return
            if self.log is not None:
                message = str(eval(self.log, frame.f_globals, frame.f_locals))
        except Exception as err:  # noqa: BLE001 - never into user code
            self.errors += 1
            self.note = f"{type(err).__name__}: {err}"
            if self.errors >= MAX_ERRORS:
                self.enabled = False
                self.note = f"disabled after {self.errors} errors; last: {self.note}"
            return
        self.hits += 1
        snap = _snapshot(self, frame, message)
        _snapshots.append(snap)
        _spill(snap)
        if self.max_hits and self.hits >= self.max_hits:
            self.enabled = False
            remove(self.id)


def _snapshot(bp: Breakpoint, frame, message: str | None) -> dict:
    budget = Budget(tensor_stats=False)
    frames = []
    current = frame
    while current is not None and len(frames) < MAX_SNAPSHOT_FRAMES:
        code = current.f_code
        frames.append(
            {
                "func": code.co_name,
                "file": code.co_filename,
                "lineno": current.f_lineno,
                # Locals of the hit frame; the outer ones only name where it came from.
                "locals": _locals(current, budget) if current is frame else [],
            }
        )
        current = current.f_back
    return {
        "id": next(_snapshot_ids),
        "bp_id": bp.id,
        "hit": bp.hits,
        "time": time.time(),
        "thread": threading.current_thread().name,
        "log": message,
        "frames": frames,
    }


def _spill(snap: dict) -> None:
    """Appends the snapshot to the run directory; a failure (full or
    read-only disk) turns spilling off and costs the program nothing."""
    global _spill_fd, _spilled, _spill_off
    if _spill_off:
        return
    try:
        if _spill_fd is None:
            from rankscope._probe import crashes

            directory = os.path.join(crashes.run_dir(), "snapshots")
            os.makedirs(directory, mode=0o700, exist_ok=True)
            path = os.path.join(directory, f"pid{os.getpid()}.jsonl")
            _spill_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            _spill_identity.update(pid=os.getpid(), rank=crashes._rank(), host=os.uname().nodename)
        line = (json.dumps(dict(snap, **_spill_identity), default=str) + "\n").encode("utf-8", "backslashreplace")
        if _spilled + len(line) > MAX_SPILL_BYTES:
            _spill_off = True
            return
        os.write(_spill_fd, line)
        _spilled += len(line)
    except Exception:  # noqa: BLE001
        _spill_off = True


_spill_identity: dict = {}


def _on_line(code, line):
    try:
        bps = _by_code.get(code, {}).get(line)
        if not bps:
            return sys.monitoring.DISABLE
        frame = sys._getframe(1)
        for bp in list(bps):
            bp.on_line(frame)
    except Exception:  # noqa: BLE001 - a broken breakpoint must not break the program
        pass
    return None


def _tool() -> int:
    global _tool_id
    if _tool_id is not None:
        return _tool_id
    monitoring = sys.monitoring
    for candidate in range(6):  # ids 0-5 are for tools; 6 is settrace's, 7 setprofile's
        if monitoring.get_tool(candidate) is None:
            monitoring.use_tool_id(candidate, TOOL_NAME)
            monitoring.register_callback(candidate, monitoring.events.LINE, _on_line)
            _tool_id = candidate
            return candidate
    owners = ", ".join(str(monitoring.get_tool(i)) for i in range(6))
    raise UserError(f"every sys.monitoring tool id is taken ({owners})")


def _release_tool() -> None:
    global _tool_id
    if _tool_id is None or _by_code:
        return
    sys.monitoring.register_callback(_tool_id, sys.monitoring.events.LINE, None)
    sys.monitoring.free_tool_id(_tool_id)
    _tool_id = None


def _all_code() -> list[types.CodeType]:
    """Every code object reachable from functions and running frames,
    nested ones (inner functions, comprehensions) included."""
    seen: dict[int, types.CodeType] = {}

    def visit(code):
        if id(code) in seen:
            return
        seen[id(code)] = code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                visit(const)

    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType):
            visit(obj.__code__)
    for frame in sys._current_frames().values():
        while frame is not None:
            visit(frame.f_code)
            frame = frame.f_back
    return list(seen.values())


def _resolve(spec: str) -> tuple[str, int, list[types.CodeType], str | None]:
    path, sep, where = spec.rpartition(":")
    if not sep or not where:
        raise UserError(f"{spec!r} is not FILE:LINE or FILE:FUNCTION (e.g. train.py:88, model.py:Attention.forward)")
    codes = [c for c in _all_code() if c.co_filename == path or os.path.basename(c.co_filename) == path or c.co_filename.endswith("/" + path)]
    files = sorted({c.co_filename for c in codes})
    if not files:
        raise _NotLoaded(path)
    if len(files) > 1:
        raise UserError(f"{path!r} matches several files: {', '.join(files)}; give more of the path")
    if not where.isdigit():
        return _resolve_function(files[0], where, codes)
    wanted = int(where)
    lines = sorted({ln for c in codes for _, _, ln in c.co_lines() if ln is not None and ln >= wanted})
    if not lines:
        raise UserError(f"{files[0]} has no code at or after line {wanted}")
    line = lines[0]
    holders = [c for c in codes if any(ln == line for _, _, ln in c.co_lines())]
    note = None if line == wanted else f"line {wanted} has no code; the breakpoint is on line {line}, the next line that has"
    return files[0], line, holders, note


def _resolve_function(file: str, name: str, codes: list) -> tuple[str, int, list[types.CodeType], str | None]:
    """FILE:FUNCTION (a qualified name, `Class.method`): its first line of body."""
    matches = [c for c in codes if c.co_qualname == name]
    if not matches:
        matches = [c for c in codes if c.co_name == name]
    if not matches:
        raise UserError(f"no function {name!r} in {file}")
    if len({c.co_qualname for c in matches}) > 1:
        names = ", ".join(sorted({c.co_qualname for c in matches}))
        raise UserError(f"{name!r} matches several functions in {file}: {names}; give the qualified name")
    code = matches[0]
    body = sorted({ln for _, _, ln in code.co_lines() if ln is not None and ln > code.co_firstlineno})
    if not body:
        raise UserError(f"{name!r} in {file} has no body to stop in")
    return file, body[0], [code], None


def add(
    spec: str,
    condition: str | None = None,
    log: str | None = None,
    max_hits: int | None = None,
    every: int | None = None,
    from_hit: int | None = None,
) -> dict:
    if sys.version_info < (3, 12):
        raise UserError("breakpoints need CPython 3.12 or later for now (3.11 support is not built yet)")
    if any(n is not None and n < 1 for n in (max_hits, every, from_hit)):
        raise UserError("--max, --every and --hit take a number of at least 1")
    options = {"condition": condition, "log": log, "max_hits": max_hits, "every": every, "from_hit": from_hit}
    try:
        # Compiled now, so that a syntax error is reported now, pending or not.
        for source, mode_name in ((condition, "condition"), (None if log is None else "f" + repr(log), "log template")):
            if source:
                compile(source, f"<breakpoint {mode_name}>", "eval")
    except SyntaxError as err:
        raise UserError(f"the {'condition' if 'condition' in (err.filename or '') else 'log template'} does not compile: {err.msg}") from None
    try:
        file, line, codes, note = _resolve(spec)
    except _NotLoaded as missing:
        with _lock:
            pending = _Pending(spec, missing.path, options)
            _pending[pending.id] = pending
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
        return pending.describe()
    bp = Breakpoint(file, line, codes, **_breakpoint_options(options))
    bp.note = note
    with _lock:
        _arm(bp)
    return bp.describe()


def _arm(bp: Breakpoint) -> None:
    tool = _tool()
    _breakpoints[bp.id] = bp
    for code in bp.codes:
        _by_code.setdefault(code, {}).setdefault(bp.line, []).append(bp)
        sys.monitoring.set_local_events(tool, code, sys.monitoring.events.LINE)
    # Lines that answered DISABLE before must fire again.
    sys.monitoring.restart_events()


def remove(bp_id: int) -> dict:
    with _lock:
        pending = _pending.pop(bp_id, None)
        if pending is not None:
            if not _pending and _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
            return pending.describe()
        bp = _breakpoints.pop(bp_id, None)
        if bp is None:
            raise UserError(f"no breakpoint {bp_id}; `rankscope PID break list` shows them")
        for code in bp.codes:
            lines = _by_code.get(code, {})
            holders = lines.get(bp.line, [])
            if bp in holders:
                holders.remove(bp)
            if not holders:
                lines.pop(bp.line, None)
            if not lines:
                _by_code.pop(code, None)
                if _tool_id is not None:
                    sys.monitoring.set_local_events(_tool_id, code, 0)
        _release_tool()
    return bp.describe()


def clear() -> list[dict]:
    return [remove(bp_id) for bp_id in list(_breakpoints) + list(_pending)]


def listing() -> list[dict]:
    every = [bp.describe() for bp in _breakpoints.values()] + [p.describe() for p in _pending.values()]
    return sorted(every, key=lambda d: d["id"])


def snapshots() -> list[dict]:
    return list(_snapshots)


def handle(request_text: str) -> str:
    """The probe's /v1/breakpoints endpoint: {"op": ..., ...} -> JSON."""
    try:
        request = json.loads(request_text)
        op = request.get("op")
        if op == "add":
            result = add(
                request["spec"], request.get("condition"), request.get("log"), request.get("max"), request.get("every"), request.get("hit")
            )
        elif op == "list":
            result = listing()
        elif op == "rm":
            result = remove(int(request["id"]))
        elif op == "clear":
            result = clear()
        elif op == "snapshots":
            result = snapshots()
        else:
            raise UserError(f"unknown breakpoint operation {op!r}")
        return json.dumps({"ok": result}, default=str)
    except UserError as err:
        return json.dumps({"error": str(err)})
