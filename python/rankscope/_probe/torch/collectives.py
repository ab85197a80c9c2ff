"""torch.distributed's collectives as the program calls them
(``python.collectives``): op, group, its number in the group, sizes, start,
end, and whether it is still in flight.

The public collective functions of ``torch.distributed`` are wrapped where
the program looks them up (``torch.distributed`` and ``distributed_c10d``):
a call opens a row in the run store, shown as ``in flight`` to any reader,
without the GIL, and closes it when the call returns (an ``async_op``
call when its work completes, where the backend gives a future). That is
what ``cluster bt`` reads to say which collective each rank is stuck in.

What the wrappers do not see: collectives issued from C++ (DDP's gradient
buckets), functional collectives, and, in an injected process, a function
the program bound to a name of its own before the wrapping. Where torch's
Flight Recorder runs (by default in torch 2.15, else with
``TORCH_FR_BUFFER_SIZE`` set at start), ``flight()`` reads its ring,
which has every collective of every group, C++ ones included; ``cluster
bt`` merges the two. On NCCL a call returns, and its future completes,
once its kernel is queued, so a wrapper's row closes then: a collective
stuck on the GPU shows as in flight in Flight Recorder's ring only
(NCCL's entries go "completed" when the GPU finishes them).
Numbers are torch's own sequence numbers of the group (every collective
counts, DDP's too, alike on every rank; Flight Recorder uses the same),
or, on a backend without them, the wrapped calls counted from when
recording began.

The wrappers are put in as ``distributed_c10d`` is imported, so that
``from torch.distributed import all_reduce`` binds them too, and record
nothing until ``init_process_group`` returns.

Started with the interpreter (``RANKSCOPE=1``, ``rankscope run``), a probe
records from ``init_process_group`` on, unless ``RANKSCOPE_COLLECTIVES=0``;
an injected probe records only once asked (``torch collectives on``).
"""

from __future__ import annotations

import _thread
import itertools
import os
import sys
import time
import weakref

from rankscope import _native

_C10D = "torch.distributed.distributed_c10d"
# Collectives only: point-to-point calls have no group-wide number.
OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
)
_WRAPPED = "__rankscope_collective__"


# The cells of a row (counted after ts) that a collective's end changes:
# state, end_ts and duration_ms.
_END_CELLS = (6, 11, 12)


class _Group:
    __slots__ = ("of", "name", "members", "size", "rank", "seq", "last_op", "count")

    def __init__(self, of, name, members, size, rank):
        # `of`: the group itself, weakly, so that a new group at a freed
        # one's id is not taken for it, and a group the program destroys is
        # freed (its sockets, its NCCL communicators) as without rankscope.
        try:
            self.of = weakref.ref(of)
        except TypeError:
            self.of = lambda: of
        self.name, self.members, self.size, self.rank = name, members, size, rank
        self.seq = 0
        self.last_op = None
        self.count = 0


