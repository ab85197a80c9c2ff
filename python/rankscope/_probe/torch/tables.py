"""The torch tables' rows, handed to the run store.

The store is Rust (``crates/rankscope-store``, reached through
``rankscope._native``): it keeps each table as a bounded ring in memory,
answers ``GET /v1/table`` without the GIL, and spills the rows to the run
directory. A row is a list in the order of ``COLUMNS`` (``ts`` first, in
seconds; the store adds pid, rank and host).

A row may hold a value still on its way from a GPU (a CUDA event's time, a
loss on the device): it waits here, in ``waiting``, until every such value
has arrived, and is then handed over, so there is never a device sync.
"""

from __future__ import annotations

import collections

from rankscope import _native

COLUMNS = {
    "torch_trace": ["ts", "step", "module", "module_type", "depth", "stage", "calls", "duration_ms", "gpu_ms", "alloc_delta_mb", "peak_delta_mb"],
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

# (table, row, [(column index, resolver)]): resolver() returns the value,
# or raises LookupError while it is not ready.
waiting: collections.deque = collections.deque(maxlen=10_000)
_flush_at_exit = False


def append(table: str, row: list, pending=()) -> None:
    if pending:
        waiting.append((table, row, list(pending)))
        return
    _hand_over(table, row)


def extend(table: str, rows: list) -> None:
    """Several whole rows at once (one call into the store)."""
    if rows:
        _flush_at_exit_once()
        _native.table_extend(table, rows)


def _flush_at_exit_once() -> None:
    global _flush_at_exit
    if not _flush_at_exit:
        # The last second's rows reach the disk at a clean exit too.
        from rankscope._probe.unseen import builtin

        builtin("atexit").register(_native.store_flush)
        _flush_at_exit = True


def _hand_over(table: str, row: list) -> None:
    _flush_at_exit_once()
    _native.table_append(table, row)


def resolve_pending() -> None:
    """Hands over the rows whose values have all arrived; the others wait."""
    for _ in range(len(waiting)):
        table, row, pending = waiting.popleft()
        still = []
        for index, resolver in pending:
            try:
                row[index] = resolver()
            except LookupError:
                still.append((index, resolver))
            except Exception:  # noqa: BLE001 - a value that cannot be read stays null
                row[index] = None
        if still:
            waiting.append((table, row, still))
        else:
            _hand_over(table, row)


def describe() -> dict:
    """Rows in memory per table, and where and how far the spill got."""
    import json

    return json.loads(_native.store_describe())


def sizes() -> dict:
    return describe()["rows"]
