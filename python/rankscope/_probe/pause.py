"""Pause sessions: a thread that hit a `--pause` breakpoint waits for a
debugger while the other threads run on.

The paused thread listens on a unix socket in the probe's private endpoint
directory (0700: only this user) and serves one pdb session there, which
`rankscope PID attach` relays to the terminal. Stepping (n, s, r, c) is
pdb's own, on this thread only. The session ends, and the thread resumes,
on `c`, on `q` (which here detaches instead of killing the program), when
the client goes away (Ctrl-C in `attach`), or when nobody attaches, or the
client stays silent, for the breakpoint's pause timeout.

Nothing raised by the session reaches the program: errors end the session
and the thread goes on as if it had continued.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time

from rankscope._probe import private_socket

DEFAULT_TIMEOUT_S = 300.0
_ids = itertools.count(1)
_lock = threading.Lock()
# A probe thread may hold it when the program forks: the child, which has
# only the forking thread, gets it free.
os.register_at_fork(after_in_child=_lock._at_fork_reinit)
# session id -> what `attach` needs to find it
_paused: dict[int, dict] = {}
# threads in a session: a breakpoint they hit again only records
_in_session: set[int] = set()
# session id -> the listening socket of a thread nobody has attached to yet
_waiting: dict[int, socket.socket] = {}


def paused() -> list[dict]:
    with _lock:
        return [dict(info) for info in _paused.values()]


def in_session() -> bool:
    return threading.get_ident() in _in_session


class _Lines:
    """pdb's input: a line from the socket, or '' (pdb's EOF, which ends the
    session here) on a timeout or a broken connection."""

    def __init__(self, conn: socket.socket):
        self._file = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")

    def readline(self) -> str:
        try:
            return self._file.readline()
        except (OSError, ValueError):
            return ""


class _Output:
    """pdb's output; a client that went away costs nothing."""

    def __init__(self, conn: socket.socket):
        self._file = conn.makefile("w", encoding="utf-8", errors="replace", newline="\n")
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                # makefile's text layer holds text until flushed, whatever
                # the buffering says; a session is interactive.
                self._file.write(text)
                self._file.flush()
            except (OSError, ValueError):
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._file.flush()
            except (OSError, ValueError):
                self.broken = True


def _debugger_class():
    import pdb

    class PausePdb(pdb.Pdb):
        """pdb whose quit detaches: the program was not started by this
        debugger and must not be ended by it."""

        def __init__(self, stdin, stdout, on_detach):
            # The probe's own frames (the hook that called us) are never stepped into.
            super().__init__(stdin=stdin, stdout=stdout, skip=["rankscope", "rankscope.*"], nosigint=True)
            self.use_rawinput = False
            self._on_detach = on_detach
            self.detached = False

        def detach(self) -> None:
            self.detached = True
            self.clear_all_breaks()
            self.set_continue()
            sys.settrace(None)
            # pdb leaves its trace function on the outermost frame; a frame
            # with one looks traced by someone else to the probe.
            frame = sys._getframe()
            while frame is not None:
                if getattr(frame.f_trace, "__self__", None) is self:
                    frame.f_trace = None
                frame = frame.f_back
            self._on_detach()

        def do_quit(self, arg):
            self.message("detached; the thread goes on")
            self.detach()
            return 1

        do_q = do_exit = do_quit

        def do_EOF(self, arg):
            self.detach()
            return 1

        def do_continue(self, arg):
            result = super().do_continue(arg)
            if not self.breaks:
                self.detach()
            return result

        do_c = do_cont = do_continue

        def do_run(self, arg):
            self.error("restart is not available in a live process")

        do_restart = do_run

        def trace_dispatch(self, frame, event, arg):
            if self.detached:
                return None
            try:
                result = super().trace_dispatch(frame, event, arg)
                # Once detached, a returned trace function would be set
                # back on the frame by CPython.
                return None if self.detached else result
            except (KeyboardInterrupt, SystemExit):
                raise  # the user's own interrupt, not ours
            except BaseException:  # noqa: BLE001 - a broken session never reaches the program
                self.detach()
                sys.settrace(None)
                return None

    return PausePdb


