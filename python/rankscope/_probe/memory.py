"""``rankscope PID memory ...`` (``POST /v1/memory``): the process's memory
now, its tensors and who holds them, its objects by type, and allocation
sites (``memory track``, ``memory diff``).

The timeline (``python.memory``) is the probe's native sampler's (reading
``/proc`` without the GIL); a look here adds a row of its own. Nothing here
imports torch: the tensor scan (``_probe/torch/tensors.py``) and CUDA's
figures are asked for only once the program has imported torch.
``tracemalloc`` is imported only by ``memory track on --python``.
"""

import gc
import heapq
import sys
import time

MB = float(1 << 20)
TENSOR_COLUMNS = ["shape", "dtype", "device", "mb", "bytes", "requires_grad", "kind", "holder", "views", "scan_complete"]
# What the last look saw, for "growth since": numbers and type names only,
# never the objects (a look must not keep anything alive).
_last: dict = {}
_last_types: dict = {}


class _Tracking:
    python = False
    cuda = False
    # Whether the probe turned tracemalloc / torch's memory history on. One
    # the program had on already is read, and left on (and as the program
    # set it) at `track off`.
    python_ours = False
    cuda_ours = False
    since = None
    base = None  # the tracemalloc snapshot diffs start from
    tensor_base = None  # the live tensors by site then (tensors.by_site), with torch
    started_at = None


TRACKING = _Tracking()


def _torch():
    from rankscope._probe.torch import torch_ready

    return sys.modules["torch"] if torch_ready() else None


def _device_stats(torch, device: int) -> dict:
    stats = torch.cuda.memory_stats(device)
    return {
        "device": f"cuda:{device}",
        "allocated_mb": stats.get("allocated_bytes.all.current", 0) / MB,
        "reserved_mb": stats.get("reserved_bytes.all.current", 0) / MB,
        "peak_mb": stats.get("allocated_bytes.all.peak", 0) / MB,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
    }


def _cuda(torch) -> list:
    """Per device: CUDA's caching allocator as torch counts it (host-side
    counters: no device sync)."""
    if torch is None or not torch.cuda.is_initialized():
        return []
    return [_device_stats(torch, device) for device in range(torch.cuda.device_count())]


class _Cuda:
    """CUDA in the timeline. Once CUDA is in use, ``python.memory`` gets a
    row with its figures at the steps the step clock tells (at most every
    CUDA_STEP_NS) and, on the sampler's interval while no step has, from
    the probe's CUDA watcher thread (``interval_row``; started by
    ``_native.memory_watch_cuda``, which also starts when the native
    sampler finds ``libcuda`` loaded)."""

    seen = False
    checked_ns = 0
    told_ns = 0
    # The device the row describes: the one whose allocator holds the most
    # (a rank uses one GPU; the current device is per thread, and the
    # watcher's is not the training thread's), chosen again every
    # DEVICE_EVERY_NS.
    device = None
    chosen_ns = 0


CUDA = _Cuda()
CUDA_STEP_NS = 100_000_000
CUDA_CHECK_NS = 1_000_000_000
DEVICE_EVERY_NS = 10_000_000_000


def _cuda_in_use(torch) -> bool:
    if not CUDA.seen and torch is not None and torch.cuda.is_initialized():
        from rankscope import _native

        CUDA.seen = True
        _native.memory_watch_cuda()
    return CUDA.seen


def _row_device(torch) -> dict:
    now = time.monotonic_ns()
    if CUDA.device is None or now - CUDA.chosen_ns >= DEVICE_EVERY_NS:
        devices = _cuda(torch)
        if not devices:
            return {}
        best = max(range(len(devices)), key=lambda i: devices[i]["reserved_mb"])
        CUDA.device, CUDA.chosen_ns = best, now
        return devices[best]
    return _device_stats(torch, CUDA.device)


def step_row(now_ns: int) -> None:
    """The step clock's call as it tells the step (the training thread):
    a row with CUDA's figures, at most every CUDA_STEP_NS, once CUDA is in
    use (asked of torch at most every CUDA_CHECK_NS until it is)."""
    try:
        if not CUDA.seen:
            if now_ns - CUDA.checked_ns < CUDA_CHECK_NS:
                return
            CUDA.checked_ns = now_ns
            if not _cuda_in_use(sys.modules.get("torch")):
                return
        if now_ns - CUDA.told_ns >= CUDA_STEP_NS:
            CUDA.told_ns = now_ns
            cuda_row("step")
    except Exception:  # noqa: BLE001 - the timeline goes on without this row
        pass


