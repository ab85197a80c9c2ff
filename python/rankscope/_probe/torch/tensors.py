"""The live tensors and who holds them (``python.tensors``).

Found on demand: every object ``gc`` tracks whose type is a tensor, with
each storage counted once (views of one storage are one row, the largest
view shown, ``views`` counting them). No tensor's data is read or copied
and no device is synchronised: shapes, dtypes and storage sizes are
metadata.

The holder is the most readable path found to the tensor, looked for from
what a user names things by: the models' parameters, gradients and buffers
(``model.encoder.layers.3.attn.q_proj.weight``, ``...weight.grad``), the
optimizers' state (``optimizer.state[fc1.weight]['exp_avg']``), the locals of
every thread's frames (``train_step:batch``, and one level into their lists,
tuples and dicts), and ``__main__``'s globals (``losses[3]``). A tensor none
of those reach gets the type of an object that refers to it (``referrer:
list``), for the largest ones only (``gc.get_referrers`` walks the heap).
The scan stops at its time budget and says so (``scan_complete``).

Tensors saved for backward (a training step's activations, most of its
memory between forward and backward) have no Python object the collector
knows of: autograd's graph holds them in C++. They are reached, on the main
thread at its next safe point (``_native.on_main_thread``: within 0.1 s, or
not at all for a main thread blocked in C), from every live tensor with a
``grad_fn``: each node of its graph, each of the node's
``_raw_saved_*`` tensors read through ``SavedTensor.data``, which hands the
tensor as it is kept and never runs a ``saved_tensors_hooks`` unpack hook
(that could copy it back to a GPU, or recompute a checkpointed forward);
under a pack hook (offloading) that is the packed copy, where the memory
is. Their kind is ``saved for backward``; their holder says which node
saved it and whose graph it is (``MmBackward0.self in the graph of
train_step:loss``).
"""

from __future__ import annotations

import gc
import sys
import time
import types

import torch

from rankscope import _native
from rankscope._probe.torch import models

# Unnamed tensors whose referrer's type is looked up (largest first).
MAX_REFERRER_LOOKUPS = 20
# Nodes of autograd's graphs looked into for saved tensors, at most.
MAX_GRAPH_NODES = 200_000
SAVED = "saved for backward"
# How long the main thread is given to reach a safe point for the walk.
MAIN_THREAD_WAIT_S = 0.1


def _names(containers: list) -> dict:
    """id(tensor) -> (holder path, kind), best names first. The lists,
    tuples and dicts among the locals and globals go into ``containers`` as
    (path, kind, container): their items are named by the native scan, one
    row at a time, so a list of 100 k tensors costs no entry here."""
    names: dict = {}
    found, optimizers, _ = models.discover()
    param_names = {}
    for model in found:
        root = models.label_in_main(model) or models.root_name(model)
        for name, param in model.named_parameters():
            path = f"{root}.{name}"
            names.setdefault(id(param), (path, "parameter"))
            param_names[id(param)] = name
            if param.grad is not None:
                names.setdefault(id(param.grad), (f"{path}.grad", "gradient"))
        for name, buffer in model.named_buffers():
            names.setdefault(id(buffer), (f"{root}.{name}", "buffer"))
    for index, opt in enumerate(optimizers):
        label = models.label_in_main(opt) or f"optimizer{index}"
        for param, state in list(opt.state.items()):
            pname = param_names.get(id(param), f"param@{id(param):x}")
            for key, value in list(state.items()) if isinstance(state, dict) else ():
                if _is_tensor(value):
                    names.setdefault(id(value), (f"{label}.state[{pname}][{key!r}]", "optimizer state"))
    own = ("/rankscope/",)
    # Objects the locals and globals hold (a trainer, `self`): their
    # attributes are looked at after every direct name, one level down.
    holders: list = []
    for frame in list(sys._current_frames().values()):
        while frame is not None:
            code = frame.f_code
            # A module's own frame reads its globals: named by the pass below.
            if code.co_name != "<module>" and not any(part in code.co_filename for part in own):
                for name, value in list(frame.f_locals.items()):
                    _name_value(names, containers, f"{code.co_name}:{name}", value, "local", holders)
            frame = frame.f_back
    main = sys.modules.get("__main__")
    for name, value in list(getattr(main, "__dict__", {}).items()):
        if not name.startswith("__"):
            _name_value(names, containers, name, value, "global", holders)
    # The globals of the program's own other modules (`data.CACHE`), not
    # of installed packages or the standard library.
    from rankscope._probe.memory import _library_file, _own_file

    for module_name, module in list(sys.modules.items()):
        attrs = getattr(module, "__dict__", None) if type(module) is types.ModuleType else None
        path = attrs.get("__file__") if attrs is not None else None
        if module is main or not isinstance(path, str) or _library_file(path) or _own_file(path):
            continue
        for name, value in list(attrs.items()):
            if not name.startswith("__"):
                _name_value(names, containers, f"{module_name}.{name}", value, "global", holders)
    for path, kind, obj in holders[:MAX_HOLDERS_LOOKED_INTO]:
        for name, value in list(_attributes(obj).items()):
            if isinstance(name, str) and not name.startswith("__"):
                _name_value(names, containers, f"{path}.{name}", value, kind, None)
    return names


