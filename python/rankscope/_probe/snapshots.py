"""Snapshots: what a breakpoint or watch records at a hit (the stack, and
the locals of the hit frame with the same safe reprs and tensor summaries
as crash records), kept whole in a bounded in-memory table, and the hit
frame as rows of the run store, which spills them to the run directory so
that they outlive the process."""

from __future__ import annotations

import collections
import itertools
import threading
import time

from rankscope import _native

from rankscope._probe.saferepr import MAX_ITEMS, MAX_STRING, Budget, _plain, safe_repr, type_name
from rankscope._probe.stacks import MAX_LOCALS_PER_FRAME

MAX_SNAPSHOTS = 1000
MAX_SNAPSHOT_FRAMES = 30
MAX_SNAPSHOT_STATS_ELEMENTS = 1_000_000

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


# A hit reaches the run directory's store within this (a SIGKILL right
# after must not lose it); a burst of hits is one write.
SPILL_WITHIN_S = 0.02
_errors = 0


def record(snap: dict) -> None:
    """Keeps the snapshot for `rankscope PID snapshots`, and hands its hit
    frame to the run store as `python.snapshots` and
    `python.snapshot_locals` rows, which the store spills to the run
    directory (so `query --run` answers after the process is gone)."""
    global _errors
    _table.append(snap)
    try:
        frame = snap["frames"][0] if snap["frames"] else {}
        _native.snapshot_rows(
            [snap["time"], snap["id"], snap["bp_id"], snap["hit"], snap["thread"], frame.get("func"), frame.get("file"),
             frame.get("lineno"), snap["log"]],
            frame.get("locals") or (),
            SPILL_WITHIN_S,
        )
    except Exception:  # noqa: BLE001 - the hit is still kept in memory
        _errors += 1


def listing() -> list[dict]:
    return list(_table)


def flush() -> None:
    """Writes the hits that wait for the disk (a breakpoint is done: nothing may wait)."""
    _native.store_flush()
