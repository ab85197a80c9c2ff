"""Debug sessions for editors: the probe's side of `rankscope dap`.

The adapter (in the CLI) speaks the Debug Adapter Protocol to the editor
and `POST /v1/debug` ops to this module. A session owns breakpoints that
stop a thread rather than record and go on. A stopped thread waits here,
in `_Stopped.serve`, while every other thread runs on: it answers the
requests that must run on it (evaluate and set a variable: thread-local
state such as torch's grad mode is that thread's) and leaves when told to
continue or step. Stacks, scopes and variables are read by the request's
probe thread: reading a suspended frame needs only the GIL.

Stepping is a trace function on the stopped thread only (`sys.settrace`
from that thread), on until the step ends. Pausing a running thread puts a
C trace function on that thread's running frames (`_native.trace_frames`,
as the 3.11 breakpoints do for running frames): it stops at the next line
one of them runs.

A session lives as long as its adapter polls for events: one that stops
polling for its lease (a killed adapter, a lost connection) ends as a
detach does, so no thread stays stopped for a client that is gone.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
import threading
import time

from rankscope._probe import breakpoints, stacks
from rankscope._probe.saferepr import Budget, safe_repr, type_name

_lock = threading.RLock()
# A probe thread may hold it when the program forks: the child, which has
# only the forking thread, gets it free.
os.register_at_fork(after_in_child=_lock._at_fork_reinit)
_session_ids = itertools.count(1)
_session: "Session | None" = None
MAX_EVENTS = 2000
EVALUATE_TIMEOUT_S = 30.0
# How often a stopped thread looks at its session's lease while it waits.
_WAIT_SLICE_S = 0.5


class DebugError(Exception):
    """A request that cannot be done: one line for the editor, nothing changed."""


def _library_roots() -> tuple[str, ...]:
    import sysconfig

    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.realpath(path) + os.sep)
            roots.add(path + os.sep)
    return tuple(roots)


_LIBRARY = None


def _is_library(filename: str) -> bool:
    """Code the user did not write, as justMyCode means it: the standard
    library, installed packages, frozen modules."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _library_roots()
    return (
        filename.startswith(_LIBRARY)
        or filename.startswith("<frozen")
        or f"{os.sep}site-packages{os.sep}" in filename
        or f"{os.sep}dist-packages{os.sep}" in filename
    )


class _Job:
    """Work a request hands to a stopped thread, and its answer."""

    def __init__(self, fn):
        self.fn = fn
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 - reported to the editor, never raised into the program
            self.error = err
        finally:
            self.done.set()


class _Stopped:
    """A thread held by the session, and what the editor may ask of it."""

    def __init__(self, session: "Session", ident: int, frames: list, reason: str):
        self.session = session
        self.ident = ident
        # (frame, line) innermost first: a live stack, or an exception's traceback.
        self.frames = frames
        self.frame_ids = [next(session.ref_ids) for _ in frames]
        self.reason = reason
        # The editor's exceptionInfo, for a stop on an exception.
        self.exception: dict | None = None
        self.jobs: collections.deque[_Job] = collections.deque()
        self.resume: str | None = None
        self.wake = threading.Condition(_lock)

    def serve(self) -> str:
        """Runs the jobs sent to this thread until it is resumed; returns how."""
        session = self.session
        while True:
            job = lapsed = None
            with _lock:
                while not self.jobs and self.resume is None and not session.closed:
                    if session.lapsed():
                        lapsed = True
                        break
                    self.wake.wait(_WAIT_SLICE_S)
                if self.jobs:
                    job = self.jobs.popleft()
                elif self.resume is not None:
                    return self.resume
            if job is not None:
                job.run()
            elif lapsed or session.closed:
                # Outside our lock: ending takes the breakpoints' lock, which
                # an import arming a pending breakpoint holds while it posts here.
                _end(session, "the adapter stopped polling")
                return "continue"

    def call(self, fn, timeout: float):
        """Runs `fn` on the stopped thread (from a probe thread) and waits for it."""
        job = _Job(fn)
        with _lock:
            if self.resume is not None:
                raise DebugError("the thread is no longer stopped")
            self.jobs.append(job)
            self.wake.notify_all()
        if not job.done.wait(timeout):
            raise DebugError(f"the stopped thread did not answer within {timeout:g} s")
        if job.error is not None:
            raise job.error
        return job.result


class Session:
    def __init__(self, client: str, lease_s: float, just_my_code: bool):
        self.id = next(_session_ids)
        self.client = client
        self.lease_s = max(1.0, float(lease_s))
        self.just_my_code = just_my_code
        self.last_poll = time.monotonic()
        self.closed = False
        self.events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)
        self.seq = 0
        self.posted = threading.Condition(_lock)
        self.ref_ids = itertools.count(1)
        # path -> breakpoint ids of setBreakpoints; function and data ones
        self.line_bps: dict[str, list[int]] = {}
        self.function_bps: list[int] = []
        self.data_bps: list[int] = []
        self.exception_filters: set[str] = set()
        self.stopped: dict[int, _Stopped] = {}
        # ref -> (thread ident, kind, object, evaluate name)
        self.refs: dict[int, tuple] = {}
        self.frames: dict[int, tuple[int, object]] = {}
        self.pauses: dict[int, list] = {}
        # Threads told to continue that a pause reached before they left
        # `serve`: each pauses itself on its way out.
        self.pause_on_leaving: set[int] = set()
        self.steppers: dict[int, "_Stepper"] = {}
        self.known_threads: dict[int, str] | None = None
        # 3.11: a step that stops on a line with a breakpoint is followed by
        # that line's hook call; the pair is one stop, not two.
        self.just_stepped: dict[int, tuple] = {}

    def lapsed(self) -> bool:
        return time.monotonic() - self.last_poll > self.lease_s

    def post(self, event: str, body: dict) -> None:
        with _lock:
            self.seq += 1
            self.events.append({"seq": self.seq, "event": event, "body": body})
            self.posted.notify_all()
        _wake_polls()

    def forget(self, ident: int) -> None:
        """A resumed thread's frames and values are no longer the editor's to ask for."""
        with _lock:
            self.stopped.pop(ident, None)
            for ref in [r for r, held in self.refs.items() if held[0] == ident]:
                del self.refs[ref]
            for fid in [f for f, held in self.frames.items() if held[0] == ident]:
                del self.frames[fid]


def _wake_polls() -> None:
    """The adapter's long poll waits in the probe's Rust side, outside the
    GIL (crates/rankscope-probe/src/debug_wait.rs): tell it to ask again."""
    from rankscope import _native

    _native.debug_posted()


