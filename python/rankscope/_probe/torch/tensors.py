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
MAX_ITEMS = 10_000
# Unnamed tensors whose referrer's type is looked up (largest first).
MAX_REFERRER_LOOKUPS = 20


def _label_in_main(obj) -> str | None:
    main = sys.modules.get("__main__")
    for name, value in list(getattr(main, "__dict__", {}).items()):
        if value is obj and not name.startswith("__"):
            return name
    return None


def _names() -> dict:
    """id(tensor) -> (holder path, kind), best names first (setdefault)."""
    names: dict = {}
    found, optimizers, _ = models.discover()
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
                if isinstance(value, torch.Tensor):
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


def _name_value(names: dict, path: str, value, kind: str) -> None:
    if isinstance(value, torch.Tensor):
        names.setdefault(id(value), (path, kind))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value[:MAX_ITEMS]):
            if isinstance(item, torch.Tensor):
                names.setdefault(id(item), (f"{path}[{i}]", kind))
    elif isinstance(value, dict):
        for i, (key, item) in enumerate(list(value.items())):
            if i >= MAX_ITEMS:
                break
            if isinstance(item, torch.Tensor):
                names.setdefault(id(item), (f"{path}[{key!r}]", kind))


def _storage_key(tensor):
    try:
        storage = tensor.untyped_storage()
        return (storage.data_ptr(), str(tensor.device)), storage.nbytes()
    except Exception:  # noqa: BLE001 - a tensor without a storage (sparse, a subclass): on its own
        return ("id", id(tensor)), tensor.numel() * tensor.element_size()


def scan(budget_s: float = 2.0) -> dict:
    """{"rows": [[shape, dtype, device, mb, bytes, requires_grad, kind,
    holder, views, complete], ...], "complete": bool}."""
    deadline = time.monotonic() + budget_s
    names = _names()
    tensor_type = torch.Tensor
    groups: dict = {}
    complete = True
    for index, obj in enumerate(gc.get_objects()):
        if index % 4096 == 0 and time.monotonic() > deadline:
            complete = False
            break
        if not issubclass(type(obj), tensor_type):
            continue
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
    for tensor, nbytes, views, named in groups.values():
        if named is None:
            kind, holder = "tensor", None
            unnamed.append((nbytes, len(rows)))
        else:
            holder, kind = named
        rows.append(
            [
                "x".join(map(str, tensor.shape)) or "scalar",
                str(tensor.dtype).removeprefix("torch."),
                str(tensor.device),
                nbytes / float(1 << 20),
                nbytes,
                bool(tensor.requires_grad),
                kind,
                holder,
                views,
                complete,
            ]
        )
    shown = list(groups.values())
    for _, row_index in sorted(unnamed, reverse=True)[:MAX_REFERRER_LOOKUPS]:
        if time.monotonic() > deadline:
            break
        rows[row_index][7] = _referrer(shown, row_index)
    del groups, names, shown
    return {"rows": rows, "complete": complete}


def _referrer(shown: list, row_index: int) -> str | None:
    """The type of something that refers to the tensor (the scan's own
    lists and frames left out)."""
    tensor = shown[row_index][0]
    frame_type = type(sys._getframe())
    for ref in gc.get_referrers(tensor):
        if type(ref) is frame_type or ref is shown or any(ref is group for group in shown):
            continue
        return f"referrer: {type(ref).__qualname__}"
    return None
