"""Run code sent by the CLI in the target's ``__main__`` namespace, or in
one frame of one thread (``--thread``/``--frame``): its globals and locals.

Output is captured per request: while an eval runs, ``sys.stdout`` and
``sys.stderr`` route writes from the eval's thread into buffers and let every
other thread write where it always did.
"""

from __future__ import annotations

import _thread
import ast
import itertools
import linecache
import sys
import traceback

from rankscope import _native

MAX_OUTPUT_CHARS = 1 << 20
_counter = itertools.count(1)


class EvalTimeout(BaseException):
    """Raised asynchronously in eval code that ran past its timeout."""


class _Router:
    """Stands in for a standard stream while at least one eval runs."""

    def __init__(self, original, index: int):
        self._original = original
        self._index = index

    def write(self, text):
        buffers = _captures.get(_thread.get_ident())
        if buffers is None:
            return self._original.write(text)
        return buffers[self._index].write(text)

    def flush(self):
        if _thread.get_ident() not in _captures:
            self._original.flush()

    def __getattr__(self, name):
        return getattr(self._original, name)


class _Bounded:
    """What an eval prints, kept up to MAX_OUTPUT_CHARS: kept whole, a loop
    that prints took the target to 1.8 GB while it ran, for a reply that
    carries 1 MiB of it. What went past is counted, and said."""

    def __init__(self):
        self._parts = []
        self._kept = 0
        self.dropped = 0

    def write(self, text):
        n = len(text)
        room = MAX_OUTPUT_CHARS - self._kept
        if n <= room:
            self._parts.append(text)
            self._kept += n
        else:
            if room > 0:
                self._parts.append(text[:room])
                self._kept += room
            self.dropped += n - max(room, 0)
        return n

    def getvalue(self) -> str:
        return "".join(self._parts)


_captures: dict[int, tuple[_Bounded, _Bounded]] = {}
# Every router ever installed, kept for the life of the process: print()
# holds a borrowed reference to sys.stdout while its write may release the
# GIL, so a router dropped when an eval ends could be freed under another
# thread's print (a segfault, seen on 3.11). One per stream, so this stays
# small however many evals run.
_routers: list[_Router] = []
# _thread, not threading: a probe thread must not be the first to import
# threading (see mainthread.py).
_capture_lock = _thread.allocate_lock()
_saved_streams: tuple | None = None


def _begin_capture() -> tuple[_Bounded, _Bounded]:
    global _saved_streams
    buffers = (_Bounded(), _Bounded())
    with _capture_lock:
        if not _captures:
            _saved_streams = (sys.stdout, sys.stderr)
            sys.stdout = _router_for(sys.stdout, 0)
            sys.stderr = _router_for(sys.stderr, 1)
        _captures[_thread.get_ident()] = buffers
    return buffers


def _router_for(original, index: int) -> _Router:
    for router in _routers:
        if router._original is original and router._index == index:
            return router
    router = _Router(original, index)
    _routers.append(router)
    return router


def _end_capture() -> None:
    global _saved_streams
    with _capture_lock:
        _captures.pop(_thread.get_ident(), None)
        if not _captures and _saved_streams is not None:
            # Put the originals back unless the eval replaced the streams itself.
            if type(sys.stdout) is _Router:
                sys.stdout = _saved_streams[0]
            if type(sys.stderr) is _Router:
                sys.stderr = _saved_streams[1]
            _saved_streams = None


def _register_source(code: str) -> str:
    """Give the code a filename that tracebacks and inspect can show lines of."""
    filename = f"<rankscope-eval-{next(_counter)}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    return filename


def _execute(code: str, filename: str, namespace: dict, local_names=None):
    tree = ast.parse(code, filename, "exec")
    trailing = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        trailing = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace, local_names)
    if trailing is not None:
        return True, eval(compile(trailing, filename, "eval"), namespace, local_names)
    return False, None


_CO_OPTIMIZED = 0x0001
_MISSING = object()


def _fast_names(frame) -> tuple:
    """Names a function keeps in its frame's fast slots (not in a dict): what
    3.11 and 3.12 cannot change from outside the running frame."""
    code = frame.f_code
    if sys.version_info >= (3, 13) or not code.co_flags & _CO_OPTIMIZED:
        return ()
    return code.co_varnames + code.co_cellvars + code.co_freevars


def _lost_writes(names: tuple, before: dict, after) -> list[str]:
    return [n for n in names if before.get(n, _MISSING) is not after.get(n, _MISSING)]


