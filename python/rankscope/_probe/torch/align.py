"""Numbering steps alike on every rank of a job (``cluster torch ... on``).

A clock counts steps from where it started, unless the optimizer keeps a
count of its own (Adam's ``state['step']``). SGD keeps none, so two ranks
whose clocks started either side of a step boundary (one request reaching
them a moment apart) number the same step differently, and ``--every N``
samples different steps on each.

The ranks of a job already agree on one count without anything being
sent between them: how many collectives their default process group has
issued (its sequence number), which is the same on every rank at the end
of the same step. While anchors are asked for, each step boundary records
(step, that count). ``cluster torch`` finds a count every rank recorded,
and tells each rank how far to move its step number so that all give that
step the same one (``shift``). Reading the count is a local call: nothing
here makes a collective or waits on another rank.
"""

from __future__ import annotations

import collections
import sys
import time

from rankscope._probe.torch.trace import TRACER

# Boundaries recorded: enough for ranks whose clocks started this many
# steps apart to still share one.
KEEP = 256
# Anchors are recorded for this long at most: a `cluster torch` that never
# came back for them costs the program nothing after it.
FOR_S = 30.0


def _collective_count() -> int | None:
    """The default process group's sequence number, or None where the
    process is not one rank of several."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.distributed_c10d._get_default_group()
    if group.size() < 2:
        return None
    return int(group._get_sequence_number_for_group())


def _unavailable() -> str | None:
    try:
        count = _collective_count()
    except Exception as exc:  # noqa: BLE001 - a torch without sequence numbers
        return f"this torch gives no collective count ({type(exc).__name__}: {exc})"
    if count is None:
        return "this process is not one rank of an initialised torch.distributed job"
    return None


class Anchors:
    # Heard at every boundary (see `tell` in step_clock.rs).
    WHEN: dict = {}
    optimizer_pre = optimizer_post = None

    def __init__(self):
        self.ring: collections.deque = collections.deque(maxlen=KEEP)
        self.until = 0.0

    def turn_on(self) -> dict:
        why = _unavailable()
        if why is not None:
            return {"available": False, "why": why}
        with TRACER.lock:
            self.ring.clear()
            self.until = time.monotonic() + FOR_S
        TRACER.add_listener(self)
        return self.describe()

    def boundary(self, step):
        if time.monotonic() > self.until:
            TRACER.remove_listener(self, wait_s=0)
            return
        count = _collective_count()
        if count is not None:
            self.ring.append((step, count))

    def failed(self, reason: str) -> None:
        self.ring.clear()

    def listening(self) -> bool:
        return self in TRACER.listeners

    def describe(self) -> dict:
        return {"available": True, "listening": self.listening(), "anchors": [list(a) for a in list(self.ring)]}

    def shift(self, by: int) -> bool:
        """Moves the clock's step number by `by`; False where the anchors
        it was worked out from no longer hold (the clock stopped, and
        numbers its steps afresh)."""
        with TRACER.lock:
            if not self.listening() or TRACER.step is None:
                return False
            # The short way through a boundary (native, not under the lock)
            # is kept off while the number changes, as any change made from
            # outside does.
            TRACER.quiet = False
            TRACER.step = TRACER.step + by
            return True

    def done(self) -> None:
        if self.listening():
            TRACER.remove_listener(self)
        self.ring.clear()


ANCHORS = Anchors()