# Objects whose attributes are looked into for names, at most.
MAX_HOLDERS_LOOKED_INTO = 10_000
# Whose attributes are not looked into: they are named otherwise (models),
# or are code and namespaces, not data.
_NOT_HOLDERS = (types.ModuleType, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _attributes(obj) -> dict:
    """An object's own attribute dict, read without running its code (no
    ``__getattr__``, no properties); empty for one without."""
    kind = type(obj)
    if kind.__dictoffset__ == 0 or issubclass(kind, _NOT_HOLDERS) or issubclass(kind, torch.nn.Module):
        return {}
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - a class that hides its __dict__
        return {}
    return attrs if type(attrs) is dict else {}


def _is_tensor(value) -> bool:
    # type(), not isinstance(): isinstance asks an object's __class__, and
    # some objects answer with a warning or code of their own.
    return issubclass(type(value), torch.Tensor)


def _name_value(names: dict, containers: list, path: str, value, kind: str, holders: list | None) -> None:
    if _is_tensor(value):
        names.setdefault(id(value), (path, kind))
    elif type(value) in (list, tuple, dict) and value:
        containers.append((path, kind, value))
    elif holders is not None:
        holders.append((path, kind, value))


def _nbytes(tensor) -> int:
    """The bytes the tensor keeps alive: its storage's size where that can
    differ from its own (a view, an offset, a strided layout), else its own
    size. ``untyped_storage()`` gives the storage a Python object that lives
    as long as the storage does (64 bytes each: 6 MB over 100 k tensors),
    so only the tensors that need it pay for it; a tensor resized smaller
    in place reports its own size."""
    try:
        if tensor.is_meta:
            return 0  # shapes only, no memory
        if tensor._is_view() or tensor.storage_offset() or not tensor.is_contiguous():
            return tensor.untyped_storage().nbytes()
        return tensor.nbytes
    except Exception:  # noqa: BLE001 - a tensor without a storage (sparse, a subclass)
        try:
            return tensor.numel() * tensor.element_size()
        except Exception:  # noqa: BLE001 - nor an element count
            return 0


def scan(budget_s: float = 2.0) -> dict:
    """{"rows": [[ts, shape, dtype, device, mb, bytes, requires_grad,
    kind, holder, views, complete], ...], "complete": bool}."""
    rows = list(scan_rows(budget_s))
    return {"rows": rows, "complete": rows[0][-1] if rows else True}


def scan_rows(budget_s: float = 2.0):
    """The rows of ``scan``, made one at a time (a generator): the probe
    writes each into the reply and drops it before the next is made. The
    scan's tables are native (``rankscope._native.TensorScan``): 16 bytes a
    tensor, no Python object per tensor but the row being written."""
    deadline = time.monotonic() + budget_s
    # Found (and held) before the names: an id named below is then a
    # tensor the scan holds, never a new object at a freed one's address.
    found = _native.TensorScan(torch.Tensor)
    containers: list = []
    names = _names(containers)
    saved_names: dict = {}
    # Autograd's graph is read on the main thread between two bytecodes,
    # where no op and no backward runs (see on_main.rs); a main thread that
    # gets to none in time (blocked in C) is not waited for.
    walk = _native.on_main_thread(
        lambda: _saved_tensors(found.with_grad_fn(), names, saved_names, deadline),
        min(MAIN_THREAD_WAIT_S, max(0.0, deadline - time.monotonic())),
    )
    saved, walked = walk if walk is not None else ([], True)
    found.add(saved)
    del saved, walk
    complete = found.key(max(0.0, deadline - time.monotonic()), getattr(torch._C, "_storage_address", None))
    complete = complete and walked
    # Grouped before the saved tensors are named: a storage the program
    # also names (`train_step:out`) keeps the program's name.
    found.group(names, [container for _, _, container in containers])
    for key, value in saved_names.items():
        names.setdefault(key, value)
    # The largest unnamed tensors get the type of an object that refers to them.
    referred: dict = {}
    if time.monotonic() < deadline:
        # (Saved tensors are named, by their node: no referrer to look for.)
        targets = found.largest_unnamed(MAX_REFERRER_LOOKUPS + len(saved_names), _nbytes)
        targets = [t for t in targets if id(t) not in saved_names][:MAX_REFERRER_LOOKUPS]
        if targets:
            # The scan's own list refers to each: not an answer.
            referred = _referrers(targets, {id(targets)})
        del targets
    return _rows(found, names, containers, referred, complete)


def by_site(site_of, budget_s: float = 2.0) -> tuple[dict, bool]:
    """The live tensors' bytes by the place their Python object was made
    (``memory diff``): site -> [bytes, tensors, stack], each storage
    counted once, for the tensors made while tracemalloc traced
    (``tracemalloc.get_object_traceback``; a tensor's data is torch's own
    allocation, which tracemalloc never sees: only its 100-odd bytes of
    object would show a leak of tensors; CPython 3.12+, see
    ``memory.TENSORS_311``). ``site_of(traceback)`` gives the
    site and the stack to show, or None. Also whether the scan was whole."""
    import tracemalloc

    found = _native.TensorScan(torch.Tensor)
    complete = found.key(budget_s, getattr(torch._C, "_storage_address", None))
    found.group({}, [])
    sites: dict = {}
    for tensor, _views, _place in found:
        traceback = tracemalloc.get_object_traceback(tensor)
        placed = site_of(traceback) if traceback is not None else None
        if placed is not None:
            site, stack = placed
            entry = sites.get(site)
            if entry is None:
                entry = sites[site] = [0, 0, stack]
            entry[0] += _nbytes(tensor)
            entry[1] += 1
        del tensor
    return sites, complete


def _rows(found, names: dict, containers: list, referred: dict, complete: bool):
    now = time.time()
    # Many tensors share a shape, a dtype and a device: each is spelled once.
    spelled: dict = {}

    def spell(value, text):
        out = spelled.get(value)
        if out is None:
            out = spelled[value] = text(value)
        return out

    shape_text = lambda shape: "x".join(map(str, shape)) or "scalar"  # noqa: E731
    dtype_text = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    for tensor, views, place in found:
        nbytes = _nbytes(tensor)
        if place is None:
            holder, kind = names.get(id(tensor), (None, "tensor"))
        else:
            path, kind, _ = containers[place[0]]
            holder = f"{path}[{place[1]!r}]"
        if holder is None:
            holder = referred.get(id(tensor))
        try:
            shape = spell(tensor.shape, shape_text)
        except Exception:  # noqa: BLE001 - a nested tensor has no single shape
            shape = "nested" if getattr(tensor, "is_nested", False) else "?"
        yield [
            now,
            shape,
            spell(tensor.dtype, dtype_text),
            spell(tensor.device, str),
            nbytes / float(1 << 20),
            nbytes,
            tensor.requires_grad,
            kind,
            holder,
            views,
            complete,
        ]
        # The scan let the tensor go as it handed it out: the row's hold goes here.
        del tensor


def _saved_raw_names(node_type, node, cache: dict) -> tuple:
    names = cache.get(node_type)
    if names is None:
        try:
            names = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        except Exception:  # noqa: BLE001 - a node that cannot list itself
            names = ()
        cache[node_type] = names
    return names


def _sequence(tensor) -> int:
    try:
        return tensor.grad_fn._sequence_nr()
    except Exception:  # noqa: BLE001
        return -1


def _saved_tensors(roots: list, names: dict, saved_names: dict, deadline: float) -> tuple[list, bool]:
    """The tensors autograd's graphs saved for backward, reached from
    `roots` (live tensors with a ``grad_fn``), as they are kept (see the
    module's docstring); each named in `saved_names` as ``NODE.WHAT, ... in
    the graph of ROOT``: every node that saved its storage, and the name of
    the first root that reaches it. Named roots go first, the latest made
    first (the loss before the output it was computed from), so that a
    training step's graph is the loss's. Also whether the walk was whole
    (False: out of time, or of nodes)."""
    out: list = []
    seen: set = set()
    nodes: list = []  # held while walked: an id seen stays that node's
    raw_names: dict = {}
    address = getattr(torch._C, "_storage_address", None)
    # storage -> (the nodes' labels, the graph's name)
    by_storage: dict = {}
    whole = True
    roots.sort(key=lambda t: (id(t) not in names, -_sequence(t)))
    for root in roots:
        if time.monotonic() > deadline or len(nodes) > MAX_GRAPH_NODES:
            whole = False
            break
        named = names.get(id(root))
        graph = f" in the graph of {named[0]}" if named else ""
        try:
            stack = [root.grad_fn]
        except Exception:  # noqa: BLE001
            continue
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            nodes.append(node)
            if len(nodes) % 256 == 0 and (time.monotonic() > deadline or len(nodes) > MAX_GRAPH_NODES):
                whole = False
                break
            node_type = type(node)
            for attr in _saved_raw_names(node_type, node, raw_names):
                try:
                    raw = getattr(node, attr)
                    values = raw if isinstance(raw, (list, tuple)) else (raw,)
                    for i, value in enumerate(values):
                        # .data: the tensor as kept, no unpack hook run.
                        # Freed by a backward already: it raises.
                        data = value.data
                        if not _is_tensor(data):
                            continue
                        what = attr[len("_raw_saved_") :] + (f"[{i}]" if raw is values else "")
                        key = address(data) if address is not None else (str(data.device), data.data_ptr())
                        labels = by_storage.get(key)
                        if labels is None:
                            labels = by_storage[key] = (set(), graph)
                        labels[0].add(f"{node_type.__name__}.{what}")
                        out.append((data, key))
                except Exception:  # noqa: BLE001 - released, or a torch without SavedTensor.data
                    continue
            try:
                stack.extend(f for f, _ in node.next_functions if f is not None)
            except Exception:  # noqa: BLE001
                pass
        if not whole:
            break
    for data, key in out:
        labels, graph = by_storage[key]
        saved_names.setdefault(id(data), (", ".join(sorted(labels)) + graph, SAVED))
    return [data for data, _ in out], whole


def _referrers(targets: list, own: set) -> dict:
    """id(tensor) -> "referrer: TYPE" for the given tensors, in one walk of
    the heap (``gc.get_referrers`` of all of them at once); frames and the
    objects in ``own`` (the scan's) are left out."""
    wanted = {id(t) for t in targets}
    frame_type = type(sys._getframe())
    found: dict = {}
    for ref in gc.get_referrers(*targets):
        if type(ref) is frame_type or id(ref) in own:
            continue
        for item in gc.get_referents(ref):
            if id(item) in wanted and id(item) not in found:
                found[id(item)] = f"referrer: {type(ref).__qualname__}"
        if len(found) == len(wanted):
            break
    return found
