"""The torch tables, as bounded rings in memory.

A row is a list in the order of its table's columns (the CLI adds pid, rank
and host; ``ts`` is the row's own time, in seconds). A row may hold a value
still on its way from a GPU: ``pending`` lists those, and a read fills in
what has arrived without waiting for the rest (no device sync).
Spilling to the run store is not built yet: rows older than the ring's
size are gone.
"""

from __future__ import annotations

import collections
import os

COLUMNS = {
    "torch_trace": ["ts", "step", "module", "module_type", "depth", "stage", "calls", "duration_ms", "gpu_ms"],
    "torch_steps": [
        "ts",
        "step",
        "sampled",
        "duration_ms",
        "dataloader_wait_ms",
        "forward_ms",
        "backward_ms",
        "optimizer_ms",
        "loss",
        "samples",
        "samples_per_s",
    ],
}


def _ring_size() -> int:
    try:
        return max(1, int(os.environ.get("RANKSCOPE_TORCH_ROWS", "100000")))
    except ValueError:
        return 100_000


RINGS = {name: collections.deque(maxlen=_ring_size()) for name in COLUMNS}
# (row, column index, resolver) for values that arrive later: resolver()
# returns the value, or raises LookupError while it is not ready.
pending: collections.deque = collections.deque(maxlen=10_000)


def append(table: str, row: list) -> None:
    RINGS[table].append(row)


def resolve_pending() -> None:
    """Fills in the values that have arrived; the others wait."""
    for _ in range(len(pending)):
        entry = pending.popleft()
        row, index, resolver = entry
        try:
            row[index] = resolver()
        except LookupError:
            pending.append(entry)
        except Exception:  # noqa: BLE001 - a value that cannot be read stays null
            pass


_OPS = {
    "=": lambda a, b: a == b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def read(table: str, columns: list[str] | None, filters: list, count: bool) -> dict:
    """The rows that meet every `[column, op, value]` filter (the CLI's
    engine filters again), with the named columns only (others null)."""
    resolve_pending()
    names = COLUMNS[table]
    checks = []
    for column, op, value in filters:
        if column in names and op in _OPS and value is not None:
            checks.append((names.index(column), _OPS[op], value))
    rows = list(RINGS[table])
    if checks:

        def keep(row):
            try:
                return all(row[i] is not None and test(row[i], value) for i, test, value in checks)
            except TypeError:
                return True

        rows = [row for row in rows if keep(row)]
    if count:
        return {"columns": names, "count": len(rows)}
    if columns is not None:
        wanted = {i for i, name in enumerate(names) if name in columns or name == "ts"}
        rows = [[row[i] if i in wanted else None for i in range(len(names))] for row in rows]
    return {"columns": names, "rows": rows}


def sizes() -> dict:
    return {name: len(ring) for name, ring in RINGS.items()}
