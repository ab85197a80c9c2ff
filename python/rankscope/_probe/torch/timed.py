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

import weakref

from rankscope._native import StandIn

_MISSING = object()

# The stand-in itself is native (``stand_in.rs``): it runs on every module
# call of a sampled step, and on every step's root call while the NaN
# watch is armed, where a Python ``__call__`` cost a frame and the
# arguments packed again.


def timed(inner, acc: list, at: int) -> StandIn:
    """Adds each call's time (ns) and count into ``acc[at]`` and
    ``acc[at + 1]``: the step's figures are read from that one list."""
    return StandIn(inner, acc, at)


def tap(inner, acc: list, at: int, before, after) -> StandIn:
    """A timed stand-in that also calls ``before(args, kwargs, start)`` and
    ``after(args, output)``, for the modules whose calls need more than a
    time: a model's root (its input and loss), and every module under
    ``--backward`` or on a GPU. They must not raise (they catch their own
    errors). The module's time starts after ``before``: it is its own, not
    the probe's."""
    return StandIn(inner, acc, at, before, after)


def seen(inner, before, after) -> StandIn:
    """A stand-in that times nothing: it calls ``before(args, kwargs)`` and
    ``after(args, output)`` around each call (the NaN watch's, on every
    step: no clock read). They must not raise."""
    return StandIn(inner, None, 0, before, after, timing=False)


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
    module cannot take one. Neither the stand-in (see ``stand_in.rs``) nor
    what is returned keeps the module alive: a model the program drops is
    freed at once, stand-in and all."""
    try:
        attrs = module.__dict__
        module_ref = weakref.ref(module)
    except (AttributeError, TypeError):
        return None
    name = boundary(attrs)
    previous = attrs.get(name, _MISSING)
    stand_in = stand_in_of(module.forward if name == "forward" else previous)
    stand_in.previous = previous
    stand_in.owner = module
    attrs[name] = stand_in
    return (module_ref, weakref.ref(stand_in), name)


def take_off(entry) -> None:
    module_ref, stand_in_ref, name = entry
    module, stand_in = module_ref(), stand_in_ref()
    if module is None or stand_in is None:
        return  # gone with its module, or replaced by the program's own
    attrs = module.__dict__
    outer = attrs.get(name)
    if outer is stand_in:
        if stand_in.previous is _MISSING:
            attrs.pop(name, None)
        else:
            attrs[name] = stand_in.previous
        return
    # Under another stand-in: the one above takes over what this one had.
    while isinstance(outer, StandIn):
        if outer.__wrapped__ is stand_in:
            outer.__wrapped__, outer.previous = stand_in.__wrapped__, stand_in.previous
            return
        outer = outer.__wrapped__


def is_stand_in(value) -> bool:
    return isinstance(value, StandIn)
