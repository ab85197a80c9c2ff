"""Line hooks: a call into the probe when any frame reaches an armed line.

The breakpoint and watch logic (`breakpoints.py`) says which lines of which
code objects are armed; this module makes frames report them, and nothing
else pay for it. `dispatch(code, line, frame)` is called at each armed line,
with the *original* code object.

- CPython 3.12+ (`Monitoring`): `sys.monitoring` under a tool id of our own,
  `LINE` events enabled on the armed code objects only; every other line of
  those answers `DISABLE`. Running frames see it too.
- CPython 3.11 (`Instrumented`): there is no `sys.monitoring`, and a global
  trace function would slow every call. Each armed code object gets a copy
  with a call to the hook inserted at the start of each armed line (the
  `bytecode` package), swapped into every function that uses it (and into
  the code objects that define it, for inner functions). A frame that is
  already running keeps its code; for those frames only, a C trace function
  is installed on their thread (`_native.trace_frames`) and goes away when
  they return or are disarmed. A thread that another tool traces (coverage,
  a debugger) is left alone, and the caller is told.
"""

from __future__ import annotations

import os
import sys
import threading
import types

TOOL_NAME = "rankscope"


class HookError(Exception):
    """Line hooks cannot be set here (reported to the user)."""


def _probe_threads() -> set[int]:
    """Threads that run the probe's own code: never traced."""
    return {threading.get_ident()}


class Monitoring:
    """CPython 3.12+: sys.monitoring, LINE on armed code objects only."""

    def __init__(self, dispatch):
        self._dispatch = dispatch
        self._tool: int | None = None
        self._armed: dict[types.CodeType, frozenset[int]] = {}

    def original(self, code: types.CodeType) -> types.CodeType:
        return code

    def _on_line(self, code, line):
        try:
            if not self._dispatch(code, line, sys._getframe(1)):
                return sys.monitoring.DISABLE
        except Exception:  # noqa: BLE001 - a broken hook must not break the program
            pass
        return None

    def _take_tool(self) -> int:
        if self._tool is not None:
            return self._tool
        monitoring = sys.monitoring
        for candidate in range(6):  # ids 0-5 are for tools; 6 is settrace's, 7 setprofile's
            if monitoring.get_tool(candidate) is None:
                monitoring.use_tool_id(candidate, TOOL_NAME)
                monitoring.register_callback(candidate, monitoring.events.LINE, self._on_line)
                self._tool = candidate
                return candidate
        owners = ", ".join(str(monitoring.get_tool(i)) for i in range(6))
        raise HookError(f"every sys.monitoring tool id is taken ({owners})")

    def set_lines(self, code: types.CodeType, lines: set[int]) -> str | None:
        if lines:
            tool = self._take_tool()
            self._armed[code] = frozenset(lines)
            sys.monitoring.set_local_events(tool, code, sys.monitoring.events.LINE)
            # Lines that answered DISABLE before must fire again.
            sys.monitoring.restart_events()
        elif self._armed.pop(code, None) is not None and self._tool is not None:
            sys.monitoring.set_local_events(self._tool, code, 0)
        if not self._armed and self._tool is not None:
            sys.monitoring.register_callback(self._tool, sys.monitoring.events.LINE, None)
            sys.monitoring.free_tool_id(self._tool)
            self._tool = None
        return None

    def in_use(self) -> bool:
        return self._tool is not None

    def after_session(self) -> None:
        """pdb's tracing does not touch sys.monitoring: nothing to redo."""


def _import_bytecode() -> None:
    try:
        import bytecode  # noqa: F401
        return
    except ImportError:
        import rankscope

        staged = getattr(rankscope, "_staged_from", None)
        if not staged:
            raise
    # An injected probe: `bytecode` was staged beside rankscope, in a
    # directory that is on sys.path only for this import.
    sys.path.insert(0, staged)
    try:
        import bytecode  # noqa: F401
    finally:
        try:
            sys.path.remove(staged)
        except ValueError:
            pass