def interval_row() -> bool:
    """The CUDA watcher's row, on an interval in which no step wrote one;
    False while this process does not use CUDA through torch."""
    torch = _torch()
    if not _cuda_in_use(torch):
        return False
    cuda_row("interval")
    return True


def cuda_row(source: str) -> None:
    """A ``python.memory`` row with CUDA's figures (the device this process
    uses most) and tracemalloc's."""
    from rankscope import _native

    torch = sys.modules.get("torch")
    first = _row_device(torch) if torch is not None and _cuda_in_use(torch) else {}
    traced = None
    if TRACKING.python:
        tracemalloc = sys.modules.get("tracemalloc")
        if tracemalloc is not None and tracemalloc.is_tracing():
            traced = tracemalloc.get_traced_memory()[0] / MB
    _native.memory_row(
        source,
        traced,
        first.get("allocated_mb"),
        first.get("reserved_mb"),
        first.get("peak_mb"),
        first.get("alloc_retries"),
        first.get("ooms"),
    )


def handle(request_text: str):
    import json

    try:
        request = json.loads(request_text)
    except ValueError as err:
        return {"error": f"bad memory request: {err}", "hint": "send JSON with an action"}
    action = request.get("action", "summary")
    try:
        if action == "summary":
            return {"ok": summary(int(request.get("top") or 5), light=bool(request.get("light")))}
        if action == "tensors":
            return {"ok": tensors(float(request.get("budget_s") or 2.0), request.get("columns"))}
        if action == "objects":
            return {"ok": objects()}
        if action == "track":
            return {"ok": track(request.get("switch"), bool(request.get("python")), bool(request.get("cuda")))}
        if action == "diff":
            if request.get("steps"):
                first, last = (int(v) for v in request["steps"])
                return {"ok": diff_steps(first, last, int(request.get("top") or 10))}
            return {"ok": diff(int(request.get("top") or 10))}
        if action == "export":
            return {"ok": export(str(request.get("what") or ""), str(request.get("path") or ""))}
    except UserError as err:
        return {"error": str(err), "hint": err.hint}
    return {"error": f"unknown memory action {action!r}", "hint": "summary, tensors, objects, track, diff or export"}


class UserError(Exception):
    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


def summary(top: int, light: bool = False) -> dict:
    """A look; `light` (one line per rank in `cluster memory`) leaves out
    what walks the heap: the tensor scan and the count of gc's objects."""
    from rankscope import _native

    now = dict(_native.memory_now())
    torch = _torch()
    out = {
        "rss_mb": now["rss"] / MB,
        "rss_peak_mb": now["rss_peak"] / MB,
        "uss_mb": now["uss"] / MB,
        "pss_mb": now["pss"] / MB,
        "swap_mb": now["swap"] / MB,
        "python_blocks": sys.getallocatedblocks(),
        "gc_objects": None if light else _native.gc_tracked(),
        "torch": torch is not None,
        "cuda": _cuda(torch),
        "tracking": describe_tracking(),
    }
    if TRACKING.python:
        tracemalloc = sys.modules["tracemalloc"]
        current, peak = tracemalloc.get_traced_memory()
        out["python_traced_mb"], out["python_traced_peak_mb"] = current / MB, peak / MB
    if torch is not None and not light:
        from rankscope._probe.torch import tensors as tensor_scan

        # The rows as they come: a count, a sum and the largest few, never
        # all of them at once.
        count, total, complete, largest = 0, 0.0, True, []
        for row in tensor_scan.scan_rows(budget_s=1.0):
            count, total, complete = count + 1, total + row[4], row[-1]
            entry = (row[5], count, row)
            if len(largest) < top:
                heapq.heappush(largest, entry)
            elif entry > largest[0]:
                heapq.heapreplace(largest, entry)
        out["tensors"] = {
            "count": count,
            "mb": total,
            "complete": complete,
            "largest": [dict(zip(TENSOR_COLUMNS, row[1:])) for _, _, row in sorted(largest, key=lambda e: -e[0])],
        }
    then = dict(_last)
    growth = {}
    for key in ("rss_mb", "uss_mb", "gc_objects", "python_blocks"):
        if then.get(key) is not None and out[key] is not None:
            growth[key] = out[key] - then[key]
    if then:
        growth["seconds"] = time.time() - then["at"]
    out["growth"] = growth
    _last.update({k: out[k] for k in ("rss_mb", "uss_mb", "gc_objects", "python_blocks")}, at=time.time())
    cuda_row("look")
    return out


