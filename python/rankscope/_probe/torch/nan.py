"""The NaN/Inf watch (``torch nan on``): where a non-finite value first
appeared, into ``python.nan_events`` and a crash-style record.

Armed, a step costs a stand-in for the ``forward`` of each model's root
(``timed.py``: cheaper than forward hooks; it keeps a reference to the
step's input, the RNG state at its start for a model whose modules draw
random numbers, and the loss where the model returns one), a stand-in on
each loss module (the loss, and the other arguments of a call on the
model's output), and, at the optimizer's pre-hook, a finiteness check of
the loss and the gradients. Nothing is put into autograd's graph: a tensor
hook on the output, to keep the gradient that reaches it, cost the small
MLP of bench/ 13-19 us a step by itself, rankscope's code or any other's.
On a CPU the values themselves are read in place
(``_native.FiniteCheck``, crates/rankscope-probe/src/finite.rs), at once.
On a GPU their norms are taken in one fused kernel (``torch._foreach_norm``),
and the one flag made of them is read there and then, before the optimizer
applies the gradients: the CPU waits for the device to finish the step's
backward, as a program's own ``loss.item()`` does. Read later instead (a
CUDA event, at a later boundary), the flag came after the update: the
search then ran on weights already made non-finite by it, and on an H100
named the first module of the model instead of the one that made the NaN.

At an ordinary step none of this module's Python runs: the root
stand-in keeps the input, the step clock's pre-hook checks the
sentinels and the boundary lets the input go natively
(``_native.NanArm``, crates/rankscope-probe/src/nan_arm.rs). The hooks
below run where that cannot: a full check, a trip, a GPU's check, a
random forward, an output that may hold the loss, new models, a second
forward in a step (where a step a GradScaler skipped is told from
gradient accumulation: ``_repeated``).

A step that never reaches the optimizer is checked too. A GradScaler's
skips are told at the next forward (`_repeated`). A program that skips
the step itself, on a non-finite loss or gradient norm, is checked where
it clears the gradients no step used (the step clock's stand-in for
`zero_grad` calls `before_zero_grad`), or, where it skipped the backward too, at the next
forward by the loss it kept (a CPU's).

On a trip, the step is searched while its weights are still the ones it
ran with (the optimizer's pre-hook, before the update):

* its input: non-finite already (stage ``input``);
* forward: the step's forward is run again on the same input (from the
  same RNG state, where it was kept), with a hook on every module; the first module whose
  output is non-finite while its inputs were finite is the origin. When a
  module's inputs are non-finite before it ran, its parent's own code made
  them (stage ``forward``);
* the loss: forward finite, loss not (stage ``loss``; a loss function's
  value, which no stand-in sees, is read at the trip from the training
  loop's frame: ``_loss_from_frames``);
* backward: the same forward again, then ``torch.autograd.grad``; the
  deepest module whose output gradient was finite and whose input or
  parameter gradients are not is the origin (stage ``backward``). The
  backward starts from the loss where it can be made again: the model
  returns it, or a loss module was called on the model's output itself
  (it is called again with the same other arguments). Otherwise it
  starts from ones at the model's output: a module whose backward turns a
  finite gradient into a non-finite one (a square root at 0, a division
  by 0) does so for ones too; one that overflows only at the real
  gradient's size is then found from the parameters' gradients instead.

In a job of several ranks the re-run must make no collective: the other
ranks would not join it, and the job would hang or pair it with another
call. A model wrapped in DDP is re-run through the module it wraps (DDP's
own forward broadcasts buffers, and its backward all-reduces gradients),
and the whole re-run goes under a dispatch mode that refuses every c10d
operator before it is issued (``_no_collectives``: DDP's C++ calls and
the Python API's alike go through them). A step whose model itself makes
a collective (SyncBatchNorm, a sharded model) is then not searched by
re-running: its module is named from the parameters' gradients, and the
detail says why. A DDP rank whose own forward and backward re-run finite
while its gradients are not got them from another rank, through the
gradients' all-reduce (stage ``all_reduce``); ``cluster torch nan`` names
the rank where it began.

The re-run touches nothing the program keeps: ``.grad`` is left alone
(``autograd.grad`` returns its gradients), the RNG states (CPU, and CUDA
where it is in use) and every buffer that changed (BatchNorm's running
statistics) are put back as they were, and what the trace's stand-ins
counted during it is taken back. Python side
effects of a model's own ``forward`` code (a counter it bumps) do happen
twice; ``torch.autograd.detect_anomaly``, the alternative, catches only
backward NaNs and slows every step 1.5-3x.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import math
import os
import sys
import time
import types
import weakref

import torch

from rankscope import _native
from rankscope._probe.torch import models, tables, timed
from rankscope._probe.torch.stats import FLOATS, _gathered, _norms
from rankscope._probe.torch.trace import TRACER, _cuda_event, _local, _scalar_loss, _spare, _tensors, capturing

# Events kept for `torch nan` (the table keeps them all).
MAX_EVENTS = 16
# Every step checks the loss and the gradients of each model's first
# module with parameters (a non-finite gradient made anywhere after it
# reaches them on its way back); every FULL_EVERY-th step checks every
# gradient (one that never reaches them: a second input branch, or a
# gradient the model's code replaced). Reading all gradients every step
# costs a small CPU model 2-3 %; every 8th, about 0.3 %.
FULL_EVERY = 8
MAX_SENTINEL = 1 << 16
# Model calls watched through torch's global hooks before a step comes (see
# `NanWatch._watch_first_forward`): more, and the program is not training.
FIRST_CALLS = 1000
# Steps a GradScaler skips in a row, with a loss that is finite or not seen,
# before the last is replayed (see `NanWatch._repeated`): a few skips are
# its overflows at a scale too high, which it lowers by half each time.
SKIPS_BEFORE_REPLAY = 3
# How far `_find_scaler` looks: frames up from the model's call, and
# objects (a trainer, its accelerator) down from their locals.
SCALER_FRAMES, SCALER_OBJECTS = 12, 2000
_rng_state, _cuda_initialized = torch.get_rng_state, torch.cuda.is_initialized
# Whether dynamo is tracing the code that asks (torch 2.3 on; an older
# torch's hooks are traced as they are).
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
# The backward search's start where the loss cannot be made again.
ONES = "ones at the model's output (the loss function is not known here)"


def _stats(tensors) -> tuple:
    """(min, max, non-finite count) over the finite values of `tensors`,
    floating ones only; Nones when there are none."""
    low = high = None
    bad = 0
    seen = False
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        seen = True
        flat = _local(tensor).detach()
        finite = torch.isfinite(flat)
        count = int(finite.numel() - int(finite.sum()))
        bad += count
        values = flat[finite] if count else flat
        if values.numel():
            lo, hi = float(values.min()), float(values.max())
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
    return (low, high, bad) if seen else (None, None, None)


def _nonfinite(value) -> int:
    return sum(_stats([t])[2] or 0 for t in _tensors(value))


def _inputs_of(args, kwargs) -> list:
    out = [t for t in _tensors(tuple(args)) if t.is_floating_point()]
    out += [t for t in _tensors(dict(kwargs or {})) if t.is_floating_point()]
    return out


# What the root hooks keep of the step in progress: model (a weakref), args,
# kwargs, rng, cuda_rng, loss, output and loss_call (a loss module called on
# the model's output itself: (its ref, the other arguments, keyword
# arguments), made again on a replay's output; `output` is a weakref to
# that output, kept only while a loss module is watched). Native
# (nan_arm.rs): the root stand-in fills it in without the watch's Python.
_Step = _native.NanStep

# Under gradient accumulation, the step's earlier micro-batches are kept
# (their input, loss and RNG state: references, no copies) so that a
# non-finite value made by one of them is replayed with its own input,
# not the last one's. Their inputs live until the optimizer step instead
# of until the next micro-batch: kept only while their tensors come to no
# more than this, in all.
EARLIER_KEEP_BYTES = int(float(os.environ.get("RANKSCOPE_NAN_KEEP_MB", "64") or 64) * (1 << 20))
_MICRO_FIELDS = ("model", "args", "kwargs", "rng", "cuda_rng", "loss", "loss_call", "autocast")


class _Micro:
    """An earlier micro-batch of the step, as a `_Step` to replay."""

    __slots__ = (*_MICRO_FIELDS, "output", "scaler_states", "earlier", "index", "size")

    def __init__(self, step, index, size):
        for name in _MICRO_FIELDS:
            setattr(self, name, getattr(step, name))
        self.output = self.scaler_states = self.earlier = None
        self.index = index
        self.size = size  # its input tensors' bytes


def _input_bytes(args, kwargs) -> int:
    return sum(t.numel() * t.element_size() for t in _inputs_of(args, kwargs))


def _arm_field(name):
    """A NanWatch attribute kept in its native arm, which the stand-ins and
    the step clock read."""
    return property(lambda self: getattr(self._arm, name), lambda self, value: setattr(self._arm, name, value))


def _wait_for_gpu_flag(finite) -> bool:
    """The GPU check's one flag, read: the training thread waits here (the
    GIL let go) until its device has finished the step's backward. A stack
    of a rank whose GPU is stuck (a collective that never completes) shows
    this frame, named for what it waits on.

    On CUDA by a copy and an event, not ``bool(finite)``: that goes through
    torch's synchronizing copy, which under the program's
    ``torch.cuda.set_sync_debug_mode("warn")`` would print a warning into
    its stderr at every step (and raise under "error"); an event's wait
    is not one torch reports."""
    if finite.device.type != "cuda":
        return bool(finite)
    host = finite.to("cpu", non_blocking=True)
    event = _cuda_event(finite.device)
    event.synchronize()
    _spare((event,))
    return bool(host)


class NanWatch:
    # Told only where the arm's native part (nan_arm.rs) did not do the
    # step's work: see `tell` in step_clock.rs.
    WHEN = {"optimizer_pre": "unchecked", "boundary": "unchecked"}

    armed = _arm_field("armed")
    checked_steps = _arm_field("checked_steps")
    step = _arm_field("step")
    searching = _arm_field("searching")
    models_seen = _arm_field("models_seen")  # TRACER.models when last compared with `hooked`
    sentinel_params = _arm_field("sentinel_params")  # (optimizer weakref, its sentinel parameters)
    loss_modules = _arm_field("loss_modules")  # a loss module has a stand-in

    def __init__(self):
        self._arm = _native.NanArm(_finite_check(), torch.Tensor, FULL_EVERY, torch.is_grad_enabled,
                                   getattr(torch._C, "_is_any_autocast_enabled", None), _autocast_now)
        # `nothing_new` as the step clock's zero_grad stand-in asks it.
        self.quiet_zero_grad = self._arm.nothing_new
        self.events: list = []
        self.disabled = None
        self.gpu_waits = 0  # checks that waited for a GPU (`torch nan` says so)
        self.unstepped_checks = 0
        # zero_grad calls that came to the watch's Python (the stand-in's
        # inline way asks the arm only): a usual loop's are its first few.
        self.zero_grads_in_python = 0
        self.handles: list = []
        self.tripped_at = None
        self.hooked: set = set()
        self.sentinels: set = set()
        # Torch's global module hooks while no model is known (see
        # `_watch_first_forward`), and the depth of module calls per thread.
        self.first_hooks = None
        self.depth: dict = {}
        self.first_calls = 0
        self.exit_check = False
        self.first_rng = None
        # The program's GradScaler (a weak reference in the arm), looked
        # for once; the steps it skipped in a row, since `checked_steps`
        # was `skip_mark`.
        self.scaler_searched = False
        self.skips, self.skip_mark = 0, -1
        # The step number of the first of those skips.
        self.skip_first = None
        # id(optimizer or root model) -> (a weak reference to it, its
        # sentinels); cleared, never replaced: the arm reads the same dict
        # (`nothing_new`).
        self.sentinels_of: dict = {}
        self._arm.sentinels_of = self.sentinels_of

    # ---- on and off (probe thread)

    def turn_on(self) -> dict:
        self.turn_off(quiet=True)
        self.disabled = None
        self.tripped_at = None
        TRACER.add_listener(self)
        # Before any stand-in goes on: see models.hold.
        models.hold(self.take_off_plain)
        self._hook_roots()
        TRACER.zero_grad_watch = self
        self.armed = True
        TRACER.nan_arm = self._arm
        if not self.exit_check:
            from rankscope._probe.unseen import builtin

            builtin("atexit").register(self.check_at_exit)
            self.exit_check = True
        return self.describe()

    def turn_off(self, quiet: bool = False) -> dict:
        self.armed = False
        if TRACER.nan_arm is self._arm:
            TRACER.nan_arm = None
        handles, self.handles = self.handles, []
        for entry in handles:
            timed.take_off(entry)
        models.release(self.take_off_plain)
        self._unwatch_first_forward()
        if TRACER.zero_grad_watch is self:
            TRACER.zero_grad_watch = None
        TRACER.remove_listener(self)
        self.step = _Step()
        return {} if quiet else self.describe()

    def take_off_plain(self) -> bool:
        """dynamo begins to compile (`models.hold`): the stand-ins on plain
        modules come off before it traces code that may call them."""
        plain = [entry for entry in self.handles if _plain_unsafe(entry[0](), flagged=False)]
        if plain:
            self.handles = [entry for entry in self.handles if entry not in plain]
            for entry in plain:
                timed.take_off(entry)
        # The first step's global hooks too: dynamo would trace them as well.
        hooks = self.first_hooks is not None
        self._unwatch_first_forward()
        return bool(plain) or hooks

    def failed(self, reason: str) -> None:
        self.disabled = reason
        self.turn_off(quiet=True)

    def _hook_roots(self):
        """Hooks each model's root (and the loss modules); again whenever
        the models found change (a watch armed before the model existed)."""
        handles, self.handles = self.handles, []
        for entry in handles:
            timed.take_off(entry)
        self.hooked = {id(m) for m in TRACER.live_models()}
        self.models_seen = TRACER.models
        self.sentinels = set()
        self.sentinel_params = None
        self.sentinels_of.clear()
        for model in TRACER.live_models():
            self.sentinels.update(id(p) for p in _sentinels_of(model, lambda p: p.requires_grad))
            if _plain_unsafe(model):
                continue  # (its step is searched from its gradients, as a compiled model's)
            entry = timed.put_on(model, self._stand_in(model))
            if entry is not None:
                self.handles.append(entry)
        self.loss_modules = False
        for ref in TRACER.losses:
            module = ref()
            if module is not None and not _plain_unsafe(module):
                entry = timed.put_on(module, self._loss_stand_in(ref))
                if entry is not None:
                    self.handles.append(entry)
                    self.loss_modules = True
        if self.handles:
            models.hold(self.take_off_plain)
        if self.hooked:
            self._unwatch_first_forward()
        else:
            self._watch_first_forward()

    # ---- before any model is known (armed at start, or before the model was built)

    def _watch_first_forward(self):
        """The models are found through their optimizer, at its first step:
        a watch armed before that (``RANKSCOPE_TORCH=nan``) would miss the
        forward of the first step, where a bad initialisation or a bad
        first batch shows. Until a model is hooked, torch's global module
        hooks keep each outermost module call of the step instead, as the
        root stand-in does; they go once the models are hooked (at the
        first step's end). Every module call takes torch's slower general
        path meanwhile.

        With torch.compile: `torch.compile(module)` warns of global hooks
        in the program's stderr at every call of the module it makes, so
        the hooks go as that module is made (a global module-registration
        hook sees it take the module it wraps; those hooks are not counted
        as forward hooks, and cost nothing at a call). Dynamo traces into
        the hooks where it compiles a module's call (`module.compile()`, a
        compiled function that calls modules): they do nothing while it
        does (a graph break there, and an error under `fullgraph=True`).
        A compiled program's first step is then searched from its
        gradients; the hooks go as the program calls `torch.compile`, so
        that no graph is compiled with them (`models.before_compile`)."""
        if self.first_hooks is not None or models.COMPILED_CALLERS:
            return  # (with code of the program's compiled: see models.hold)
        from torch.nn.modules import module as nn_module

        pre = nn_module.register_module_forward_pre_hook(self._first_pre)
        try:
            post = nn_module.register_module_forward_hook(self._first_post, with_kwargs=True, always_call=True)
        except TypeError:  # a torch without always_call: a forward that raises leaves the depth as it was
            post = nn_module.register_module_forward_hook(self._first_post, with_kwargs=True)
        registration = nn_module.register_module_module_registration_hook(self._first_registration)
        self.first_hooks = (pre, post, registration)
        # So that nothing is compiled with these hooks there (dynamo guards
        # on how many global hooks there are: the graph would compile again
        # when they go), they go as the program calls `torch.compile`
        # (`module.compile()` calls it too), before anything is compiled.
        models.before_compile(self._unwatch_first_forward)
        self.depth = {}
        self.first_calls = 0

    def _first_registration(self, module, name, submodule):
        # `torch.compile(module)` making its wrapper: it registers the
        # module it wraps as `_orig_mod` (torch._dynamo's OptimizedModule).
        if name == "_orig_mod" and type(module).__name__ == "OptimizedModule":
            self._unwatch_first_forward()
        return None

    def _unwatch_first_forward(self):
        models.forget_before_compile(self._unwatch_first_forward)
        hooks, self.first_hooks = self.first_hooks, None
        if hooks is not None:
            from torch.nn.modules import module as nn_module

            for handle in hooks:
                handle.remove()
                # torch's handle for a global forward hook forgets its entry
                # in the with_kwargs table, which `_has_any_global_hook()`
                # reads: left there, every compiled call would warn of hooks.
                for table in ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called"):
                    getattr(nn_module, table, {}).pop(handle.id, None)
        self.depth = {}
        self.first_rng = None

    def _first_pre(self, module, args):
        if _compiling():
            return  # traced by dynamo: nothing of this may go into its graph
        try:
            thread = _thread.get_ident()
            depth = self.depth.get(thread, 0)
            self.depth[thread] = depth + 1
            if depth == 0 and not self.searching and _has_params(module) and _stochastic(module):
                self.first_rng = _rng_state()
        except Exception as exc:  # noqa: BLE001
            self.failed(f"the first forward's pre-hook failed: {type(exc).__name__}: {exc}")

    def _first_post(self, module, args, *rest):
        # (module, args, kwargs, output) as registered; (module, args,
        # None) where the forward raised: torch's `always_call` passes no
        # kwargs then. Either way the call is over.
        if _compiling():
            return
        try:
            thread = _thread.get_ident()
            depth = self.depth.get(thread, 1) - 1
            self.depth[thread] = depth
            if len(rest) != 2:
                return
            kwargs, output = rest
            if depth or self.searching:
                return
            step = self.step
            if _has_params(module):
                self.first_calls += 1
                if self.first_calls > FIRST_CALLS:
                    # No step in sight (an inference loop, or no optimizer):
                    # nothing would be checked, so the general path is not paid.
                    self._unwatch_first_forward()
                    return
                if not torch.is_grad_enabled():
                    return  # no gradient comes of it (see `_root_pre`)
                # The model's call: what the root stand-in keeps.
                step.model, step.args, step.kwargs = weakref.ref(module), args, kwargs
                step.autocast = _autocast_if_on()
                step.rng, self.first_rng = self.first_rng, None
                step.cuda_rng = step.loss = step.loss_call = None
                loss = _scalar_loss(output)
                if loss is not None:
                    step.loss = loss.detach()
                    step.output = None
                elif isinstance(output, torch.Tensor):
                    step.output = weakref.ref(output)
            elif isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point() and torch.is_grad_enabled():
                # A loss module's call: on the model's output itself, it can be
                # made again from the replay's.
                step.loss = output.detach()
                made = step.output() if step.output is not None else None
                if args and made is not None and args[0] is made:
                    step.loss_call = (weakref.ref(module), args[1:], kwargs)
        except Exception as exc:  # noqa: BLE001
            self.failed(f"the first forward's hook failed: {type(exc).__name__}: {exc}")

    def _stand_in(self, model):
        # partial: called from C, one Python frame less a step.
        stochastic = _stochastic(model)
        before = functools.partial(self._root_pre, weakref.ref(model), stochastic)

        def stand_in_of(inner):
            stand_in = timed.seen(inner, before, self._root_post)
            if not stochastic:
                # The input kept natively: `before` then runs only where
                # the arm cannot (searching); the RNG state of a random
                # forward is this Python's to copy.
                stand_in.arm = self._arm
            return stand_in

        return stand_in_of

    def _loss_stand_in(self, ref):
        before = functools.partial(self._loss_pre, ref)
        return lambda inner: timed.seen(inner, before, self._loss_post)

    # ---- the cheap part: every step (training thread)

    def _root_pre(self, model_ref, stochastic, args, kwargs):
        try:
            if self.searching or not torch.is_grad_enabled():
                # Without grad (a metric on the side, an eval pass) no
                # gradient comes of the call: the step keeps the input its
                # loss came from (see nan_arm.rs, `keep_input`).
                return
            step = self.step
            if step.args is not None:
                self._repeated(step)
                step = self.step
                if step.args is not None:
                    self._keep_earlier(step)
            # The RNG state (a 5 kB copy, about 3 us) only where the
            # forward draws from it.
            step.scaler_states = self._scaler_states()
            step.model, step.args, step.kwargs = model_ref, args, kwargs
            step.autocast = _autocast_if_on()
            step.rng = _rng_state() if stochastic else None
            step.cuda_rng = step.loss = step.output = step.loss_call = None
            # Not while a CUDA graph is captured: reading a generator's
            # state then raises (the replay then runs without it).
            if stochastic and _cuda_initialized() and not torch.cuda.is_current_stream_capturing():
                step.cuda_rng = torch.cuda.get_rng_state_all()
        except Exception as exc:  # noqa: BLE001
            self.failed(f"the root pre-hook failed: {type(exc).__name__}: {exc}")

    def _keep_earlier(self, step):
        """The micro-batch the step kept, before the next one takes its
        place: kept too, while the kept inputs stay under EARLIER_KEEP_BYTES
        (past it, the search replays the last micro-batch only)."""
        earlier = step.earlier
        if earlier is None:
            earlier = step.earlier = []
        elif earlier and earlier[-1] is None:
            earlier.append(None)  # over the cap already: only counted
            return
        size = _input_bytes(step.args, step.kwargs)
        kept = sum(m.size for m in earlier)
        earlier.append(_Micro(step, len(earlier), size) if kept + size <= EARLIER_KEEP_BYTES else None)

    def _repeated(self, step):
        """A model's forward with grad while the step still keeps an input:
        no optimizer step came between (its pre-hook lets the input go).
        Either the step goes on (gradient accumulation, a GAN's
        discriminator called on real and fake), or the step ended without
        one: a GradScaler found its scaled gradients non-finite and skipped
        the optimizer, which no hook shows. Its `update()` replaces the
        dict of per-optimizer states, so a dict other than the one the
        kept step began with says the scaler ended that step. The step's
        weights are still its own, so it can be searched now: at once
        where its loss was non-finite; where the loss was finite or not
        seen, after SKIPS_BEFORE_REPLAY skips in a row, since a few are
        the scaler's overflows by design (a replay at the real scale then
        finds nothing, and nothing is recorded)."""
        if self.tripped_at is not None:
            return
        scaler = self._find_scaler()
        if scaler is None:
            # A program that skips the backward of a non-finite loss (and
            # with it the step) clears no gradient that `_before_zero_grad`
            # would see: the loss the step kept is read here, where that
            # costs no wait (a CPU's; a GPU's is left to the next step).
            # Not under gradient accumulation (a backward made gradients
            # since the last optimizer step): the step's check sees them;
            # nor for a model in eval mode (a validation pass that left
            # grad on: its metric may be inf by design).
            loss = step.loss
            model = step.model() if step.model is not None else None
            if loss is not None and model is not None and model.training:
                loss = _local(loss)
                if loss.device.type == "cpu" and not math.isfinite(float(loss)) and not self._backward_since():
                    self._trip(TRACER.step if TRACER.step is not None else 0, step,
                               lambda: [p for opt in list(TRACER.known_optimizers)
                                        for p in models.params_with_grads(opt)],
                               unapplied="found at the model's next forward: the loss was not finite, and no "
                                         "optimizer step came after it")
            return
        self._scaler_skipped(step, scaler)

    def _scaler_skipped(self, step, scaler, cleared=False):
        """The scaler skipped the step: its `update()` since the step began
        says so at the next forward where no zero_grad came, and at the
        zero_grad that ends it (`cleared`) the gradients no optimizer step
        used say so. Counted once a step."""
        states = step.scaler_states
        if not cleared and (states is None or getattr(scaler, "_per_optimizer_states", states) is states):
            return
        step.scaler_states = None
        if self.skip_mark != self.checked_steps:
            # An optimizer step was checked since the last skip.
            self.skips, self.skip_mark = 0, self.checked_steps
        self.skips += 1
        if self.skips == 1:
            self.skip_first = TRACER.step
        loss = step.loss
        # Read now: the scaler's own check of its gradients has waited for
        # the device already.
        finite_loss = loss is None or math.isfinite(float(_local(loss)))
        if finite_loss and self.skips < SKIPS_BEFORE_REPLAY:
            return
        skipped, self.skips = self.skips, 0
        first, found = self._first_skipped("found at a step the GradScaler skipped (its update never ran)", skipped)
        self._trip(first, step,
                   lambda: [p for opt in list(TRACER.known_optimizers) for p in models.params_with_grads(opt)],
                   unapplied=found)

    def _first_skipped(self, found, skipped):
        """The step an event names where the scaler skipped `skipped` in a
        row: the first of them, where its weights were last changed; the
        batch replayed is the last one's, the only one kept."""
        now = TRACER.step if TRACER.step is not None else 0
        first = self.skip_first if skipped > 1 and self.skip_first is not None else now
        if skipped > 1:
            found += f"; the batch replayed is step {now}'s, the last of {skipped} it skipped in a row from step {first}"
        return first, found

    def _scaler_states(self):
        weak = self._arm.scaler
        scaler = weak() if weak is not None else None
        return getattr(scaler, "_per_optimizer_states", None) if scaler is not None else None

    def _find_scaler(self):
        """The program's GradScaler, looked for once, at the first second
        forward of a step: in the locals of the frames that called the
        model (the training loop), and in the attributes of the objects
        they hold, two deep (a trainer's `scaler`, its accelerator's)."""
        weak = self._arm.scaler
        if weak is not None:
            return weak()
        if self.scaler_searched:
            return None
        self.scaler_searched = True
        found = models.find_grad_scaler(sys._getframe(1), SCALER_FRAMES, SCALER_OBJECTS)
        if found is not None:
            self._arm.scaler = weakref.ref(found)
        return found

    def _root_post(self, args, output):
        try:
            if not self.searching and torch.is_grad_enabled():
                loss = _scalar_loss(output)
                if loss is not None:
                    self.step.loss = loss.detach()
                elif self.loss_modules and isinstance(output, torch.Tensor):
                    # Which tensor the loss module must be given to be
                    # called again (a weakref: a temporary's address may be
                    # reused by another tensor).
                    self.step.output = weakref.ref(output)
        except Exception as exc:  # noqa: BLE001
            self.failed(f"the root hook failed: {type(exc).__name__}: {exc}")

    def _loss_pre(self, ref, args, kwargs):
        try:
            step = self.step
            # Only a call on the model's output itself: a loss given
            # sigmoid(output), or another output of the model, cannot be
            # made again from the replayed output.
            if not self.searching and step.output is not None and args and args[0] is step.output() and torch.is_grad_enabled():
                step.loss_call = (ref, args[1:], kwargs)
        except Exception as exc:  # noqa: BLE001
            self.failed(f"the loss hook failed: {type(exc).__name__}: {exc}")

    def _loss_post(self, args, output):
        try:
            if not self.searching and isinstance(output, torch.Tensor) and output.dim() == 0 and torch.is_grad_enabled():
                self.step.loss = output.detach()
        except Exception as exc:  # noqa: BLE001
            self.failed(f"the loss hook failed: {type(exc).__name__}: {exc}")

    # ---- a step the program skipped itself

    # ---- at zero_grad (the step clock's stand-in calls these)
    #
    # A program that finds a non-finite loss or gradient norm and skips
    # `optimizer.step()` itself (as large-model trainers do) never reaches
    # the pre-hook's check, so the NaN would never be located. Every
    # training loop clears its gradients between two backwards; where the
    # gradients it clears were made since the last optimizer step, no step
    # used them, and they are checked then, while the weights are still the
    # ones they were made with. The usual step costs one native comparison
    # of the sentinel's gradient (`unapplied`, nan_arm.rs).

    def before_zero_grad(self, owner, of_optimizer):
        """Checks what no step used; returns what `after_zero_grad` needs."""
        if not self._arm.armed:
            return None
        self.zero_grads_in_python += 1
        if not self.nothing_new(owner):
            self._before_zero_grad(owner, of_optimizer)
        return self.sentinels_of.get(id(owner))

    def nothing_new(self, owner) -> bool:
        """Whether a zero_grad of `owner` clears only gradients the last
        check saw (the usual step: the sentinels' gradients are the ones it
        saw, or the owner has none, a submodule), so that nothing is checked;
        asked inline by the step clock's stand-in too, of the arm itself
        (`quiet_zero_grad`): no frame of Python at every step."""
        return self._arm.nothing_new(owner)

    def after_zero_grad(self, known, args, kwargs):
        if known is not None and known[1] and (args[:1] == (False,) or kwargs.get("set_to_none") is False):
            # Zeroed in place: a new version of the same gradients, which
            # the next zero_grad (the model's, then the optimizer's) must
            # not take for a backward's.
            self._arm.noted(known[1])

    def _sentinels_for(self, owner, of_optimizer) -> list:
        """The sentinels among an optimizer's parameters, or a watched
        model's; none for any other module (a submodule's own zero_grad)."""
        known = self.sentinels_of.get(id(owner))
        if known is not None and known[0]() is owner:
            return known[1]
        if of_optimizer:
            mine = self._optimizer_sentinels(owner)
        elif id(owner) in self.hooked:
            mine = [p for p in owner.parameters() if id(p) in self.sentinels]
        else:
            mine = []
        if len(self.sentinels_of) > 64:
            self.sentinels_of.clear()
        self.sentinels_of[id(owner)] = (weakref.ref(owner), mine)
        return mine

    def _optimizer_sentinels(self, optimizer) -> list:
        """The sentinels among an optimizer's parameters. An optimizer that
        holds none of the models' (a second one, for the layers after the
        embedding: Muon's partner, separate learning rates) gets its own,
        chosen as the models' are among its parameters: checked at its
        pre-hook, a NaN from its layers' backward is found before it
        applies it. Before, only the optimizer that holds the models'
        sentinel found it, after the other had spoiled its weights, and
        the step before was blamed for an update."""
        mine = [p for group in optimizer.param_groups for p in group["params"] if id(p) in self.sentinels]
        if mine or not self.sentinels:
            return mine
        own = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        for model in TRACER.live_models():
            chosen = _sentinels_of(model, lambda p: id(p) in own)
            if chosen:
                self.sentinels.update(id(p) for p in chosen)
                return chosen
        return []

    def _backward_since(self) -> bool:
        """Whether a backward made gradients since the last optimizer step."""
        mine = [p for optimizer in list(TRACER.known_optimizers) for p in self._sentinels_for(optimizer, True)]
        return bool(mine) and self._arm.unapplied(mine)

    def _before_zero_grad(self, owner, of_optimizer):
        try:
            if self.searching or self.tripped_at is not None or not self.sentinels:
                return
            mine = self._sentinels_for(owner, of_optimizer)
            if not mine or not self._arm.unapplied(mine):
                return
            step = self.step
            model = step.model() if step.model is not None else None
            if step.args is None or model is None:
                return
            # A GradScaler skips the steps whose scaled gradients overflowed,
            # by design: its skips are judged as `_repeated` judges them
            # (the step clock ends the skipped step here, after this).
            scaler = self._find_scaler()
            if scaler is not None and getattr(scaler, "_enabled", True):
                # (Gradients no optimizer step used, cleared: skipped, whatever
                # the scaler's states say, which a scaler found only now lacks.)
                self._scaler_skipped(step, scaler, cleared=True)
                return
            params = (models.params_with_grads(owner) if of_optimizer
                      else [p for p in owner.parameters() if p.grad is not None])
            self._arm.noted(mine)
            self.unstepped_checks += 1
            with torch.no_grad():
                finite = _finite_now([p.grad for p in params], step.loss)
            if not finite:
                # (No scaler: its overflows went `_scaler_skipped`'s way
                # above. A NaN made outside the model, in the loss, which
                # the replay cannot make again, is still one.)
                self._trip(TRACER.step if TRACER.step is not None else 0, step, params,
                           unapplied="found as the program cleared gradients that no optimizer step used (it skipped "
                                     "the step)",
                           forwards=True, certain=True)
        except Exception as exc:  # noqa: BLE001 - the watch goes off, the program goes on
            self.failed(f"the check at zero_grad failed: {type(exc).__name__}: {exc}")

    def optimizer_pre(self, optimizer, step_number):
        if not self.armed:
            return
        self._check_step(optimizer, step_number)
        primary = TRACER.primary
        if TRACER.marker == "optimizer" and primary is not None and primary() is optimizer:
            # Checked: the step's input and loss go now, not at the boundary
            # (as they do at it, see `boundary`), which a step that raises
            # in the optimizer after this hook never reaches: a program that
            # then drops its model and batch must see them freed.
            self.step.clear()

    def _check_step(self, optimizer, step_number):
        if self.checked_steps % FULL_EVERY == 0 or not self.sentinels:
            params = models.params_with_grads(optimizer)
            self._arm.noted([p for p in params if id(p) in self.sentinels])
            self._check(step_number, params, [p.grad for p in params])
            return
        # Most steps: the sentinels' gradients only, and no list of every
        # parameter (the search makes one if it runs).
        cached = self.sentinel_params
        if cached is None or cached[0]() is not optimizer:
            mine = self._optimizer_sentinels(optimizer)
            # Forgotten with the optimizer: the parameters are the program's.
            cached = self.sentinel_params = (weakref.ref(optimizer, self._forget_sentinels), mine)
        step = self.step
        self._arm.noted(cached[1])
        # On a CPU, read in place in one call (see finite.rs).
        finite = _finite_check().check_grads(cached[1], step.loss)
        if finite is not None:
            self._arm.counted(step_number)
            if not finite and self.tripped_at is None:
                self._trip(step_number, step, models.params_with_grads(optimizer))
            return
        grads = [p.grad for p in cached[1] if p.grad is not None]
        self._check(step_number, lambda: models.params_with_grads(optimizer), grads, native=False)

    optimizer_post = None  # not heard (see trace.EVENTS)

    def closure_step(self, optimizer, args, kwargs):
        """The arguments of a step given a closure, the closure wrapped.

        ``optimizer.step(closure)`` runs the forward and backward inside
        the step, after the pre-hook's check: that check saw the gradients
        of the step before, and a NaN was found a step late, after the
        optimizer had applied it, and the replay named the wrong module.
        Each call of the closure is checked as it returns instead, while
        the weights are those it ran with (LBFGS moves them between its
        calls). torch's ``args`` begin with the optimizer itself. None: no
        closure."""
        if not self.armed:
            return None
        positional = len(args) > 1 and callable(args[1])
        closure = args[1] if positional else (kwargs or {}).get("closure")
        if not callable(closure):
            return None
        ref = weakref.ref(optimizer)

        def checked_closure():
            loss = closure()
            self._closure_returned(ref, loss)
            return loss

        if positional:
            return (args[0], checked_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": checked_closure}

    def _closure_returned(self, ref, loss):
        """A closure's forward and backward are done, and the optimizer has
        not used its gradients yet: the step's check, as at a pre-hook."""
        optimizer = ref()
        if not self.armed or optimizer is None or self.searching:
            return
        try:
            step = self.step
            if step.loss is None and isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
                step.loss = loss.detach()
            # As the pre-hook's check runs: inside the step's no_grad.
            with torch.no_grad():
                self._check_step(optimizer, TRACER.current_step(optimizer))
            # The next call keeps its own input (LBFGS calls it again).
            self.step.clear()
        except Exception as exc:  # noqa: BLE001 - the watch goes off, the program goes on
            self.failed(f"the check after the step's closure failed: {type(exc).__name__}: {exc}")

    def _forget_sentinels(self, gone):
        cached = self.sentinel_params
        if cached is not None and cached[0] is gone:
            self.sentinel_params = None

    def boundary(self, step_number):
        if not self.armed:
            return
        if TRACER.marker == "rankscope.step()":
            # No optimizer marks the step: the gradients are checked here
            # (the program has applied them already).
            params = [p for model in TRACER.live_models() for p in model.parameters() if p.grad is not None]
            self._arm.noted([p for p in params if id(p) in self.sentinels])
            full = self.checked_steps % FULL_EVERY == 0 or not self.sentinels
            grads = [p.grad for p in params if full or id(p) in self.sentinels]
            self._check(step_number - 1 if step_number else 0, params, grads)
        if TRACER.models is not self.models_seen:
            # The tracer found its models again: hooked anew where they changed.
            self.models_seen = TRACER.models
            if {id(m) for m in TRACER.live_models()} != self.hooked:
                self._hook_roots()
        # Checked: the step's input and loss go, so that nothing of the
        # program's lives longer than it would have (the last batch of a
        # training loop, say).
        self.step.clear()

    def _check(self, step_number, params, grads, native=True):
        """`params`: the step's parameters with gradients, or a function
        that lists them (called only on a trip); `native`: whether to try
        the read in place first (False: the caller just did)."""
        loss = self.step.loss
        if native and (grads or loss is not None):
            # On a CPU the values themselves, read in place (see finite.rs):
            # a NaN or an Inf element, not a norm that overflowed.
            finite = _finite_check().check([*grads, loss] if loss is not None else grads)
            if finite is not None:
                self._arm.counted(step_number)
                if not finite and self.tripped_at is None:
                    self._trip(step_number, self.step, params)
                return
        # Through torch: a sharded gradient's own shard (see trace._local).
        grads = [_local(g) for g in grads]
        if loss is not None:
            loss = _local(loss)
        first = grads[0] if grads else loss
        if first is not None and first.device.type != "cpu" and capturing():
            # A step captured into a CUDA graph: no kernel of the watch's
            # goes into the program's graph, nothing is copied out or
            # waited on (the values exist only when the graph is replayed).
            return
        values = list(_norms(grads)) if grads else []
        if loss is not None:
            values.append(loss)
        if not values:
            return
        self._arm.counted(step_number)
        if values[0].device.type == "cpu":
            # One read per value: cheaper than stacking a few scalars.
            if not all(math.isfinite(v.item()) for v in values) and self.tripped_at is None:
                self._trip(step_number, self.step, params)
            return
        with torch.no_grad():
            # all() of the flags, not a sum of the norms (that could overflow).
            finite = torch.isfinite(_gathered(values, values[0].device)).all()
        # A GPU: read now, before the optimizer applies the gradients (see
        # the top of this file). Not while a graph is captured (above).
        self.gpu_waits += 1
        if not _wait_for_gpu_flag(finite) and self.tripped_at is None:
            self._trip(step_number, self.step, params)

    # ---- the search, on a trip only

    def _trip(self, step_number, step, params, unapplied=False, forwards=None, certain=False, frames=None):
        """`unapplied`: a step whose update never ran, found at exit (see
        `check_at_exit`; or the detail to give, for a step a GradScaler
        skipped, see `_repeated`): recorded only where the replay names an
        origin, unless `certain`: gradients seen non-finite where no loss
        scaler's overflow can have made them."""
        self.tripped_at = step_number
        if callable(params):
            params = params()
        loss_from = None
        if step.loss is None:
            found = _loss_from_frames(frames)
            if found is not None:
                step.loss, loss_from = found
        self.searching = True
        # The replay runs inside a step the trace may be sampling: what its
        # stand-ins count during it is taken back.
        held = TRACER.held()
        try:
            event = self._search(step, params, forwards)
        except Exception as exc:  # noqa: BLE001 - the event is still recorded, with why the search stopped
            event = {"stage": "unknown", "module": None, "what": f"the search failed: {type(exc).__name__}: {exc}"}
        finally:
            self.searching = False
            TRACER.restore(held)
        if unapplied:
            if event.pop("unfound", False) and not certain:
                self.tripped_at = None
                return
            found = unapplied if isinstance(unapplied, str) else (
                "found at exit, in the gradients of a step whose update never ran (no optimizer step came after its "
                "backward)")
            event["detail"] = f"{found}; {event['detail']}" if event.get("detail") else found
        event.pop("unfound", None)
        if loss_from is not None and event.get("loss") is not None:
            event["detail"] = f"{event['detail']}; {loss_from}" if event.get("detail") else loss_from
        # Weights spoiled before the step began: the step before spoiled them.
        self._record(max(step_number - 1, 0) if event.pop("previous_step", False) else step_number, event)

    def check_at_exit(self) -> None:
        """A program that stops at its first non-finite loss ends before a
        step it missed (a gradient the sentinels did not see) shows at the
        next: the gradients the last step left are checked once at exit.
        Where the step's update has run, it cannot be replayed, so the
        module is named from the parameters' gradients; where it never ran
        (see below), the step is replayed."""
        try:
            if not self.armed or self.tripped_at is not None or TRACER.step is None:
                return
            params = [p for optimizer in list(TRACER.known_optimizers) for p in models.params_with_grads(optimizer)]
            if not params:
                return
            grads = [_local(p.grad) for p in params]
            finite = _finite_check().check(grads)
            if finite is None:
                finite = all(math.isfinite(v.item()) for v in _norms(grads))
            if finite:
                return
            step = self.step
            if step.args is not None and step.model is not None and step.model() is not None:
                # The step's input is still kept: no optimizer step (whose
                # pre-hook lets it go) came after its forward, so its
                # gradients were never applied. A GradScaler skips the
                # optimizer where its scaled gradients overflowed, as it
                # does now and then by design; a program may skip a step
                # with a non-finite gradient norm, or end between backward
                # and step. The weights are still the step's, so it is
                # replayed at the real scale, and an event recorded only
                # where that names an origin.
                # A run of scaler skips still going (the program ended in
                # it): named from its first, as `_scaler_skipped` would.
                running = self.skips + 1 if self.skip_mark == self.checked_steps and self.skips else 1
                first, found = self._first_skipped(
                    "found at exit, in the gradients of a step whose update never ran (no optimizer step came "
                    "after its backward)", running)
                # Where no loss scaler can have overflowed (no autocast in
                # the step, no GradScaler seen), the gradients are
                # non-finite by the program's own arithmetic: the event is
                # recorded though the replay names no module (a loss
                # function's NaN, whose program stopped at it).
                certain = step.autocast is None and not _any_grad_scaler()
                self._trip(first, step, params, unapplied=found, certain=certain, frames=_exit_frames())
                tables.flush()
                _native.store_flush()
                return
            step_number = max(TRACER.step - 1, 0)
            self.tripped_at = step_number
            event = self._from_param_grads(params, None, "found at exit in the gradients the last step left; "
                                                        "that step's update had run, so it was not replayed")
            self._record(step_number, event)
            tables.flush()
            _native.store_flush()
        except Exception:  # noqa: BLE001 - the program is exiting: nothing of ours may change how
            pass

    def _search(self, step, params, forwards=None) -> dict:
        """The step's search; under gradient accumulation, on the micro-batch
        that made the non-finite value: the first whose loss was non-finite,
        else the last, else the first earlier one whose replay names an
        origin. The weights are the same for all of them: no optimizer
        step came between. `forwards`: the forwards kept are not known to
        be micro-batches (see `_before_zero_grad`)."""
        earlier = [m for m in (step.earlier or ()) if m is not None]
        if not earlier:
            return self._search_one(step, params)
        count = len(step.earlier) + 1
        for micro in earlier:
            if micro.loss is not None and not math.isfinite(float(_local(micro.loss))):
                return _in_micro(self._search_one(micro, params), micro.index, count, forwards)
        event = self._search_one(step, params)
        if event.get("unfound") or event.get("stage") == "unknown":
            for micro in earlier:
                found = self._search_one(micro, params)
                if not found.get("unfound") and found.get("stage") != "unknown":
                    return _in_micro(found, micro.index, count, forwards)
        if None in step.earlier:
            note = f"the step had {count} micro-batches; only the first {len(earlier)} and the last were kept (RANKSCOPE_NAN_KEEP_MB)"
            event["detail"] = f"{event['detail']}; {note}" if event.get("detail") else note
        return event

    def _search_one(self, step, params) -> dict:
        model = step.model() if step.model is not None else None
        loss = step.loss
        loss_value = float(_local(loss)) if loss is not None else None
        if model is None or step.args is None:
            return self._from_param_grads(params, loss_value, "no forward of a model was seen this step")
        spoiled = self._spoiled_weights(model, loss_value)
        if spoiled is not None:
            return spoiled
        inputs = _inputs_of(step.args, step.kwargs)
        low, high, bad = _stats(inputs)
        if bad:
            # An input made by another model of the program's (a GAN's
            # discriminator fed the generator's output) is no data
            # pipeline's fault where that model's weights went non-finite.
            for other in TRACER.live_models():
                if other is model:
                    continue
                spoiled = self._spoiled_weights(other, loss_value)
                if spoiled is not None:
                    spoiled["detail"] += (f"; the non-finite input of {models.qualified(model, '') or type(model).__name__}, "
                                          "the model whose step found it, may be this one's output")
                    return spoiled
            return {
                "stage": "input",
                "module": models.qualified(model, ""),
                "module_type": type(model).__name__,
                "what": "the model's input",
                "nonfinite": bad,
                "inputs": (low, high, bad),
                "weights": _stats(list(model.parameters())),
                "loss": loss_value,
            }
        try:
            return self._replayed(model, step, params, loss_value)
        except _CollectiveInReplay as stopped:
            return self._from_param_grads(
                params, loss_value,
                f"not replayed: the step's model makes a collective ({stopped.op}) that the other ranks would not join",
            )

    def _replayed(self, model, step, params, loss_value) -> dict:
        replay = _Replay(model, step)
        found = replay.forward()
        if found is not None:
            found["loss"] = loss_value
            return found
        if loss_value is not None and not math.isfinite(loss_value):
            return {
                "stage": "loss",
                "module": _loss_name(step),
                "module_type": None,
                "what": "the loss (the model's outputs were finite)",
                "nonfinite": 1,
                "inputs": _stats(list(_tensors(replay.output))),
                "weights": (None, None, None),
                "loss": loss_value,
            }
        back = _Replay(model, step)
        try:
            found = back.backward()
        except _CollectiveInReplay:
            raise
        except Exception as exc:  # noqa: BLE001 - named from the parameters' gradients instead
            # A reentrant checkpoint refuses `autograd.grad` ("incompatible
            # with .grad()").
            return self._from_param_grads(params, loss_value, f"the backward could not be replayed: {type(exc).__name__}: {str(exc)[:200]}")
        if found is not None:
            found["loss"] = loss_value
            if back.start is not None:
                found["detail"] = f"backward replayed from {back.start}"
            return found
        if _ddp(model) and back.start is not None and _world() > 1:
            detail = f"this rank's own forward and backward were finite when replayed; the backward started from {back.start}"
            if back.start == ONES:
                detail += "; a loss whose own gradient is non-finite at a finite value would look the same"
            return {
                "stage": "all_reduce",
                "module": models.qualified(model, ""),
                "module_type": type(model).__name__,
                "what": "its gradients, after DDP's all-reduce: another rank sent non-finite ones "
                        "(`rankscope cluster torch nan` names the rank where it began)",
                "nonfinite": sum(_nonfinite(p.grad) for p in params),
                "inputs": (None, None, None),
                "weights": _stats(list(model.parameters())),
                "loss": loss_value,
                "detail": detail,
            }
        if back.start == ONES:
            # A loss function (not a module): it cannot be made again, and
            # its value was not seen. The model's part was finite both
            # ways, so the step went non-finite between its output and the
            # loss: the loss, or the gradient it sent back.
            return {
                "stage": "loss",
                "module": _loss_name(step),
                "module_type": None,
                "what": "the loss or the gradient it sent back (the model's forward, and its backward from ones at "
                        "its output, were finite when replayed)",
                "nonfinite": sum(_nonfinite(p.grad) for p in params),
                "inputs": _stats(list(_tensors(replay.output))),
                "weights": (None, None, None),
                "loss": loss_value,
                "detail": "a gradient from the loss large enough to overflow in the model's backward would look the "
                          "same; `nonfinite` counts the parameters' non-finite gradients",
                # (A loss scaler's overflow, too: see `check_at_exit`.)
                "unfound": loss_value is None or math.isfinite(loss_value),
            }
        return {**self._from_param_grads(params, loss_value, "the replay found no origin"), "unfound": True}

    def _spoiled_weights(self, model, loss_value):
        """The step began with non-finite weights: a replay would name the
        first module that uses one, in a forward that only carried them.
        Where they came from is the step before: its update (most steps
        check the sentinels' gradients only, which a gradient that overflows
        elsewhere can miss), or the program's own change between steps."""
        for name, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            bad = sum(_nonfinite(p) for p in own)
            if bad:
                return {
                    "previous_step": True,
                    "stage": "update",
                    "module": models.qualified(model, name),
                    "module_type": type(module).__name__,
                    "what": "its weights became non-finite between this step and the next (the optimizer's update, "
                            "or the program's own change of them)",
                    "nonfinite": bad,
                    "inputs": (None, None, None),
                    "weights": _stats(own),
                    "loss": loss_value,
                    "detail": "found at the next step, whose weights were already non-finite",
                }
        return None

    def _from_param_grads(self, params, loss_value, why) -> dict:
        """The module nearest the output whose own parameters got non-finite
        gradients (backward runs from the output)."""
        names = {}
        order = []
        found = TRACER.live_models()
        known = {id(p) for model in found for p in model.parameters()}
        if any(id(p) not in known for p in params):
            # A model the watch has not met yet: made since the last step
            # (a new model replacing the old), or compiled before its first
            # step was seen. Looked for now, at a trip only.
            try:
                fresh = models.discover()[0]
            except Exception:  # noqa: BLE001 - the models known are searched
                fresh = []
            found = found + [m for m in fresh if not any(m is f for f in found)]
        for model in found:
            for name, module in model.named_modules():
                order.append((models.qualified(model, name), module))
                for p in module.parameters(recurse=False):
                    names[id(p)] = (models.qualified(model, name), module)
        bad = {id(p) for p in params if _nonfinite(p.grad)}
        culprit = None
        for name, module in order:
            if any(id(p) in bad for p in module.parameters(recurse=False)):
                culprit = (name, module)
        if culprit is None:
            return {"stage": "unknown", "module": None, "what": why, "nonfinite": None, "loss": loss_value}
        name, module = culprit
        own = list(module.parameters(recurse=False))
        return {
            "stage": "backward",
            "module": name,
            "module_type": type(module).__name__,
            "what": "its parameters' gradients",
            "nonfinite": sum(_nonfinite(p.grad) for p in own),
            "inputs": (None, None, None),
            "weights": _stats(own),
            "loss": loss_value,
            "detail": f"from the parameters' gradients ({why})",
        }

    def _record(self, step_number, event) -> None:
        inputs = event.get("inputs") or (None, None, None)
        weights = event.get("weights") or (None, None, None)
        path = _write_record(step_number, event)
        row = [
            time.time(),
            step_number,
            event.get("stage"),
            event.get("module"),
            event.get("module_type"),
            event.get("what"),
            event.get("nonfinite"),
            inputs[0],
            inputs[1],
            inputs[2],
            weights[0],
            weights[1],
            weights[2],
            event.get("loss"),
            event.get("detail"),
            path,
        ]
        tables.append("nan_events", row)
        columns = ("ts", "step", "stage", "module", "module_type", "what", "nonfinite", "input_min", "input_max",
                   "input_nonfinite", "weight_min", "weight_max", "weight_nonfinite", "loss", "detail", "record")
        self.events.append(dict(zip(columns, row)))
        del self.events[:-MAX_EVENTS]

    def describe(self) -> dict:
        return {
            "armed": self.armed,
            "checked_steps": self._arm.steps_seen,
            "gpu_waits": self.gpu_waits,
            # Gradients a zero_grad found that no optimizer step used, checked.
            "unstepped_checks": self.unstepped_checks,
            "zero_grads_in_python": self.zero_grads_in_python,
            "tripped_at": self.tripped_at,
            "events": self.events,
            "disabled": self.disabled,
            "numbered": TRACER._numbering(),
        }


_FINITE = []


def _sentinels_of(model, mine) -> list:
    """The sentinels among the parameters `mine` picks: the smallest weight
    of the first module that has one (upstream of everything after it: a
    non-finite gradient made anywhere after reaches it on its way back), or
    of the next ones while it is large or a lookup (a language model's
    embedding), with that module's bias; none where no parameter is picked. A weight's
    gradient is its output's gradient times its input, so a non-finite
    input (a bad batch) spoils it too; a bias's is its output's gradient
    only, which a ReLU after the module zeroes where its output was NaN:
    the bias alone let a NaN batch through unseen, and the update it
    spoiled was blamed a step later. A large weight's gradient is read by
    its first slice (finite.rs, `read_sentinel`), so the size that counts
    is that slice's."""
    fallback = []
    lookups = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    for module in model.modules():
        own = [(name, p) for name, p in module.named_parameters(recurse=False) if mine(p)]
        weights = [p for name, p in own if not name.endswith("bias")]
        fallback += [p for name, p in own]
        # An embedding's rows are its tokens': a row's gradient is made only
        # where the batch has that token (and is sparse, with `sparse=True`).
        if weights and not isinstance(module, lookups):
            weight = min(weights, key=_slice_size)
            if _slice_size(weight) <= MAX_SENTINEL:
                return [weight] + [p for name, p in own if name.endswith("bias")]
    return [min(fallback, key=_slice_size)] if fallback else []


def _slice_size(p) -> int:
    """What the check reads of `p`'s gradient (see `_sentinels_of`)."""
    n = p.numel()
    return n // p.shape[0] if n > 4096 and p.dim() >= 2 and p.shape[0] else n


def _finite_now(grads, loss) -> bool:
    """Whether these gradients and the loss are all finite, read now (on a
    GPU, waiting for the device: only where a step was skipped)."""
    values = [*grads, loss] if loss is not None else list(grads)
    if not values:
        return True
    finite = _finite_check().check(values)
    if finite is not None:
        return finite
    norms = list(_norms([_local(g) for g in grads])) if grads else []
    if loss is not None:
        norms.append(_local(loss))
    if norms[0].device.type == "cpu":
        return all(math.isfinite(v.item()) for v in norms)
    if capturing():
        return True
    return _wait_for_gpu_flag(torch.isfinite(_gathered(norms, norms[0].device)).all())


def _finite_check():
    if not _FINITE:
        _FINITE.append(_native.FiniteCheck(FLOATS))
    return _FINITE[0]


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_now():
    """((device, dtype), ...) of the autocast contexts on now, or None."""
    on = []
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                on.append((device, torch.get_autocast_dtype(device)))
        except (TypeError, RuntimeError, AttributeError):  # a torch before 2.4: CUDA's, asked without a device
            if device == "cuda" and torch.is_autocast_enabled():
                on.append((device, torch.get_autocast_gpu_dtype()))
    return tuple(on) or None


def _autocast_if_on():
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return None
    return _autocast_now()


def _plain_unsafe(module, flagged=True) -> bool:
    """Whether a stand-in on `module` would be seen by dynamo: it is not
    compiled itself, and code the program compiles calls modules (see
    `models.COMPILED_CALLERS`; `flagged=False`: whether it is plain at all)."""
    if module is None:
        return False
    if flagged and not models.COMPILED_CALLERS:
        return False
    return not models.is_compiled(module)


def _has_params(module) -> bool:
    return next(module.parameters(), None) is not None


def _stochastic(model) -> bool:
    """Whether the model's forward draws random numbers, as far as its
    modules tell: dropout of any kind, RReLU, stochastic depth (timm's
    DropPath), a module that keeps a dropout rate, or one whose class's
    own code calls a random function by name (``torch.rand`` for a random
    mask, ``F.dropout``: `_draws_in_code`). A forward that draws them only
    in a function of its own elsewhere is replayed with other draws (the
    program's own RNG state is put back after a replay all the same). A
    module that cannot be asked counts as random."""
    try:
        return _draws(model)
    except Exception:  # noqa: BLE001 - a property of the program's that raises
        return True


# Names whose call draws from torch's generators, as a class's code names them.
_RANDOM_NAMES = frozenset(
    "rand randn randint rand_like randn_like randint_like randperm bernoulli bernoulli_ multinomial "
    "normal normal_ uniform_ exponential_ geometric_ cauchy_ log_normal_ random_ poisson "
    "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout native_dropout "
    "rrelu rrelu_ gumbel_softmax".split()
)
# Per module class: whether its own code names one (looked at once a class).
_random_classes: dict = {}
# How deep the search goes into functions nested in a method's code.
_CODE_DEPTH = 3


def _names_random(code, depth=0) -> bool:
    if not _RANDOM_NAMES.isdisjoint(code.co_names):
        return True
    if depth < _CODE_DEPTH:
        for const in code.co_consts:
            if isinstance(const, types.CodeType) and _names_random(const, depth + 1):
                return True
    return False


def _draws_in_code(cls) -> bool:
    known = _random_classes.get(cls)
    if known is None:
        known = False
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch."):
                break  # torch's own classes are told apart by type above
            for value in vars(klass).values():
                code = getattr(getattr(value, "__func__", value), "__code__", None)
                if isinstance(code, types.CodeType) and _names_random(code):
                    known = True
                    break
            if known:
                break
        if len(_random_classes) < 4096:
            _random_classes[cls] = known
    return known


def _draws(model) -> bool:
    for module in model.modules():
        if isinstance(module, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)):
            return True
        name = type(module).__name__.lower()
        if "drop" in name or "stochastic" in name or "noise" in name:
            return True
        for attr in ("dropout", "dropout_p", "drop_prob", "drop_rate", "attn_dropout", "attention_dropout", "p_drop"):
            value = getattr(module, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return True
        if _draws_in_code(type(module)):
            return True
    return False


# Frames of the program's own code looked at for the loss, up from the
# optimizer step or the zero_grad that tripped (see `_loss_from_frames`),
# and the nodes of a candidate's graph walked to rank it.
LOSS_FRAMES, LOSS_GRAPH_NODES = 8, 256


def _loss_candidates(name, value, depth=0):
    """(name, tensor) of the one-element float tensors with a graph in a
    local: itself, or an entry of a dict, tuple or list it holds (a trainer
    that keeps ``losses = {"ce": ..., "total": ...}``, or returns
    ``(loss, logs)``). By exact type: nothing of the program's runs (a
    proxy's ``__class__``, a mapping's own ``items``)."""
    kind = type(value)
    if issubclass(kind, torch.Tensor):
        if (value.grad_fn is not None and value.is_floating_point() and value.numel() == 1
                and value.device.type != "meta"):
            yield name, value
    elif depth == 0 and kind is dict:
        for key, item in list(value.items())[:64]:
            if type(key) in (str, int):
                yield from _loss_candidates(f"{name}[{key!r}]", item, 1)
    elif depth == 0 and kind in (tuple, list):
        for i, item in enumerate(value[:64]):
            yield from _loss_candidates(f"{name}[{i}]", item, 1)


def _graph_of(tensor) -> tuple[set, bool | None]:
    """The ids of the nodes of `tensor`'s graph (up to LOSS_GRAPH_NODES),
    and whether a backward ran through it: True where a saved tensor of one
    of its nodes was freed (a backward without ``retain_graph`` frees them
    as it goes), False where one could still be read, None where none of
    its nodes saved a tensor."""
    seen: set = set()
    ran = None
    todo = [tensor.grad_fn]
    while todo and len(seen) < LOSS_GRAPH_NODES:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if ran is None:
            for attr in dir(node):
                if not attr.startswith("_saved_"):
                    continue
                try:
                    saved = getattr(node, attr)
                except RuntimeError:  # "... after they have already been freed"
                    ran = True
                    break
                if isinstance(saved, torch.Tensor):
                    ran = False
                    break
        todo.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return seen, ran


def _loss_from_frames(frames=None):
    """(the loss, where it was read) where no stand-in saw the step's loss:
    a loss function's (``F.cross_entropy``), whose value nothing of the
    watch's holds. The training loop still holds it when a check trips, in
    its optimizer step or its zero_grad (or, at exit after an uncaught
    exception, in the traceback's frames: `frames`, innermost first).
    Looked for at a trip only, so an armed step pays nothing for it; the
    frames are read, never changed.

    The candidates are one-element float tensors with a graph in the locals
    of the nearest LOSS_FRAMES of the program's frames, through which a
    backward ran (not the next step's loss, made before the program
    cleared the gradients it skipped). The loss is the one named ``loss``
    (not ``aux_loss``, ``running_loss`` or ``prev_loss``), else one that no
    other candidate's graph holds (``total`` over ``ce`` and ``aux_loss``),
    named with "loss" first, then a non-finite one (a GAN's loss that went
    NaN, not the other model's). A tensor named for nothing of the kind is
    taken only where its graph holds every other candidate of its frame
    (``total = ce + reg``; a weight norm the program's step helper computed
    beside it is not its loss). None: not found."""
    try:
        if frames is None:
            frames = []
            frame = sys._getframe(1)
            while frame is not None and len(frames) < 4 * LOSS_FRAMES:
                frames.append(frame)
                frame = frame.f_back
        candidates = []  # (frame's rank, name, tensor, frame)
        looked = 0
        for frame in frames:
            if looked >= LOSS_FRAMES:
                break
            module = frame.f_globals.get("__name__") or ""
            if module.startswith(("rankscope", "torch")):
                continue
            for name, value in list(frame.f_locals.items()):
                candidates.extend((looked, n, t, frame) for n, t in _loss_candidates(name, value))
            looked += 1
        graphs = {id(c[2]): _graph_of(c[2]) for c in candidates}
        # A graph no backward has run through is a loss still to come (the
        # next step's, made before the program cleared the gradients it
        # skipped), or one kept with `retain_graph`: not this step's to
        # say, where a wrong value would mislead more than none.
        candidates = [c for c in candidates if graphs[id(c[2])][1] is not False]
        if not candidates:
            return None

        def rank(candidate):
            at, name, tensor, _ = candidate
            held = any(id(tensor.grad_fn) in graphs[id(other[2])][0]
                       for other in candidates if other[2] is not tensor)
            finite = bool(torch.isfinite(_local(tensor).detach()).all())
            return (name != "loss", held, "loss" not in name.lower(), finite, at)

        best = min(candidates, key=rank)
        at, name, tensor, frame = best
        if "loss" not in name.lower() and any(
                c[0] == at and c[2] is not tensor and id(c[2].grad_fn) not in graphs[id(tensor)][0] for c in candidates):
            return None
        code = frame.f_code
        where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
        return tensor.detach().reshape(()), f"the loss was read from `{name}` in {code.co_name} ({where})"
    except Exception:  # noqa: BLE001 - a local that will not be read leaves the event without its loss, as before
        return None


def _any_grad_scaler() -> bool:
    """Whether the program holds a GradScaler (or one is left to the
    collector): looked for by type among every object, at exit, where the
    frames `_find_scaler` looks in are gone. A scaler on a CPU needs no
    autocast, and its overflows look like a NaN step's."""
    kinds = models.grad_scaler_kinds()
    return bool(kinds) and bool(_native.gc_instances(kinds))


def _exit_frames():
    """The frames of the exception the program ended with, innermost
    first (the interpreter keeps it for the exit's handlers); None where
    it ended without one (`sys.exit`: its loop's frames are gone)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    tb = getattr(exc, "__traceback__", None)
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1] or None


def _loss_name(step) -> str:
    """The loss module the step called on the model's output; one the
    program made and never called (a criterion left over) is not it."""
    call = step.loss_call
    module = call[0]() if call is not None else None
    return type(module).__name__ if module is not None else "the loss"


class _CollectiveInReplay(Exception):
    """A re-run reached a collective, and was stopped before it was issued."""

    def __init__(self, op):
        super().__init__(op)
        self.op = op


# The c10d operators every collective goes through, from Python or C++
# (functional collectives included).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _world() -> int:
    """How many ranks the default process group has (1 without one)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - no group to ask
        pass
    return 1


def _eager():
    """The replay run eagerly where the program compiled the model: its
    per-module hooks, traced by dynamo, broke the compiled graph (warnings
    in the program's stderr) and compiled new frames the program then ran
    (``model.compile()`` in place, whose root the replay calls)."""
    stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if stance is not None:
        return stance("force_eager")
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.config.patch(disable=True)
    return contextlib.nullcontext()


def _no_collectives():
    """A dispatch mode that stops a re-run at its first collective, before
    it is issued; a no-op outside a job of several ranks."""
    if _world() < 2:
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
                raise _CollectiveInReplay(str(func))
            return func(*args, **(kwargs or {}))

    return NoCollectives()


def _in_micro(event, index, count, forwards=False):
    """An event found in an earlier micro-batch, said so."""
    note = (f"in the model's forward {index + 1} of {count} since its last optimizer step" if forwards
            else f"in micro-batch {index + 1} of {count} of the step (gradient accumulation)")
    event["detail"] = f"{note}; {event['detail']}" if event.get("detail") else note
    return event


def _ddp(model) -> bool:
    parallel = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    return parallel is not None and isinstance(model, parallel)


def _to_ddp_device(model, args, kwargs):
    """The step's inputs as DDP's forward hands them to the module it wraps:
    on its device, where it was given one."""
    ids = getattr(model, "device_ids", None)
    if not ids:
        return args, kwargs
    device = torch.device(getattr(model, "device_type", "cuda"), ids[0]) if isinstance(ids[0], int) else torch.device(ids[0])

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, (list, tuple)):
            return type(value)(move(v) for v in value) if not hasattr(value, "_fields") else type(value)(*(move(v) for v in value))
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    return move(tuple(args)), move(dict(kwargs or {}))


