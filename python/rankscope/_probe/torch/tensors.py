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
"""

from __future__ import annotations

import gc
import sys
import time

import torch

from rankscope._probe.torch import models

# Container items looked into, per container, for holder names.
MAX_ITEMS = 1_000_000
# Unnamed tensors whose referrer's type is looked up (largest first).
MAX_REFERRER_LOOKUPS = 20


def _label_in_main(obj) -> str | None:
    main = sys.modules.get("__main__")
    for name, value in list(getattr(main, "__dict__", {}).items()):
        if value is obj and not name.startswith("__"):
            return name
    return None


def _names(objects: list, containers: list) -> dict:
    """id(tensor) -> (holder path, kind), best names first; for a
    container's items an int instead, the container's place in
    ``containers`` and the item's index packed together (see ``_holder``):
    a list of 100 k tensors costs an int each, not a string and a tuple."""
    names: dict = {}
    found, optimizers, _ = models.discover(objects)
    param_names = {}
    for model in found:
        root = _label_in_main(model) or models.root_name(model)
        for name, param in model.named_parameters():
            path = f"{root}.{name}"
            names.setdefault(id(param), (path, "parameter"))
            param_names[id(param)] = name
            if param.grad is not None:
                names.setdefault(id(param.grad), (f"{path}.grad", "gradient"))
        for name, buffer in model.named_buffers():
            names.setdefault(id(buffer), (f"{root}.{name}", "buffer"))
    for index, opt in enumerate(optimizers):
        label = _label_in_main(opt) or f"optimizer{index}"
        for param, state in list(opt.state.items()):
            pname = param_names.get(id(param), f"param@{id(param):x}")
            for key, value in list(state.items()) if isinstance(state, dict) else ():
                if _is_tensor(value):
                    names.setdefault(id(value), (f"{label}.state[{pname}][{key!r}]", "optimizer state"))
    own = ("/rankscope/",)
    for frame in list(sys._current_frames().values()):
        while frame is not None:
            code = frame.f_code
            # A module's own frame reads its globals: named by the pass below.
            if code.co_name != "<module>" and not any(part in code.co_filename for part in own):
                for name, value in list(frame.f_locals.items()):
                    _name_value(names, containers, f"{code.co_name}:{name}", value, "local")
            frame = frame.f_back
    main = sys.modules.get("__main__")
    for name, value in list(getattr(main, "__dict__", {}).items()):
        if not name.startswith("__"):
            _name_value(names, containers, name, value, "global")
    return names


def _is_tensor(value) -> bool:
    # type(), not isinstance(): isinstance asks an object's __class__, and
    # some objects answer with a warning or code of their own.
    return issubclass(type(value), torch.Tensor)


def _name_value(names: dict, containers: list, path: str, value, kind: str) -> None:
    if _is_tensor(value):
        names.setdefault(id(value), (path, kind))
        return
    if type(value) in (list, tuple):
        items, keys = value[:MAX_ITEMS], None
    elif type(value) is dict:
        keys = list(value)[:MAX_ITEMS]
        items = [value.get(key) for key in keys]
    else:
        return
    slot = len(containers) << 32
    tensor_type = torch.Tensor
    named = False
    for i, item in enumerate(items):
        if issubclass(type(item), tensor_type):
            names.setdefault(id(item), slot | i)
            named = True
    if named:
        containers.append((path, kind, keys))


def _storage_key(tensor):
    """The storage's identity, and its size. A CPU storage is its address
    alone (an int: a scan keys 100 k of them), another device's is the
    address with the device."""
    try:
        storage = tensor.untyped_storage()
        if tensor.is_cpu:
            return storage.data_ptr(), storage.nbytes()
        return (storage.data_ptr(), str(tensor.device)), storage.nbytes()
    except Exception:  # noqa: BLE001 - a tensor without a storage (sparse, a subclass): on its own
        return ("id", id(tensor)), tensor.numel() * tensor.element_size()


def _holder(named, containers: list):
    """(path, kind) from what ``_names`` keeps; a container's item is
    spelled only here, one row at a time."""
    if named is None:
        return None, "tensor"
    if type(named) is int:
        path, kind, keys = containers[named >> 32]
        index = named & 0xFFFFFFFF
        return f"{path}[{index if keys is None else keys[index]!r}]", kind
    return named


def scan(budget_s: float = 2.0) -> dict:
    """{"rows": [[ts, shape, dtype, device, mb, bytes, requires_grad,
    kind, holder, views, complete], ...], "complete": bool}."""
    rows = list(scan_rows(budget_s))
    return {"rows": rows, "complete": rows[0][-1] if rows else True}


def scan_rows(budget_s: float = 2.0):
    """The rows of ``scan``, made one at a time (a generator): the probe
    writes each into the reply and drops it before the next is made, so the
    100 k rows of a big scan never all live at once."""
    deadline = time.monotonic() + budget_s
    objects = gc.get_objects()
    containers: list = []
    names = _names(objects, containers)
    tensor_type = torch.Tensor
    kinds = {kind for kind in set(map(type, objects)) if issubclass(kind, tensor_type)}
    found = [obj for obj in objects if type(obj) in kinds]
    del objects
    # One tensor per storage; a storage seen through several views gets
    # [views, the view shown] in `shared` (the view with a name, else the
    # largest). Most storages have one view, and cost a dict entry only.
    first: dict = {}
    shared: dict = {}
    complete = True
    for index, obj in enumerate(found):
        if index % 4096 == 0 and time.monotonic() > deadline:
            complete = False
            break
        key, _ = _storage_key(obj)
        shown = first.setdefault(key, obj)
        if shown is obj:
            continue
        group = shared.get(key)
        if group is None:
            group = shared[key] = [1, shown]
        group[0] += 1
        current = group[1]
        named, current_named = id(obj) in names, id(current) in names
        if named and not current_named or named == current_named and obj.numel() > current.numel():
            group[1] = obj
    del found
    for key, (_, shown) in shared.items():
        first[key] = shown
    # The largest unnamed tensors get the type of an object that refers to them.
    referred: dict = {}
    if time.monotonic() < deadline:
        unnamed = sorted(((_storage_key(t)[1], id(t)) for t in first.values() if id(t) not in names), reverse=True)[:MAX_REFERRER_LOOKUPS]
        if unnamed:
            wanted = {i for _, i in unnamed}
            targets = [t for t in first.values() if id(t) in wanted]
            # The scan's own tables refer to every tensor: not an answer.
            own = {id(first), id(shared), id(targets), *map(id, shared.values())}
            referred = _referrers(targets, own)
            del targets
    return _rows(first, shared, names, containers, referred, complete)


def _rows(first: dict, shared: dict, names: dict, containers: list, referred: dict, complete: bool):
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
    while first:
        # Taken out as it is written: the scan's hold on each tensor goes with its row.
        key, tensor = first.popitem()
        group = shared.pop(key, None)
        _, nbytes = _storage_key(tensor)
        holder, kind = _holder(names.get(id(tensor)), containers)
        if holder is None:
            holder = referred.get(id(tensor))
        yield [
            now,
            spell(tensor.shape, shape_text),
            spell(tensor.dtype, dtype_text),
            spell(tensor.device, str),
            nbytes / float(1 << 20),
            nbytes,
            tensor.requires_grad,
            kind,
            holder,
            1 if group is None else group[0],
            complete,
        ]
        del tensor, group


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