def _current(session_id) -> Session:
    session = _session
    if session is None or session.closed or session.id != session_id:
        raise DebugError(f"no such debug session {session_id}; attach again")
    return session


def _features() -> dict:
    return {"raised_exceptions": sys.version_info >= (3, 12)}


def _hello() -> dict:
    return {"pid": os.getpid(), "python": "%d.%d.%d" % sys.version_info[:3], "features": _features()}


def _attach(client: str, lease_s: float, just_my_code: bool) -> dict:
    global _session
    old = _session
    if old is not None and not old.closed:
        if not old.lapsed():
            raise DebugError(
                f"a debug session ({old.client}) is already attached to process {os.getpid()}; "
                "disconnect it first, or wait for it to time out"
            )
        _end(old, "a new client attached")
    with _lock:
        if _session is not old:
            raise DebugError("another client attached at the same moment; try again")
        _session = Session(client, lease_s, just_my_code)
        session = _session
    return {"session": session.id, **_hello()}


def _end(session: Session, why: str) -> int:
    """Detach: the session's breakpoints go, its stopped threads resume."""
    with _lock:
        if session.closed:
            return 0
        session.closed = True
        ids = [i for ids in session.line_bps.values() for i in ids] + session.function_bps + session.data_bps
        session.line_bps, session.function_bps, session.data_bps = {}, [], []
        resumed = 0
        for stopped in session.stopped.values():
            if stopped.resume is None:
                stopped.resume = "continue"
                resumed += 1
            stopped.wake.notify_all()
        for state in session.pauses.values():
            state[0] = False
        session.pauses.clear()
        if _monitor is not None:
            _monitor.end_all()
        for stepper in session.steppers.values():
            stepper.active = False
        session.posted.notify_all()
    _wake_polls()
    for bp_id in ids:
        try:
            breakpoints.remove(bp_id)
        except breakpoints.UserError:
            pass  # removed by itself (--max) or by the user
    _exceptions.update(session, set())
    return resumed


# -- stopping -------------------------------------------------------------------


def _visible_stack(frame) -> list:
    return [(f, f.f_lineno) for f in stacks.visible(frame)]


def stop(frame, reason: str, description: str = "", hit_ids=(), text: str | None = None, frames=None, exception: dict | None = None) -> None:
    """Holds the calling thread for the editor until it continues or steps.
    Called on the program's thread, from a breakpoint, a step or a pause."""
    session = _session
    me = threading.get_ident()
    if session is None or session.closed:
        return
    if session.lapsed():
        _end(session, "the adapter stopped polling")
        return
    if stacks._is_probe_stack(frame):
        return  # code the editor runs in __main__ runs on a probe thread: never held
    with _lock:
        if me in session.stopped:
            return  # code the editor runs on a stopped thread hit a breakpoint: it only records
        stepper = session.steppers.pop(me, None)
        if stepper is not None:
            stepper.finish()
        held = _Stopped(session, me, frames if frames is not None else _visible_stack(frame), reason)
        if not held.frames:
            return
        held.exception = exception
        session.stopped[me] = held
        for fid, (f, _) in zip(held.frame_ids, held.frames):
            session.frames[fid] = (me, f)
        # A pause asked for before this stop is answered by it: it must not
        # stop the thread again once it is continued.
        session.pause_on_leaving.discard(me)
        pending = session.pauses.pop(me, None)
        if pending is not None:
            pending[0] = False
            if _monitor is not None:
                _monitor.done(me)
    body = {"reason": reason, "threadId": me, "allThreadsStopped": False, "description": description or reason}
    if hit_ids:
        body["hitBreakpointIds"] = list(hit_ids)
    if text:
        body["text"] = text
    collectives = _collectives()
    if collectives is not None:
        body["collectives"] = collectives  # the adapter's: it says what the stop does to the other ranks
    session.post("stopped", body)
    action = "continue"
    try:
        action = held.serve()
    finally:
        session.forget(me)
    if action in ("next", "step_in", "step_out") and not session.closed:
        top = held.frames[0][0]
        _Stepper(session, action, top).install()
    else:
        breakpoints._after_session()
        if me in session.pause_on_leaving and not session.closed:
            session.pause_on_leaving.discard(me)
            try:
                _pause(session, me)
            except DebugError as err:
                session.post("output", {"category": "console", "output": f"rankscope: the pause did not take: {err}\n"})


def _collectives() -> dict | None:
    """What a stop here does to the rest of a job: torch.distributed's
    default group (this rank, its size, its backend) and the timeout after
    which the backend fails a collective that waits, read from the group
    where the program set torch.distributed up (torch is never imported
    here). None where it has not."""
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if dist is None or c10d is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = c10d._get_default_group()
        info = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": str(dist.get_backend(group))}
        # Per device type (cpu:gloo,cuda:nccl): the first to give up is the one that counts.
        timeouts = []
        for device in getattr(group, "_device_types", ()):
            try:
                backend = group._get_backend(device)
                timeouts.append((backend.options._timeout.total_seconds(), str(backend.name())))
            except Exception:  # noqa: BLE001 - a backend without options: the default below
                continue
        if timeouts:
            info["timeout_s"], info["backend"] = min(timeouts)
        else:
            info["timeout_s"] = c10d._get_default_timeout(info["backend"]).total_seconds()
        return info
    except Exception:  # noqa: BLE001 - an older or newer torch: the stop goes on without it
        return None


def breakpoint_disabled(handler, owner: int) -> None:
    """A session's breakpoint (or data breakpoint) turned itself off after
    its condition or log message kept failing: the editor marks it
    unverified, and the Debug Console says why."""
    session = _session
    if session is None or session.closed or owner != session.id:
        return
    where = f"{os.path.basename(handler.file)}:{getattr(handler, 'line', None) or handler.function}"
    session.post("breakpoint", {"reason": "changed", "breakpoint": {"id": handler.id, "verified": False, "message": handler.note}})
    session.post("output", {"category": "console", "output": f"rankscope: the breakpoint at {where} is off: {handler.note}\n"})