class Recorder:
    def __init__(self):
        self.on = False
        self.originals: dict = {}  # op -> the function wrapped
        self.groups: dict = {}  # id(process group) -> _Group
        self.keys = itertools.count(1)
        self.in_flight: dict = {}  # key -> the row as opened
        self.errors = 0
        self.sites: dict = {}  # (code, instruction) -> "func (file:line)"
        self.shapes: dict = {}  # (shape, dtype) -> (shapes, dtype, bytes an item)
        self.tensor_type = None

    # ---- on and off

    def turn_on(self) -> dict:
        c10d = sys.modules.get(_C10D)
        if c10d is None:
            raise LookupError("torch.distributed is not imported in this process")
        self._wrap(c10d)
        self.start()
        return self.describe()

    def start(self) -> None:
        # torch is whole by now (it may still have been importing when the
        # wrappers went in).
        self.tensor_type = sys.modules["torch"].Tensor
        self.on = True

    def turn_off(self) -> dict:
        self.on = False
        c10d = sys.modules.get(_C10D)
        dist = sys.modules.get("torch.distributed")
        for op, original in self.originals.items():
            for module in (c10d, dist):
                current = getattr(module, op, None) if module is not None else None
                if getattr(current, _WRAPPED, None) is original:
                    setattr(module, op, original)
        self.originals.clear()
        return self.describe()

    def _wrap(self, c10d) -> None:
        import functools
        import inspect

        dist = sys.modules.get("torch.distributed")
        for op in OPS:
            original = getattr(c10d, op, None)
            if original is None or getattr(original, _WRAPPED, None) is not None:
                continue
            try:
                parameters = list(inspect.signature(original).parameters)
            except (TypeError, ValueError):
                continue
            wrapper = self._wrapper(op, original, parameters)
            functools.update_wrapper(wrapper, original)
            setattr(wrapper, _WRAPPED, original)
            self.originals[op] = original
            setattr(c10d, op, wrapper)
            if dist is not None and getattr(dist, op, None) is original:
                setattr(dist, op, wrapper)

    def _wrapper(self, op, original, parameters):
        recorder = self
        group_at = parameters.index("group") if "group" in parameters else None
        async_at = parameters.index("async_op") if "async_op" in parameters else None
        # torch may still be importing (the wrapping happens as it imports
        # distributed_c10d): its `compiler` is looked up at call time.
        torch = sys.modules["torch"]

        def collective(*args, **kwargs):
            # Under torch.compile's tracing, the call is torch's own: dynamo
            # folds this test and traces the original, with no graph break.
            if not recorder.on or torch.compiler.is_compiling():
                return original(*args, **kwargs)
            try:
                entry = recorder._enter(op, args, kwargs, group_at, async_at)
            except Exception:  # noqa: BLE001 - the call goes on unrecorded
                recorder.errors += 1
                entry = None
            try:
                result = original(*args, **kwargs)
            except BaseException:
                recorder._leave(entry, "failed")
                raise
            recorder._leave(entry, "done", result)
            return result

        return collective

    # ---- a call (the program's thread)

    def _group(self, group):
        if group is None:
            # The default group, without c10d's checks on every call; a new
            # default group (after destroy_process_group) is a new object.
            group = sys.modules[_C10D].GroupMember.WORLD
        found = self.groups.get(id(group))
        if found is None or found.of() is not group:
            found = self._new_group(group)
        return group, found

    def _new_group(self, group):
        c10d = sys.modules[_C10D]
        if group is None:
            group = c10d._get_default_group()  # raises as the call itself would
        try:
            name = c10d._get_process_group_name(group)
        except Exception:  # noqa: BLE001
            name = str(len(self.groups))
        try:
            members = c10d.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001
            members = []
        found = _Group(group, str(name), ",".join(map(str, members)), group.size(), group.rank())
        self.groups[id(group)] = found
        return found

    def _tensors(self, first):
        """(shapes, dtype, bytes) of the first argument: the tensor, or
        the list of tensors, that the call moves."""
        # type(), not isinstance(): an object list's items may be anything.
        kind = type(first)
        if issubclass(kind, self.tensor_type):
            # A loop sends the same shape again and again: its text is kept.
            known = self.shapes.get((first.shape, first.dtype))
            if known is None:
                known = self._shape_of((first,))
                if len(self.shapes) < 1024:
                    self.shapes[(first.shape, first.dtype)] = known
            return known[0], known[1], first.numel() * known[2]
        if kind in (list, tuple):
            tensors = [v for v in first[:4] if issubclass(type(v), self.tensor_type)]
            if tensors:
                shapes, dtype, item = self._shape_of(tensors)
                return shapes, dtype, tensors[0].numel() * item
        return None, None, None

    @staticmethod
    def _shape_of(tensors):
        shapes = ";".join("x".join(map(str, t.shape)) or "scalar" for t in tensors)
        return shapes, str(tensors[0].dtype)[6:], tensors[0].element_size()

    def _enter(self, op, args, kwargs, group_at, async_at):
        if kwargs:
            group = kwargs["group"] if "group" in kwargs else (args[group_at] if group_at is not None and len(args) > group_at else None)
            asynchronous = bool(kwargs["async_op"] if "async_op" in kwargs else (args[async_at] if async_at is not None and len(args) > async_at else False))
            first = args[0] if args else next((kwargs[k] for k in ("tensor", "output", "input", "tensor_list", "object_list") if k in kwargs), None)
        else:
            group = args[group_at] if group_at is not None and len(args) > group_at else None
            asynchronous = bool(args[async_at]) if async_at is not None and len(args) > async_at else False
            first = args[0] if args else None
        group, info = self._group(group)
        try:
            # torch's own number, which counts every collective of the group
            # (DDP's too) alike on every rank, and is what Flight Recorder says.
            info.seq = group._get_sequence_number_for_group() + 1
        except Exception:  # noqa: BLE001 - a backend without one: counted here
            info.seq += 1
        info.count += 1
        info.last_op = op
        key = next(self.keys)  # one step under the GIL: no two calls share a key
        shapes, dtype, size = self._tensors(first)
        caller = sys._getframe(2)
        # By instruction, not line: a line number is looked up in the code's
        # line table, which costs more than the rest of the call site.
        site = (caller.f_code, caller.f_lasti)
        where = self.sites.get(site)
        if where is None:
            where = f"{caller.f_code.co_name} ({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})"
            if len(self.sites) < 4096:
                self.sites[site] = where
        row = [time.time(), info.seq, op, info.name, info.size, info.rank, info.members, "in flight", shapes, dtype, size,
               asynchronous, None, None, where, _thread_name(), _step()]
        _native.table_open("collectives", key, row)
        self.in_flight[key] = row
        return key, row, time.perf_counter()

    def _leave(self, entry, state, result=None):
        if entry is None:
            return
        try:
            key, row, began = entry
            if state == "done" and row[11]:
                future = getattr(result, "get_future", None)
                if future is not None:
                    try:
                        future().add_done_callback(lambda _f: self._close(key, began, "done"))
                        return
                    except Exception:  # noqa: BLE001 - a backend without futures: closed as issued
                        pass
                state = "issued"
            self._close(key, began, state)
        except Exception:  # noqa: BLE001
            self.errors += 1

    def _close(self, key, began, state):
        try:
            end = (state, time.time() * 1e6, (time.perf_counter() - began) * 1e3)
            row = self.in_flight.pop(key, None)
            if not _native.table_finish("collectives", key, _END_CELLS, end) and row is not None:
                # Dropped from the store's open rows (thousands in flight at
                # once): the finished row still goes in, whole.
                row = list(row)
                for at, value in zip(_END_CELLS, end):
                    row[at + 1] = value
                _native.table_append("collectives", row)
        except Exception:  # noqa: BLE001
            self.errors += 1

    # ---- what `torch collectives` shows

    def describe(self) -> dict:
        dist = sys.modules.get("torch.distributed")
        initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
        now = time.time()
        groups = []
        for info in self.groups.values():
            flying = [
                {"op": row[2], "seq": row[1], "waiting_s": now - row[0], "caller": row[14]}
                for row in list(self.in_flight.values())
                if row[3] == info.name
            ]
            groups.append(
                {
                    "group": info.name,
                    "size": info.size,
                    "group_rank": info.rank,
                    "members": info.members,
                    "count": info.count,
                    "last_seq": info.seq,
                    "last_op": info.last_op,
                    "in_flight": flying,
                }
            )
        return {
            "on": self.on,
            "initialized": initialized,
            "backend": dist.get_backend() if initialized else None,
            "wrapped": sorted(self.originals),
            "groups": groups,
            "errors": self.errors,
        }