def tensors(budget_s: float, columns=None) -> dict:
    """``python.tensors``: rows in the table's column order, or only the
    ``columns`` a query reads (the others come back as null). The rows are
    a generator: the probe writes each into the reply as it is made."""
    names = ["ts", *TENSOR_COLUMNS]
    torch = _torch()
    if torch is None:
        return {"columns": names, "rows": []}
    from rankscope._probe.torch import tensors as tensor_scan

    rows = tensor_scan.scan_rows(budget_s=budget_s)
    if columns is not None:
        keep = [i for i, name in enumerate(names) if i == 0 or name in columns]
        names = [names[i] for i in keep]
        rows = ([row[i] for i in keep] for row in rows)
    return {"columns": names, "rows": rows}


def objects() -> dict:
    """``python.objects``: counts and shallow sizes by type, and growth since
    the last look (type names and numbers are kept, never objects)."""
    counts: dict = {}
    sizes: dict = {}
    getsizeof = sys.getsizeof
    for obj in gc.get_objects():
        kind = type(obj)
        name = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ not in ("builtins", None) else kind.__qualname__
        counts[name] = counts.get(name, 0) + 1
        try:
            sizes[name] = sizes.get(name, 0) + getsizeof(obj)
        except Exception:  # noqa: BLE001 - a type whose __sizeof__ fails counts 0 bytes
            pass
    now = time.time()
    rows = []
    # Growth only from a second look on; a type new since then grew from 0.
    looked = bool(_last_types)
    for name, count in counts.items():
        mb = sizes.get(name, 0) / MB
        before = _last_types.get(name, (0, 0.0))
        rows.append([now, name, count, mb, count - before[0] if looked else None, mb - before[1] if looked else None])
    _last_types.clear()
    _last_types.update({name: (count, sizes.get(name, 0) / MB) for name, count in counts.items()})
    return {"columns": ["ts", "type", "count", "mb", "count_growth", "mb_growth"], "rows": rows}


def describe_tracking() -> dict:
    return {
        "python": TRACKING.python,
        "cuda": TRACKING.cuda,
        "since": TRACKING.started_at,
    }


def _history_options(torch) -> dict:
    """torch's memory history registers a callback for `record_function`
    annotations, on the calling thread only unless asked for all threads.
    The probe serves each request on a thread of its own (rankscope-server's
    `dispatch`), so the callback went on with one thread and was looked for
    by another at `track off`: torch printed "Requested callback is not
    found" into the program's stderr (an H100, torch 2.11). For all
    threads, the program's own annotations are recorded too."""
    import inspect

    impl = getattr(torch.cuda.memory, "_record_memory_history_impl", None)
    try:
        accepted = inspect.signature(impl).parameters
    except (TypeError, ValueError):
        return {}
    return {"global_record_annotations": True} if "global_record_annotations" in accepted else {}


def track(switch, python: bool, cuda: bool) -> dict:
    if switch not in ("on", "off"):
        return describe_tracking()
    if not python and not cuda:
        python = True
    if switch == "on":
        if python and not TRACKING.python:
            import tracemalloc

            TRACKING.python_ours = not tracemalloc.is_tracing()
            if TRACKING.python_ours:
                # 16 frames: enough stack to tell two callers of one line apart.
                tracemalloc.start(16)
            TRACKING.python = True
            TRACKING.base = tracemalloc.take_snapshot()
            TRACKING.tensor_base = _tensor_sites()
        if cuda and not TRACKING.cuda:
            torch = _torch()
            if torch is None or not torch.cuda.is_available():
                raise UserError(
                    "no CUDA here: --cuda records CUDA allocations (torch's memory history)",
                    "use --python for Python allocations; CUDA needs a GPU and a program that uses it",
                )
            recording = getattr(torch._C, "_cuda_isHistoryEnabled", None)
            TRACKING.cuda_ours = not (recording is not None and recording())
            if TRACKING.cuda_ours:
                # Python stacks only: the sites users read; C++ frames cost an
                # unwind at every allocation and a slow symbolisation at export.
                torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python", **_history_options(torch))
            TRACKING.cuda = True
        TRACKING.started_at = TRACKING.started_at or time.time()
    else:
        if python and TRACKING.python:
            if TRACKING.python_ours:
                sys.modules["tracemalloc"].stop()
            TRACKING.python = False
            TRACKING.base = TRACKING.tensor_base = None
        if cuda and TRACKING.cuda:
            if TRACKING.cuda_ours:
                torch = sys.modules["torch"]
                torch.cuda.memory._record_memory_history(enabled=None, **_history_options(torch))
            TRACKING.cuda = False
        if not TRACKING.python and not TRACKING.cuda:
            TRACKING.started_at = None
    out = describe_tracking()
    if TRACKING.python:
        tracemalloc = sys.modules["tracemalloc"]
        out["overhead_mb"] = tracemalloc.get_tracemalloc_memory() / MB
    return out