def on_breakpoint(bp, frame, message: str | None) -> None:
    """A hit of a session's breakpoint (after its condition and counts)."""
    session = _session
    if session is None or session.closed or bp.options.stop != session.id:
        return
    me = threading.get_ident()
    if message is not None:
        line = frame.f_lineno
        session.post(
            "output",
            {"category": "console", "output": message + "\n", "source": {"path": frame.f_code.co_filename}, "line": line},
        )
        return
    stepped = session.just_stepped.pop(me, None)
    if stepped is not None and stepped[0] is frame and stepped[1] == frame.f_lineno:
        return  # the step already stopped on this line (3.11: the line event comes before the hook call)
    kind = "function breakpoint" if bp.id in session.function_bps else "breakpoint"
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    stop(frame, kind, f"{kind} at {where}", hit_ids=(bp.id,))


def on_watch(watch, frame, message: str) -> None:
    session = _session
    if session is None or session.closed or watch.stop != session.id:
        return
    stop(frame, "data breakpoint", message, hit_ids=(watch.id,), text=message)


def breakpoint_armed(bp) -> None:
    """A pending breakpoint of a session was armed when its module was imported."""
    session = _session
    if session is None or session.closed or bp.options.stop != session.id:
        return
    session.post("breakpoint", {"reason": "changed", "breakpoint": {"id": bp.id, "verified": True, "line": bp.line}})


# -- stepping -------------------------------------------------------------------


class _Stepper:
    """A trace function on one thread until its step ends.

    `next` stops at the next line of the same frame, or of its caller once
    it returns; calls made meanwhile run untraced (their frames get no local
    trace). `step_in` stops at the next line run anywhere on the thread.
    `step_out` stops at the caller's next line once the frame returns.
    Frames of the probe, and with justMyCode library frames, are not
    stopped in: a step in goes on through them."""

    def __init__(self, session: Session, mode: str, frame):
        self.session = session
        self.mode = mode
        self.target = frame
        self.start = (frame, frame.f_lasti)
        self.first = True
        self.active = True
        self.ident = threading.get_ident()
        # (frame, the trace function it had): a tool that traced this thread
        # before the step (coverage) gets its functions back after it.
        self.traced: list = []
        self.previous = None

    def install(self) -> None:
        with _lock:
            self.session.steppers[self.ident] = self
        frame = self.target
        while frame is not None:
            if not stacks.is_own(frame):
                self.traced.append((frame, frame.f_trace))
                frame.f_trace = self.local
            frame = frame.f_back
        self.previous = sys.gettrace()
        sys.settrace(self.on_call)

    def finish(self) -> None:
        """Takes this thread's tracing off (called on the thread itself)."""
        self.active = False
        sys.settrace(self.previous)
        for frame, before in self.traced:
            if frame.f_trace == self.local:
                frame.f_trace = before
        self.traced = []

    def _stoppable(self, frame) -> bool:
        if stacks.is_own(frame):
            return False
        return not (self.session.just_my_code and _is_library(frame.f_code.co_filename))

    def on_call(self, frame, event, arg):
        if not self.active:
            return None
        if self.mode == "step_in" and self._stoppable(frame):
            self.traced.append((frame, None))
            return self.local
        return None

    def local(self, frame, event, arg):
        if not self.active:
            return None
        try:
            if event == "line":
                if self.first:
                    self.first = False
                    if frame is self.start[0] and frame.f_lasti == self.start[1]:
                        return self.local  # the event of the line we stopped on
                if self.mode == "step_in" and self._stoppable(frame) or self.mode == "next" and frame is self.target:
                    self._stop(frame)
                    return None
            elif event == "return" and frame is self.target:
                caller = frame.f_back
                while caller is not None and not self._stoppable(caller):
                    caller = caller.f_back
                if caller is None:
                    self.finish()  # out of the user's code: the thread runs on
                    self.session.steppers.pop(self.ident, None)
                    breakpoints._after_session()
                    return None
                if caller.f_trace is None:
                    caller.f_trace = self.local
                    self.traced.append((caller, None))
                self.target = caller
                if self.mode == "step_out":
                    self.mode = "next"
        except Exception:  # noqa: BLE001 - a failed step lets the thread run on
            self.finish()
            return None
        return self.local

    def _stop(self, frame) -> None:
        with _lock:
            self.session.steppers.pop(self.ident, None)
        self.finish()
        if sys.version_info < (3, 12):
            self.session.just_stepped[self.ident] = (frame, frame.f_lineno)
        stop(frame, "step", "step")


# -- pausing a running thread -----------------------------------------------------


def _pause(session: Session, ident: int) -> dict:
    from rankscope import _native

    with _lock:
        held = session.stopped.get(ident)
        if held is not None:
            if held.resume == "continue":
                # Continued a moment ago and not gone yet: the pause would
                # find it in `serve` and be lost; it pauses itself as it leaves.
                session.pause_on_leaving.add(ident)
            return {}  # stopped, or stepping: a stop comes anyway
    frame = sys._current_frames().get(ident)
    if frame is None:
        raise DebugError(f"no thread {ident}; `threads` lists them")
    if stacks._is_probe_stack(frame):
        raise DebugError("that thread is rankscope's own")
    wanted = [f for f in stacks.visible(frame)]
    if not wanted:
        raise DebugError("the thread runs no Python code of the program to stop in")
    if any(f.f_trace is not None for f in wanted):
        raise DebugError("another tool traces that thread (coverage or a debugger); it cannot be paused here")

    def arrived(frame):
        if not state[0]:
            return
        state[0] = False
        with _lock:
            session.pauses.pop(ident, None)
        stop(frame, "pause", "paused")

    state = [True, arrived, *wanted]
    with _lock:
        old = session.pauses.pop(ident, None)
        if old is not None:
            old[0] = False
        session.pauses[ident] = state
    if sys.version_info >= (3, 12):
        _monitor.pause(ident, state)
    elif not _native.trace_frames(state):
        session.pauses.pop(ident, None)
        raise DebugError("this Python cannot trace another thread; set a breakpoint where it runs instead")
    return {}


