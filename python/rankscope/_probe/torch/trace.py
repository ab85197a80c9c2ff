"""Per-module timings at sampled steps (``python.torch_trace``) and one row
per step (``python.torch_steps``).

Imported only once the program has imported torch. Three kinds of hook,
all removed when the trace goes off:

* torch's global optimizer step hooks (pre and post, native:
  ``step_clock.rs``): the post hook marks the step boundary and the pre
  hook times the optimizer. They are on for
  as long as the trace is. torch iterates those dictionaries live, so they
  are edited from a probe thread only while no thread is inside an
  optimizer step (``_native.edit_unless_running``), and from the training
  thread only where that is safe (see ``_unhook_from_post``).
* a stand-in for ``forward`` on each of the found models' modules that
  match the glob (and always on each model's root, for the step's
  figures), put on only around sampled steps, at the end of the step
  before one and taken off at its end, so an unsampled step runs the
  modules untouched. Stand-ins (``timed.py``), not forward hooks: a module
  with a hook leaves torch's fast call path, and on a small MLP the hooks
  cost ten times what the stand-ins do.
* with ``backward``: tensor hooks on each module's output (the gradient
  reaching it: its backward starts) and on its inputs that need a gradient
  (the gradient leaving it: its backward ends), registered by the
  stand-ins in a sampled step and gone with that step's graph. Module backward
  hooks (``register_full_backward_hook``) are not used: they wrap inputs
  and outputs in an autograd Function, and a module that then modifies its
  input in place (``ReLU(inplace=True)``) fails.

Nothing a hook does may reach the program: each catches everything, counts
it, and turns the trace off with the reason.
"""

from __future__ import annotations

import _thread
import collections
import os
import functools
import sys
import time
import weakref

import torch

from rankscope import _native
from rankscope._probe import memory as _timeline
from rankscope._probe.torch import models, tables, timed

_perf = time.perf_counter_ns
# How long a probe thread waits for the training thread to leave an
# optimizer step before it leaves the edit to the training thread.
EDIT_WAIT_S = 2.0
# Without an optimizer, models are looked for again at steps 1, 2, 4, ...
MAX_REDISCOVERY_INTERVAL = 1024
# The step is set at every boundary (``_native.set_step``, an atomic that
# the memory timeline's rows and a profile's samples read); the timeline's
# Python is told at most this often, a call per step being a cost of its
# own: where CUDA is in use it adds a row with CUDA's figures
# (``memory.step_row``, itself at most every 100 ms).
STEP_TOLD_NS = 20_000_000
# What a listener (the NaN watch, gradient and activation statistics) may
# hear of: optimizer_pre(optimizer, step), optimizer_post(optimizer, step)
# and boundary(step); when, see `tell` in step_clock.rs.
EVENTS = ("optimizer_pre", "optimizer_post", "boundary")
# What the step is told as once the clock stops: no step (the native side's
# i64::MIN), so that later memory rows and profile samples carry none.
NO_STEP = -(1 << 63)


class UserError(Exception):
    """A request that cannot be met, said to the user as is."""


def _ms(ns):
    return None if ns is None else ns / 1e6


class _Slot:
    """One timed module. Its calls' time and count in the step being
    sampled are in the tracer's ``acc`` at ``at`` and ``at + 1``; the rest
    is for the modules that need more than a time (GPU, ``--backward``)."""

    __slots__ = (
        "name",
        "type",
        "depth",
        "rows",
        "cuda",
        "at",
        "open_events",
        "events",
        "bwd_start",
        "bwd_end",
        "bwd_ns",
        "bwd_calls",
        "bwd_open",
        "bwd_events",
        "mem_starts",
        "alloc_delta",
        "peak_delta",
        "start_hook",
        "end_hook",
    )

    def __init__(self, name, type_name, depth, rows, cuda, at):
        self.name, self.type, self.depth, self.rows, self.cuda, self.at = name, type_name, depth, rows, cuda, at
        self.open_events: list = []
        self.mem_starts: list = []
        self.start_hook = self.end_hook = None
        self.reset()

    def reset(self):
        self.open_events.clear()
        self.mem_starts.clear()
        self.alloc_delta = self.peak_delta = 0
        self.bwd_ns = self.bwd_calls = 0
        self.events = []
        self.bwd_start = self.bwd_end = None
        # A GPU module's backward: [start event, end event] of the pass in
        # progress, and the pairs of the passes done.
        self.bwd_open = None
        self.bwd_events = []


capturing = tables.capturing


def _module_device(module, model_device):
    """The GPU a module's figures are read on: that of its own first
    parameter (a model split over GPUs in one process, as Hugging Face's
    ``device_map="auto"`` does, has modules on several), else its model's.
    A module on the CPU inside a GPU model has none."""
    if model_device is None:
        return None
    first = next(module.parameters(), None)
    if first is None:
        return model_device
    return first.device if first.is_cuda else None


# Timing events already read, for reuse, per device index (an event is
# recorded only on its own device's streams): on an H100 a new event's
# making, recording and freeing took 14 us, recording a kept one 3 us.
_spare_events: dict = {}
SPARE_EVENTS = 4096
# The current stream's torch object by (stream id, device index, device
# type): torch.cuda.current_stream() makes a new one each call (7 us).
_streams: dict = {}


def _cuda_event(device=None):
    """A timing event on `device`'s current stream: a rank whose model is
    on cuda:1 while its current device is cuda:0 (DDP without
    ``set_device``) times its own work, not device 0's idle stream."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    try:
        event = _spare_events[index].pop()
    except (KeyError, IndexError):
        event = torch.cuda.Event(enable_timing=True)
    key = torch._C._cuda_getCurrentStream(index)
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= 64:  # a program that makes a stream per step
            _streams.clear()
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    event.record(stream)
    return event


def _spare(events):
    """Events whose times were read, kept for `_cuda_event`."""
    for event in events:
        spare = _spare_events.setdefault(event.device.index, [])
        if len(spare) < SPARE_EVENTS:
            spare.append(event)


def _allocated(device):
    """The caching allocator's (allocated, peak allocated) bytes on
    `device`: host-side reads, no device sync. One read of the nested
    counters: ``memory_allocated()`` and ``max_memory_allocated()`` each
    flatten and sort all of them (about 40 us a call)."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    try:
        counters = torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]
        return counters["current"], counters["peak"]
    except (AttributeError, KeyError, TypeError):
        return torch.cuda.memory_allocated(index), torch.cuda.max_memory_allocated(index)


def _memory_start(slot):
    slot.mem_starts.append(_allocated(slot.cuda))


def _memory_end(slot):
    """Allocated and peak deltas of one call. torch's peak counter is never
    reset (a program that logs it would see the reset), so the peak is exact
    when the call set a new one, and otherwise the most the counters can show:
    what the call left allocated above its start."""
    if not slot.mem_starts:
        return
    allocated, peak = slot.mem_starts.pop()
    now, now_peak = _allocated(slot.cuda)
    slot.alloc_delta += now - allocated
    rise = now_peak - allocated if now_peak > peak else now - allocated
    if rise > slot.peak_delta:
        slot.peak_delta = rise