def _own_file(filename: str) -> bool:
    return "/rankscope/" in filename or filename.endswith("tracemalloc.py")


def _library_file(filename: str) -> bool:
    """An installed package's, the standard library's, or a frozen module's."""
    return (
        "/site-packages/" in filename
        or "/dist-packages/" in filename
        or filename.startswith("<")
        or filename.startswith(sys.base_prefix + "/lib/python")
        or filename.startswith(sys.prefix + "/lib/python")
    )


def diff(top: int) -> dict:
    """What grew since the last look (or since tracking began), by
    allocation site: each growing allocation is put at the innermost frame
    of the user's own code in its stack (torch's internals allocate on the
    user's behalf), with the stack of the largest that went there."""
    if not TRACKING.python:
        raise UserError("memory tracking is off", "`rankscope PID memory track on --python` first, then `memory diff` after a while")
    tracemalloc = sys.modules["tracemalloc"]
    now = tracemalloc.take_snapshot()
    tensors_now = _tensor_sites()
    out = _compare(TRACKING.base, now, top, TRACKING.tensor_base, tensors_now)
    TRACKING.base, TRACKING.tensor_base = now, tensors_now
    return out


class _StepSpan:
    """``memory diff --steps A..B``: tracemalloc snapshots taken by the
    training thread at two step boundaries (the first at or after the end
    of step A, the second at or after the end of step B), through the torch
    step clock's listeners."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.base = self.base_step = self.result = self.error = self.tensor_base = None

    # Not heard (see torch/trace.py, EVENTS): the boundary is enough.
    optimizer_pre = optimizer_post = None

    def failed(self, reason: str) -> None:
        self.error = reason

    def boundary(self, step):
        ended = step - 1  # the step that just ended; `step` begins
        if self.result is not None or not TRACKING.python:
            return
        tracemalloc = sys.modules["tracemalloc"]
        if self.base is None and ended >= self.first:
            self.base, self.base_step = tracemalloc.take_snapshot(), ended
            self.tensor_base = _tensor_sites(SPAN_SCAN_S)
        elif self.base is not None and ended >= self.last:
            self.result = _compare(self.base, tracemalloc.take_snapshot(), 50, self.tensor_base, _tensor_sites(SPAN_SCAN_S))
            self.result["steps"] = [self.base_step, ended]
            self.base = None
            from rankscope._probe.torch.trace import TRACER

            TRACER.remove_listener(self, wait_s=0)


_span: list = []  # the armed _StepSpan, if any


def diff_steps(first: int, last: int, top: int) -> dict:
    if not TRACKING.python:
        raise UserError("memory tracking is off", "`rankscope PID memory track on --python` first")
    if not 0 <= first < last:
        raise UserError(f"--steps {first}..{last} is not a span", "e.g. --steps 100..200: from the end of step 100 to the end of step 200")
    if _torch() is None:
        raise UserError("steps come from torch's optimizer, and torch is not imported here", "use `memory diff` between two looks instead")
    from rankscope._probe.torch.trace import TRACER

    span = _span[0] if _span else None
    if span is None or (span.first, span.last) != (first, last):
        if span is not None:
            TRACER.remove_listener(span, wait_s=0)
        span = _StepSpan(first, last)
        _span[:] = [span]
        TRACER.add_listener(span)
    if span.error is not None:
        _span.clear()
        raise UserError(f"the span's snapshots failed: {span.error}", "try again, or use `memory diff` between two looks")
    if span.result is None:
        return {"state": "waiting", "steps": [first, last], "base_step": span.base_step, "step": TRACER.step}
    _span.clear()
    result = dict(span.result)
    result["sites"] = result["sites"][:top]
    result["state"] = "done"
    return result


def _site_of(traceback):
    """((file, line), stack) for an allocation's traceback: the innermost
    frame of the user's own code (torch's internals allocate on the user's
    behalf), and the stack below it; None for rankscope's own."""
    frames = [f for f in traceback if not _own_file(f.filename)]
    if not frames:
        return None
    # Made on the probe's behalf: its whole stack (not cut short) begins in
    # rankscope, a request on the probe's thread (the modules a diff
    # imports, importlib's frames innermost). A program's call that goes
    # through a stand-in begins in the program.
    whole = getattr(traceback, "total_nframe", None) in (None, len(traceback))
    if whole and _own_file(traceback[0].filename):
        return None
    # tracemalloc lists the most recent frame last.
    users = [f for f in frames if not _library_file(f.filename)]
    site = users[-1] if users else frames[-1]
    return (site.filename, site.lineno), [f"{f.filename}:{f.lineno}" for f in reversed(frames)][:8]