class Instrumented:
    """CPython 3.11: hooked copies of code objects, plus a per-thread trace
    for frames that were already running."""

    def __init__(self, dispatch):
        try:
            _import_bytecode()
        except ImportError:
            raise HookError(
                "breakpoints on CPython 3.11 need the `bytecode` package in the target's environment: pip install bytecode"
            ) from None
        self._dispatch = dispatch
        self._armed: dict[types.CodeType, frozenset[int]] = {}
        # Each code object we made -> the original it replaces.
        self._original_of: dict[types.CodeType, types.CodeType] = {}
        # Lines that carry a hook call in each code object we made.
        self._hooked: dict[types.CodeType, frozenset[int]] = {}
        # One state list per traced thread: [active, callback, frame, ...].
        self._traces: list[list] = []
        self._lock = threading.RLock()
        # (A probe thread may hold it when the program forks: free in the child.)
        os.register_at_fork(after_in_child=self._lock._at_fork_reinit)

    def original(self, code: types.CodeType) -> types.CodeType:
        return self._original_of.get(code, code)

    def in_use(self) -> bool:
        return bool(self._armed)

    def after_session(self) -> None:
        """A pdb session on this thread replaced its trace function (and
        took it off at the end): running frames are traced again."""
        with self._lock:
            self._trace_running(include_current=True)

    # -- the hook the instrumented code calls --------------------------------

    def _hook(self, code, line):
        try:
            self._dispatch(code, line, sys._getframe(1))
        except Exception:  # noqa: BLE001 - never into user code
            pass

    def _traced_line(self, frame):
        try:
            code = frame.f_code
            line = frame.f_lineno
            if line in self._hooked.get(code, ()):
                return  # this code has its own hook call there
            original = self._original_of.get(code, code)
            if line in self._armed.get(original, ()):
                self._dispatch(original, line, frame)
        except Exception:  # noqa: BLE001
            pass

    # -- arming ---------------------------------------------------------------

    def set_lines(self, code: types.CodeType, lines: set[int]) -> str | None:
        with self._lock:
            code = self.original(code)
            if lines:
                self._armed[code] = frozenset(lines)
            else:
                self._armed.pop(code, None)
            self._rebuild()
            return self._trace_running()

    def _instrument(self, code: types.CodeType, lines: frozenset[int]) -> types.CodeType:
        from bytecode import Bytecode, Instr

        listing = Bytecode.from_code(code)
        out = []
        previous_line = None
        past_prologue = False
        for item in listing:
            if isinstance(item, Instr):
                # A hook at the first instruction of each stretch of an armed
                # line, past the frame set-up (RESUME), where a call is legal.
                if past_prologue and item.lineno in lines and item.lineno != previous_line:
                    n = item.lineno
                    out += [
                        Instr("PUSH_NULL", lineno=n),
                        Instr("LOAD_CONST", self._hook, lineno=n),
                        Instr("LOAD_CONST", code, lineno=n),
                        Instr("LOAD_CONST", n, lineno=n),
                        Instr("PRECALL", 2, lineno=n),
                        Instr("CALL", 2, lineno=n),
                        Instr("POP_TOP", lineno=n),
                    ]
                if item.name == "RESUME":
                    past_prologue = True
                previous_line = item.lineno
            out.append(item)
        listing[:] = out
        return listing.to_code()

    def _rebuild(self) -> None:
        """Puts every function back on its original code, then swaps in
        fresh instrumented copies for what is armed now."""
        functions: dict[types.CodeType, list] = {}
        # The functions alone, walked natively (see breakpoints._functions).
        from rankscope._probe.breakpoints import _functions

        for obj in _functions():
            code = obj.__code__
            original = self._original_of.get(code)
            if original is not None:
                obj.__code__ = original
                code = original
            functions.setdefault(code, []).append(obj)
        self._original_of.clear()
        self._hooked.clear()
        if not self._armed:
            return
        parents: dict[types.CodeType, list[types.CodeType]] = {}
        seen: set[int] = set()

        def visit(code):
            if id(code) in seen:
                return
            seen.add(id(code))
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    parents.setdefault(const, []).append(code)
                    visit(const)

        for code in functions:
            visit(code)
        for frames in sys._current_frames().values():
            while frames is not None:
                visit(frames.f_code)
                frames = frames.f_back
        current: dict[types.CodeType, types.CodeType] = {}

        def install(original, version):
            current[original] = version
            self._original_of[version] = original
            for function in functions.get(original, ()):
                function.__code__ = version
            for parent in parents.get(original, ()):
                base = current.get(parent, parent)
                consts = tuple(version if (c is original or self._original_of.get(c) is original) else c for c in base.co_consts)
                install(parent, base.replace(co_consts=consts))

        for original, lines in self._armed.items():
            version = self._instrument(current.get(original, original), lines)
            self._hooked[version] = lines
            install(original, version)
        # Parents rebuilt after their child was instrumented keep the hooks.
        for version, original in list(self._original_of.items()):
            if original in self._armed and version not in self._hooked:
                self._hooked[version] = self._armed[original]

    def _trace_running(self, include_current: bool = False) -> str | None:
        """Per-thread traces for frames that run code without the hooks they
        need now; returns a note for the user when a thread is left alone."""
        from rankscope import _native

        for state in self._traces:
            state[0] = False  # each takes itself off at its next event
        self._traces = []
        if not self._armed:
            return None
        skipped = []
        me = None if include_current else threading.get_ident()
        others_trace_all = getattr(threading, "_trace_hook", None) is not None
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            wanted = []
            traced = False
            walk = frame
            while walk is not None:
                traced = traced or walk.f_trace is not None
                original = self._original_of.get(walk.f_code, walk.f_code)
                lines = self._armed.get(original)
                if lines and not lines <= self._hooked.get(walk.f_code, frozenset()):
                    wanted.append(walk)
                walk = walk.f_back
            if not wanted:
                continue
            if traced or others_trace_all:
                skipped.append(wanted[0])
                continue
            state = [True, self._traced_line, *wanted]
            if _native.trace_frames(state):
                self._traces.append(state)
        if skipped:
            where = ", ".join(f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})" for f in skipped)
            return (
                f"another tool traces the thread running {where} (coverage or a debugger): that frame, already running, "
                "is left alone; calls made from now on see the breakpoint"
            )
        return None


def make(dispatch):
    if sys.version_info >= (3, 12):
        return Monitoring(dispatch)
    return Instrumented(dispatch)