def _gpu_ms(pairs):
    """Resolver: the pairs' summed elapsed time once all have completed."""

    def resolve():
        if not all(end.query() for _, end in pairs):
            raise LookupError("not yet")
        total = sum(start.elapsed_time(end) for start, end in pairs)
        # Each pair is in this row alone (the NaN replay's are dropped).
        _spare(event for pair in pairs for event in pair)
        return total

    return resolve


_PLAIN = (torch.Tensor, torch.nn.Parameter)

_ZERO_GRAD_WATCHED = "_rankscope_zero_grad_watched"


def _zero_grad_stand_in(tracer, own, of_optimizer):
    """`zero_grad` as the class had it, the step clock told first (the
    usual step's call passes through natively: `StepClock.zero_grad_call`)."""

    call = tracer.zero_grad_call

    @functools.wraps(own)
    def zero_grad(self, *args, **kwargs):
        # Compiling first: dynamo folds it, and traces nothing of ours.
        if _compiling():
            return own(self, *args, **kwargs)
        return call(own, self, of_optimizer, args, kwargs)

    setattr(zero_grad, _ZERO_GRAD_WATCHED, own)
    return zero_grad


def _divisor(grad_fn, made_by):
    """What a loss made by dividing by a number (``loss / accum``, or
    ``loss * (1 / accum)``) was divided by; None for any other product or
    quotient (by a tensor that trains, or by more than one number)."""
    other = getattr(grad_fn, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.numel() != 1 or other.requires_grad or other.is_cuda:
        return None
    value = float(other)
    if made_by == "MulBackward0":
        value = 1 / value if value else 0.0
    rounded = round(value)
    # Only a whole number can be a count of micro-batches.
    return rounded if rounded >= 1 and abs(value - rounded) < 1e-6 * rounded else None


def _local(tensor):
    """A DTensor's own shard (an FSDP2 or tensor-parallel parameter, its
    gradient, a sharded output); any other tensor as it is. The probe reads
    values through this: a DTensor's reductions are partial, and reading
    one (``.item()``, ``.tolist()``) all-reduces it, a collective the
    program never made (one rank alone making it hangs the job)."""
    if type(tensor) in _PLAIN:
        return tensor  # (a missing attribute's lookup raises inside: a microsecond a tensor)
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


# How deep `_tensors` looks into containers: an LSTM's `(out, (h, c))` is
# two, a dataclass holding a dict of tuples three.
TENSORS_DEPTH = 4


def _tensors(value, depth=0):
    """The tensors in a module's output or inputs: in tuples, lists, dicts
    (a Hugging Face output is one) and dataclasses, nested. Read by type
    and plain attribute access only, so no proxy's ``__getattr__`` runs."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if depth >= TENSORS_DEPTH:
        return
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        fields = getattr(type(value), "__dataclass_fields__", None)
        if not isinstance(fields, dict):
            return
        items = []
        for name in fields:
            try:
                items.append(object.__getattribute__(value, name))
            except AttributeError:  # an InitVar, or a field not set
                pass
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list, dict)) or hasattr(type(item), "__dataclass_fields__"):
            yield from _tensors(item, depth + 1)


# A sampled step on a GPU keeps this many losses' copies at most.
MAX_LOSSES = 1024


_LOSS_WATCHED = "_rankscope_loss_watched"
# Whether dynamo is tracing the code that asks (torch 2.3 on; an older
# torch's stand-ins are traced as they are).
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def _scalar_loss(output):
    """The loss in a root module's output: a 0-dim floating tensor, or the
    ``loss`` of a model output that carries one (Hugging Face's)."""
    if isinstance(output, torch.Tensor):
        candidate = output
    elif isinstance(output, dict):
        candidate = output.get("loss")
    else:
        candidate = getattr(output, "loss", None)
    if isinstance(candidate, torch.Tensor) and candidate.dim() == 0 and candidate.is_floating_point():
        return candidate
    return None


def _step_wrapper_code():
    """The code of the wrapper torch puts around every optimizer's step:
    a thread with a frame of it may be iterating the global hooks."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    for const in getattr(getattr(wrap, "__code__", None), "co_consts", ()):
        if getattr(const, "co_name", None) == "wrapper":
            return const
    return None


class Tracer(_native.StepClock):
    """The step clock (the optimizer's step hooks, or ``rankscope.step()``)
    and the trace. The clock runs while the trace or any other feature
    (``listeners``: the NaN watch, gradient and activation statistics)
    needs steps; ``on`` says whether it runs, ``tracing`` whether the trace
    is on.

    The clock's state (``on``, ``quiet``, ``tracing``, ``every``, ``step``,
    ``last_end``, ``step_told``, ``opt_start``, ``opt_ns``, ``opt_calls``,
    ``marker``, ``primary``, ``told``) lives in the native base class, with
    the hooks torch calls at every step and the short way through a step
    boundary (``step_clock.rs``); the rest is here."""

    def __init__(self):
        self.lock = _thread.RLock()
        # Turning features on or off may hold it when the program forks: free in the child.
        os.register_at_fork(after_in_child=self.lock._at_fork_reinit)
        self.on = False
        self.tracing = False
        # Features that hear of each optimizer step and step boundary:
        # objects with a method (or None) for each of EVENTS, and failed(reason).
        self.listeners: list = []
        # Stand-ins on `zero_grad` while the clock runs: (class, its own, ours).
        self.zero_grads: list = []
        # Per owner of a zero_grad: (weakref, step, its sentinel gradient's
        # id and version just after it cleared them); see `_skipped`.
        self.zero_marks: dict = {}
        # The NaN watch, armed: told at each zero_grad before a step ends there.
        self.zero_grad_watch = None
        # Each event's (listener, its bound method, when), made when the
        # listeners change: a listener that has no use for an event sets it
        # to None and is not called for it (see `tell`, step_clock.rs).
        self.told: dict = {event: () for event in EVENTS}
        self.every, self.glob, self.backward = 1, "*", False
        self.models: list = []  # weakrefs to root modules
        self.losses: list = []  # weakrefs to loss modules
        self.known_optimizers: weakref.WeakSet = weakref.WeakSet()
        self.plan: list = []  # (module weakref, name, type, depth, rows, is_root, cuda)
        self.prepared = None  # (plan, what _attach puts on for it): see _prepare
        self.replan = False  # the plan to be made again at the next boundary (`take_off_plain`)
        # The short way through a step boundary (set by the long way, under
        # the lock, and cleared by every change made from outside).
        self.quiet = False
        self.primary = None  # weakref to the optimizer whose step ends a step
        self.marker = None
        self.step = None  # the step in progress
        # Where the clock's step numbers come from: "start" (the program's
        # first step is 0), "optimizer" (its own count) or "clock" (counted
        # from the clock's first boundary: SGD keeps no count).
        self.numbered = None
        self.last_end = None
        self.step_told = 0
        self.sampling = False  # stand-ins are on for the step in progress
        self.sampled_steps = 0
        # A stand-in on `torch.Tensor.backward` (class, its own, ours), put
        # on where a sampled step's root gave no loss and no loss module is
        # known: the loss is then what the program calls backward on.
        self.backward_watch = None
        self.grad_scaler = None  # weakref to the program's GradScaler, or False: none found
        self.slots: list = []
        self.hooked = 0  # slots with a stand-in on now
        self.full: list = []  # the slots with more than a time to reset each step
        # Each slot's calls' ns and count in the sampled step, side by side.
        self.acc: list = []
        self.zeros: list = []
        self.plan_id = None  # the store's copy of the rows' fixed cells (_native.trace_plan)
        self.plan_fixed = None
        self.handles: list = []  # what timed.take_off needs, one per stand-in
        self.opt_hooks = None  # [(pre dict, id) or None, (post dict, id) or None]
        self.errors = 0
        self.disabled = None
        self.next_rediscovery = 1
        self.partial = True
        # Set while RANKSCOPE_TORCH turns features on as the program
        # imports torch: no step can be in progress then.
        self.before_first_step = False
        self._reset_step()
        self.wire(tables, _timeline.step_row, STEP_TOLD_NS)

    def _reset_step(self):
        self.first_fwd = self.pass_start = self.opt_start = None
        self.fwd_ns = self.bwd_ns = self.opt_ns = self.opt_calls = self.samples = 0
        self.loss = self.loss_event = None
        self.loss_n = None  # (how many, their sum) where `loss` is their mean, a float
        self.loss_trained = False  # `loss` is of losses that need grad
        self.samples_trained = False  # `samples` counts calls made with grad
        # What every loss taken at backward was divided by, alike for all
        # (None: none divided; False: not alike), and whether a loss
        # module's trained loss waits for its backward.
        self.loss_divisor = None
        self.module_loss = False
        # Under gradient accumulation the step waits for data before each
        # micro-batch: from a backward's end to the next forward, summed
        # (`between`, ns). `output_loss`: the model returned the step's
        # loss, which its backward must not add again.
        self.between = 0
        self.backward_done = None
        self.output_loss = False

    # ---- turning on and off (probe thread, or the env at torch's import)

    def turn_on(self, every: int, glob: str, backward: bool, wait_s: float = EDIT_WAIT_S) -> dict:
        if every < 1:
            raise UserError(f"--every must be 1 or more, not {every}")
        # Before the plan: code of the program's that dynamo compiled
        # already keeps stand-ins off plain modules (models.hold).
        models.hold(self.take_off_plain)
        try:
            return self._turn_on(every, glob, backward, wait_s)
        except BaseException:
            if not self.tracing:
                models.release(self.take_off_plain)
            raise

    def _turn_on(self, every: int, glob: str, backward: bool, wait_s: float) -> dict:
        with self.lock:
            self.quiet = False
            found, optimizers, losses = models.discover()
            self._adopt(found, optimizers, losses)
            # A request refused leaves the running trace as it was.
            was = self.every, self.glob, self.backward
            self.every, self.glob, self.backward = every, glob, backward
            names: list = []
            plan = self._plan(names)
            if found and not any(rows for _, _, _, _, rows, _, _ in plan):
                self.every, self.glob, self.backward = was
                raise UserError(models.no_match(glob, names, found))
            self.plan = plan
            # A new setting takes effect at the next step boundary; the step
            # in progress was not seen whole, so it gets no row (none is in
            # progress before the first: see `before_first_step`).
            self._detach()
            self.partial = not self.before_first_step
            self.tracing = True
            self.disabled = None
        # The step rows are kept natively and taken by the store's thread:
        # the last second's reach the disk at a clean exit too.
        tables._flush_at_exit_once()
        installed = self._start_clock(wait_s)
        return {"models": len(found), "modules": self._traced_modules(), "optimizer_hooks": installed}

    def _traced_modules(self) -> int:
        """The modules the trace gives rows for (what `trace on`, `trace
        off` and "timed now" count: not the root kept for the step's
        figures alone, nor a loss module)."""
        return sum(1 for ref, _, _, _, rows, _, _ in self.plan if rows and ref() is not None)

    def _start_clock(self, wait_s) -> bool:
        with self.lock:
            self.quiet = False
            if not self.on:
                # What the clock counted when it last ran is stale: the
                # first boundary numbers the steps afresh. Started before
                # the program's first step, that step is seen whole, and
                # is step 0.
                self.partial = not self.before_first_step
                self.step = 0 if self.before_first_step else None
                self.numbered = "start" if self.before_first_step else None
                self.last_end = None
            self.on = True
        installed = self._install_optimizer_hooks(wait_s)
        self._watch_zero_grad()
        import rankscope

        rankscope._step_hook = self.mark_step
        return installed

    def add_listener(self, listener, wait_s: float = EDIT_WAIT_S) -> bool:
        """Starts the clock for `listener` (once); True when the optimizer
        hooks are in."""
        with self.lock:
            self.quiet = False
            if not self.models:
                found, optimizers, losses = models.discover()
                self._adopt(found, optimizers, losses)
                self.plan = self._plan()
            if listener not in self.listeners:
                self.listeners.append(listener)
                self._listened()
        return self._start_clock(wait_s)

    def remove_listener(self, listener, wait_s: float = EDIT_WAIT_S) -> None:
        with self.lock:
            self.quiet = False
            if listener in self.listeners:
                self.listeners.remove(listener)
                self._listened()
            idle = not self.tracing and not self.listeners
        if idle:
            self._stop_clock(wait_s)

    def _renumber(self) -> None:
        """An optimizer that steps more often than the one that marked
        steps marks them now (``weigh`` in step_clock.rs): the next
        boundary numbers them from its count, as a clock started at it
        would have, and the step in progress, not seen whole by that
        marker, gets no row."""
        with self.lock:
            self.quiet = False
            self.partial = True
            self.numbered = None

    def _closure_step(self, optimizer, args, kwargs):
        """An optimizer step's arguments with its closure wrapped by the
        NaN watch (see NanWatch.closure_step), or None to leave them."""
        from rankscope._probe.torch.nan import WATCH

        return WATCH.closure_step(optimizer, args, kwargs)

    def current_step(self, optimizer=None) -> int:
        """The step in progress: the clock's, or before its first boundary
        the optimizer's own count (steps are numbered from 0)."""
        if self.step is not None:
            return self.step
        completed = models.completed_steps(optimizer) if optimizer is not None else None
        return completed or 0

    def _listened(self) -> None:
        # Under the lock. A new dict: the training thread reads it without one.
        told = {}
        for event in EVENTS:
            entries = []
            for listener in self.listeners:
                call = getattr(listener, event, None)
                if call is not None:
                    entries.append((listener, call, getattr(listener, "WHEN", {}).get(event)))
            told[event] = tuple(entries)
        self.told = told

    def _listener_failed(self, listener, call, exc) -> None:
        """A listener's call raised: that feature goes off, the others and
        the program go on."""
        try:
            self.remove_listener(listener, wait_s=0)
            listener.failed(f"{getattr(call, '__name__', 'a step hook')} failed: {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001
            pass

    def turn_off(self, reason: str | None = None, wait_s: float = EDIT_WAIT_S) -> dict:
        with self.lock:
            self.quiet = False
            was_on = self.tracing
            self.tracing = False
            if reason is not None:
                self.disabled = reason
            removed = self._traced_modules() if was_on else 0
            self._detach()
            self.lean_clear()
            self._unwatch_backward()
            models.release(self.take_off_plain)
            idle = not self.listeners
        done = self._stop_clock(wait_s) if idle else True
        try:
            tables.flush()
        except Exception:  # noqa: BLE001 - the rows stay for the next hand-over
            pass
        return {"was_on": was_on, "modules_restored": removed, "optimizer_hooks_removed": done}

    def _stop_clock(self, wait_s) -> bool:
        try:
            tables.flush()
        except Exception:  # noqa: BLE001 - the rows stay for the next hand-over
            pass
        with self.lock:
            self.quiet = False
            self.on = False
            import rankscope

            if getattr(rankscope, "_step_hook", None) == self.mark_step:
                rankscope._step_hook = None
        _native.set_step(NO_STEP)
        self.step_told = 0
        self._unwatch_zero_grad()
        self.zero_marks.clear()
        return self._remove_optimizer_hooks(wait_s)

    def _fail(self, where: str, exc: BaseException) -> None:
        try:
            self.errors += 1
            self.turn_off(f"{where} failed: {type(exc).__name__}: {exc}", wait_s=0)
        except Exception:  # noqa: BLE001 - nothing may reach the program
            self.quiet = self.on = False

    def _edit_optimizer_hooks(self, sets, dels, wait_s) -> bool:
        from rankscope import _native

        code = _step_wrapper_code()
        deadline = time.monotonic() + wait_s
        while True:
            if _native.edit_unless_running(sys._current_frames, code, sets, dels):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _install_optimizer_hooks(self, wait_s) -> bool:
        if self.opt_hooks is not None and all(self.opt_hooks):
            return True
        self._remove_optimizer_hooks(wait_s)
        if self.opt_hooks is not None:
            return False
        # What register_optimizer_step_{pre,post}_hook do, made atomically.
        from torch.optim import optimizer as opt_module
        from torch.utils.hooks import RemovableHandle

        pre_dict, post_dict = opt_module._global_optimizer_pre_hooks, opt_module._global_optimizer_post_hooks
        pre, post = RemovableHandle(pre_dict), RemovableHandle(post_dict)
        sets = [(pre_dict, pre.id, self.pre), (post_dict, post.id, self.post)]
        if not self._edit_optimizer_hooks(sets, [], wait_s):
            return False
        self.opt_hooks = [(pre_dict, pre.id), (post_dict, post.id)]
        return True

    def _remove_optimizer_hooks(self, wait_s) -> bool:
        hooks = self.opt_hooks
        if hooks is None:
            return True
        if self._edit_optimizer_hooks([], [entry for entry in hooks if entry is not None], wait_s):
            self.opt_hooks = None
            return True
        return False  # the post hook takes them off at the end of the step

    def _unhook_from_post(self):
        """Called by the post hook while torch iterates the global post
        hooks: the pre hooks are not being iterated (safe to edit), and the
        post hook may remove itself only as the last entry of an
        OrderedDict (its iterator then has nothing left to check)."""
        hooks = self.opt_hooks
        if hooks is None:
            return
        pre, post = hooks
        if pre is not None:
            pre[0].pop(pre[1], None)
            hooks[0] = None
        if post is not None:
            post_dict, key = post
            if type(post_dict) is collections.OrderedDict and next(reversed(post_dict), None) == key:
                del post_dict[key]
                hooks[1] = None
        if not any(hooks):
            self.opt_hooks = None

    # ---- what the trace is about

    def _adopt(self, found, optimizers, losses):
        self.models = [weakref.ref(m) for m in found]
        self.losses = [weakref.ref(m) for m in losses]
        for opt in optimizers:
            self.known_optimizers.add(opt)

    def _matches(self, name: str) -> bool:
        if self.glob in ("*", ""):
            return True
        import fnmatch

        return fnmatch.fnmatchcase(name, self.glob)

    def _plan(self, names: list | None = None) -> list:
        """The modules a sampled step puts stand-ins on; `names`, where
        given, gets every name the glob was matched against."""
        plan = []
        for ref in self.models:
            model = ref()
            if model is None:
                continue
            first = next(model.parameters(), None)
            # The device its GPU figures are read on (None: a CPU model).
            cuda = first.device if first is not None and first.is_cuda else None
            for name, module in models.outside_compiled(model):
                qualified = models.qualified(model, name)
                if names is not None:
                    names.append(qualified)
                # (A glob may leave out the model's label.)
                rows = self._matches(qualified) or (name != "" and name != qualified and self._matches(name))
                if rows or name == "":
                    depth = 0 if name == "" else name.count(".") + 1
                    plan.append((weakref.ref(module), qualified, type(module).__name__, depth, rows, name == "",
                                 cuda if name == "" else _module_device(module, cuda)))
        return plan

    def _rediscover(self):
        found, optimizers, losses = models.discover()
        self._adopt(found, optimizers, losses)
        self.plan = self._plan()
        if self.handles:
            self._detach()

    def held(self) -> tuple:
        """The sampled step's figures as they are now, for `restore`: the
        NaN watch's replay runs the model inside a step the trace may be
        sampling, and must leave no time, call, sample, loss or GPU event
        in its rows."""
        slots = [
            (slot, list(slot.open_events), list(slot.events), list(slot.mem_starts), slot.alloc_delta,
             slot.peak_delta, slot.bwd_ns, slot.bwd_calls, slot.bwd_start, slot.bwd_end,
             None if slot.bwd_open is None else list(slot.bwd_open), list(slot.bwd_events))
            for slot in self.full
        ]
        loss, event = self.loss, self.loss_event
        return (list(self.acc), self.first_fwd, self.pass_start, self.fwd_ns, self.bwd_ns, self.samples,
                list(loss) if type(loss) is list else loss, list(event) if type(event) is list else event,
                self.loss_n, self.loss_trained, self.samples_trained, self.loss_divisor, self.module_loss,
                self.between, self.backward_done, self.output_loss, slots)

    def restore(self, held: tuple) -> None:
        (acc, self.first_fwd, self.pass_start, self.fwd_ns, self.bwd_ns, self.samples, self.loss, self.loss_event, self.loss_n,
         self.loss_trained, self.samples_trained, self.loss_divisor, self.module_loss,
         self.between, self.backward_done, self.output_loss, slots) = held
        if len(acc) == len(self.acc):
            self.acc[:] = acc
        for slot, open_events, events, mem_starts, *rest in slots:
            slot.open_events[:] = open_events
            slot.events = events
            slot.mem_starts[:] = mem_starts
            (slot.alloc_delta, slot.peak_delta, slot.bwd_ns, slot.bwd_calls, slot.bwd_start, slot.bwd_end,
             slot.bwd_open, slot.bwd_events) = rest

    def live_models(self) -> list:
        return [m for m in (ref() for ref in self.models) if m is not None]

    # ---- the step boundary (training thread)

    def mark_step(self):
        """``rankscope.step()``: the end of a step, for programs whose
        optimizer does not mark it; once called, it alone marks steps."""
        try:
            now = _perf()
            self.marker = "rankscope.step()"
            self.boundary(now, None, False)
            if self.last_end == now:
                # As at the optimizer's post hook: the probe's own work at
                # the boundary is in no step's time.
                self.last_end = _perf()
        except Exception as exc:  # noqa: BLE001
            self._fail("rankscope.step()", exc)

    # ---- a step the program skipped (training thread)

    def _watch_zero_grad(self):
        """Stand-ins for `Optimizer.zero_grad` and `Module.zero_grad`, on
        the class while the clock runs (nothing is added to the program's
        objects). A step whose optimizer step the program skipped (a
        GradScaler that found an overflow, a trainer that skips a
        non-finite loss) has no boundary at an optimizer hook: it ends
        where the program clears the gradients it made (`_skipped`), so
        that it is a step of its own, numbered as the program counts its
        iterations, not a part of the next. The NaN watch checks such a
        step's gradients there first (`zero_grad_watch`)."""
        optim = sys.modules.get("torch.optim")
        for owner, of_optimizer in ((getattr(optim, "Optimizer", None), True), (torch.nn.Module, False)):
            if not isinstance(owner, type):
                continue
            own = owner.__dict__.get("zero_grad")
            if own is None or getattr(own, _ZERO_GRAD_WATCHED, None) is not None:
                continue
            stand_in = _zero_grad_stand_in(self, own, of_optimizer)
            setattr(owner, "zero_grad", stand_in)
            self.zero_grads.append((owner, own, stand_in))

    def _unwatch_zero_grad(self):
        watched, self.zero_grads = self.zero_grads, []
        for owner, own, stand_in in watched:
            # Only where it is still ours: a program that replaced it since
            # keeps its own (ours then passes the call through).
            if owner.__dict__.get("zero_grad") is stand_in:
                setattr(owner, "zero_grad", own)

    def _zero_grad(self, own, owner, of_optimizer, args, kwargs):
        watch = self.zero_grad_watch
        step, primary = self.step, self.primary
        mark = self.zero_marks.get(id(owner))
        # The usual step: a boundary came since this owner's last zero_grad
        # (its mark is of an earlier step), so no step can end here. (The
        # stand-in itself takes this way where no NaN watch is armed.)
        usual = mark is not None and mark[1] != step and mark[0]() is owner
        known = None
        try:
            if watch is not None:
                known = watch.before_zero_grad(owner, of_optimizer)
            if not usual and self._skipped(owner, of_optimizer):
                self.boundary(_perf(), None, False)
                step = self.step
        except Exception as exc:  # noqa: BLE001
            self._fail("the step clock at zero_grad", exc)
        out = own(owner, *args, **kwargs)
        try:
            if watch is not None:
                watch.after_zero_grad(known, args, kwargs)
            if not self.on:
                return out
            if usual and mark[2] is primary and not args and kwargs.get("set_to_none", True):
                # Cleared to None, the owner the same: no gradient to read.
                self.zero_marks[id(owner)] = (mark[0], step, primary, None, None)
                return out
            sentinel = self._sentinel_grad(owner, of_optimizer)
            if sentinel is not None:
                if len(self.zero_marks) >= 64:
                    self.zero_marks.clear()
                self.zero_marks[id(owner)] = (weakref.ref(owner), step, primary, *sentinel)
        except Exception as exc:  # noqa: BLE001
            self._fail("the step clock at zero_grad", exc)
        return out

    def _sentinel_grad(self, owner, of_optimizer):
        """(id, version) of the gradient of the owner's first parameter
        ((None, None): none now); None for an owner other than the
        optimizer whose step ends a step (the primary, where one has
        stepped), or the model where
        the clock knows one only (not a GAN's, whose two models' gradients
        come from each other's backward, nor a submodule's own call)."""
        if of_optimizer:
            primary = self.primary() if self.primary is not None else None
            if primary is not None and primary is not owner:
                return None  # (none yet: no optimizer has stepped, as a GradScaler's first skips)
            groups = owner.param_groups
            param = groups[0]["params"][0] if groups and groups[0]["params"] else None
        elif len(self.models) == 1 and self.models[0]() is owner:
            param = next(owner.parameters(), None)
        else:
            return None
        if param is None:
            return None
        grad = param.grad
        return (None, None) if grad is None else (id(grad), grad._version)

    def _skipped(self, owner, of_optimizer) -> bool:
        """Whether this zero_grad clears gradients that a backward made
        since the owner's last zero_grad, with no step boundary since: no
        optimizer step used them, and the step ends here."""
        if not self.on or self.partial or self.step is None or self.marker == "rankscope.step()":
            return False
        if self.opt_start is not None:
            return False  # inside an optimizer step: a closure's (LBFGS calls it again and again)
        mark = self.zero_marks.get(id(owner))
        if mark is None and self.numbered == "start" and self.step == 0:
            # The program's first step, the clock on since before it: no
            # gradient was made before it.
            mark = (lambda: owner, 0, self.primary, None, None)
        # (A primary that changed since, as the clock learns which of two
        # optimizers ends the step, left a step uncounted: not a skip.)
        if mark is None or mark[0]() is not owner or mark[1] != self.step or mark[2] is not self.primary:
            return False
        now = self._sentinel_grad(owner, of_optimizer)
        return now is not None and now[0] is not None and now != mark[3:]

    def _boundary(self, now, optimizer, unknown_optimizer):
        """The long way through a step boundary; the short way, taken while
        `quiet`, is ``boundary_at`` in step_clock.rs."""
        with self.lock:
            self.quiet = False
            if not self.on:
                return
            if self.replan:
                # Compiled modules only from here on (`take_off_plain`).
                self.replan = False
                self.plan = self._plan()
            if unknown_optimizer:
                self._rediscover()
            elif not self.models and self.step is not None and self.step >= self.next_rediscovery:
                self.next_rediscovery = self.step + min(max(1, self.step), MAX_REDISCOVERY_INTERVAL)
                self._rediscover()
            elif any(ref() is None for ref in self.models):
                # A model the program dropped, maybe for another (an
                # inference loop that swaps its model, with no optimizer to
                # show the new one).
                self._rediscover()
            completed = None
            if self.partial:
                # The step in progress was not seen whole: no row. Its
                # number is the optimizer's own count where it keeps one,
                # so that a trace turned on at different times on two
                # ranks numbers their steps alike; counted from here on.
                # Only where the clock starts, or a new marker takes over
                # (`_renumber`): a `trace on` while the clock runs (for the
                # NaN watch, or an earlier `trace on`) keeps its numbers,
                # which an optimizer made mid-run (a fine-tuning phase's)
                # would have sent back over steps already numbered.
                if self.numbered is None:
                    completed = models.completed_steps(optimizer) if optimizer is not None else None
                    self.numbered = "clock" if completed is None else "optimizer"
            elif self.step is not None and self.tracing:
                self._finish_step(now)
            if tables.waiting:
                # Rows whose GPU values have arrived (also after `trace off`,
                # while a listener keeps the clock): `quiet` waits for none.
                tables.resolve_pending()
            self.partial = False
            if completed is None:
                completed = 1 if self.step is None else self.step + 1
            self.step = completed
            _native.set_step(completed)  # (what a profile's samples are tagged with)
            if now - self.step_told >= STEP_TOLD_NS:
                self.step_told = now
                _timeline.step_row(now)
            self.last_end = now
            self._reset_step()
            if self.tracing and self.step % self.every == 0:
                if self.handles:
                    self.acc[:] = self.zeros
                    for slot in self.full:
                        slot.reset()
                else:
                    self._attach()
                self.sampling = bool(self.handles)
            elif self.handles or self.sampling:
                self._detach()
            # Whether the next boundary may take the short way: the clock
            # settled, its models known, no stand-in on, no row waiting for
            # a GPU. Anything that changes one of these from a probe thread
            # clears it.
            self.quiet = (
                self.on
                and (self.tracing or bool(self.listeners))
                and not self.partial
                and (not self.handles or self.handles is self.lean_handles)
                and bool(self.models)
                and self.step is not None
                and self.last_end is not None
                and not tables.waiting
            )
        # Each listener's `boundary(step)`, where its WHEN lets it: see
        # `tell` (step_clock.rs), which says when a listener is called.
        self.tell("boundary", self.step)
        tables.hand_over_if_due(now)

    def _finish_step(self, now):
        wall = time.time()
        step, sampled = self.step, self.sampling
        duration = now - self.last_end if self.last_end is not None else None
        row = [wall, step, sampled, _ms(duration), None, None, None, _ms(self.opt_ns) if self.opt_calls else None, None, None, None]
        if sampled:
            self.sampled_steps += 1
            acc = self.acc
            if self.first_fwd is not None and self.last_end is not None:
                row[4] = _ms(self.first_fwd - self.last_end + self.between)
            roots = [slot.at for slot in self.slots if slot.depth == 0]
            if any(acc[at + 1] for at in roots):
                row[5] = _ms(sum(acc[at] for at in roots))
            if self.backward and self.bwd_ns:
                row[6] = _ms(self.bwd_ns)
            pending = self._loss_into(row, 8)
            if self.samples:
                row[9] = self.samples
                if duration:
                    row[10] = self.samples / (duration / 1e9)
            self._trace_rows(wall, step)
        else:
            pending = ()
        tables.append("torch_steps", row, pending)

    def _loss_into(self, row, index):
        """Puts the loss in `row` now (CPU), or returns how to read it
        later without a device sync (CUDA)."""
        loss, events = self.loss, self.loss_event
        if loss is None or (self.samples_trained and not self.loss_trained):
            # (A validation loss, in a step that trained on a loss not seen.)
            return ()
        # Under gradient accumulation a program that divides each micro-
        # batch's loss by their number backs the parts of the batch's
        # loss: their sum, the mean of the losses as a loss module gives.
        taken = len(loss) if type(loss) is list else (self.loss_n[0] if self.loss_n else 1)
        undo = taken if self.loss_divisor and self.loss_divisor == taken else 1
        if events is None:
            row[index] = float(loss) * undo
            return ()

        def resolve():
            # The host copies, once their copies' events have passed.
            if not all(event.query() for event in events):
                raise LookupError("not yet")
            total = 0.0
            for copy in loss:
                total += float(copy)
            return total / len(loss) * undo

        return [(index, resolve)]

    def _trace_rows(self, wall, step):
        acc = self.acc
        if self.plan_id is not None:
            # The forward rows of the modules on a CPU: made by the store
            # from a copy of the counters.
            tables.post_trace(self.plan_id, (wall, step, acc[:]))
        whole = []  # handed over in one call
        for slot in self.full:
            if not slot.rows:
                continue
            calls = acc[slot.at + 1]
            if calls and slot.cuda is not None:
                row = [wall, step, slot.name, slot.type, slot.depth, "forward", calls, acc[slot.at] / 1e6, None, None, None]
                row[9], row[10] = slot.alloc_delta / 2**20, slot.peak_delta / 2**20
                if slot.events:
                    tables.append("torch_trace", row, [(8, _gpu_ms(slot.events))])
                else:
                    whole.append(row)
            if slot.bwd_calls:
                row = [wall, step, slot.name, slot.type, slot.depth, "backward", slot.bwd_calls, _ms(slot.bwd_ns), None, None, None]
                if slot.bwd_events:
                    tables.append("torch_trace", row, [(8, _gpu_ms(slot.bwd_events))])
                else:
                    whole.append(row)
        tables.extend("torch_trace", whole)

    # ---- the stand-ins, around sampled steps only

    def _attach(self):
        self._detach()
        prepared = self.prepared
        if prepared is None or prepared[0] is not self.plan:
            prepared = self.prepared = (self.plan, *self._prepare())
        _, entries, slots, full, acc, zeros, fixed = prepared
        handles, hooked = [], 0
        try:
            acc[:] = zeros
            for slot in full:
                slot.reset()
            for ref, stand_in_of, traced in entries:
                module = ref()
                if module is not None:
                    entry = timed.put_on(module, stand_in_of)
                    if entry is not None:
                        handles.append(entry)
                        hooked += traced
        finally:
            self.hooked = hooked
            self.slots, self.handles, self.full = slots, handles, full
            self.acc, self.zeros = acc, zeros
            if handles:
                models.hold(self.take_off_plain)
            if fixed != self.plan_fixed:
                # The same modules as at the last sampled step keep their
                # plan (the store keeps a few; rows wait for it in the outbox).
                self.plan_fixed = fixed
                self.plan_id = _native.trace_plan(fixed) if any(fixed) else None
        self._hand_to_short_way(entries, handles)

    def _hand_to_short_way(self, entries, handles):
        """Where every stand-in just put on sits on its module's own
        forward, nothing under it, and a sampled step needs only their
        times: the short way puts these same stand-ins on and takes them
        off from now on (``Lean``, step_clock.rs)."""
        stand_ins = [entry[1]() for entry in handles]
        if (
            len(handles) == len(entries)
            and handles
            and not self.full
            and not self.backward
            and self.plan_id is not None
            and all(name == "forward" and s is not None and s.previous is timed._MISSING for (_, _, name), s in zip(handles, stand_ins))
        ):
            roots = [slot.at for slot in self.slots if slot.depth == 0]
            pairs = [(entry[0], s) for entry, s in zip(handles, stand_ins)]
            self.lean_set((self.plan, handles, pairs, self.acc, self.zeros, roots, self.plan_id))
        else:
            self.lean_clear()

    def _prepare(self):
        """What each sampled step of this plan puts on: made once per plan,
        since making it at every sampled step cost more than the step's own
        timing. The stand-ins themselves are made anew at each attach, so
        that nothing here holds a module (the plan's references are weak)."""
        entries, slots, full = [], [], []
        acc: list = []
        fixed: list = []  # per pair in acc: the row's fixed cells, for the store's plan
        for ref, name, type_name, depth, rows, is_root, cuda in self.plan:
            slot = _Slot(name, type_name, depth, rows, cuda if cuda is not None and torch.cuda.is_available() else None, len(acc))
            acc += (0, 0)
            fixed.append((name, type_name, depth, "forward") if rows and slot.cuda is None else None)
            entries.append((ref, self._stand_in(slot, is_root, acc), 1 if rows else 0))
            slots.append(slot)
            if slot.cuda is not None or self.backward:
                full.append(slot)
        for ref in self.losses:
            at = len(acc)  # its own counters: the loss module is not traced
            acc += (0, 0)
            fixed.append(None)
            entries.append((ref, lambda inner, at=at: timed.tap(inner, acc, at, None, self._loss_out), 0))
        return entries, slots, full, acc, [0] * len(acc), fixed

    def take_off_plain(self) -> bool:
        """dynamo begins to compile (`models.hold`, on the thread that
        calls the compiled code): the stand-ins on plain modules come off
        before it traces code that may call them, and the plan keeps to
        compiled modules from now on. The next boundary takes the long way."""
        # (`models.COMPILED_CALLERS` is set once this returns.)
        self.replan = True
        self.quiet = False
        self.lean_clear()
        if not any(entry[0]() is not None and not models.is_compiled(entry[0]()) for entry in self.handles):
            return False
        self._detach()
        return True

    def _detach(self):
        handles, self.handles = self.handles, []
        self.sampling = False
        for entry in handles:
            timed.take_off(entry)

    def _stand_in(self, slot, is_root, acc):
        """What stands in for the module's forward: most modules only add
        their time (the trace's main cost, on every module call of a
        sampled step); a root, a GPU module or --backward does more."""
        at = slot.at
        backward, cuda = self.backward, slot.cuda
        if not (is_root or backward or cuda is not None):
            return lambda inner: timed.timed(inner, acc, at)
        tracer = self
        if backward:
            slot.start_hook, slot.end_hook = self._gradient_hooks(slot)

        def before(args, kwargs, now):
            try:
                if is_root:
                    tracer._root_input(now, args, kwargs)
                if backward:
                    for tensor in args:
                        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                            tensor.register_hook(slot.end_hook)
                if cuda is not None and not torch.cuda.is_current_stream_capturing():
                    # (An event recorded into a CUDA graph's capture would be
                    # a node of the graph, never read.)
                    _memory_start(slot)
                    slot.open_events.append(_cuda_event(cuda))
            except Exception as exc:  # noqa: BLE001
                tracer._fail(f"the trace's start of {slot.name}", exc)

        def after(args, output):
            try:
                if cuda is not None and slot.open_events:
                    slot.events.append((slot.open_events.pop(), _cuda_event(cuda)))
                    _memory_end(slot)
                if is_root:
                    loss = _scalar_loss(output)
                    if loss is not None:
                        tracer._take_loss(loss)
                        tracer.output_loss = True
                    if tracer.backward_watch is None and torch.is_grad_enabled():
                        tracer._watch_backward()
                if backward:
                    for tensor in _tensors(output):
                        if tensor.requires_grad:
                            tensor.register_hook(slot.start_hook)
            except Exception as exc:  # noqa: BLE001
                tracer._fail(f"the trace's end of {slot.name}", exc)

        return lambda inner: timed.tap(inner, acc, at, before, after)

    def _root_input(self, now, args, kwargs):
        if self.first_fwd is None:
            # The step's first call (the step's figures were taken and reset).
            self.first_fwd = now
            self.samples_trained = self.module_loss = self.output_loss = False
            self.loss_divisor = self.backward_done = None
            self.between = 0
        elif self.backward_done is not None and torch.is_grad_enabled():
            # The next micro-batch: what it waited since the last backward.
            self.between += now - self.backward_done
            self.backward_done = None
        first = args[0] if args else next((v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor)), None)
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            # The batches the step trained on: a call without grad (a
            # validation pass between steps) counts only in a step that
            # trains on none (an inference loop marked by rankscope.step()).
            if torch.is_grad_enabled():
                if not self.samples_trained:
                    self.samples, self.samples_trained = 0, True
                    if self.first_fwd != now:
                        # A validation pass came first: the step waited
                        # for data only outside its forwards (the start
                        # is moved so that `first_fwd - last_end`, the
                        # wait on both ways, leaves them out).
                        self.first_fwd = now - sum(self.acc[slot.at] for slot in self.slots if slot.depth == 0)
                self.samples += first.shape[0]
            elif not self.samples_trained:
                self.samples += first.shape[0]

    def _watch_backward(self):
        """The loss of a program whose model returns none and that calls no
        loss module (``F.cross_entropy(model(x), y)``, or plain tensor
        arithmetic) is the scalar it calls ``backward()`` on: a stand-in
        on ``torch.Tensor.backward``, on the class (nothing is added to a
        tensor), keeps it in a sampled step. In another step it costs a
        test (the step's first forward is None there). Under gradient
        accumulation the step's loss is the micro-batches' mean, or, where
        the program divides each by their number, their sum (`_loss_into`).
        A loss module's trained loss is the one its backward takes. It is
        put on for a model that returns its loss too: where each backward
        ends, the wait for the next micro-batch's data begins."""
        own = torch.Tensor.__dict__.get("backward")
        if own is None or getattr(own, _LOSS_WATCHED, None) is not None:
            return
        tracer = self

        @functools.wraps(own)
        def backward(self, *args, **kwargs):
            # Compiling first: dynamo folds it, and traces nothing of ours.
            if _compiling() or tracer.first_fwd is None:
                return own(self, *args, **kwargs)
            tracer._backward_loss(self)
            try:
                return own(self, *args, **kwargs)
            finally:
                tracer.backward_done = _perf()

        setattr(backward, _LOSS_WATCHED, own)
        torch.Tensor.backward = backward
        self.backward_watch = (own, backward)

    def _unwatch_backward(self):
        watch, self.backward_watch = self.backward_watch, None
        # Only where it is still ours (a program that replaced it since keeps its own).
        if watch is not None and torch.Tensor.__dict__.get("backward") is watch[1]:
            torch.Tensor.backward = watch[0]

    def _backward_loss(self, tensor):
        try:
            if self.output_loss:
                return  # taken at the model's return
            if self.module_loss:
                # A loss module took this backward's loss (its output, or
                # a sum the program made of it).
                self.module_loss = False
                return
            if tensor.dim() != 0 or not tensor.requires_grad or not tensor.is_floating_point():
                return
            grad_fn = tensor.grad_fn
            scale = divisor = None
            made_by = type(grad_fn).__name__ if grad_fn is not None else None
            if made_by == "MulBackward0":
                scale = self._grad_scale(grad_fn)
            if scale is None and made_by in ("DivBackward0", "MulBackward0"):
                divisor = _divisor(grad_fn, made_by)
            if scale is None:
                self._take_loss(tensor.detach(), trained=True, divisor=divisor)
                return
            with torch.no_grad():
                self._take_loss(tensor.detach() / scale, trained=True)
        except Exception as exc:  # noqa: BLE001
            self._fail("the trace's loss at backward", exc)

    def _grad_scale(self, grad_fn):
        """The GradScaler's scale where the tensor is a loss it scaled
        (``scaler.scale(loss)``: a product with the scaler's own scale
        tensor, `grad_fn` its MulBackward0): the loss is the product
        divided by it. None otherwise."""
        other = getattr(grad_fn, "_saved_other", None)
        if not isinstance(other, torch.Tensor) or other.numel() != 1:
            return None
        if self.grad_scaler is None:
            # Looked for once, from the frame that called backward().
            found = models.find_grad_scaler(sys._getframe(3), 12, 2000)
            self.grad_scaler = weakref.ref(found) if found is not None else False
        scaler = self.grad_scaler() if self.grad_scaler else None
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor) and scale.device == other.device and scale.data_ptr() == other.data_ptr():
            return other
        return None

    def _take_loss(self, loss, trained=None, divisor=None):
        """Keeps a loss of the sampled step: its row has the mean of them
        all, which under gradient accumulation is the micro-batches' mean
        (the batch's loss), not the last micro-batch's. `trained`: whether
        it needs grad, where `loss` was detached already."""
        loss = _local(loss)
        # (Given `trained`, the caller has detached it.)
        detached = trained is not None
        trained = loss.requires_grad if trained is None else trained
        if trained != self.loss_trained:
            if not trained and self.loss is not None:
                return  # a validation loss, in a step that has trained ones
            # The step's first loss that trains: those without grad before
            # it (a validation pass) are not the step's.
            self.loss = self.loss_event = self.loss_n = self.loss_divisor = None
            self.loss_trained = trained
        held = self.loss
        if held is None:
            self.loss_divisor = divisor
        elif self.loss_divisor != divisor:
            self.loss_divisor = False
        if loss.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                return  # (a copy and an event would be nodes of the graph)
            # Copied out behind the step's kernels and read once the copy's
            # event has passed: `float()` of a GPU tensor would wait for the
            # whole queue (a sync per sampled step).
            copy, event = loss.detach().to("cpu", non_blocking=True), _cuda_event(loss.device)
            if type(held) is list:
                if len(held) < MAX_LOSSES:
                    held.append(copy)
                    self.loss_event.append(event)
            else:
                self.loss, self.loss_event = [copy], [event]
        elif held is None or type(held) is list:
            # (The first; or a CPU loss after GPU ones, which a step of
            # one model does not make: the CPU's alone count then.)
            self.loss, self.loss_event = (loss if detached else loss.detach()), None
        else:
            # Summed in the order seen, as a loop of `total += loss` does.
            n, total = self.loss_n if type(held) is float else (1, float(held))
            total += float(loss.detach())  # (of a tensor that needs grad, float() warns)
            self.loss, self.loss_n = total / (n + 1), (n + 1, total)

    def _loss_out(self, args, output):
        try:
            if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
                self._take_loss(output)
                if output.requires_grad:
                    self.module_loss = True
        except Exception as exc:  # noqa: BLE001
            self._fail("the trace's end of the loss module", exc)

    def _gradient_hooks(self, slot):
        tracer, perf = self, _perf
        queue = torch.autograd.Variable._execution_engine.queue_callback

        def start(grad):
            try:
                if tracer.sampling:
                    now = perf()
                    if slot.bwd_start is None and slot.bwd_end is not None:
                        # Its input's gradient came first: the output is
                        # one of its inputs (nn.Identity, a disabled drop
                        # path), so the module has no backward of its own.
                        slot.bwd_start = slot.bwd_end
                    elif slot.bwd_start is None:
                        slot.bwd_start = now
                        if slot.cuda is not None and not capturing():
                            # On autograd's thread for the device, whose
                            # current stream is the one the engine runs
                            # this module's backward on.
                            slot.bwd_open = [_cuda_event(slot.cuda), None]
                    if tracer.pass_start is None:
                        tracer.pass_start = now
                        queue(tracer._pass_end)
            except Exception as exc:  # noqa: BLE001
                tracer._fail(f"the backward hook of {slot.name}", exc)

        def end(grad):
            try:
                if tracer.sampling:
                    now = perf()
                    if slot.bwd_end is None or now > slot.bwd_end:
                        slot.bwd_end = now
                        if slot.bwd_open is not None and not capturing():
                            slot.bwd_open[1] = _cuda_event(slot.cuda)
            except Exception as exc:  # noqa: BLE001
                tracer._fail(f"the backward hook of {slot.name}", exc)

        return start, end

    def _pass_end(self):
        """Queued on autograd's engine by the first gradient of a backward
        pass; runs when the pass ends. A module whose inputs need no
        gradient (the first layer, the model itself) ends here."""
        try:
            now = _perf()
            if self.pass_start is not None:
                self.bwd_ns += now - self.pass_start
                self.pass_start = None
            for slot in self.slots:
                if slot.bwd_start is not None:
                    ended = slot.bwd_end is not None and slot.bwd_end >= slot.bwd_start
                    slot.bwd_ns += (slot.bwd_end if ended else now) - slot.bwd_start
                    slot.bwd_calls += 1
                    slot.bwd_start = slot.bwd_end = None
                    opened, slot.bwd_open = slot.bwd_open, None
                    if opened is not None:
                        # Ended by its input's gradient, else by the pass.
                        stop = opened[1] if ended and opened[1] is not None else None
                        if stop is None and not capturing():
                            stop = _cuda_event(slot.cuda)
                        if stop is not None:
                            slot.bwd_events.append((opened[0], stop))
        except Exception as exc:  # noqa: BLE001
            self._fail("the end-of-backward callback", exc)

    # ---- what `rankscope PID torch` shows

    def _step_in_progress(self):
        """The step in progress as the clock numbers it (`trace on` names
        the first sampled step from it): before the clock's first boundary,
        the number that boundary will give it less one; None while the
        clock is off (what it counted then is stale)."""
        if not self.on:
            return None
        if self.step is not None:
            return self.step
        if self.marker != "rankscope.step()":
            primary = self.primary() if self.primary is not None else None
            counts = [models.completed_steps(opt) for opt in ([primary] if primary is not None else list(self.known_optimizers))]
            counts = [c for c in counts if c is not None]
            if counts:
                return max(counts)
        return 0  # counted from here: the first boundary makes it 1

    def _numbering(self):
        """Where the step numbers come from (see `numbered`), also before
        the clock's first boundary has settled it."""
        if not self.on or self.numbered is not None:
            return self.numbered
        if self.marker != "rankscope.step()":
            primary = self.primary() if self.primary is not None else None
            if any(models.completed_steps(opt) is not None for opt in ([primary] if primary is not None else list(self.known_optimizers))):
                return "optimizer"
        return "clock"

    def describe(self) -> dict:
        if self.opt_hooks is not None and not self.on:
            self._remove_optimizer_hooks(0)
        return {
            "on": self.tracing,
            "every": self.every,
            "modules": self.glob,
            "backward": self.backward,
            "hooked_modules": self.hooked if self.handles else 0,
            "stand_ins": len(self.handles),
            "optimizer_hooks": 0 if self.opt_hooks is None else sum(1 for entry in self.opt_hooks if entry is not None),
            # The step clock runs for another feature too (the NaN watch).
            "clock": self.on,
            "sampling_now": self.sampling,
            "sampled_steps": self.sampled_steps,
            "step": self._step_in_progress(),
            "numbered": self._numbering(),
            "marker": self.marker,
            "errors": self.errors,
            "disabled": self.disabled,
            "rows": (store := tables.describe())["rows"],
            "store": store,
        }


TRACER = Tracer()