def pause(frame, bp_id: int, timeout: float, on_resume=None, wanted=lambda: True) -> str:
    """Holds this thread for a debugger; returns how the pause ended.
    `on_resume` is called in this thread once the session is over (the
    3.11 line hooks re-trace running frames then: pdb's tracing replaced theirs)."""
    from rankscope import _native

    endpoint = _native.endpoint()
    if endpoint is None:
        return "not paused: the probe is not running"
    session = next(_ids)
    path = os.path.join(os.path.dirname(endpoint), f"pause-{os.getpid()}-{session}.sock")
    me = threading.get_ident()
    thread = threading.current_thread()
    try:
        server = private_socket.listen(path)
    except OSError as err:
        return f"not paused: cannot listen on {path}: {err}"
    info = {
        "session": session,
        "bp_id": bp_id,
        "thread": thread.name,
        "thread_id": me,
        "file": frame.f_code.co_filename,
        "line": frame.f_lineno,
        "func": frame.f_code.co_name,
        "socket": path,
        "since": time.time(),
        "timeout_s": timeout,
    }
    with _lock:
        _paused[session] = info
        _waiting[session] = server
        _in_session.add(me)
    conn = None
    try:
        # The breakpoint may have been removed since this hit began: then
        # release() ran before this session existed and cannot end it.
        if wanted():
            conn = private_socket.accept_one(server, path, timeout)
        else:
            server.close()
            os.unlink(path)
            _waiting.pop(session, None)
    finally:
        with _lock:
            _paused.pop(session, None)
            released = _waiting.pop(session, None) is None
            if conn is None:
                _in_session.discard(me)
    if released:
        if conn is not None:
            conn.close()
        with _lock:
            _in_session.discard(me)
        return "resumed: the breakpoint was removed"
    if conn is None:
        return f"resumed after {timeout:g} s with no debugger"
    return _serve(conn, frame, info, timeout, on_resume)


def release(bp_id: int) -> None:
    """Resumes the threads that a removed breakpoint holds and that nobody
    has attached to yet (an attached session ends with its client)."""
    with _lock:
        sessions = [(s, info["socket"]) for s, info in _paused.items() if info["bp_id"] == bp_id and s in _waiting]
        for session, _ in sessions:
            _waiting.pop(session, None)
    for _, path in sessions:
        # A connection is what wakes a waiting accept() for sure; the
        # session sees it is no longer waited for, and lets it go.
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.settimeout(1.0)
                wake.connect(path)
        except OSError:
            pass


def _serve(conn: socket.socket, frame, info: dict, timeout: float, on_resume) -> str:
    me = threading.get_ident()

    def on_detach():
        _in_session.discard(me)
        if on_resume is not None:
            try:
                on_resume()
            except Exception:  # noqa: BLE001
                pass
        try:
            # The session's file objects still hold the socket open: shut it
            # down, so that the client sees the end now.
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()

    conn.settimeout(timeout)
    out = _Output(conn)
    debugger = _debugger_class()(_Lines(conn), out, on_detach)
    try:
        out.write(
            f"rankscope: thread {info['thread']!r} (pid {os.getpid()}) paused at {info['file']}:{info['line']} "
            f"by breakpoint {info['bp_id']}; the other threads run on.\n"
            "pdb commands work here (n, s, r, c, w, u, d, l, p, pp); c, q or Ctrl-C resume the thread.\n"
        )
        debugger.reset()
        outermost = frame
        while outermost.f_back is not None:
            outermost = outermost.f_back
        debugger.botframe = outermost
        debugger.interaction(frame, None)
        if debugger.detached:
            return "resumed"
        # A step was asked for: pdb traces this thread from here on, and
        # stops at the next line (its own dispatch, stepping frame by frame).
        walk = frame
        while walk is not None:
            walk.f_trace = debugger.trace_dispatch
            walk = walk.f_back
        sys.settrace(debugger.trace_dispatch)
        return "stepping"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001
        debugger.detached = True
        on_detach()
        return "resumed after a session error"