class _Replay:
    """The step's forward run again, with a hook on every module."""

    def __init__(self, model, step):
        self.model, self.step = model, step
        # What the re-run calls: the module DDP wraps, not DDP's forward
        # (see the module's docstring).
        self.inner = model.module if _ddp(model) else model
        self.names = {}
        for name, module in model.named_modules():
            self.names[id(module)] = models.qualified(model, name)
        self.found = None
        self.running: list = []  # (module, its args) whose forward is in progress
        self.output = None
        self.start = None  # where the backward replay started (see `backward`)
        self.loss_module = None  # the loss module it started from

    def _module_entry(self, module, name, args):
        tensors = _inputs_of(args, {})
        return {
            "module": name,
            "module_type": type(module).__name__,
            "inputs": _stats(tensors),
            "weights": _stats(list(module.parameters())),
        }

    def _pre(self, module, args):
        if self.found is None and self.running:
            bad = sum(_nonfinite(t) for t in _inputs_of(args, {}))
            if bad:
                parent, parent_args = self.running[-1]
                name = self.names.get(id(parent), type(parent).__name__)
                # The inputs are the parent's own (finite: else the search
                # would have stopped before it); what its code made is told
                # in words, as the value it handed the child.
                found = self._module_entry(parent, name, parent_args)
                low, high, _ = _stats(_inputs_of(args, {}))
                made = f", which it handed {bad} non-finite value{'s' if bad != 1 else ''}"
                if low is not None:
                    made += f" (the finite ones from {low:.6g} to {high:.6g})"
                child = self.names.get(id(module), type(module).__name__)
                found.update(
                    stage="forward",
                    what=f"its own forward code, before it called {child}{made}",
                    nonfinite=bad,
                )
                self.found = found
        self.running.append((module, args))

    def _post(self, module, args, output):
        if self.running and self.running[-1][0] is module:
            self.running.pop()
        if self.found is None:
            bad = _nonfinite(output)
            if bad:
                found = self._module_entry(module, self.names.get(id(module), type(module).__name__), args)
                found.update(stage="forward", what="its output", nonfinite=bad)
                self.found = found

    def _run(self, pre, post, grad_enabled: bool, then=None):
        """The forward, as the step ran it (its input, and its RNG state
        where it was kept), with `pre` and `post` on every module, and then
        `then(output)` under the same grad mode; returns what `then`
        returns (or the output). After it all, the program's RNG states
        (CPU, and CUDA where it is in use) are put back, and every buffer
        that changed (of the model, and of the loss module called again):
        after `then`, since putting back a buffer that autograd saved
        would make `then`'s backward fail, and only the changed ones (a
        new version, or other values), so that the others' versions stay
        as they were."""
        step = self.step
        rng_now = torch.get_rng_state()
        cuda_now = None
        if torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
            cuda_now = torch.cuda.get_rng_state_all()
        call = step.loss_call
        loss_module = call[0]() if call is not None else None
        owners = [self.model] if loss_module is None else [self.model, loss_module]
        buffers = [(b, b._version, b.detach().clone()) for owner in owners for b in owner.buffers()]
        handles = []
        try:
            for module in self.model.modules():
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
            if step.rng is not None:
                torch.set_rng_state(step.rng)
            if step.cuda_rng is not None:
                torch.cuda.set_rng_state_all(step.cuda_rng)
            args, kwargs = step.args, step.kwargs or {}
            if self.inner is not self.model:
                args, kwargs = _to_ddp_device(self.model, args, kwargs)
            with contextlib.ExitStack() as contexts:
                contexts.enter_context(torch.set_grad_enabled(grad_enabled))
                contexts.enter_context(_no_collectives())
                contexts.enter_context(_eager())
                # Under the autocast the step's forward ran under: float16
                # overflows where a float32 replay would not.
                for device, dtype in step.autocast or ():
                    contexts.enter_context(torch.autocast(device, dtype=dtype))
                output = self.inner(*args, **kwargs)
                return then(output) if then is not None else output
        finally:
            for handle in handles:
                handle.remove()
            with torch.no_grad():
                for buffer, version, saved in buffers:
                    # BatchNorm's kernel updates its running statistics in
                    # place without a new version: their values say. (Each
                    # rank's own shard: comparing a DTensor whole would be
                    # a collective.)
                    if buffer._version != version or not torch.equal(_local(buffer), _local(saved)):
                        buffer.copy_(saved)
            torch.set_rng_state(rng_now)
            if cuda_now is not None:
                torch.cuda.set_rng_state_all(cuda_now)

    def forward(self):
        # With grad on, as the program's own forward ran: a reentrant
        # checkpoint warns into the program's stderr ("None of the inputs
        # have requires_grad=True") when called without it. Its graph goes
        # with the replay.
        self.output = self._run(self._pre, self._post, grad_enabled=True)
        return self.found

    def _roots(self, output) -> tuple:
        """Where the backward starts: the loss, made again where it can be
        (the model returns it, or the step's loss module was called on the
        model's output itself and is called again with the same other
        arguments), else ones at the model's floating outputs."""
        loss = _scalar_loss(output)
        if loss is not None and loss.requires_grad:
            self.start = "the loss the model returned"
            return [loss], [torch.ones_like(loss)]
        call = self.step.loss_call
        module = call[0]() if call is not None else None
        if module is not None and isinstance(output, torch.Tensor):
            # The other arguments detached: the program's backward freed
            # the graph they were part of.
            rest = [a.detach() if isinstance(a, torch.Tensor) else a for a in call[1]]
            named = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in (call[2] or {}).items()}
            try:
                loss = module(output, *rest, **named)
            except Exception:  # noqa: BLE001 - the search goes on from ones
                loss = None
            if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
                self.start = f"the loss ({type(module).__name__}, called again with the step's target)"
                self.loss_module = module
                return [loss], [torch.ones_like(loss)]
        outputs = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
        self.start = ONES if outputs else None
        return outputs, [torch.ones_like(t) for t in outputs]

    def backward(self):
        """Per call of each module: was the gradient reaching its output
        finite, and the ones leaving it (to its inputs and its own
        parameters)?"""
        order = list(self.model.named_modules())
        # Per module, each call's [inputs, outputs]: a module called several
        # times in a step (a recurrent cell, a shared block) sends each
        # call's gradient into the one before it, so they are told apart.
        calls, open_calls = {}, {}
        # A forward run inside the backward is a checkpoint's recompute, not
        # a call of the step's (its tensors are not the graph's).
        task = getattr(torch._C, "_current_graph_task_id", None)

        def recomputing() -> bool:
            return task is not None and task() != -1

        def pre(module, args):
            if recomputing():
                return
            call = [[t for t in _inputs_of(args, {}) if t.requires_grad], []]
            calls.setdefault(id(module), []).append(call)
            open_calls.setdefault(id(module), []).append(call)

        def post(module, args, out):
            if recomputing():
                return
            started = open_calls.get(id(module))
            if started:
                started.pop()[1].extend(t for t in _tensors(out) if t.is_floating_point() and t.requires_grad)

        return self._run(pre, post, grad_enabled=True, then=lambda output: self._backward(output, order, calls))

    def _backward(self, output, order, calls):
        position = {id(m): i for i, (_, m) in enumerate(order)}
        roots, seeds = self._roots(output)
        if not roots:
            return None
        watched = []
        for key, made in calls.items():
            for n, (ins, outs) in enumerate(made):
                watched.extend((key, n, "out", t) for t in outs)
                watched.extend((key, n, "in", t) for t in ins)
        params = [(id(m), p) for _, m in order for p in m.parameters(recurse=False) if p.requires_grad]
        # A tied parameter (a language model's output layer that shares the
        # embedding's weight) sums the gradients of every module that uses
        # it: a NaN in it says nothing of any one of them (the output layer
        # was blamed for a NaN that came in through the embedding).
        uses: dict = {}
        for _, p in params:
            uses[id(p)] = uses.get(id(p), 0) + 1
        params = [(key, p) for key, p in params if uses[id(p)] == 1]
        # (module, call) -> non-finite elements of the gradients that reached
        # its outputs, and that left it for its inputs; module -> those of its
        # own parameters' gradients (summed by autograd over its calls).
        reach, leave, own = {}, {}, {}
        # From a loss module: also the gradient it sent back to the output.
        outs = [output] if self.loss_module is not None else []
        targets = [t for _, _, _, t in watched] + [p for _, p in params] + outs
        grads = torch.autograd.grad(roots, targets, grad_outputs=seeds, allow_unused=True, retain_graph=False)
        if outs and grads[-1] is not None and _nonfinite(grads[-1]):
            return {
                "stage": "backward",
                "module": type(self.loss_module).__name__,
                "module_type": None,
                "what": "the gradient the loss sent back to the model's output",
                "nonfinite": _nonfinite(grads[-1]),
                "inputs": _stats([output]),
                "weights": (None, None, None),
            }
        for (key, n, side, _), grad in zip(watched, grads[: len(watched)]):
            if grad is None:
                continue
            table = reach if side == "out" else leave
            table[key, n] = table.get((key, n), 0) + _nonfinite(grad)
        for (key, _), grad in zip(params, grads[len(watched):len(watched) + len(params)]):
            if grad is not None:
                own[key] = own.get(key, 0) + _nonfinite(grad)

        def origin(module):
            """(the call, or None, and its non-finite count) where `module`
            turned a finite gradient into a non-finite one: a call whose
            output's gradient was finite and whose inputs' was not, or its
            own parameters' gradients where no call's output got a
            non-finite one (they sum every call's)."""
            key = id(module)
            made = range(len(calls.get(key, ())))
            for n in made:
                if reach.get((key, n), 0) == 0 and leave.get((key, n), 0) > 0:
                    return n, leave[key, n] + own.get(key, 0)
            if own.get(key, 0) > 0 and all(reach.get((key, n), 0) == 0 for n in made):
                return None, own[key]
            return None

        found = {id(m): origin(m) for _, m in order}
        candidates = [(name, m) for name, m in order if found[id(m)] is not None]
        # The deepest: a container is a candidate whenever one of its children is.
        deepest = [
            (name, m)
            for name, m in candidates
            if not any(other is not m and any(sub is other for sub in m.modules()) for _, other in candidates)
        ]
        if not deepest:
            return None
        name, module = max(deepest, key=lambda c: position[id(c[1])])
        label = self.names.get(id(module), name)
        n, nonfinite = found[id(module)]
        made = calls.get(id(module), [])
        what = "the gradient it sent back (its output's gradient was finite)"
        if len(made) > 1 and n is not None:
            what += f"; call {n + 1} of its {len(made)} in the step"
        return {
            "stage": "backward",
            "module": label,
            "module_type": type(module).__name__,
            "what": what,
            "nonfinite": nonfinite,
            "inputs": _stats(made[n][0] if n is not None else [t for ins, _ in made for t in ins]),
            "weights": _stats(list(module.parameters())),
        }