class _Monitor:
    """3.12+: the debugger's own sys.monitoring tool. A pause enables LINE
    on the code objects of the paused thread's running frames only (3.13
    no longer lets one thread set another's trace function); RAISE, for the
    "raised" exception filter, is global but fires only on a raise."""

    def __init__(self):
        self.tool: int | None = None
        # thread ident -> its pause state ([active, callback, frames...])
        self.pausing: dict[int, list] = {}
        self.raises = False

    def _take(self) -> int:
        if self.tool is None:
            monitoring = sys.monitoring
            for tool in range(6):
                if monitoring.get_tool(tool) is None:
                    monitoring.use_tool_id(tool, "rankscope-debugger")
                    monitoring.register_callback(tool, monitoring.events.LINE, self._on_line)
                    monitoring.register_callback(tool, monitoring.events.RAISE, _on_raise)
                    self.tool = tool
                    break
            else:
                raise DebugError("every sys.monitoring tool id is taken (another debugger or profiler?)")
        return self.tool

    def _release_if_idle(self) -> None:
        if self.tool is not None and not self.pausing and not self.raises:
            monitoring = sys.monitoring
            monitoring.set_events(self.tool, 0)
            monitoring.register_callback(self.tool, monitoring.events.LINE, None)
            monitoring.register_callback(self.tool, monitoring.events.RAISE, None)
            monitoring.free_tool_id(self.tool)
            self.tool = None

    def _codes(self) -> set:
        return {frame.f_code for state in self.pausing.values() for frame in state[2:]}

    def pause(self, ident: int, state: list) -> None:
        tool = self._take()
        with _lock:
            self.pausing[ident] = state
        for code in {frame.f_code for frame in state[2:]}:
            sys.monitoring.set_local_events(tool, code, sys.monitoring.events.LINE)

    def done(self, ident: int) -> None:
        with _lock:
            state = self.pausing.pop(ident, None)
            if state is None or self.tool is None:
                return
            keep = self._codes()
            for code in {frame.f_code for frame in state[2:]} - keep:
                sys.monitoring.set_local_events(self.tool, code, 0)
        self._release_if_idle()

    def end_all(self) -> None:
        for ident in list(self.pausing):
            self.done(ident)

    def set_raises(self, on: bool) -> None:
        if on:
            tool = self._take()
            sys.monitoring.set_events(tool, sys.monitoring.events.RAISE)
            self.raises = True
        elif self.raises:
            self.raises = False
            if self.tool is not None:
                sys.monitoring.set_events(self.tool, 0)
            self._release_if_idle()

    def _on_line(self, code, line):
        state = self.pausing.get(threading.get_ident())
        if state is None or not state[0]:
            return None  # another thread in the same code: it runs on
        try:
            frame = sys._getframe(1)
            if not stacks.is_own(frame):
                self.done(threading.get_ident())
                state[1](frame)
        except Exception:  # noqa: BLE001 - never into the program
            pass
        return None


_monitor = _Monitor() if sys.version_info >= (3, 12) else None


# -- exceptions -------------------------------------------------------------------


_SKIPPED_EXCEPTIONS = (StopIteration, StopAsyncIteration, GeneratorExit)


class _Exceptions:
    """The session's exception filters: `uncaught` wraps the excepthooks;
    `raised` (3.12+) is sys.monitoring's RAISE event, which costs only
    when something raises."""

    def __init__(self):
        self.hooks = None

    def update(self, session: Session, filters: set[str]) -> None:
        session.exception_filters = filters
        if "uncaught" in filters and self.hooks is None:
            self._wrap_hooks()
        elif "uncaught" not in filters and self.hooks is not None:
            self._unwrap_hooks()
        if _monitor is not None:
            _monitor.set_raises("raised" in filters)

    def _wrap_hooks(self) -> None:
        previous_sys, previous_threading = sys.excepthook, threading.excepthook

        def sys_hook(kind, value, tb):
            _stop_uncaught(value, tb)
            return previous_sys(kind, value, tb)

        def threading_hook(args):
            _stop_uncaught(args.exc_value, args.exc_traceback)
            return previous_threading(args)

        sys.excepthook, threading.excepthook = sys_hook, threading_hook
        self.hooks = (sys_hook, threading_hook, previous_sys, previous_threading)

    def _unwrap_hooks(self) -> None:
        sys_hook, threading_hook, previous_sys, previous_threading = self.hooks
        # Someone who wrapped ours since keeps theirs (and ours inside it, inert).
        if sys.excepthook is sys_hook:
            sys.excepthook = previous_sys
        if threading.excepthook is threading_hook:
            threading.excepthook = previous_threading
        self.hooks = None


_exceptions = _Exceptions()


def _describe_exception(exc) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ is the program's, not ours to raise
        text = "<str() failed>"
    return f"{type_name(exc)}: {text[:300]}"


# The traceback's text for the editor's exception widget: its last lines
# (where it was raised) are kept when it is longer.
MAX_TRACEBACK_CHARS = 20_000


def _exception_info(exc, break_mode: str) -> dict:
    """DAP's exceptionInfo body, made on the program's thread when it stops
    (str() and the traceback's source lines are the program's to give)."""
    cls = type(exc)
    module = getattr(cls, "__module__", None) or ""
    full = cls.__qualname__ if module in ("builtins", "") else f"{module}.{cls.__qualname__}"
    try:
        message = str(exc)[:1000]
    except Exception:  # noqa: BLE001 - a broken __str__ is the program's
        message = "<str() failed>"
    try:
        import traceback

        trace = "".join(traceback.format_exception(exc))[-MAX_TRACEBACK_CHARS:]
    except Exception:  # noqa: BLE001 - the stop matters more than its text
        trace = ""
    return {
        "exceptionId": full,
        "description": message,
        "breakMode": break_mode,
        "details": {"message": message, "typeName": cls.__name__, "fullTypeName": full, "stackTrace": trace},
    }


def _stop_uncaught(exc, tb) -> None:
    session = _session
    if session is None or session.closed or "uncaught" not in session.exception_filters or tb is None:
        return
    try:
        frames = []
        while tb is not None:
            if not stacks.is_own(tb.tb_frame):
                frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        frames.reverse()
        if frames:
            text = _describe_exception(exc)
            stop(frames[0][0], "exception", f"uncaught {text}", text=text, frames=frames, exception=_exception_info(exc, "unhandled"))
    except Exception:  # noqa: BLE001 - the program's own excepthook still runs
        pass


def _on_raise(code, offset, exc):
    session = _session
    if session is None or session.closed or isinstance(exc, _SKIPPED_EXCEPTIONS):
        return None
    try:
        tb = exc.__traceback__
        if tb is not None and tb.tb_next is not None:
            return None  # RAISE fires again in each frame it passes through: stop where it began
        frame = sys._getframe(1)
        if stacks.is_own(frame) or stacks._is_probe_stack(frame) or threading.get_ident() in session.stopped:
            return None
        if session.just_my_code and _is_library(code.co_filename):
            return None
        text = _describe_exception(exc)
        stop(frame, "exception", f"raised {text}", text=text, exception=_exception_info(exc, "always"))
    except Exception:  # noqa: BLE001
        pass
    return None


# -- breakpoints ------------------------------------------------------------------