# Why tensors' data is not in a diff here, where it is not.
TENSORS_311 = (
    "tensor data not counted by site: CPython 3.11's tracemalloc cannot find the "
    "allocation of an object with a managed __dict__, as a torch.Tensor is (3.12+ can)"
)


def _tensor_sites(budget_s: float = 2.0):
    """Live tensors' bytes by site (``tensors.by_site``), where torch is
    imported and tracemalloc can find a tensor's allocation; None
    elsewhere."""
    if "torch" not in sys.modules or sys.version_info < (3, 12):
        return None
    from rankscope._probe.torch import tensors

    return tensors.by_site(_site_of, budget_s)


# A span's scans run on the training thread, at a step boundary: shorter.
SPAN_SCAN_S = 0.5


def _new_site(sites: dict, key) -> dict:
    entry = sites.get(key)
    if entry is None:
        entry = sites[key] = {
            "file": key[0],
            "lineno": key[1],
            "size_diff_mb": 0.0,
            "count_diff": 0,
            "size_mb": 0.0,
            "tensor_diff_mb": 0.0,
            "tensor_count_diff": 0,
            "largest": -1,
        }
    return entry


def _compare(base, now, top: int, tensors_base=None, tensors_now=None) -> dict:
    tracemalloc = sys.modules["tracemalloc"]
    mine = [tracemalloc.Filter(False, "*/rankscope/*"), tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = now.filter_traces(mine).compare_to(base.filter_traces(mine), "traceback")
    sites: dict = {}
    for stat in stats:
        if stat.size_diff <= 0:
            continue
        placed = _site_of(stat.traceback)
        if placed is None:
            continue
        key, stack = placed
        entry = _new_site(sites, key)
        entry["size_diff_mb"] += stat.size_diff / MB
        entry["count_diff"] += stat.count_diff
        entry["size_mb"] += stat.size / MB
        if stat.size_diff > entry["largest"]:
            entry["largest"] = stat.size_diff
            entry["stack"] = stack
    # Tensors' data, which tracemalloc does not see, by the site of their
    # objects: what grew between the two looks.
    complete = None
    if tensors_now is not None:
        (before, _), (after, complete) = tensors_base or ({}, True), tensors_now
        for key, (nbytes, count, stack) in after.items():
            was = before.get(key, (0, 0, None))
            grew, more = nbytes - was[0], count - was[1]
            if grew <= 0 and more <= 0:
                continue
            entry = _new_site(sites, key)
            entry["tensor_diff_mb"] += grew / MB
            entry["tensor_count_diff"] += more
            entry.setdefault("stack", stack)
    for entry in sites.values():
        entry["total_diff_mb"] = entry["size_diff_mb"] + entry["tensor_diff_mb"]
    ranked = sorted(sites.values(), key=lambda e: (-e["total_diff_mb"], -e["count_diff"]))[:top]
    for entry in ranked:
        del entry["largest"]
    from rankscope import _native

    proc = dict(_native.memory_now())
    note = None
    if "torch" in sys.modules and sys.version_info < (3, 12):
        note = TENSORS_311
    return {
        "sites": ranked,
        "tensor_scan_complete": complete,
        "tensor_note": note,
        "rss_mb": proc["rss"] / MB,
        "traced_mb": tracemalloc.get_traced_memory()[0] / MB,
        "tracemalloc_overhead_mb": tracemalloc.get_tracemalloc_memory() / MB,
    }


def export(what: str, path: str) -> dict:
    if what != "cuda":
        raise UserError(f"cannot export {what!r}", "rankscope PID memory export cuda OUT.pickle (a snapshot PyTorch's memory_viz opens)")
    torch = _torch()
    if torch is None or not torch.cuda.is_initialized():
        raise UserError("CUDA is not in use in this process", "an export needs a program that has used CUDA")
    if not TRACKING.cuda:
        raise UserError("CUDA allocations are not being recorded", "`memory track on --cuda` first, so the snapshot has allocation sites")
    torch.cuda.memory._dump_snapshot(path)
    return {"path": path}
