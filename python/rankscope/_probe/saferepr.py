"""Bounded, exception-proof reprs of arbitrary objects.

Builtin values are summarized without calling user code. A user-defined
``__repr__`` is called under a deadline (a busy loop is interrupted) and any
exception it raises is reported instead of propagated. Tensors and arrays are
summarized from their metadata only: never printed, never synchronized.
"""

from __future__ import annotations

import time

from rankscope import _native

MAX_STRING = 200
MAX_ITEMS = 6
MAX_DEPTH = 2
MAX_REPR = 400
REPR_DEADLINE_S = 0.25
# Across one request; past it, user reprs are no longer called.
REPR_BUDGET_S = 2.0


class ReprTimeout(BaseException):
    """Raised asynchronously in a ``__repr__`` that ran past its deadline."""


# Builtins whose C repr is short and cannot run user code.
_SCALARS = frozenset((bool, float, complex, type(None), type(...), range, slice))
# Items that let a short container be printed by its own C repr in one go:
# the hot path of a snapshot, which must stay within tens of microseconds.
_PLAIN_ITEMS = _SCALARS | {int, str}
_SEQUENCES = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"), frozenset: ("frozenset({", "})")}
_type_names: dict[type, str] = {}


def type_name(obj: object) -> str:
    t = type(obj)
    cached = _type_names.get(t)
    if cached is not None:
        return cached
    module = getattr(t, "__module__", "") or ""
    name = getattr(t, "__qualname__", None) or t.__name__
    name = name if module == "builtins" else f"{module}.{name}"
    if len(_type_names) < 4096:
        _type_names[t] = name
    return name


def _plain(items) -> bool:
    plain = _PLAIN_ITEMS
    for item in items:
        t = type(item)
        if t not in plain or (t is str and len(item) > MAX_STRING) or (t is int and item.bit_length() > 256):
            return False
    return True


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more chars)"


# Tensor statistics are computed only on the CPU and only up to this many
# elements: a crash record may spend that, a live `bt --locals` never does.
MAX_STATS_ELEMENTS = 10_000_000


class Budget:
    """Time spent in user reprs during one request, and whether tensors get
    statistics (crash records) or metadata only (a live process)."""

    def __init__(self, seconds: float = REPR_BUDGET_S, tensor_stats: bool = False, max_stats_elements: int = MAX_STATS_ELEMENTS):
        self.left = seconds
        self.tensor_stats = tensor_stats
        self.max_stats_elements = max_stats_elements


def safe_repr(obj: object, budget: Budget | None = None, depth: int = 0) -> str:
    if budget is None:
        budget = Budget()
    try:
        return _cut(_repr(obj, budget, depth), MAX_REPR)
    except ReprTimeout:
        return f"<{type_name(obj)} object: repr interrupted>"
    except BaseException as exc:  # noqa: BLE001 - never let a repr escape
        return f"<{type_name(obj)} object: repr failed: {type(exc).__name__}>"


def _repr(obj: object, budget: Budget, depth: int) -> str:
    t = type(obj)
    if t is int:
        try:
            return repr(obj)
        except ValueError:  # more digits than int_max_str_digits allows
            return f"<int of {obj.bit_length()} bits>"
    if t in _SCALARS:
        return repr(obj)
    if t is str:
        if len(obj) <= MAX_STRING:
            return repr(obj)
        return f"{obj[:MAX_STRING]!r}... ({len(obj)} chars)"
    if t in (bytes, bytearray):
        if len(obj) <= MAX_STRING:
            return repr(obj)
        return f"{bytes(obj[:MAX_STRING])!r}... ({len(obj)} bytes)"
    if t in _SEQUENCES:
        if len(obj) <= MAX_ITEMS and _plain(obj):
            return repr(obj)
        if t in (list, tuple) and depth < MAX_DEPTH and _plain(obj[:MAX_ITEMS]):
            opening, closing = _SEQUENCES[t]
            head = repr(list(obj[:MAX_ITEMS]))[1:-1]
            return f"{opening}{head}, ... {len(obj) - MAX_ITEMS} more{closing} (len={len(obj)})"
        return _sequence(obj, t, budget, depth)
    if t is dict:
        if len(obj) <= MAX_ITEMS and _plain(obj) and _plain(obj.values()):
            return repr(obj)
        return _mapping(obj, budget, depth)
    summary = _array_summary(obj, t, budget.max_stats_elements if budget.tensor_stats else 0)
    if summary is not None:
        return summary
    if isinstance(obj, type):
        return type.__repr__(obj)
    if t.__repr__ is object.__repr__:
        return object.__repr__(obj)
    return _user_repr(obj, budget)


