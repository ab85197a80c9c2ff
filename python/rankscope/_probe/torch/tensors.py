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


def _names(objects: list) -> dict:
    """id(tensor) -> (holder path, kind), best names first (setdefault)."""
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
                    _name_value(names, f"{code.co_name}:{name}", value, "local")
            frame = frame.f_back
    main = sys.modules.get("__main__")
    for name, value in list(getattr(main, "__dict__", {}).items()):
        if not name.startswith("__"):
            _name_value(names, name, value, "global")
    return names


def _is_tensor(value) -> bool:
    # type(), not isinstance(): isinstance asks an object's __class__, and
    # some objects answer with a warning or code of their own.
    return issubclass(type(value), torch.Tensor)


def _name_value(names: dict, path: str, value, kind: str) -> None:
    if _is_tensor(value):
        names.setdefault(id(value), (path, kind))
    elif type(value) in (list, tuple):
        tensor_type = torch.Tensor
        for i, item in enumerate(value[:MAX_ITEMS]):
            if issubclass(type(item), tensor_type):
                names.setdefault(id(item), (f"{path}[{i}]", kind))
    elif type(value) is dict:
        for i, (key, item) in enumerate(list(value.items())):
            if i >= MAX_ITEMS:
                break
            if _is_tensor(item):
                names.setdefault(id(item), (f"{path}[{key!r}]", kind))


def _storage_key(tensor):
    try:
        storage = tensor.untyped_storage()
        return (storage.data_ptr(), str(tensor.device)), storage.nbytes()
    except Exception:  # noqa: BLE001 - a tensor without a storage (sparse, a subclass): on its own
        return ("id", id(tensor)), tensor.numel() * tensor.element_size()


def scan(budget_s: float = 2.0) -> dict:
    """{"rows": [[ts, shape, dtype, device, mb, bytes, requires_grad,
    kind, holder, views, complete], ...], "complete": bool}."""
    deadline = time.monotonic() + budget_s
    objects = gc.get_objects()
    names = _names(objects)
    tensor_type = torch.Tensor
    kinds = {kind for kind in set(map(type, objects)) if issubclass(kind, tensor_type)}
    found = [obj for obj in objects if type(obj) in kinds]
    del objects
    groups: dict = {}
    complete = True
    for index, obj in enumerate(found):
        if index % 4096 == 0 and time.monotonic() > deadline:
            complete = False
            break
        key, nbytes = _storage_key(obj)
        group = groups.get(key)
        if group is None:
            groups[key] = [obj, nbytes, 1, names.get(id(obj))]
        else:
            group[2] += 1
            named = names.get(id(obj))
            # The row shows the view with a name, else the largest.
            if group[3] is None and named is not None or (named is None) == (group[3] is None) and obj.numel() > group[0].numel():
                group[0], group[3] = obj, named if named is not None else group[3]
    rows = []
    unnamed = []
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
    for tensor, nbytes, views, named in groups.values():
        if named is None:
            kind, holder = "tensor", None
            unnamed.append((nbytes, len(rows)))
        else:
            holder, kind = named
        rows.append(
            [
                now,
                spell(tensor.shape, shape_text),
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
        )
    shown = list(groups.values())
    lookups = sorted(unnamed, reverse=True)[:MAX_REFERRER_LOOKUPS]
    if lookups and time.monotonic() < deadline:
        for row_index, holder in _referrers(shown, [i for _, i in lookups]).items():
            rows[row_index][8] = holder
    del groups, names, shown, found
    return {"rows": rows, "complete": complete}


def _referrers(shown: list, row_indexes: list) -> dict:
    """row index -> "referrer: TYPE" for the given rows' tensors, in one
    walk of the heap (``gc.get_referrers`` of all of them at once); the
    scan's own lists and frames are left out."""
    tensors = {id(shown[i][0]): i for i in row_indexes}
    frame_type = type(sys._getframe())
    own = {id(group) for group in shown}
    own.add(id(shown))
    found: dict = {}
    for ref in gc.get_referrers(*(shown[i][0] for i in row_indexes)):
        if type(ref) is frame_type or id(ref) in own:
            continue
        for item in gc.get_referents(ref):
            row_index = tensors.get(id(item))
            if row_index is not None and row_index not in found:
                found[row_index] = f"referrer: {type(ref).__qualname__}"
        if len(found) == len(tensors):
            break
    return found
