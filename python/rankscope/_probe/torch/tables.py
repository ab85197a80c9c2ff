"""The torch tables' rows, handed to the run store.

The store is Rust (``crates/rankscope-store``, reached through
``rankscope._native``): it keeps each table as a bounded ring in memory,
answers ``GET /v1/table`` without the GIL, and spills the rows to the run
directory. A row is a list in the order of ``COLUMNS`` (``ts`` first, in
seconds; the store adds pid, rank and host).

The step clock's rows of every step and sampled step (``torch_steps``,
and the CPU forward rows of ``torch_trace``) are kept natively, as cells
and counters (``_native.step_row``, ``trace_keep``; the short way keeps
its own without a Python object), and the store makes and takes them on
its own thread, before each read and each write to disk: the training
thread only keeps them. The other rows of sampled steps (``grad_stats``,
``activation_stats``, the trace's rows with GPU times) wait in ``outbox``
and are handed over together, at a step boundary at least
``HAND_OVER_NS`` after the last, at exit, and when a reader asks (the
probe's table endpoint does, before it reads). A call into the store
right after a step's kernels costs about 10 us, most of it cache misses
on the way in; one call per batch instead of one per row is most of what
takes the trace from +5 % of a small model's step to under 1 %.

A row may hold a value still on its way from a GPU (a CUDA event's time, a
loss on the device): it waits here, in ``waiting``, until every such value
has arrived, and is then handed over, so there is never a device sync.
"""

from __future__ import annotations

import _thread
import collections
import os
import sys
import threading
import time

from rankscope import _native

COLUMNS = {
    "torch_trace": ["ts", "step", "module", "module_type", "depth", "stage", "calls", "duration_ms", "gpu_ms", "alloc_delta_mb", "peak_delta_mb"],
    "torch_steps": [
        "ts",
        "step",
        "sampled",
        "step_ms",
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
# Rows waiting to be handed over, by table; `due`: when they are (a
# perf_counter_ns), far off while there are none.
OUTBOX_TABLES = frozenset(("torch_steps", "torch_trace", "grad_stats", "activation_stats"))
outbox: dict = {}
NEVER = 1 << 62
due = NEVER
# A reader's hand-over runs on a probe thread while the training thread may post.
_outbox_lock = _thread.allocate_lock()
# A reader's hand-over may hold it when the program forks: free in the child.
os.register_at_fork(after_in_child=_outbox_lock._at_fork_reinit)
# A quarter of the store's own spill interval (1 s): a batch of a few hundred rows
# costs the training thread about what a batch of 30 did.
HAND_OVER_NS = 250_000_000
# The thread that runs the program's exit (see `flush`).
_MAIN = threading.main_thread().ident


def append(table: str, row: list, pending=()) -> None:
    if pending:
        waiting.append((table, row, list(pending)))
        return
    _hand_over(table, row)


def extend(table: str, rows: list) -> None:
    """Several whole rows at once (one call into the store)."""
    if table in OUTBOX_TABLES:
        post(table, rows)
    elif rows:
        _flush_at_exit_once()
        _native.table_extend(table, rows)


def post(table: str, rows: list) -> None:
    """Rows for the outbox (the step clock's): handed over with the next
    batch. A ``torch_steps`` row is kept natively instead."""
    if not rows:
        return
    if table == "torch_steps":
        for row in rows:
            _native.step_row(row)
        return
    with _outbox_lock:
        box = outbox.get(table)
        if box is None:
            box = outbox[table] = []
        box += rows
        _waiting()


def _waiting() -> None:
    # Under _outbox_lock: the first row of a batch sets when it goes.
    global due
    if due == NEVER:
        _flush_at_exit_once()
        due = time.perf_counter_ns() + HAND_OVER_NS
        _native.table_rows_waiting(True)


def post_trace(plan: int, counters: tuple) -> None:
    """A sampled step's trace counters, ``(ts, step, acc)``: kept natively,
    the store makes their rows (``_native.trace_keep``)."""
    _flush_at_exit_once()
    _native.trace_keep(plan, [counters])


def hand_over_if_due(now_ns: int) -> None:
    if now_ns >= due:
        flush()


def flush() -> None:
    """Hands the outbox over now (a reader asks, or the program exits)."""
    global due
    if waiting and _thread.get_ident() == _MAIN:
        # At exit (the main thread): rows whose GPU values have arrived
        # since the last step boundary. Never from a probe thread: a CUDA
        # call there would break a CUDA graph the program is capturing.
        resolve_pending()
    if due == NEVER and not outbox:
        return
    with _outbox_lock:
        # Handed over under the lock: batches reach the store in order.
        due = NEVER
        tables = list(outbox.items())
        outbox.clear()
        failed = None
        for table, rows in tables:
            try:
                if rows:
                    _native.table_extend(table, rows)
            except Exception as exc:  # noqa: BLE001 - the other tables' rows still go
                failed = exc
        _native.table_rows_waiting(False)
        if failed is not None:
            raise failed


def _flush_at_exit_once() -> None:
    global _flush_at_exit
    if not _flush_at_exit:
        # The last second's rows reach the disk at a clean exit too.
        from rankscope._probe.unseen import builtin

        atexit = builtin("atexit")
        atexit.register(_native.store_flush)
        # Registered after: runs first (atexit goes in reverse order).
        atexit.register(flush)
        _flush_at_exit = True


def _hand_over(table: str, row: list) -> None:
    if table in OUTBOX_TABLES:
        post(table, [row])
        return
    _flush_at_exit_once()
    _native.table_append(table, row)


def capturing() -> bool:
    """Whether this thread's current stream is capturing a CUDA graph (a
    program that captures a whole step, ``optimizer.step()`` included, runs
    the step hooks inside it): no event may then be recorded, queried or
    waited on, nor a value copied out. A query in a capture invalidates it,
    and an event recorded in one can never be queried afterwards."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def resolve_pending() -> None:
    """Hands over the rows whose values have all arrived; the others wait
    (all of them while a CUDA graph is being captured: see `capturing`)."""
    if waiting and capturing():
        return
    for _ in range(len(waiting)):
        try:
            table, row, pending = waiting.popleft()
        except IndexError:  # a reader's thread took the rest
            break
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

    flush()
    return json.loads(_native.store_describe())


def sizes() -> dict:
    return describe()["rows"]