def _hit_options(hit_condition: str | None) -> dict:
    """DAP's hit condition ("5", ">=5", ">5", "==5", "%5") as rankscope's counts."""
    if not hit_condition or not hit_condition.strip():
        return {}
    text = hit_condition.replace(" ", "")
    for prefix in (">=", "==", ">", "%", ""):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            n = int(text[len(prefix):])
            if n < 1 and prefix != ">":
                break
            if prefix in (">=", ""):
                return {"from_hit": n}
            if prefix == ">":
                return {"from_hit": n + 1}
            if prefix == "==":
                return {"from_hit": n, "max_hits": 1}
            return {"every": n}
    raise breakpoints.UserError(f"hit condition {hit_condition!r} is not N, >=N, >N, ==N or %N")


def _add(session: Session, spec: str, entry: dict, line_hint) -> tuple[int | None, dict]:
    try:
        options = breakpoints.Options(
            condition=entry.get("condition") or None,
            log=entry.get("log_message") if entry.get("log_message") else None,
            stop=session.id,
            **_hit_options(entry.get("hit_condition")),
        )
        described = breakpoints.add_with(spec, options)
    except breakpoints.UserError as err:
        return None, {"id": None, "verified": False, "line": line_hint, "message": str(err)}
    reply = {"id": described["id"], "verified": not described.get("pending"), "line": described["line"] if isinstance(described["line"], int) else line_hint}
    if described.get("note"):
        reply["message"] = described["note"]
    return described["id"], reply


def _remove_all(ids: list[int]) -> None:
    for bp_id in ids:
        try:
            breakpoints.remove(bp_id)
        except breakpoints.UserError:
            pass


def _set_breakpoints(session: Session, path: str, entries: list[dict]) -> dict:
    _remove_all(session.line_bps.pop(path, []))
    ids, replies = [], []
    for entry in entries:
        line = int(entry["line"])
        bp_id, reply = _add(session, f"{path}:{line}", entry, line)
        if bp_id is not None:
            ids.append(bp_id)
        replies.append(reply)
    if ids:
        session.line_bps[path] = ids
    return {"breakpoints": replies}


def _function_spec(name: str) -> str:
    """A function breakpoint's name: FILE:FUNCTION as `break add` takes it,
    or a bare (qualified) name, looked for in every loaded file."""
    if ":" in name:
        return name
    found = set()
    for function in breakpoints._functions():
        code = function.__code__
        if getattr(code, "co_qualname", code.co_name) == name or code.co_name == name:
            found.add(code.co_filename)
    if not found:
        raise breakpoints.UserError(f"no loaded function is named {name!r}; give FILE:FUNCTION")
    if len(found) > 1:
        raise breakpoints.UserError(f"{name!r} is in several files ({', '.join(sorted(found))}); give FILE:FUNCTION")
    return f"{found.pop()}:{name}"


def _set_function_breakpoints(session: Session, entries: list[dict]) -> dict:
    _remove_all(session.function_bps)
    session.function_bps = []
    replies = []
    for entry in entries:
        try:
            spec = _function_spec(str(entry.get("name", "")))
        except breakpoints.UserError as err:
            replies.append({"id": None, "verified": False, "message": str(err)})
            continue
        bp_id, reply = _add(session, spec, entry, None)
        if reply.get("line") is None:
            reply.pop("line")
        if bp_id is not None:
            session.function_bps.append(bp_id)
        replies.append(reply)
    return {"breakpoints": replies}


def _set_exception_breakpoints(session: Session, filters: list[str]) -> dict:
    replies = []
    wanted = set()
    for name in filters:
        if name == "raised" and not _features()["raised_exceptions"]:
            replies.append({"verified": False, "message": "stopping on every raise needs Python 3.12+ (sys.monitoring)"})
        elif name in ("raised", "uncaught"):
            wanted.add(name)
            replies.append({"verified": True})
        else:
            replies.append({"verified": False, "message": f"unknown exception filter {name!r}"})
    try:
        _exceptions.update(session, wanted)
    except DebugError as err:
        return {"breakpoints": [{"verified": False, "message": str(err)} for _ in filters]}
    return {"breakpoints": replies}


def _data_breakpoint_info(session: Session, ref: int, name: str) -> dict:
    held = session.refs.get(ref)
    none = {"dataId": None, "description": "", "accessTypes": ["write"], "canPersist": False}
    if held is None or held[1] != "locals":
        return {**none, "description": "rankscope watches the locals of a function: pick one under Locals"}
    frame = held[2]
    code = frame.f_code
    if code.co_name == "<module>":
        return {**none, "description": "module-level names are not watched; pick a local of a function"}
    qualname = getattr(code, "co_qualname", code.co_name)
    data_id = json.dumps([code.co_filename, qualname, name])
    return {"dataId": data_id, "description": f"{name} in {qualname}", "accessTypes": ["write"], "canPersist": False}


def _set_data_breakpoints(session: Session, entries: list[dict]) -> dict:
    _remove_all(session.data_bps)
    session.data_bps = []
    replies = []
    for entry in entries:
        try:
            file, qualname, name = json.loads(entry["dataId"])
            described = breakpoints.watch(f"{file}:{qualname}", name, stop=session.id)
        except (ValueError, KeyError, TypeError):
            replies.append({"id": None, "verified": False, "message": "not a data breakpoint of rankscope's"})
            continue
        except breakpoints.UserError as err:
            replies.append({"id": None, "verified": False, "message": str(err)})
            continue
        session.data_bps.append(described["id"])
        replies.append({"id": described["id"], "verified": True})
    return {"breakpoints": replies}


# -- threads, stacks, variables ---------------------------------------------------------


def _threads() -> dict[int, str]:
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident == me or stacks._is_probe_stack(frame):
            continue
        out[ident] = names.get(ident) or f"Thread-{ident}"
    return out


def _thread_events(session: Session) -> None:
    now = _threads()
    known = session.known_threads
    session.known_threads = now
    if known is None:
        return
    for ident in now.keys() - known.keys():
        session.post("thread", {"reason": "started", "threadId": ident})
    for ident in known.keys() - now.keys():
        if ident not in session.stopped:
            session.post("thread", {"reason": "exited", "threadId": ident})


