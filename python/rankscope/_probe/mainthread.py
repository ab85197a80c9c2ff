"""threading's idea of the main thread, kept true when the probe is the
first to import threading.

``threading`` takes the thread that imports it for the main thread. When
that is a probe thread (an inject whose bootstrap ran on the injector's
native thread, because the main thread sleeps in C; or a request whose
code imported threading), CPython 3.11 and 3.12 record the probe thread's
ident and lock: ``main_thread()`` is a stopped thread that is not the main
one, ``current_thread()`` on the real main thread is a ``_DummyThread``,
and at exit the interpreter no longer waits for non-daemon threads, so
their work is lost. 3.13 takes the right ident from the runtime but the
importing thread's native id.

``repair()`` runs right after such an import, with the GIL held, before
the program can see the module: it gives threading the main-thread object
that importing it on the main thread would have made.
"""

import _thread
import os
import sys


def main_ident() -> int | None:
    """The ident (``threading.get_ident()``) of the interpreter's main thread."""
    get = getattr(_thread, "_get_main_thread_ident", None)  # 3.13+
    if get is not None:
        return get()
    # CPython lists thread states newest first, and sys._current_frames()
    # keeps that order: the main thread's state is the oldest, hence last.
    frames = sys._current_frames()
    if not frames:
        return None
    ident = next(reversed(frames))
    frame = frames[ident]
    while frame.f_back is not None:
        frame = frame.f_back
    if frame.f_code.co_name == "_bootstrap" and frame.f_globals.get("__name__") == "threading":
        return None  # a threading.Thread: the main thread has no Python frame; change nothing
    return ident


def repair() -> None:
    threading = sys.modules.get("threading")
    if threading is None:
        return
    real = main_ident()
    wrong = threading._main_thread
    if real is None:
        return
    if wrong.ident == real:
        # 3.13 and later: only the native id is the importing thread's
        # (on Linux the main thread's native id is the process id).
        if getattr(wrong, "_native_id", None) not in (None, os.getpid()):
            wrong._native_id = os.getpid()
        return
    shutdown_locks = getattr(threading, "_shutdown_locks", None)
    if shutdown_locks is None:
        return  # not the 3.11/3.12 layout this rebuilds
    main = threading._MainThread.__new__(threading._MainThread)
    threading.Thread.__init__(main, name="MainThread", daemon=False)
    # The main thread's lock is released by threading._shutdown() on the
    # main thread itself, never by a thread state ending.
    lock = _thread.allocate_lock()
    lock.acquire()
    main._tstate_lock = lock
    main._started.set()
    main._ident = real
    main._native_id = os.getpid()
    with threading._shutdown_locks_lock:
        shutdown_locks.discard(getattr(wrong, "_tstate_lock", None))
        shutdown_locks.add(lock)
    with threading._active_limbo_lock:
        if threading._active.get(wrong.ident) is wrong:
            del threading._active[wrong.ident]
        threading._active[real] = main
    threading._dangling.discard(wrong)
    threading._main_thread = main
