"""Stand-ins for a module's ``forward``, put on the module itself (its
``__dict__``) for a sampled step and taken off after it.

Why not forward hooks: a module with any hook leaves torch's fast path in
``Module._call_impl`` for the general one (Python code that looks at every
kind of hook, for every call), and a hook's registration builds handles
and dicts. On a small MLP, a pair of hooks on each module cost about 2 us a
module call; a stand-in costs about 0.2 us, and attaching one is a dict
store. The module's ``__call__`` still runs torch's own code, which finds
the stand-in as ``self.forward``.

A stand-in must not change what the program sees:

* ``copy.deepcopy(module)`` (an EMA copy made at a sampled step) gives the
  copy its own forward, untimed, not a stand-in that would run the
  original module;
* pickling (``torch.save(module)``) saves the forward it stands in for;
* ``inspect.signature(module.forward)`` follows ``__wrapped__``, and any
  other attribute (``__self__``, ``__func__``, ``__name__``) is the inner
  forward's;
* an exception goes through untouched (the call then counts nothing).

Taking it off restores exactly what was there (an instance attribute of
the program's, such as ``torch.compile``'s ``OptimizedModule.forward``, or
nothing). Two features may stand in on one module (the trace and the NaN
watch on a model's root) and go off in any order: one under another is
taken out of the chain. Code of the program's that wrapped a stand-in in
between keeps its wrapper, which goes on calling the stand-in, a
pass-through whose counts nobody reads.
"""

from __future__ import annotations

import copy
import time

_perf = time.perf_counter_ns
_MISSING = object()


class Timed:
    """Adds each call's time (ns) and count into ``acc[at]`` and
    ``acc[at + 1]``: the step's figures are read from that one list."""

    __slots__ = ("__wrapped__", "acc", "at", "previous")

    def __init__(self, inner, acc: list, at: int):
        self.__wrapped__, self.acc, self.at = inner, acc, at
        # The module's own `forward` attribute before this one (_MISSING:
        # none; __wrapped__ is then its class's forward, bound).
        self.previous = _MISSING

    def __call__(self, *args, **kwargs):
        start = _perf()
        out = self.__wrapped__(*args, **kwargs)
        acc, at = self.acc, self.at
        acc[at] += _perf() - start
        acc[at + 1] += 1
        return out

    def __getattr__(self, name):
        return getattr(self.__wrapped__, name)

    def __deepcopy__(self, memo):
        # A bound method copies as the same function bound to the copy.
        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce_ex__(self, protocol):
        return self.__wrapped__.__reduce_ex__(protocol)

    def __repr__(self):
        return repr(self.__wrapped__)


class Tap(Timed):
    """A stand-in that also calls ``before(args, kwargs, start)`` and
    ``after(args, output)``, for the modules whose calls need more than a
    time: a model's root (its input and loss), and every module under
    ``--backward`` or on a GPU. They must not raise (they catch their own
    errors)."""

    __slots__ = ("before", "after")

    def __init__(self, inner, acc: list, at: int, before, after):
        super().__init__(inner, acc, at)
        self.before, self.after = before, after

    def __call__(self, *args, **kwargs):
        if self.before is not None:
            self.before(args, kwargs, _perf())
        # After `before`: the module's time is its own, not the probe's
        # (a GPU module's event and counters are read there).
        start = _perf()
        out = self.__wrapped__(*args, **kwargs)
        end = _perf()
        acc, at = self.acc, self.at
        acc[at] += end - start
        acc[at + 1] += 1
        if self.after is not None:
            self.after(args, out)
        return out


class Seen(Timed):
    """A stand-in that times nothing: it calls ``before(args, kwargs)`` and
    ``after(args, output)`` around each call (the NaN watch's, on every
    step: two clock reads fewer). They must not raise."""

    __slots__ = ("before", "after")

    def __init__(self, inner, before, after):
        super().__init__(inner, None, 0)
        self.before, self.after = before, after

    def __call__(self, *args, **kwargs):
        self.before(args, kwargs)
        out = self.__wrapped__(*args, **kwargs)
        self.after(args, out)
        return out


def boundary(attrs: dict) -> str:
    """The attribute a stand-in goes on: ``forward``, or, for a module
    compiled in place (``module.compile()``), the compiled call that
    ``Module.__call__`` runs instead of its own, so that the stand-in is
    outside the compiled code: a stand-in on ``forward`` would be inside
    it, where dynamo guards on it and compiles again."""
    return "_compiled_call_impl" if attrs.get("_compiled_call_impl") is not None else "forward"


def put_on(module, stand_in_of) -> tuple | None:
    """Puts ``stand_in_of(forward)`` on `module` (or of its compiled call,
    see ``boundary``); returns what ``take_off`` needs, or None where the
    module cannot take one."""
    try:
        attrs = module.__dict__
    except AttributeError:
        return None
    name = boundary(attrs)
    previous = attrs.get(name, _MISSING)
    stand_in = stand_in_of(module.forward if name == "forward" else previous)
    stand_in.previous = previous
    attrs[name] = stand_in
    return (attrs, stand_in, name)


def take_off(entry) -> None:
    attrs, stand_in, name = entry
    outer = attrs.get(name)
    if outer is stand_in:
        if stand_in.previous is _MISSING:
            attrs.pop(name, None)
        else:
            attrs[name] = stand_in.previous
        return
    # Under another stand-in: the one above takes over what this one had.
    while isinstance(outer, Timed):
        if outer.__wrapped__ is stand_in:
            outer.__wrapped__, outer.previous = stand_in.__wrapped__, stand_in.previous
            return
        outer = outer.__wrapped__


def is_stand_in(value) -> bool:
    return isinstance(value, Timed)