def _stack(session: Session, ident: int, start: int, levels: int) -> dict:
    held = session.stopped.get(ident)
    if held is None:
        raise DebugError("the thread is running; pause it to see its stack")
    chosen = list(zip(held.frame_ids, held.frames))
    total = len(chosen)
    chosen = chosen[start : start + levels] if levels else chosen[start:]
    frames = []
    for fid, (frame, line) in chosen:
        code = frame.f_code
        frames.append(
            {
                "id": fid,
                "name": getattr(code, "co_qualname", code.co_name),
                "path": code.co_filename,
                "line": line,
                "subtle": session.just_my_code and _is_library(code.co_filename),
            }
        )
    return {"frames": frames, "total": total}


def _frame(session: Session, fid: int):
    held = session.frames.get(fid)
    if held is None:
        raise DebugError(f"no frame {fid}: its thread has run on since")
    return held


def _new_ref(session: Session, ident: int, kind: str, obj, name: str | None) -> int:
    ref = next(session.ref_ids)
    session.refs[ref] = (ident, kind, obj, name)
    return ref


def _scopes(session: Session, fid: int) -> dict:
    ident, frame = _frame(session, fid)
    local_names = frame.f_locals
    is_module = frame.f_code.co_name == "<module>"
    scopes = [
        {"name": "Locals", "ref": _new_ref(session, ident, "locals", frame, ""), "named": len(local_names), "expensive": False}
    ]
    if not is_module:
        scopes.append(
            {"name": "Globals", "ref": _new_ref(session, ident, "globals", frame, ""), "named": len(frame.f_globals), "expensive": True}
        )
    return {"scopes": scopes}


_LEAVES = (int, float, complex, bool, str, bytes, type(None), type(...))


def _is_tensor(value) -> bool:
    t = type(value)
    return any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in t.__mro__) or (
        t.__module__ == "torch.nn.parameter"
    )


def _children(value):
    """(named, indexed) children of a value, without calling user code
    beyond what reading attributes from `__dict__` does."""
    if isinstance(value, _LEAVES) or type(value).__name__ in ("function", "builtin_function_or_method", "method"):
        return None
    if _is_tensor(value):
        return "tensor"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "sequence"
    if isinstance(value, (set, frozenset)):
        return "set"
    if isinstance(getattr(value, "__dict__", None), dict) and value.__dict__:
        return "object"
    return None


def _variable(session: Session, ident: int, name: str, value, evaluate_name: str | None, budget: Budget) -> dict:
    entry = {"name": name, "value": safe_repr(value, budget), "type": type_name(value), "ref": 0}
    if evaluate_name:
        entry["evaluate_name"] = evaluate_name
    kind = _children(value)
    if kind is not None:
        entry["ref"] = _new_ref(session, ident, kind, value, evaluate_name)
        if kind == "sequence" or kind == "set":
            entry["indexed"] = len(value)
        elif kind == "dict":
            entry["named"] = len(value)
    return entry


def _tensor_fields(tensor) -> list[tuple[str, object]]:
    """What a tensor says about itself from metadata: no `.item()`, no sync."""
    fields = []
    for attr in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "grad"):
        try:
            if attr == "grad" and not tensor.is_leaf:
                continue  # reading it on a non-leaf prints a warning into the program's stderr
            fields.append((attr, getattr(tensor, attr)))
        except Exception:  # noqa: BLE001
            continue
    try:
        fields.append(("numel", tensor.numel()))
    except Exception:  # noqa: BLE001
        pass
    return fields


def _items(kind: str, value, start: int, count: int):
    stop = start + count if count else None
    if kind in ("locals", "globals"):
        frame = value
        mapping = frame.f_locals if kind == "locals" else frame.f_globals
        items = list(mapping.items())
        if kind == "globals" or frame.f_code.co_name == "<module>":
            items = [(k, v) for k, v in items if not stacks._is_noise(str(k), v)]
        return [(str(k), v, str(k) if str(k).isidentifier() else None) for k, v in items[start:stop]]
    if kind == "dict":
        keys = list(itertools.islice(value.keys(), start, stop))
        return [(str(k) if isinstance(k, str) else repr(k), value[k], repr(k)) for k in keys]
    if kind == "sequence":
        return [(str(i), value[i], str(i)) for i in range(start, min(len(value), stop or len(value)))]
    if kind == "set":
        return [(str(start + i), v, None) for i, v in enumerate(itertools.islice(value, start, stop))]
    if kind == "tensor":
        return [(name, v, name) for name, v in _tensor_fields(value)]
    if kind == "object":
        names = sorted(value.__dict__)[start:stop]
        return [(n, value.__dict__[n], n) for n in names]
    return []


def _child_name(parent: str | None, kind: str, suffix: str | None) -> str | None:
    if suffix is None:
        return None
    if kind in ("locals", "globals"):
        return suffix
    if not parent:
        return None
    if kind in ("dict", "sequence"):
        return f"{parent}[{suffix}]"
    return f"{parent}.{suffix}"


def _variables(session: Session, ref: int, start: int, count: int) -> dict:
    held = session.refs.get(ref)
    if held is None:
        raise DebugError(f"no variables {ref}: its thread has run on since")
    ident, kind, value, name = held
    budget = Budget(tensor_stats=True)
    out = []
    for child, child_value, suffix in _items(kind, value, start, count):
        out.append(_variable(session, ident, child, child_value, _child_name(name, kind, suffix), budget))
    return {"variables": out}


# -- evaluate and set a variable (on the stopped thread) ---------------------------------


def _write_back(frame) -> None:
    """3.11/3.12: a function's locals live in fast slots; what was written
    into the frame's f_locals dict is copied back, on the frame's own
    stopped thread, as a trace function's return does."""
    if sys.version_info >= (3, 13):
        return  # f_locals writes through (PEP 667)
    import ctypes

    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


_HOVER_NODES = None


def _hover_safe(expression: str) -> bool:
    """Hovers evaluate names, attributes and constant subscripts only: no call runs."""
    import ast

    global _HOVER_NODES
    if _HOVER_NODES is None:
        _HOVER_NODES = (ast.Expression, ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Load, ast.Tuple, ast.UnaryOp, ast.USub, ast.Slice)
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return False
    return all(isinstance(node, _HOVER_NODES) for node in ast.walk(tree))