def _write_record(step_number, event) -> str | None:
    """A crash-style record (``rankscope crashes`` lists it): the training
    thread's stack at the trip, with its locals, and what was found."""
    try:
        from rankscope._probe import crashes

        message = (
            f"non-finite value first seen at step {step_number} in {event.get('stage')}: "
            f"{event.get('module')} ({event.get('what')})"
        )

        class NonFiniteValue(ArithmeticError):
            pass

        # Named as the docs and `crashes` show it, not by where it is made.
        NonFiniteValue.__module__ = "rankscope"
        NonFiniteValue.__qualname__ = "NonFiniteValue"
        exc = NonFiniteValue(message)
        exc.__traceback__ = _traceback_here()
        rec = crashes.build_record(exc, "nan-watch", thread_name=_thread_name())
        rec["nan_event"] = {k: v for k, v in event.items() if k not in ("inputs", "weights")}
        rec["nan_event"]["step"] = step_number
        name = f"crash-{int(rec['time'] * 1000)}-rank{rec['rank']}-pid{rec['pid']}.json"
        import json

        from rankscope._probe.torch import _no_nan

        data = json.dumps(_no_nan(rec), ensure_ascii=False, default=str).encode("utf-8", "backslashreplace")
        return crashes._write_atomically(crashes.run_dir(), name, data)
    except Exception as err:  # noqa: BLE001 - the row is still kept
        try:
            sys.stderr.write(f"rankscope: NaN record not written: {type(err).__name__}: {err}\n")
        except Exception:  # noqa: BLE001
            pass
        return None


def _traceback_here():
    """A traceback of the calling thread's user frames (rankscope's and
    torch's own left in: the reader cuts at the user's)."""
    import types

    frame = sys._getframe(1)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    tb = None
    for frame in frames:
        if os.sep + "rankscope" + os.sep in frame.f_code.co_filename:
            continue
        tb = types.TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
    return tb


def _thread_name() -> str:
    threading = sys.modules.get("threading")
    if threading is not None:
        return threading.current_thread().name
    return "MainThread"


WATCH = NanWatch()