def _format_error(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return "".join(traceback.format_exception_only(type(exc), exc))
    tb = exc.__traceback__
    # Drop this module's own frames: the user wants the traceback of their code.
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _check(code: str) -> dict:
    import codeop

    try:
        incomplete = codeop.compile_command(code, "<rankscope-eval>", "exec") is None
    except (SyntaxError, ValueError, OverflowError):
        incomplete = False
    return {"stdout": "", "stderr": "", "value": None, "error": None, "incomplete": incomplete}


def run(
    code: str, timeout_s: float, check_only: bool = False, thread: str | None = None, frame: int | None = None, eval_id: str | None = None
) -> dict:
    if check_only:
        return _check(code)
    reply = {"value": None, "error": None, "timed_out": False, "notes": []}
    target = local_names = None
    fast = ()
    try:
        if thread is None and frame is None:
            main = sys.modules.get("__main__")
            namespace = main.__dict__ if main is not None else {}
        else:
            from rankscope._probe import stacks

            try:
                target, reply["frame"] = stacks.find_frame(thread, frame or 0)
            except stacks.NoSuchFrame as exc:
                return {"stdout": "", "stderr": "", "value": None, "error": str(exc), "hint": exc.hint}
            namespace = target.f_globals
            # 3.13 (PEP 667): a write-through proxy. 3.11/3.12: the frame's
            # dict, which the running function never reads back.
            local_names = target.f_locals
            fast = _fast_names(target)
            before = {n: local_names.get(n, _MISSING) for n in fast}
            func = target.f_code.co_name
            # Only the mapping is needed from here on.
            target = None
        _run_captured(code, timeout_s, namespace, local_names, reply, eval_id)
        lost = _lost_writes(fast, before, local_names) if fast else []
        if lost:
            reply["notes"].append(
                f"Python {sys.version_info.major}.{sys.version_info.minor} cannot change the locals of a running function from outside it: "
                f"{func}() does not see the new {', '.join(lost)} (Python 3.13 writes them through)"
            )
    finally:
        # No reference to the target's frame outlives the request (3.13's
        # proxy holds the frame).
        target = local_names = None
    # A plain dict: Rust makes it JSON, so an eval does not import `json`
    # (nor `re` and `enum`) into the program.
    return reply


def _quits(code: str, namespace: dict, local_names) -> str | None:
    """`exit()` or `quit()` as site gives them: they close ``sys.stdin``,
    the program's, before they raise SystemExit (which the eval catches),
    and a program that reads its stdin then failed. Not run."""
    if "exit" not in code and "quit" not in code:
        return None
    try:
        names = {node.func.id for node in ast.walk(ast.parse(code))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    except SyntaxError:
        return None
    builtins = namespace.get("__builtins__")
    builtins = builtins if isinstance(builtins, dict) else getattr(builtins, "__dict__", {})
    for name in sorted(names & {"exit", "quit"}):
        for scope in (local_names or {}, namespace, builtins):
            if name in scope:
                if type(scope[name]).__name__ == "Quitter":
                    return (f"{name}() closes the program's sys.stdin and cannot end the program from an eval: not run "
                            "(Ctrl-D leaves the REPL; `raise SystemExit` is caught like any error)\n")
                break
    return None


def _run_captured(code: str, timeout_s: float, namespace: dict, local_names, reply: dict, eval_id: str | None) -> None:
    refused = _quits(code, namespace, local_names)
    if refused is not None:
        reply.update(error=refused, stdout="", stderr="")
        return
    filename = _register_source(code)
    out, err = _begin_capture()
    token = None
    try:
        try:
            # eval_id lets POST /v1/eval/interrupt raise KeyboardInterrupt here.
            token = _native.arm_deadline(timeout_s, EvalTimeout, eval_id)
            try:
                has_value, value = _execute(code, filename, namespace, local_names)
                if has_value and value is not None:
                    text = repr(value)
                    reply["value"] = text[:MAX_OUTPUT_CHARS]
                    if len(text) > MAX_OUTPUT_CHARS:
                        reply["notes"].append(f"the value's repr was cut at {MAX_OUTPUT_CHARS} characters of {len(text)}")
            finally:
                _native.disarm_deadline(token)
        except EvalTimeout:
            if token is not None:
                _native.disarm_deadline(token)
            if _native.stopping():
                reply["error"] = "eval interrupted: the program is exiting\n"
            else:
                reply["timed_out"] = True
                reply["error"] = f"TimeoutError: eval interrupted after {timeout_s:g}s (the target runs on)\n"
        except BaseException as exc:  # noqa: BLE001 - SystemExit and all: the target lives on
            reply["error"] = _format_error(exc)
    finally:
        _end_capture()
    reply["stdout"] = out.getvalue()
    reply["stderr"] = err.getvalue()
    for name, kept in (("output", out), ("error output", err)):
        if kept.dropped:
            reply["notes"].append(f"the eval's {name} was cut at {MAX_OUTPUT_CHARS} characters: {kept.dropped} more were not kept")
