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
import os
import sys
import time

from rankscope import _native

_C10D = "torch.distributed.distributed_c10d"
OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
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
# Point-to-point: numbered by peer, not in the group's count (collective.rs).
# op -> (way, the peer's parameter, the group peer's parameter)
P2P_OPS = {
    "send": ("send", "dst", "group_dst"),
    "isend": ("send", "dst", "group_dst"),
    "recv": ("recv", "src", "group_src"),
    "irecv": ("recv", "src", "group_src"),
}
_WRAPPED = "__rankscope_collective__"


def _has_compiler_test(torch) -> bool:
    """Whether this torch has ``torch.compiler.is_compiling`` (2.3 on).
    Told by its version: the wrappers go in while torch is still importing,
    before ``torch.compiler`` is there to look at."""
    major, minor = _version(getattr(torch, "__version__", ""))
    return (major, minor) >= (2, 3)


def _version(text) -> tuple:
    parts = str(text).split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (99, 0)  # a build that does not say: take it as new


def _never() -> bool:
    return False


class Recorder:
    """The wrappers and what they share. A call's own work (its group's
    number, its sizes and call site, its row) is native: a
    ``_native.CollectiveLog`` and one ``_native.CollectiveCall`` a
    function (crates/rankscope-probe/src/collective.rs). The Python here
    runs once a group, a shape or a list argument: what the native side
    asks of torch by name."""

    def __init__(self):
        self.originals: dict = {}  # op -> the function wrapped
        self.log = _native.CollectiveLog(self._group_info, self._tensors, self._shape_of_one, _thread_name, _step)

    @property
    def on(self) -> bool:
        return self.log.on

    @property
    def errors(self) -> int:
        return self.log.errors

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
        self.log.start(sys.modules[_C10D].GroupMember, sys.modules["torch"].Tensor)

    def turn_off(self) -> dict:
        self.log.stop()
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
        for op in OPS + tuple(P2P_OPS):
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
        group_at = parameters.index("group") if "group" in parameters else None
        async_at = parameters.index("async_op") if "async_op" in parameters else None
        first = parameters[0] if parameters else None
        p2p = None
        if op in P2P_OPS:
            way, peer, group_peer = P2P_OPS[op]

            def at(name):
                return parameters.index(name) if name in parameters else None

            p2p = (way, (at(peer), peer), (at(group_peer), group_peer), (at("tag"), "tag"))
            # isend and irecv have no async_op: they are async.
            if op.startswith("i"):
                async_at = None
        recorded = _native.CollectiveCall(self.log, op, original, group_at, async_at, first, p2p)
        # torch may still be importing (the wrapping happens as it imports
        # distributed_c10d): its `compiler` is looked up at call time.
        torch = sys.modules["torch"]

        # A Python function, not the native call itself: under
        # torch.compile's tracing, dynamo folds this test and traces the
        # original (which it maps to a functional collective), with no
        # graph break. `recorded` calls the original alone while off.
        if _has_compiler_test(torch):

            def collective(*args, **kwargs):
                if torch.compiler.is_compiling():
                    return original(*args, **kwargs)
                return recorded(args, kwargs)

        else:
            # torch before 2.3 has no `torch.compiler.is_compiling`: ask
            # dynamo, where the program has imported it (nothing compiles
            # otherwise). Tracing through this may break the graph there,
            # where the test above would not; the call itself is the same.
            def collective(*args, **kwargs):
                dynamo = sys.modules.get("torch._dynamo")
                if dynamo is not None and getattr(dynamo, "is_compiling", _never)():
                    return original(*args, **kwargs)
                return recorded(args, kwargs)

        return collective

    # ---- asked by the native side, once a group, a shape or a list

    def _group_info(self, group):
        """(name, members, size, rank) of a group met for the first time."""
        c10d = sys.modules[_C10D]
        if group is None:
            group = c10d._get_default_group()  # raises as the call itself would
        try:
            name = c10d._get_process_group_name(group)
        except Exception:  # noqa: BLE001
            name = str(len(self.log.groups()))
        try:
            members = c10d.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001
            members = []
        return str(name), ",".join(map(str, members)), group.size(), group.rank()

    def _shape_of_one(self, tensor):
        return self._shape_of((tensor,))

    def _tensors(self, first):
        """(shapes, dtype, bytes) of a first argument that is not a tensor:
        the list of tensors that the call moves, or nothing. Its bytes are
        the whole list's, as a tensor first argument's are the whole
        tensor's: `all_gather`'s list and `all_gather_into_tensor`'s output
        count alike (nccl-tests' size)."""
        # type(), not isinstance(): an object list's items may be anything.
        tensor_type = sys.modules["torch"].Tensor
        if type(first) in (list, tuple):
            tensors = [v for v in first if issubclass(type(v), tensor_type)]
            if tensors:
                shapes, dtype, item = self._shape_of(tensors[:4])
                if len(tensors) > 4:
                    shapes += f";... ({len(tensors)} tensors)"
                return shapes, dtype, sum(t.numel() for t in tensors) * item
        return None, None, None

    @staticmethod
    def _shape_of(tensors):
        shapes = ";".join("x".join(map(str, t.shape)) or "scalar" for t in tensors)
        return shapes, str(tensors[0].dtype)[6:], tensors[0].element_size()

    # ---- what `torch collectives` shows

    def describe(self) -> dict:
        dist = sys.modules.get("torch.distributed")
        initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
        now = time.time()
        flying = self.log.in_flight()
        groups = []
        for name, size, rank, members, count, seq, last_op in self.log.groups():
            groups.append(
                {
                    "group": name,
                    "size": size,
                    "group_rank": rank,
                    "members": members,
                    "count": count,
                    "last_seq": seq,
                    "last_op": last_op,
                    "in_flight": [
                        {"op": op, "seq": seq_of, "waiting_s": now - ts, "caller": caller, "peer": peer}
                        for group, op, seq_of, ts, caller, peer in flying
                        if group == name
                    ],
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
