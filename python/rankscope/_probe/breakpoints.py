"""Breakpoints and watches that record and go on, set from outside into a
live process.

How frames get to us is `linehooks`' business (sys.monitoring on 3.12+,
instrumented code objects and a per-thread trace for running frames on
3.11). Here: what is armed where, and what a hit does. A breakpoint hit
evaluates the condition (compiled once, when the breakpoint is set), counts,
and records a snapshot or a log line (`snapshots`), or pauses the thread for
`rankscope PID attach` (`pause`). A watch compares one local of a function
at each of its lines and records each change with the line that made it.
Nothing raised here reaches user code: a failing condition is counted, and
after MAX_ERRORS the breakpoint disables itself and says why.

A breakpoint in a file that is not imported yet stays pending: a meta-path
finder that only watches wraps that module's loader, and arms the breakpoint
once the module has executed (module-level lines of that first run are not
seen; functions are).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.machinery
import itertools
import json
import os
import sys
import threading
import types

from rankscope._probe import linehooks, snapshots
from rankscope._probe import pause as pause_module
from rankscope._probe.saferepr import Budget, safe_repr, type_name

MAX_ERRORS = 5

_lock = threading.RLock()
# A probe thread may hold it when the program forks: the child, which has
# only the forking thread, gets it free.
os.register_at_fork(after_in_child=_lock._at_fork_reinit)
_ids = itertools.count(1)
# Breakpoints and watches by id; both are "handlers" of lines.
_handlers: dict[int, "Breakpoint | Watch"] = {}
# original code object -> line -> handlers there
_by_code: dict[types.CodeType, dict[int, list]] = {}
_hooks = None


class UserError(Exception):
    """Bad input: reported to the CLI, nothing changed."""


class _NotLoaded(Exception):
    """No loaded code comes from this file (yet)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


def _dispatch(code, line, frame) -> bool:
    handlers = _by_code.get(code)
    if handlers is None:
        return False
    here = handlers.get(line)
    if not here:
        return False
    for handler in list(here):
        handler.on_line(frame, line)
    return True


def _line_hooks():
    global _hooks
    if _hooks is None:
        try:
            _hooks = linehooks.make(_dispatch)
        except linehooks.HookError as err:
            raise UserError(str(err)) from None
    return _hooks


def _arm(handler) -> str | None:
    hooks = _line_hooks()
    _handlers[handler.id] = handler
    notes = []
    try:
        for code in handler.codes:
            lines = _by_code.setdefault(code, {})
            for line in handler.lines:
                lines.setdefault(line, []).append(handler)
            note = hooks.set_lines(code, set(lines))
            if note:
                notes.append(note)
    except linehooks.HookError as err:
        _disarm(handler)
        raise UserError(str(err)) from None
    return "; ".join(notes) or None


def _disarm(handler) -> None:
    _handlers.pop(handler.id, None)
    for code in handler.codes:
        lines = _by_code.get(code, {})
        for line in handler.lines:
            holders = lines.get(line, [])
            if handler in holders:
                holders.remove(handler)
            if not holders:
                lines.pop(line, None)
        if not lines:
            _by_code.pop(code, None)
        if _hooks is not None:
            _hooks.set_lines(code, set(lines))


