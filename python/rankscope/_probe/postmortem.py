"""Post-mortem debugging of a crashed process, chosen by RANKSCOPE_ON_ERROR.

- ``record`` (default): nothing beyond the crash record.
- ``console``: pdb on the terminal. In a job only rank 0 may take the
  terminal (several ranks reading one tty would fight over it); the other
  ranks, and a process without a tty, hold on a socket instead.
- ``socket``: the process listens on ``debug-rank<R>-pid<P>.sock`` in the
  run directory (0700, so only this user) and serves one pdb session there:
  ``rankscope debug --rank R`` or ``nc -U`` on the socket.
- ``web``: one page per rank on 127.0.0.1, port RANKSCOPE_WEB_PORT (7860)
  plus the rank, with the stack, the locals and a pdb console. The URL
  carries a random token, printed on stderr: any local user can reach a
  loopback port, and the console runs code.

A held process waits at most RANKSCOPE_HOLD_TIMEOUT seconds (default 600)
for a debugger, and a session that stays silent that long ends too, so a
crashed job never hangs for ever. Then the process goes on to exit as it
would have.
"""

from __future__ import annotations

import os
import sys

from rankscope._probe import crashes, private_socket

MODES = ("record", "console", "socket", "web")
DEFAULT_WEB_PORT = 7860
DEFAULT_HOLD_S = 600.0
_MARK = "__rankscope_post_mortem__"


def mode() -> str:
    value = os.environ.get("RANKSCOPE_ON_ERROR", "record").strip().lower() or "record"
    if value not in MODES:
        sys.stderr.write(f"rankscope: RANKSCOPE_ON_ERROR={value!r} is not one of {', '.join(MODES)}; recording only\n")
        return "record"
    return value


def hold_timeout() -> float:
    try:
        value = float(os.environ.get("RANKSCOPE_HOLD_TIMEOUT", DEFAULT_HOLD_S))
    except ValueError:
        return DEFAULT_HOLD_S
    return value if value > 0 else DEFAULT_HOLD_S


def socket_path(rank: int, pid: int) -> str:
    return os.path.join(crashes.run_dir(), f"debug-rank{rank}-pid{pid}.sock")


def _in_a_job() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def open_for(exc: BaseException) -> None:
    chosen = mode()
    # torchrun's own process fails because a worker did: holding it would
    # only keep the job from ending, with nothing to debug in it.
    if chosen == "record" or getattr(exc, _MARK, False) or crashes._is_launcher():
        return
    try:
        setattr(exc, _MARK, True)
    except Exception:  # noqa: BLE001
        pass
    tb = exc.__traceback__
    if chosen == "console" and sys.stdin is not None and sys.stdin.isatty() and (not _in_a_job() or crashes._rank() == 0):
        _console(exc, tb)
    elif chosen == "web":
        from rankscope._probe import postmortem_web

        if not postmortem_web.serve(exc, tb, hold_timeout()):
            _hold_on_socket(exc, tb)
    else:
        _hold_on_socket(exc, tb)


def _debugger(stdin=None, stdout=None, prompt: str = "(Pdb) "):
    import pdb

    debugger = pdb.Pdb(stdin=stdin, stdout=stdout)
    if stdin is not None:
        debugger.use_rawinput = False
    debugger.prompt = prompt
    return debugger


def _console(exc: BaseException, tb) -> None:
    sys.stderr.write(f"rankscope: post-mortem of {type(exc).__name__}: {exc} (q to quit)\n")
    debugger = _debugger()
    debugger.reset()
    debugger.interaction(None, tb)


def _hold_on_socket(exc: BaseException, tb) -> None:
    import socket

    rank, pid = crashes._rank() or 0, os.getpid()
    directory = crashes.run_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = socket_path(rank, pid)
    hold = hold_timeout()
    server = private_socket.listen(path)
    sys.stderr.write(
        f"rankscope: rank {rank} (pid {pid}) is held for a debugger after {type(exc).__name__}: "
        f"`rankscope debug --pid {pid}` (or `nc -U {path}`); it exits in {hold:g} s otherwise\n"
    )
    sys.stderr.flush()
    conn = private_socket.accept_one(server, path, hold)
    if conn is None:
        sys.stderr.write(f"rankscope: no debugger came within {hold:g} s; exiting\n")
        return
    with conn:
        conn.settimeout(hold)
        # Two file objects: a text file that both reads and writes drops its
        # read-ahead on every write, and with it the lines typed ahead.
        reader = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")
        stream = conn.makefile("w", buffering=1, encoding="utf-8", errors="replace", newline="\n")
        try:
            stream.write(
                f"rankscope: post-mortem of rank {rank} (pid {pid}): {type(exc).__name__}: {exc}\n"
                "pdb commands work here (w, u, d, l, ll, p, pp, a); q ends the session and the process exits.\n"
            )
            debugger = _debugger(stdin=reader, stdout=stream, prompt=f"(Pdb rank {rank}) ")
            debugger.reset()
            debugger.interaction(None, tb)
        except (OSError, socket.timeout):
            pass  # the debugger left or went silent: the process goes on to exit
        finally:
            for f in (reader, stream):
                try:
                    f.close()
                except OSError:
                    pass