def _run_code(expression: str, context: str, namespace: dict, local_names):
    """Evaluates (or, in the REPL, executes) the expression; returns
    (has value, value, printed text)."""
    from rankscope import _native
    from rankscope._probe import evaluate

    # One name for all: an editor evaluates its watches at every stop, and
    # registering each text with linecache would grow it for ever.
    filename = "<rankscope-dap>"
    out, err = evaluate._begin_capture()
    token = _native.arm_deadline(EVALUATE_TIMEOUT_S, evaluate.EvalTimeout, None)
    try:
        try:
            code = compile(expression, filename, "eval")
            has_value, value = True, eval(code, namespace, local_names)
        except SyntaxError:
            if context != "repl":
                raise
            has_value, value = evaluate._execute(expression, filename, namespace, local_names)
    except evaluate.EvalTimeout:
        raise DebugError(f"interrupted after {EVALUATE_TIMEOUT_S:g} s") from None
    except BaseException as exc:  # noqa: BLE001 - the program never sees the editor's errors
        raise DebugError(f"{type(exc).__name__}: {exc}") from None
    finally:
        _native.disarm_deadline(token)
        evaluate._end_capture()
    return has_value, value, out.getvalue() + err.getvalue()


def _in_frame(session: Session, fid, work) -> tuple:
    """Runs `work(globals, locals)` in a stopped frame, on its own thread,
    with what it wrote to the frame's locals written back; in `__main__`
    when there is no frame. Returns (thread ident or 0, what work returned)."""
    if fid is None:
        main = sys.modules.get("__main__")
        namespace = main.__dict__ if main is not None else {}
        # Values of the previous console line are let go (refs hold objects alive).
        session.forget(0)
        return 0, work(namespace, None)
    ident, frame = _frame(session, fid)
    held = session.stopped.get(ident)
    if held is None:
        raise DebugError("the thread has run on since")

    def on_thread():
        result = work(frame.f_globals, frame.f_locals)
        if frame.f_code.co_flags & 0x0001:  # CO_OPTIMIZED: fast locals
            _write_back(frame)
        return result

    return ident, held.call(on_thread, EVALUATE_TIMEOUT_S + 5)


def _evaluate(session: Session, expression: str, fid, context: str) -> dict:
    if context == "hover" and not _hover_safe(expression):
        raise DebugError("hovers show names, attributes and subscripts; type calls in the Debug Console")
    ident, (has_value, value, printed) = _in_frame(session, fid, lambda g, l: _run_code(expression, context, g, l))
    return _value_reply(session, ident, has_value, value, printed, expression)


def _set_expression(session: Session, expression: str, text: str, fid) -> dict:
    """A Watch entry edited in the editor: `expression = text`, where the
    expression is a name, an attribute or a subscript; answers with its new value."""
    import ast

    try:
        target = ast.parse(expression.strip(), mode="eval").body
        ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise DebugError(f"not an expression: {err.msg}") from None
    if not isinstance(target, (ast.Name, ast.Attribute, ast.Subscript)):
        raise DebugError("only a name, an attribute or a subscript can be set")

    def work(namespace, local_names):
        _run_code(f"{expression.strip()} = ({text})", "repl", namespace, local_names)
        return _run_code(expression, "watch", namespace, local_names)

    ident, (has_value, value, printed) = _in_frame(session, fid, work)
    return _value_reply(session, ident, has_value, value, printed, expression)


# What the Debug Console completes: a dotted name ending at the cursor.
MAX_COMPLETIONS = 500


def _completions(session: Session, text: str, offset: int, fid) -> dict:
    """Names for the Debug Console: after `a.b.` the attributes of `a.b`,
    else the frame's locals, globals, builtins and keywords. Only names are
    looked up and attributes read (as a hover does): what runs of the
    program's is a property or `__dir__` on that path, never a call typed."""
    import builtins
    import keyword
    import re

    before = text[: max(0, min(offset, len(text)))]
    match = re.search(r"((?:[A-Za-z_][A-Za-z0-9_]*\.)*)([A-Za-z_][A-Za-z0-9_]*)?$", before)
    chain = match.group(1).rstrip(".").split(".") if match and match.group(1) else []
    prefix = (match.group(2) or "") if match else ""

    def names(namespace_globals: dict, namespace_locals) -> list[tuple[str, str]]:
        if chain:
            for scope in (namespace_locals or {}, namespace_globals, vars(builtins)):
                if chain[0] in scope:
                    obj = scope[chain[0]]
                    break
            else:
                return []
            for attribute in chain[1:]:
                obj = getattr(obj, attribute)
            return [(name, "property") for name in dir(obj)]
        found: dict[str, str] = {}
        for scope in (vars(builtins), namespace_globals, namespace_locals or {}):
            for name, value in list(scope.items()):
                found[name] = _completion_type(value)
        for word in keyword.kwlist:
            found.setdefault(word, "keyword")
        return list(found.items())

    try:
        if fid is None:
            main = sys.modules.get("__main__")
            candidates = names(main.__dict__ if main is not None else {}, None)
        else:
            ident, frame = _frame(session, fid)
            held = session.stopped.get(ident)
            if held is None:
                raise DebugError("the thread has run on since")
            # Attribute lookups are the program's code (properties, __getattr__):
            # they run on its thread, as an evaluate does.
            candidates = held.call(lambda: names(frame.f_globals, frame.f_locals), EVALUATE_TIMEOUT_S + 5)
    except DebugError:
        raise
    except Exception:  # noqa: BLE001 - a name that is not there, or an attribute that raises: nothing to offer
        candidates = []
    private = prefix.startswith("_")
    targets = sorted(
        {(name, kind) for name, kind in candidates if name.startswith(prefix) and (private or not name.startswith("_"))},
        key=lambda item: item[0].lower(),
    )[:MAX_COMPLETIONS]
    start = len(before) - len(prefix)
    return {"targets": [{"label": name, "type": kind, "start": start, "length": len(prefix)} for name, kind in targets]}


def _completion_type(value) -> str:
    # type(), not isinstance: isinstance may read a `__class__` the program defines.
    if issubclass(type(value), type):
        return "class"
    if type(value).__name__ == "module":
        return "module"
    if callable(value):
        return "function"
    return "variable"


def _value_reply(session: Session, ident, has_value: bool, value, printed: str, expression: str) -> dict:
    reply = {"result": "", "type": "", "ref": 0}
    if has_value:
        entry = _variable(session, ident, "", value, expression, Budget(tensor_stats=True))
        reply = {"result": entry["value"], "type": entry["type"], "ref": entry["ref"]}
        for key in ("named", "indexed"):
            if key in entry:
                reply[key] = entry[key]
    if printed:
        reply["output"] = printed
    return reply