# The columns `cluster bt` reads (crates/rankscope-cli/src/stuck.rs).
FLIGHT_COLUMNS = ["seq", "op", "process_group", "group_ranks", "state", "caller", "ts"]


def flight(tail: int = 16) -> dict:
    """The last ``tail`` collectives of each group from torch's Flight
    Recorder, as rows of ``FLIGHT_COLUMNS`` (none where it is off: it keeps
    nothing unless its buffer size was set before the process group began).
    Read on request only: the dump walks the recorder's whole ring."""
    out = {"columns": FLIGHT_COLUMNS, "rows": [], "enabled": False}
    c10d = sys.modules.get(_C10D)
    dist = sys.modules.get("torch.distributed")
    if c10d is None or dist is None or not dist.is_available() or not dist.is_initialized():
        return out
    dump = getattr(sys.modules["torch"]._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return out
    import json

    try:
        trace = json.loads(dump(True, False))
    except Exception as exc:  # noqa: BLE001 - an older torch, a backend without it
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    entries = [e for e in trace.get("entries", ()) if not e.get("is_p2p")]
    out["enabled"] = bool(entries)
    members = {}
    try:
        for group, name in list(c10d._world.pg_names.items()):
            members[str(name)] = ",".join(map(str, c10d.get_process_group_ranks(group)))
    except Exception:  # noqa: BLE001 - torch's private registry moved: no members
        pass
    by_group: dict = {}
    for entry in entries:
        group = entry.get("process_group") or [str(entry.get("pg_id", "?"))]
        by_group.setdefault(str(group[0]), []).append(entry)
    for name, items in by_group.items():
        items.sort(key=lambda e: e.get("collective_seq_id", 0))
        for entry in items[-tail:]:
            op = str(entry.get("profiling_name") or "?")
            # "gloo:all_reduce", "nccl:all_reduce_coalesced"
            op = op.split(":", 1)[-1]
            # Gloo leaves a finished entry "scheduled" and marks it retired;
            # NCCL moves it on to "completed".
            finished = entry.get("state") == "completed" or entry.get("retired")
            out["rows"].append(
                [
                    entry.get("collective_seq_id"),
                    op,
                    name,
                    members.get(name, ""),
                    "done" if finished else "in flight",
                    None,
                    (entry.get("time_created_ns") or 0) / 1e9,
                ]
            )
    return out


def _step():
    """The torch step in progress, where the step clock runs (a torch
    feature is on); None elsewhere."""
    trace = sys.modules.get("rankscope._probe.torch.trace")
    tracer = getattr(trace, "TRACER", None)
    return tracer.step if tracer is not None and tracer.on else None


def _thread_name() -> str:
    threading = sys.modules.get("threading")  # torch imported it
    return threading.current_thread().name if threading is not None else str(_thread.get_ident())


RECORDER = Recorder()


def by_default() -> bool:
    return os.environ.get("RANKSCOPE_COLLECTIVES", "1").strip() != "0"


def at_import(c10d) -> None:
    """As the program imports ``distributed_c10d`` (a probe that started
    with the interpreter): wrapped now, so that every name the program
    binds is the wrapper; recording starts at ``init_process_group``."""
    RECORDER._wrap(c10d)


def at_init() -> None:
    if RECORDER.originals:
        RECORDER.start()