def _sequence(obj, t, budget: Budget, depth: int) -> str:
    opening, closing = _SEQUENCES[t]
    if depth >= MAX_DEPTH:
        return f"{t.__name__}(len={len(obj)})"
    items = []
    for i, item in enumerate(obj):
        if i == MAX_ITEMS:
            items.append(f"... {len(obj) - MAX_ITEMS} more")
            break
        items.append(safe_repr(item, budget, depth + 1))
    if t is tuple and len(obj) == 1:
        items[0] += ","
    body = ", ".join(items)
    suffix = f" (len={len(obj)})" if len(obj) > MAX_ITEMS else ""
    return f"{opening}{body}{closing}{suffix}"


def _mapping(obj: dict, budget: Budget, depth: int) -> str:
    if depth >= MAX_DEPTH:
        return f"dict(len={len(obj)})"
    items = []
    for i, (key, value) in enumerate(list(obj.items())[: MAX_ITEMS + 1]):
        if i == MAX_ITEMS:
            items.append(f"... {len(obj) - MAX_ITEMS} more")
            break
        items.append(f"{safe_repr(key, budget, depth + 1)}: {safe_repr(value, budget, depth + 1)}")
    suffix = f" (len={len(obj)})" if len(obj) > MAX_ITEMS else ""
    return "{" + ", ".join(items) + "}" + suffix


def _array_summary(obj: object, t: type, stats_max_elements: int = 0) -> str | None:
    """Tensors and arrays: shape, dtype and device, read from metadata only;
    with `stats_max_elements`, min/max/mean and NaN/Inf counts of CPU
    tensors up to that size."""
    module = getattr(t, "__module__", "") or ""
    root = module.split(".", 1)[0]
    if root == "torch" and hasattr(obj, "shape") and hasattr(obj, "dtype"):
        shape = tuple(obj.shape)
        device = getattr(obj, "device", "?")
        grad = ", requires_grad=True" if getattr(obj, "requires_grad", False) else ""
        extra = _tensor_stats(obj, stats_max_elements) if stats_max_elements else ""
        return f"{t.__name__}(shape={list(shape)}, dtype={obj.dtype}, device={device}{grad}{extra})"
    if root == "numpy" and t.__name__ == "ndarray":
        return f"ndarray(shape={list(obj.shape)}, dtype={obj.dtype})"
    return None


def _tensor_stats(tensor, max_elements: int) -> str:
    """", min=..., max=..., mean=..., nan=N, inf=N" for a CPU tensor of a
    real dtype and at most `max_elements` elements; "" otherwise. A GPU
    tensor would need a device sync, which a failing CUDA context may never
    finish."""
    try:
        import torch

        if tensor.device.type != "cpu" or tensor.is_sparse or tensor.numel() == 0:
            return ""
        if tensor.numel() > max_elements or tensor.dtype == torch.bool or tensor.is_complex():
            return ""
        with torch.no_grad():
            values = tensor.detach()
            if not values.is_floating_point():
                values = values.double()
            nan = int(torch.isnan(values).sum())
            inf = int(torch.isinf(values).sum())
            finite = values[torch.isfinite(values)]
            if finite.numel() == 0:
                return f", nan={nan}, inf={inf}"
            finite = finite.double()
            return (
                f", min={float(finite.min()):.6g}, max={float(finite.max()):.6g}, "
                f"mean={float(finite.mean()):.6g}, nan={nan}, inf={inf}"
            )
    except Exception:  # noqa: BLE001 - a summary never fails the record
        return ""


def _user_repr(obj: object, budget: Budget) -> str:
    if budget.left <= 0:
        return f"<{type_name(obj)} object at {id(obj):#x}>"
    started = time.monotonic()
    token = _native.arm_deadline(min(REPR_DEADLINE_S, budget.left), ReprTimeout)
    try:
        try:
            text = repr(obj)
        finally:
            _native.disarm_deadline(token)
            budget.left -= time.monotonic() - started
    except ReprTimeout:
        _native.disarm_deadline(token)
        return f"<{type_name(obj)} object: repr took longer than {REPR_DEADLINE_S}s>"
    if not isinstance(text, str):
        return f"<{type_name(obj)} object: repr returned {type(text).__name__}>"
    return text