def _set_variable(session: Session, ref: int, name: str, text: str) -> dict:
    held = session.refs.get(ref)
    if held is None:
        raise DebugError(f"no variables {ref}: its thread has run on since")
    ident, kind, container, _ = held
    stopped = session.stopped.get(ident)
    if stopped is None:
        raise DebugError("the thread has run on since")

    def on_thread():
        frame = container if kind in ("locals", "globals") else stopped.frames[0][0]
        has_value, value, _ = _run_code(text, "watch", frame.f_globals, frame.f_locals)
        if kind == "locals":
            local_names = frame.f_locals
            if name not in local_names:
                raise DebugError(f"{name!r} is not a local here")
            local_names[name] = value
            if frame.f_code.co_flags & 0x0001:
                _write_back(frame)
        elif kind == "globals":
            frame.f_globals[name] = value
        elif kind == "dict":
            keys = {(str(k) if isinstance(k, str) else repr(k)): k for k in container}
            if name not in keys:
                raise DebugError(f"no key {name} here")
            container[keys[name]] = value
        elif kind == "sequence":
            if isinstance(container, tuple):
                raise DebugError("a tuple cannot be changed")
            container[int(name)] = value
        elif kind == "object":
            setattr(container, name, value)
        else:
            raise DebugError("this value cannot be changed from the editor")
        return value

    try:
        value = stopped.call(on_thread, EVALUATE_TIMEOUT_S)
    except DebugError:
        raise
    except BaseException as exc:  # noqa: BLE001
        raise DebugError(f"{type(exc).__name__}: {exc}") from None
    entry = _variable(session, ident, name, value, None, Budget(tensor_stats=True))
    return {"value": entry["value"], "type": entry["type"], "ref": entry["ref"]}


def _resume(session: Session, ident: int, how: str) -> dict:
    with _lock:
        held = session.stopped.get(ident)
        if held is None or held.resume is not None:
            raise DebugError("the thread is not stopped")
        held.resume = how
        held.wake.notify_all()
    return {}


def _modules() -> dict:
    """The program's modules, for the editor's Modules and Loaded Scripts
    views. Read from each module's own dict: `getattr` could run a
    module-level `__getattr__` of the program's."""
    module_type = type(sys)
    rows = []
    for name, module in list(sys.modules.items()):
        # rankscope's own are left out, as its frames are.
        if not issubclass(type(module), module_type) or name == "rankscope" or name.startswith("rankscope."):
            continue
        names = module.__dict__
        path = names.get("__file__")
        path = path if type(path) is str else None
        version = names.get("__version__")
        row = {"name": name, "path": path, "user": path is not None and not _is_library(path)}
        if type(version) is str:
            row["version"] = version[:100]
        rows.append(row)
    rows.sort(key=lambda r: r["name"])
    return {"modules": rows}


def _exception_info_of(session: Session, ident: int) -> dict:
    with _lock:
        held = session.stopped.get(ident)
    if held is None:
        raise DebugError("the thread is not stopped")
    if held.exception is None:
        raise DebugError("the thread did not stop on an exception")
    return held.exception


def _source(path: str) -> dict:
    import linecache

    lines = linecache.getlines(path)
    if not lines:
        raise DebugError(f"no source for {path}")
    return {"content": "".join(lines)}


def _events(session: Session, after: int, wait_s: float) -> dict:
    session.last_poll = time.monotonic()
    _thread_events(session)
    deadline = time.monotonic() + max(0.0, min(float(wait_s), 30.0))
    with _lock:
        while not session.closed:
            if session.seq > after:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            session.posted.wait(left)
        session.last_poll = time.monotonic()
        events = [e for e in session.events if e["seq"] > after]
    return {"events": events, "closed": session.closed}


def handle(request_text: str) -> str:
    """The probe's /v1/debug endpoint: {"op": ..., ...} -> JSON."""
    try:
        request = json.loads(request_text)
        op = request.get("op")
        if op == "hello":
            result = _hello()
        elif op == "attach":
            result = _attach(str(request.get("client", "editor")), request.get("lease_s", 10.0), bool(request.get("just_my_code", True)))
        else:
            session = _current(request.get("session"))
            result = _session_op(session, op, request)
        return json.dumps({"ok": result}, default=str)
    except (DebugError, breakpoints.UserError) as err:
        return json.dumps({"error": str(err)})
    except (KeyError, TypeError, ValueError) as err:
        return json.dumps({"error": f"bad debug request: {type(err).__name__}: {err}"})


def _session_op(session: Session, op: str, request: dict):
    thread = request.get("thread")
    if op == "events":
        return _events(session, int(request.get("after", 0)), float(request.get("wait_s", 2.0)))
    if op == "detach":
        return {"resumed": _end(session, "the editor detached")}
    if op == "set_breakpoints":
        return _set_breakpoints(session, str(request["path"]), list(request.get("breakpoints", [])))
    if op == "set_function_breakpoints":
        return _set_function_breakpoints(session, list(request.get("breakpoints", [])))
    if op == "set_exception_breakpoints":
        return _set_exception_breakpoints(session, [str(f) for f in request.get("filters", [])])
    if op == "data_breakpoint_info":
        return _data_breakpoint_info(session, int(request["ref"]), str(request["name"]))
    if op == "set_data_breakpoints":
        return _set_data_breakpoints(session, list(request.get("breakpoints", [])))
    if op == "threads":
        current = _threads()
        return {"threads": [{"id": i, "name": n, "stopped": i in session.stopped} for i, n in current.items()]}
    if op == "stack":
        return _stack(session, int(thread), int(request.get("start", 0)), int(request.get("levels", 0)))
    if op == "scopes":
        return _scopes(session, int(request["frame"]))
    if op == "variables":
        return _variables(session, int(request["ref"]), int(request.get("start", 0)), int(request.get("count", 0)))
    if op == "evaluate":
        fid = request.get("frame")
        return _evaluate(session, str(request["expression"]), None if fid is None else int(fid), str(request.get("context", "repl")))
    if op == "set_expression":
        fid = request.get("frame")
        return _set_expression(session, str(request["expression"]), str(request["value"]), None if fid is None else int(fid))
    if op == "set_variable":
        return _set_variable(session, int(request["ref"]), str(request["name"]), str(request["value"]))
    if op in ("continue", "next", "step_in", "step_out"):
        return _resume(session, int(thread), op)
    if op == "pause":
        return _pause(session, int(thread))
    if op == "modules":
        return _modules()
    if op == "completions":
        fid = request.get("frame")
        return _completions(session, str(request["text"]), int(request["offset"]), None if fid is None else int(fid))
    if op == "exception_info":
        return _exception_info_of(session, int(thread))
    if op == "source":
        return _source(str(request["path"]))
    raise DebugError(f"unknown debug operation {op!r}")