class _Pending:
    """A breakpoint in a file not imported yet: armed when a module whose
    file matches finishes executing (functions exist then)."""

    def __init__(self, spec: str, path: str, options: "Options"):
        self.id = next(_ids)
        self.spec, self.path, self.options = spec, path, options
        self.note = None

    def describe(self) -> dict:
        file, _, line = self.spec.rpartition(":")
        return {
            "id": self.id,
            "kind": "breakpoint",
            "file": file,
            "line": int(line) if line.isdigit() else line,
            **self.options.describe(),
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
                bp = Breakpoint(file, line, codes, pending.options)
                bp.id = pending.id
                _arm(bp)
            except Exception as err:  # noqa: BLE001 - reported in break list, never raised into the import
                pending.note = f"could not arm on import: {err}"
                continue
            del _pending[pending.id]
            bp.note = note
            if pending.options.stop is not None:
                from rankscope._probe import debugger

                debugger.breakpoint_armed(bp)
        if not _pending and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


@dataclasses.dataclass(frozen=True)
class Options:
    """What `break add` says about a breakpoint, checked once: kept as is
    while it is pending, and by the breakpoint once armed."""

    condition: str | None = None
    log: str | None = None
    max_hits: int | None = None
    every: int | None = None
    from_hit: int | None = None
    pause: bool | None = None
    pause_timeout: float | None = None
    # The editor's debug session (`rankscope dap`) this breakpoint stops for.
    stop: int | None = None

    # wire name -> field, as the CLI sends them and `break list` shows them
    REQUEST_KEYS = {"condition": "condition", "log": "log", "max": "max_hits", "every": "every", "hit": "from_hit", "pause": "pause", "pause_timeout": "pause_timeout"}

    @classmethod
    def from_request(cls, request: dict) -> "Options":
        return cls(**{field: request.get(key) for key, field in cls.REQUEST_KEYS.items()})

    def describe(self) -> dict:
        return {
            "condition": self.condition,
            "log": self.log,
            "max": self.max_hits,
            "every": self.every,
            "hit_from": self.from_hit,
            "pause": bool(self.pause) or None,
        }

    def check(self) -> None:
        """Bad input is reported now, pending or not, and changes nothing."""
        if any(n is not None and n < 1 for n in (self.max_hits, self.every, self.from_hit, self.pause_timeout)):
            raise UserError("--max, --every, --hit and --pause-timeout take a number of at least 1")
        if self.pause and self.log is not None:
            raise UserError("a logpoint never stops: give --log or --pause, not both")
        if self.pause and self.stop is not None:
            raise UserError("a breakpoint pauses for `attach` or stops for an editor, not both")
        for source, what in ((self.condition, "condition"), (None if self.log is None else "f" + repr(self.log), "log template")):
            if source:
                try:
                    compile(source, f"<breakpoint {what}>", "eval")
                except SyntaxError as err:
                    raise UserError(f"the {what} does not compile: {err.msg}") from None


def _count_error(handler, err: Exception) -> None:
    """An error at a hit is recorded, never raised; too many disable the handler."""
    handler.errors += 1
    handler.note = f"{type(err).__name__}: {err}"
    if handler.errors >= MAX_ERRORS:
        handler.enabled = False
        handler.note = f"disabled after {handler.errors} errors; last: {handler.note}"
        # A debug session's: its editor hears of it (once, should threads race here).
        owner = handler.options.stop if isinstance(handler, Breakpoint) else handler.stop
        if owner is not None and handler.errors == MAX_ERRORS:
            from rankscope._probe import debugger

            debugger.breakpoint_disabled(handler, owner)


class Breakpoint:
    def __init__(self, file: str, line: int, codes: list, options: Options):
        self.id = next(_ids)
        self.file, self.line, self.codes = file, line, codes
        self.lines = (line,)
        self.options = options
        self.condition = compile(options.condition, "<breakpoint condition>", "eval") if options.condition else None
        self.log = compile("f" + repr(options.log), "<logpoint>", "eval") if options.log is not None else None
        self.max_hits, self.every, self.from_hit = options.max_hits, options.every, options.from_hit
        self.pause = bool(options.pause)
        self.pause_timeout = options.pause_timeout or pause_module.DEFAULT_TIMEOUT_S
        self.passes = self.hits = self.errors = 0
        self.enabled, self.note = True, None
        # Removed by the user: a pause it was about to start does not.
        self.released = False

    def describe(self) -> dict:
        return {
            "id": self.id,
            "kind": "breakpoint",
            "file": self.file,
            "line": self.line,
            **self.options.describe(),
            "passes": self.passes,
            "hits": self.hits,
            "errors": self.errors,
            "enabled": self.enabled,
            "note": self.note,
        }


    def on_line(self, frame, line) -> None:
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
            _count_error(self, err)
            return
        self.hits += 1
        snapshots.record(snapshots.take(self.id, self.hits, frame, message))
        if self.max_hits and self.hits >= self.max_hits:
            self.enabled = False
            remove(self.id, release_paused=False)
        if self.options.stop is not None:
            from rankscope._probe import debugger

            debugger.on_breakpoint(self, frame, message)
        elif self.pause and not pause_module.in_session():
            self.note = pause_module.pause(
                frame, self.id, self.pause_timeout, on_resume=_after_session, wanted=lambda: not self.released
            )


def _after_session() -> None:
    if _hooks is not None:
        with _lock:
            _hooks.after_session()



_UNBOUND = object()


class Watch:
    """Records each change of one local of a function, with the line that
    made it: the value is compared at every line of the function (its code
    object only), the change is charged to the line that ran before."""

    def __init__(self, file: str, function: str, name: str, code: types.CodeType, tensor: bool, stop: int | None = None):
        self.id = next(_ids)
        # The editor's debug session a change stops for (a data breakpoint).
        self.stop = stop
        self.file, self.function, self.name, self.codes = file, function, name, [code]
        self.tensor = tensor
        # Every line of the body; 0 stands for "a call starts" (state reset).
        self.lines = tuple(sorted({ln for _, _, ln in code.co_lines() if ln is not None and ln > code.co_firstlineno}))
        self.first_line = self.lines[0] if self.lines else None
        # id(frame) -> [value identity, repr or tensor version, last line]
        self._frames: dict[int, list] = {}
        self._first_stretch_end: dict[types.CodeType, int] = {}
        self.passes = self.hits = self.errors = 0
        self.enabled, self.note = True, None

    def describe(self) -> dict:
        return {
            "id": self.id,
            "kind": "watch",
            "file": self.file,
            "line": self.function,
            "watch": self.name,
            "tensor": self.tensor or None,
            "passes": self.passes,
            "hits": self.hits,
            "errors": self.errors,
            "enabled": self.enabled,
            "note": self.note,
        }

    def _state_of(self, value):
        if self.tensor:
            return getattr(value, "_version", None)
        return safe_repr(value, Budget(tensor_stats=False))

    def on_line(self, frame, line) -> None:
        if not self.enabled:
            return
        self.passes += 1
        try:
            value = frame.f_locals.get(self.name, _UNBOUND)
            key = id(frame)
            state = self._frames.get(key)
            # A call's first line starts its state afresh: a parameter's
            # value, or an unbound name, is where the function began.
            if state is None or (line == self.first_line and frame.f_lasti < self._first_stretch(frame.f_code)):
                if len(self._frames) > 1024:
                    self._frames.clear()
                self._frames[key] = [id(value), None if value is _UNBOUND else self._state_of(value), line]
                return
            last_id, last_state, last_line = state
            state[2] = line
            if value is _UNBOUND:
                return
            if id(value) == last_id and not self.tensor and type(value) in (int, float, str, bool, type(None)):
                return
            now = self._state_of(value)
            if id(value) == last_id and now == last_state:
                return
            if id(value) != last_id and now == last_state and not self.tensor:
                state[0] = id(value)
                return  # a new object with the same value: not a change
            state[0], state[1] = id(value), now
            self._record(frame, value, last_state, now, last_line)
        except Exception as err:  # noqa: BLE001 - never into user code
            _count_error(self, err)

    def _first_stretch(self, code) -> int:
        """Where the first stretch of the first body line ends: a frame
        before it has just been called (the 3.11 copy has its own offsets)."""
        end = self._first_stretch_end.get(code)
        if end is None:
            end = 0
            for start, stop, ln in code.co_lines():
                if ln == self.first_line and (end == 0 or start == end):
                    end = stop
                elif end:
                    break
            self._first_stretch_end[code] = end
        return end

    def _record(self, frame, value, before, after, changed_by) -> None:
        self.hits += 1
        budget = Budget(tensor_stats=True, max_stats_elements=snapshots.MAX_SNAPSHOT_STATS_ELEMENTS)
        text = safe_repr(value, budget)
        if self.tensor:
            was = "first seen" if before is None else f"version {before} -> {after}"
            message = f"{self.name} changed in place ({was}) by line {changed_by}: {text}"
        else:
            was = "<unbound>" if before is None else before
            message = f"{self.name} = {text} (was {was}) changed by line {changed_by}"
        snap = snapshots.take(self.id, self.hits, frame, message, with_locals=False)
        snap["frames"][0]["locals"] = [[self.name, text, type_name(value)]]
        snap["changed_by"] = changed_by
        snapshots.record(snap)
        if self.stop is not None:
            from rankscope._probe import debugger

            debugger.on_watch(self, frame, message)


def _functions() -> list:
    """Every function the collector tracks, found by their type alone: the
    collector's lists walked natively, not a list of every object (0.7 s a
    breakpoint on 3.11 with torch imported, and an editor's resent list of
    a file's breakpoints timed out). Never `isinstance` over every object:
    it asks an object's `__class__`, which some answer with a warning into
    the program's stderr (torch's deprecated `reduce_op`), an error under
    `-W error`."""
    from rankscope import _native

    try:
        return _native.gc_instances((types.FunctionType,))
    except Exception:  # noqa: BLE001 - the slow way, by exact type
        return [obj for obj in gc.get_objects() if type(obj) is types.FunctionType]


def _all_code() -> list[types.CodeType]:
    """Every code object reachable from functions and running frames,
    nested ones (inner functions, comprehensions) included, as originals
    (not the instrumented copies of 3.11)."""
    original = _hooks.original if _hooks is not None else (lambda code: code)
    seen: dict[int, types.CodeType] = {}

    def visit(code):
        code = original(code)
        if id(code) in seen:
            return
        seen[id(code)] = code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                visit(const)

    for function in _functions():
        visit(function.__code__)
    for frame in sys._current_frames().values():
        while frame is not None:
            visit(frame.f_code)
            frame = frame.f_back
    return list(seen.values())


def _codes_of(path: str) -> tuple[str, list[types.CodeType]]:
    codes = [c for c in _all_code() if _matches(c.co_filename, path)]
    files = sorted({c.co_filename for c in codes})
    if not files:
        raise _NotLoaded(path)
    if len(files) > 1:
        raise UserError(f"{path!r} matches several files: {', '.join(files)}; give more of the path")
    return files[0], codes


def _on_disk(path: str) -> bool:
    """Whether a file not imported yet could still be: as given, or under
    one of the directories imports search (a pending breakpoint for a typo
    would wait for ever)."""
    if os.path.isabs(path):
        return os.path.isfile(path)
    roots = [os.getcwd(), *(p for p in sys.path if isinstance(p, str) and p)]
    return any(os.path.isfile(os.path.join(root, path)) for root in roots)


def _split(spec: str) -> tuple[str, str]:
    path, sep, where = spec.rpartition(":")
    if not sep or not where or not path:
        raise UserError(f"{spec!r} is not FILE:LINE or FILE:FUNCTION (e.g. train.py:88, model.py:Attention.forward)")
    return path, where


def _resolve(spec: str) -> tuple[str, int, list[types.CodeType], str | None]:
    path, where = _split(spec)
    file, codes = _codes_of(path)
    if not where.isdigit():
        code = _function(file, where, codes)
        body = sorted({ln for _, _, ln in code.co_lines() if ln is not None and ln > code.co_firstlineno})
        if not body:
            raise UserError(f"{where!r} in {file} has no body to stop in")
        return file, body[0], [code], None
    wanted = int(where)
    lines = sorted({ln for c in codes for _, _, ln in c.co_lines() if ln is not None and ln >= wanted and _body_line(c, ln)})
    if not lines:
        raise UserError(f"{file} has no code at or after line {wanted}")
    line = lines[0]
    holders = [c for c in codes if any(ln == line for _, _, ln in c.co_lines())]
    note = None if line == wanted else f"line {wanted} has no code; the breakpoint is on line {line}, the next line that has"
    return file, line, holders, note


def _body_line(code: types.CodeType, line: int) -> bool:
    """A `def` line holds only the frame's set-up in a function's own code."""
    return code.co_name == "<module>" or line != code.co_firstlineno


def _function(file: str, name: str, codes: list) -> types.CodeType:
    """FILE:FUNCTION: a qualified name (`Class.method`) or a plain one."""
    matches = [c for c in codes if c.co_qualname == name] if hasattr(types.CodeType, "co_qualname") else []
    if not matches:
        matches = [c for c in codes if c.co_name == name]
    if not matches:
        raise UserError(f"no function {name!r} in {file}")
    if len({c.co_qualname for c in matches}) > 1:
        names = ", ".join(sorted({c.co_qualname for c in matches}))
        raise UserError(f"{name!r} matches several functions in {file}: {names}; give the qualified name")
    return matches[0]


def add(spec: str, condition: str | None = None, **more) -> dict:
    """A breakpoint at FILE:LINE or FILE:FUNCTION; `more` are the other
    fields of Options (log, max_hits, every, from_hit, pause, pause_timeout)."""
    return add_with(spec, Options(condition=condition, **more))


def add_with(spec: str, options: Options) -> dict:
    options.check()
    _line_hooks()  # a Python that cannot hook lines says so before anything is pending
    with _lock:
        try:
            file, line, codes, note = _resolve(spec)
        except _NotLoaded as missing:
            if not _on_disk(missing.path):
                raise UserError(
                    f"no loaded code comes from {missing.path!r}, and no such file is found from the target's "
                    "working directory or sys.path; give the path as the program imports it"
                ) from None
            pending = _Pending(spec, missing.path, options)
            _pending[pending.id] = pending
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return pending.describe()
        bp = Breakpoint(file, line, codes, options)
        running_note = _arm(bp)
        bp.note = "; ".join(n for n in (note, running_note) if n) or None
    return bp.describe()


def watch(spec: str, name: str, tensor: bool = False, stop: int | None = None) -> dict:
    path, where = _split(spec)
    if where.isdigit():
        raise UserError(f"a watch is set on a function, FILE:FUNCTION (e.g. train.py:train_step), not on line {where}")
    if not name.isidentifier():
        raise UserError(f"{name!r} is not a variable name")
    _line_hooks()
    with _lock:
        try:
            file, codes = _codes_of(path)
        except _NotLoaded:
            raise UserError(f"no loaded code comes from {path!r}; a watch needs its function to exist") from None
        code = _function(file, where, codes)
        local_names = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
        if name not in local_names:
            known = ", ".join(sorted(local_names)) or "none"
            raise UserError(f"{name!r} is not a local of {code.co_qualname} (its locals: {known})")
        handler = Watch(file, code.co_qualname, name, code, tensor, stop)
        if not handler.lines:
            raise UserError(f"{code.co_qualname} in {file} has no body to watch")
        handler.note = _arm(handler)
    return handler.describe()


def remove(bp_id: int, release_paused: bool = True) -> dict:
    """Removes a breakpoint; threads it holds paused with nobody attached go
    on (not when it removes itself at --max: that hit still pauses)."""
    with _lock:
        pending = _pending.pop(bp_id, None)
        if pending is not None:
            if not _pending and _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
            return pending.describe()
        handler = _handlers.get(bp_id)
        if handler is None:
            raise UserError(f"no breakpoint {bp_id}; `rankscope PID break list` shows them")
        _disarm(handler)
        if release_paused:
            handler.released = True
    if release_paused:
        pause_module.release(bp_id)
    snapshots.flush()
    return handler.describe()


def clear() -> list[dict]:
    return [remove(bp_id) for bp_id in list(_handlers) + list(_pending)]


def listing() -> list[dict]:
    every = [h.describe() for h in _handlers.values()] + [p.describe() for p in _pending.values()]
    for session in pause_module.paused():
        for entry in every:
            if entry["id"] == session["bp_id"]:
                entry.setdefault("paused", []).append(session["thread"])
    return sorted(every, key=lambda d: d["id"])


def handle(request_text: str) -> str:
    """The probe's /v1/breakpoints endpoint: {"op": ..., ...} -> JSON."""
    try:
        request = json.loads(request_text)
        op = request.get("op")
        if op == "add":
            result = add_with(request["spec"], Options.from_request(request))
        elif op == "watch":
            result = watch(request["spec"], request["name"], bool(request.get("tensor")))
        elif op == "list":
            result = listing()
        elif op == "rm":
            result = remove(int(request["id"]))
        elif op == "clear":
            result = clear()
        elif op == "snapshots":
            result = snapshots.listing()
        elif op == "paused":
            result = pause_module.paused()
        else:
            raise UserError(f"unknown breakpoint operation {op!r}")
        return json.dumps({"ok": result}, default=str)
    except UserError as err:
        return json.dumps({"error": str(err)})
