"""Snapshots: what a breakpoint or watch records at a hit (the stack, and
the locals of the hit frame with the same safe reprs and tensor summaries
as crash records), kept in a bounded in-memory table and spilled to the run
directory so that they outlive the process."""

from __future__ import annotations

import collections
import itertools
import json
import os
import threading
import time

from rankscope._probe.saferepr import MAX_ITEMS, MAX_STRING, Budget, _plain, safe_repr, type_name
from rankscope._probe.stacks import MAX_LOCALS_PER_FRAME

MAX_SNAPSHOTS = 1000
MAX_SNAPSHOT_FRAMES = 30
MAX_SNAPSHOT_STATS_ELEMENTS = 1_000_000
# Snapshots spilled to the run directory (see _Spill); past this size the spill stops.
MAX_SPILL_BYTES = 64 << 20

_table: collections.deque = collections.deque(maxlen=MAX_SNAPSHOTS)
_ids = itertools.count(1)


# Values whose builtin repr is short and cannot run user code: printed
# inline, since a hit must cost tens of microseconds, not hundreds.
_INLINE = {int: "int", float: "float", bool: "bool", type(None): "NoneType", str: "str"}
_SMALL_CONTAINERS = {list: "list", tuple: "tuple", dict: "dict", set: "set", frozenset: "frozenset"}


def _snapshot_locals(frame, budget: Budget) -> list[list[str]]:
    """[name, safe repr, type] of each local of the hit frame: the same
    reprs and tensor summaries as crash records, with a fast path for the
    scalars and short plain containers that most locals are."""
    try:
        items = list(frame.f_locals.items())
    except Exception as exc:  # noqa: BLE001
        return [["<locals>", f"<unavailable: {type(exc).__name__}>", ""]]
    out = []
    inline, containers, plain = _INLINE, _SMALL_CONTAINERS, _plain
    for name, value in items[:MAX_LOCALS_PER_FRAME]:
        t = type(value)
        kind = inline.get(t)
        if kind is not None:
            if (t is not int or value.bit_length() <= 256) and (t is not str or len(value) <= MAX_STRING):
                out.append([name, repr(value), kind])
                continue
        else:
            kind = containers.get(t)
            if kind is not None and len(value) <= MAX_ITEMS and plain(value) and (t is not dict or plain(value.values())):
                out.append([name, repr(value), kind])
                continue
        out.append([str(name), safe_repr(value, budget), type_name(value)])
    if len(items) > MAX_LOCALS_PER_FRAME:
        out.append(["...", f"{len(items) - MAX_LOCALS_PER_FRAME} more locals", ""])
    return out


def take(bp_id: int, hit: int, frame, message: str | None, with_locals: bool = True) -> dict:
    # Tensor statistics as in crash records, on CPU tensors small enough
    # that a hit stays cheap; larger ones get their metadata only.
    budget = Budget(tensor_stats=True, max_stats_elements=MAX_SNAPSHOT_STATS_ELEMENTS)
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
                "locals": _snapshot_locals(current, budget) if current is frame and with_locals else [],
            }
        )
        current = current.f_back
    return {
        "id": next(_ids),
        "bp_id": bp_id,
        "hit": hit,
        "time": time.time(),
        "thread": threading.current_thread().name,
        "log": message,
        "frames": frames,
    }


class _Spill:
    """Snapshots appended, one JSON line each, to
    <run dir>/snapshots/pid<P>.jsonl, so that they outlive the process.

    A hit after a quiet spell is written at once; the hits of a burst are
    written together, at most FLUSH_S later (by the next hit, a one-shot
    timer, or exit), so a hot breakpoint costs one write per burst rather
    than one per hit. Any failure (full or read-only disk) turns the spill
    off and costs the program nothing."""

    FLUSH_S = 0.02
    # Snapshots hold only JSON-ready values (no cycles), so the encoder needs
    # neither the circularity check nor a per-call setup.
    _encoder = json.JSONEncoder(check_circular=False, default=str)

    def __init__(self):
        self.fd: int | None = None
        self.off = False
        self.written = 0
        self.buffer: list[bytes] = []
        self.last_write = 0.0
        self.timer: threading.Timer | None = None
        self.identity = ""
        self.lock = threading.Lock()

    def _open(self) -> None:
        from rankscope._probe import crashes

        directory = os.path.join(crashes.run_dir(), "snapshots")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, f"pid{os.getpid()}.jsonl")
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        identity = {"pid": os.getpid(), "rank": crashes._rank(), "host": os.uname().nodename}
        # Appended to each line's object: ', "pid": 1, ...}'
        self.identity = ", " + json.dumps(identity)[1:]
        import atexit

        atexit.register(self.flush)

    def add(self, snap: dict) -> None:
        if self.off:
            return
        try:
            if self.fd is None:
                self._open()
            line = (self._encoder.encode(snap)[:-1] + self.identity + "\n").encode("utf-8", "backslashreplace")
            with self.lock:
                if self.written + len(line) > MAX_SPILL_BYTES:
                    self.off = True
                    return
                self.written += len(line)
                self.buffer.append(line)
                if time.monotonic() - self.last_write >= self.FLUSH_S:
                    self._write()
                elif self.timer is None:
                    self.timer = threading.Timer(self.FLUSH_S, self.flush)
                    self.timer.daemon = True
                    self.timer.start()
        except Exception:  # noqa: BLE001
            self.off = True

    def flush(self) -> None:
        try:
            with self.lock:
                self.timer = None
                if self.buffer and self.fd is not None:
                    self._write()
        except Exception:  # noqa: BLE001
            self.off = True

    def _write(self) -> None:
        data = b"".join(self.buffer)
        self.buffer.clear()
        self.last_write = time.monotonic()
        os.write(self.fd, data)


_spill = _Spill()


def record(snap: dict) -> None:
    _table.append(snap)
    _spill.add(snap)


def listing() -> list[dict]:
    return list(_table)


def flush() -> None:
    """Writes what a burst left buffered (a breakpoint is done: nothing may wait for the next hit)."""
    _spill.flush()
