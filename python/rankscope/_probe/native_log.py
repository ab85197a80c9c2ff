"""The native crash log: faulthandler's stacks of every thread after a
SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL, in ``native-<pid>.log`` in the
run directory. An empty log is removed at a clean exit.

Kept apart from the crash recorder, which imports much more, so that
starting a probe imports nothing into the program (see ``unseen``).
"""

import os
import sys

from rankscope import _native
from rankscope._probe.unseen import builtin

# faulthandler writes to this file's descriptor: it must stay open.
_log = None
_fork_hook = False


def enable() -> None:
    global _log, _fork_hook
    faulthandler = builtin("faulthandler")
    if faulthandler.is_enabled():
        return  # the user's own setup wins
    directory = _native.run_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"native-{os.getpid()}.log")
    if os.path.exists(path) and os.path.getsize(path) > 0:
        # An earlier process with this PID crashed here: keep its log.
        path = os.path.join(directory, f"native-{os.getpid()}-{_native.wall_ms()}.log")
    log = open(path, "w")  # noqa: SIM115 - kept open on purpose
    faulthandler.enable(file=log, all_threads=True)
    _log = log
    builtin("atexit").register(_close)
    if not _fork_hook:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook = True


def _close() -> None:
    """At a clean exit: an empty native log means no native crash; drop it."""
    global _log
    log = _log
    if log is None:
        return
    try:
        faulthandler = builtin("faulthandler")
        if faulthandler.is_enabled():
            faulthandler.disable()
        _log = None
        path = log.name
        log.close()
        if os.path.getsize(path) == 0:
            os.unlink(path)
    except Exception:  # noqa: BLE001
        pass


def _after_fork_in_child() -> None:
    # The parent's native log belongs to the parent; the child gets its own.
    global _log
    if _log is None:
        return
    _log = None
    try:
        builtin("faulthandler").disable()
        enable()
        # A child that multiprocessing forked (a DataLoader worker) leaves
        # by os._exit, past atexit: its log is closed, and dropped where
        # empty, by multiprocessing's own exit function, which such a child
        # runs last. Its finalizers are cleared as it starts, and then its
        # after-fork callbacks run: the finalizer is registered from one.
        util = sys.modules.get("multiprocessing.util")
        if util is not None and _log is not None:
            util.register_after_fork(_finalize_in_worker, _finalize_in_worker)
    except Exception:  # noqa: BLE001
        pass


def _finalize_in_worker(_) -> None:
    try:
        util = sys.modules["multiprocessing.util"]
        # The lowest priority: after the program's own finalizers.
        util.Finalize(None, _close, exitpriority=-(2**31))
    except Exception:  # noqa: BLE001
        pass
