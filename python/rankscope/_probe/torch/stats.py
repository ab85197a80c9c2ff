"""Gradient statistics (``torch grads``: ``python.grad_stats``) and
activation statistics (``torch activations``: ``python.activation_stats``)
at sampled steps (``step % every == 0``, the same steps on every rank).

Gradients are read at the optimizer's pre-hook, where they are whole and
the weights not yet updated: norms and max |g| of all of an optimizer's
gradients, the weights' norms, and the update's norm from a copy of the
weights taken there and compared at the post-hook. On a GPU these are
fused kernels (``torch._foreach_norm``). On a CPU they are read in place
(``_native.GradRead``): one pass over each gradient, one that copies each
weight, one over the copy and the weight after the step, and no torch
call; through torch that was six passes and about 30 dispatcher calls, 4 %
of a small model's step at ``--every 10``. That copy is taken only while the parameters
come to at most ``RANKSCOPE_GRAD_UPDATE_MB`` (256 MB by default), so the
feature never doubles a large model's memory; past it the ratio is null.
Up to 16 MB the copies are kept between sampled steps and copied into.
A non-finite count is computed only for a gradient whose norm is not
finite (it is 0 otherwise). Everything is read with one transfer per step:
at once on a CPU, through a CUDA event at a later boundary on a GPU.

Flags compare each parameter with its own history (an exponential average
of its gradient norm, after three samples): ``exploding`` past 10x,
``vanishing`` under 1/100 (or exactly 0), ``nonfinite``.

Activations: a forward hook on each chosen module, attached only around
sampled steps as the trace's are; its first floating output's mean, std,
max |x|, zero fraction and non-finite count, computed without a gradient
and read like the gradients'.
"""

from __future__ import annotations

import fnmatch
import math
import os
import time
import weakref

import torch

from rankscope import _native
from rankscope._probe.torch import models, tables, timed
from rankscope._probe.torch.trace import TRACER, _local, _tensors, capturing

WARMUP = 3
# What `grads` and `activations` say while no model is known (as `trace on` does).
NO_MODEL_YET = "no model found yet: the probe looks again when an optimizer steps (or at rankscope.step())"
# Up to this size the weights' copies are kept between sampled steps.
KEEP_COPIES_BYTES = 16 << 20
EXPLODING, VANISHING = 10.0, 0.01
DECAY = 0.9


# The float types read in place on a CPU (the order the native readers
# take them in), and those whose norms are taken in float32.
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALVES = (torch.float16, torch.bfloat16)


def _resolver(values, event):
    """The host copy of `values` once its CUDA event has passed."""

    def resolve():
        if event is not None and not event.query():
            raise LookupError("not yet")
        return values.tolist()

    return resolve


def _to_host(stacked):
    """(resolver, ready now): a CPU tensor is read at once; a GPU one is
    copied out without a sync and read once its event has passed (an event
    on the tensor's own device: see trace._cuda_event)."""
    if stacked.device.type == "cpu":
        return (lambda: stacked.tolist()), True
    host = stacked.to("cpu", non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(stacked.device))
    return _resolver(host, event), False


def _norms(tensors, ord=2):
    """Each tensor's norm; half-precision ones in float32, so that a half
    gradient's norm past 65504 is not infinite (float64, sparse and
    DTensor gradients refuse a float32 `dtype`, and keep their own).
    Empty tensors count 0."""
    tensors = [t if t.numel() else t.new_zeros(1) for t in tensors]
    halves = [i for i, t in enumerate(tensors) if t.dtype in HALVES]
    if not halves:
        return torch._foreach_norm(tensors, ord)
    try:
        wide = torch._foreach_norm([tensors[i] for i in halves], ord, dtype=torch.float32)
    except (TypeError, RuntimeError):  # an older torch
        wide = torch._foreach_norm([tensors[i].float() for i in halves], ord)
    if len(halves) == len(tensors):
        return wide
    # A mixed list: the others in their own type, in their places.
    out = list(torch._foreach_norm([t for t in tensors if t.dtype not in HALVES], ord))
    for at, norm in zip(halves, wide):
        out.insert(at, norm)
    return out


def _values(grad):
    """A gradient's values as a dense tensor: a sparse one's stored values
    (an ``Embedding(sparse=True)``'s), summed where an index repeats, which
    have its norm, extremes and non-finite count; any other as it is."""
    if grad.layout == torch.strided:
        return grad
    if grad.is_sparse:
        return grad.coalesce().values()
    return grad.values()  # compressed layouts (CSR and the like)


def _gathered(values, device):
    """Scalars onto one device (a model split over GPUs), in one stack
    where they are there already."""
    try:
        return torch.stack(list(values)).to(device)
    except RuntimeError:
        return torch.stack([v.reshape(()).to(device) for v in values])


def _drain(waiting: list, rows) -> list:
    """Hands the values that have arrived to `rows`; returns those still
    on their way (the newest 64: a GPU that never answers costs no memory)."""
    if waiting and capturing():
        return waiting  # no event is queried inside a CUDA graph's capture
    still = []
    for resolve, meta in waiting:
        try:
            rows(resolve(), meta)
        except LookupError:
            still.append((resolve, meta))
    return still[-64:]


class GradStats:
    # Heard only at sampled steps, after a pre-hook that kept something, and
    # while a GPU's values are on their way (see `tell` in step_clock.rs).
    WHEN = {"optimizer_pre": "sampled", "optimizer_post": "before", "boundary": "waiting"}

    def __init__(self):
        self.on = False
        self.every = 10
        self.disabled = None
        self.history: dict = {}  # param name -> (samples, running norm)
        self.names: dict = {}  # id(param) -> (name, module name)
        # optimizer id -> (its weakref, step, params, values, copies): from
        # its pre-hook to its post-hook. An optimizer whose step raised in
        # between never reaches the post-hook: its entry goes when it is
        # freed (`_optimizer_gone`), not kept with its parameters.
        self.before: dict = {}
        self.waiting: list = []  # (resolver, rows meta) read at a later boundary
        self.cap = int(os.environ.get("RANKSCOPE_GRAD_UPDATE_MB", "256") or 256) << 20
        self.params = 0
        self.last: list = []  # the last sampled step's rows
        self.kept = None  # (optimizer weakref, buffers): the last copies, for a small model
        # optimizer id -> (its weakref, _native.GradRead): a CPU's statistics
        self.readers: dict = {}
        self.read_at: dict = {}  # optimizer id -> (its weakref, the step it was last read at)

    def turn_on(self, every: int) -> dict:
        if every < 1:
            raise ValueError("--every must be 1 or more")
        self.every = every
        self.disabled = None
        TRACER.add_listener(self)
        self._name_params()
        self.on = True
        return self.describe()

    def turn_off(self) -> dict:
        self.on = False
        TRACER.remove_listener(self)
        self.before.clear()
        self.kept = None
        self.readers.clear()
        described = self.describe()
        self.disabled = None  # said once: a look from now on turns it on
        return described

    def failed(self, reason: str) -> None:
        self.disabled = reason
        self.on = False
        self.before.clear()
        self.kept = None
        self.readers.clear()

    def _name_params(self, found=None):
        names = {}
        trained = 0
        for model in TRACER.live_models() if found is None else found:
            for name, param in model.named_parameters():
                names[id(param)] = (models.qualified(model, name), models.qualified(model, name.rpartition(".")[0]))
                trained += param.requires_grad  # a frozen one never has a gradient to read
        self.names = names
        self.params = trained

    def _name_unknown(self, params) -> None:
        """Names for parameters the models known so far do not hold: the
        first sampled step may come before the step clock's first boundary
        has found the models (RANKSCOPE_TORCH=grads at start), so they are
        looked for here. Parameters of no model keep positional names, and
        are not looked for again."""
        self._name_params(models.discover()[0])
        unnamed = [p for p in params if id(p) not in self.names]
        if unnamed:
            names = dict(self.names)
            for i, p in enumerate(params):
                names.setdefault(id(p), (f"param{i}", "?"))
            self.names = names

    def optimizer_pre(self, optimizer, step):
        # Called at sampled steps only (WHEN).
        if not self.on:
            return
        read = self.read_at.get(id(optimizer))
        if read is not None and read[1] == step and read[0]() is optimizer:
            # Its second step in one step: where a later optimizer took
            # over marking steps, the step in progress spans two of its
            # calls (see `weigh` in step_clock.rs). The first one's rows
            # stand; a second set would give each parameter two rows.
            return
        params = models.params_with_grads(optimizer)
        if self.before:
            # Another optimizer's step of this step is open: this one steps
            # inside it (ZeroRedundancyOptimizer's local one, a wrapper's
            # inner one), over parameters already read there.
            taken = {id(p) for entry in self.before.values() if entry[1] == step for p in entry[2]}
            params = [p for p in params if id(p) not in taken]
        if not params:
            return
        if len(self.read_at) >= 64:
            # Optimizers the program made and dropped (one per phase, or
            # per run of a sweep) are not kept track of for ever.
            self.read_at = {k: v for k, v in self.read_at.items() if v[0]() is not None}
        self.read_at[id(optimizer)] = (weakref.ref(optimizer), step)
        if any(id(p) not in self.names for p in params):
            self._name_unknown(params)
        grads = [p.grad for p in params]
        if grads[0].device.type == "cpu" and self._native_pre(optimizer, step, params, grads):
            return
        if grads[0].device.type != "cpu" and capturing():
            return  # a captured step: no copy out, no event (see trace.capturing)
        # Values through torch: a sharded parameter's own shard, read
        # without a collective (see trace._local); the rows say so by its
        # size. The parameters themselves stay, for their names.
        local = [_local(p) for p in params]
        grads = [_values(_local(g)) for g in grads]
        if grads[0].device.type == "cpu" and self._native_pre(optimizer, step, local, grads, params):
            return
        size = sum(p.numel() * p.element_size() for p in local)
        device = grads[0].device
        with torch.no_grad():
            norms = _gathered(_norms(grads), device)
            if device.type == "cpu":
                # The inf-norm kernel is 25x slower than aminmax on a CPU.
                lows, highs = zip(*(torch.aminmax(g) if g.numel() else (g.new_zeros(()), g.new_zeros(())) for g in grads))
                maxes = torch.maximum(torch.stack(highs), torch.stack(lows).neg()).float()
            else:
                maxes = _gathered(_norms(grads, math.inf), device)
            weights = _gathered(_norms([p.detach() for p in local]), device)
            stacked = torch.stack([norms, maxes, weights])
            copies = self._copies(optimizer, local, size)
        self.before[id(optimizer)] = (weakref.ref(optimizer, self._optimizer_gone), step, params, stacked, copies, local)

    def _native_pre(self, optimizer, step, params, grads, named=None) -> bool:
        """On a CPU: the statistics read in place (``_native.GradRead``,
        crates/rankscope-probe/src/grad_read.rs), one pass over each tensor
        and no torch call; False where a tensor is not one it reads
        (strided, another dtype), and torch's kernels do it. The
        parameters are read as they are (no ``detach()``: nothing here
        goes through autograd)."""
        reader = self.readers.get(id(optimizer))
        if reader is None or reader[0]() is not optimizer:
            for key in [k for k, entry in list(self.readers.items()) if entry[0]() is None]:
                self.readers.pop(key, None)
            # Its copies of the weights (up to 16 MB kept between sampled
            # steps) go with the optimizer.
            reader = self.readers[id(optimizer)] = (weakref.ref(optimizer, self._optimizer_gone), _native.GradRead(FLOATS))
        read = reader[1]
        got = read.norms(grads)
        if got is None:
            return False
        weight_norms = read.keep(params, self.cap)
        if weight_norms is None:
            return False
        self.before[id(optimizer)] = (reader[0], step, named or params, (got[0], got[1], weight_norms), read, params)
        return True

    def _optimizer_gone(self, gone) -> None:
        """An optimizer was freed: what was kept for it goes too (the
        program's memory is then what it would be without rankscope)."""
        # On whichever thread let the optimizer go: the dicts are replaced,
        # never changed in place (a step may be iterating them), and nothing
        # raises (it would be printed, in the program's stderr).
        try:
            before = list(self.before.items())
            if any(entry[0] is gone for _, entry in before):
                # A step that raised between the hooks: its parameters.
                self.before = {key: entry for key, entry in before if entry[0] is not gone}
            entries = list(self.readers.items())  # one C call: a consistent copy
            if any(entry[0] is gone for _, entry in entries):
                self.readers = {key: entry for key, entry in entries if entry[0] is not gone}
                for _, (ref, read) in entries:
                    if ref is gone:
                        read.release()
            kept = self.kept
            if kept is not None and kept[0] is gone:
                self.kept = None
        except Exception:  # noqa: BLE001
            pass

    def _meta(self, step, params, have_update, read_now, local) -> tuple:
        """What a step's rows are made with besides its values (sizes: of
        what was read, a sharded parameter's own shard). Read later (a
        GPU), the gradients are another step's by then: a non-finite
        norm's count is left null, not counted on those (no `params`)."""
        names = [self.names.get(id(p), (f"param{i}", "?")) for i, p in enumerate(params)]
        return (time.time(), step, names, [p.numel() for p in local], have_update, params if read_now else None)

    def _copies(self, optimizer, params, size):
        """The weights before the update, for its norm: into buffers kept
        from the last sampled step for a small model (allocating them each
        time cost more than copying), fresh ones up to the cap, else None."""
        if size > self.cap:
            return None
        weights = [p.detach() for p in params]
        if size > KEEP_COPIES_BYTES:
            self.kept = None
            return [w.clone() for w in weights]
        kept = self.kept
        if kept is not None and kept[0]() is optimizer and len(kept[1]) == len(weights) and all(
            b.shape == w.shape and b.dtype == w.dtype and b.device == w.device for b, w in zip(kept[1], weights)
        ):
            copy = getattr(torch, "_foreach_copy_", None)
            if copy is not None:
                copy(kept[1], weights)
            else:
                for buffer, weight in zip(kept[1], weights):
                    buffer.copy_(weight)
            return kept[1]
        copies = [w.clone() for w in weights]
        self.kept = (weakref.ref(optimizer, self._optimizer_gone), copies)
        return copies

    def optimizer_post(self, optimizer, step):
        taken = self.before.pop(id(optimizer), None)
        if taken is None:
            return
        if not self.on:
            # Turned off since the pre-hook: its copy goes too.
            if isinstance(taken[4], _native.GradRead):
                taken[4].release()
            return
        _, step, params, stacked, copies, local = taken
        if isinstance(copies, _native.GradRead):
            updates = copies.update(local)
            if copies.kept_bytes > KEEP_COPIES_BYTES:
                copies.release()
            if len(self.readers) > 1:
                # One copy kept between sampled steps in all, as one slot
                # did (an optimizer gone leaves a reader with none).
                for _, other in self.readers.values():
                    if other is not copies:
                        other.release()
            self._rows((*stacked, updates), self._meta(step, params, updates is not None, True, local))
            return
        with torch.no_grad():
            if copies is not None:
                # In place on the copies: before - after, with no new buffers.
                torch._foreach_sub_(copies, [p.detach() for p in local])
                updates = _gathered(_norms(copies), stacked.device)
            else:
                updates = torch.full_like(stacked[0], float("nan"))
            both = torch.cat([stacked, updates.reshape(1, -1).to(stacked.device)])
        resolve, now = _to_host(both)
        meta = self._meta(step, params, copies is not None, now, local)
        if now:
            self._rows(resolve(), meta)
        else:
            self.waiting.append((resolve, meta))

    def boundary(self, step):
        self.waiting = _drain(self.waiting, self._rows)

    def _rows(self, values, meta):
        wall, step, names, sizes, have_update, params = meta
        norms, maxes, weights, updates = values
        rows = []
        for i, (name, module) in enumerate(names):
            norm = norms[i]
            nonfinite = 0
            if not math.isfinite(norm):
                grad = _values(_local(params[i].grad)) if params is not None and params[i].grad is not None else None
                nonfinite = int((~torch.isfinite(grad)).sum()) if grad is not None else None
            update = updates[i] if have_update else None
            ratio = update / weights[i] if update is not None and weights[i] > 0 else None
            rows.append([wall, step, name, module, sizes[i], norm, maxes[i], nonfinite, weights[i], ratio, self._flag(name, norm)])
        tables.extend("grad_stats", rows)
        # Summed up only when asked (`describe`). A step of several
        # optimizers (a GAN's) is summed up over all of theirs.
        last = self.last
        if rows and last and last[0][1] == step:
            self.last = last + rows
        else:
            self.last = rows

    def _flag(self, name, norm) -> str | None:
        if not math.isfinite(norm):
            return "nonfinite"
        samples, running = self.history.get(name, (0, 0.0))
        flag = None
        if samples >= WARMUP and running > 0:
            if norm > EXPLODING * running:
                flag = "exploding"
            elif norm < VANISHING * running:
                flag = "vanishing"
        self.history[name] = (samples + 1, norm if samples == 0 else DECAY * running + (1 - DECAY) * norm)
        return flag

    def describe(self) -> dict:
        if self.on and not self.params:
            # Models that came after `on` (named at the first sampled step
            # otherwise): `count` says what will be read.
            self._name_params(models.discover()[0])
        described = {
            "on": self.on,
            "every": self.every,
            "count": self.params,
            "rows": tables.sizes().get("grad_stats", 0),
            "disabled": self.disabled,
            "numbered": TRACER._numbering(),
            "last": _summary(self.last),
        }
        if self.on and not self.params:
            described["note"] = NO_MODEL_YET
        return described


def _summary(rows) -> dict | None:
    """The last sampled step at a glance: its total gradient norm (over
    every parameter, as ``clip_grad_norm_`` takes it), the largest norms,
    and every parameter flagged."""
    if not rows:
        return None
    norms = [(r[2], r[5]) for r in rows if r[5] is not None]
    finite = [n for _, n in norms if math.isfinite(n)]
    bad = [n for _, n in norms if not math.isfinite(n)]
    total = bad[0] if bad else math.sqrt(sum(n * n for n in finite))
    largest = sorted((n, name) for name, n in norms if math.isfinite(n))[-5:][::-1]
    return {
        "step": rows[0][1],
        "total_norm": total,
        "largest": [{"param": name, "norm": n} for n, name in largest],
        "flagged": [{"param": r[2], "flag": r[10], "norm": r[5]} for r in rows if r[10]],
    }


# Outputs up to this many elements get exact statistics through a float32
# copy; larger ones (a language model's logits: 8 x 4096 x 128k) are reduced
# in place, with no copy of their size.
ACTIVATION_COPY_MAX = 1 << 24


def _activation(x):
    """[mean, std, max |x|, zero fraction, non-finite count, element count]
    of `x`, on its device, without a sync."""
    n = x.numel()
    if n == 0:
        # Made on the device itself: a list copied from the host would be a
        # stream sync at every call.
        out = x.new_full((6,), float("nan"), dtype=torch.float32)
        out.narrow(0, 4, 2).zero_()  # a fill: `out[4] = 0` copies from the host on older torch
        return out
    if n <= ACTIVATION_COPY_MAX:
        values = x.float()
        std, mean = torch.std_mean(values) if n > 1 else (torch.zeros((), device=x.device), values.mean())
        finite = torch.isfinite(x)
        return torch.stack([mean, std, values.abs().max(), (x == 0).float().mean(), (finite.numel() - finite.sum()).float(),
                            mean.new_full((), n)])
    # Sums in (at least) float32 as the reduction reads; std from the sum
    # of squares (one pass, so less exact where the mean dwarfs the spread).
    wide = torch.promote_types(x.dtype, torch.float32)
    total = x.sum(dtype=wide)
    squares = torch.linalg.vector_norm(x, dtype=wide).square()
    mean = total / n
    std = ((squares - total * mean).clamp_min(0) / (n - 1)).sqrt()
    return torch.stack([
        mean,
        std,
        torch.linalg.vector_norm(x, float("inf"), dtype=wide),
        (n - torch.count_nonzero(x)).to(wide) / n,
        (n - torch.isfinite(x).sum()).to(wide),
        mean.new_full((), n),
    ]).float()


def _calls(values):
    """A module's statistics over its calls in a step (a shared layer, an
    RNN cell), as of all their outputs together: means and zero fractions
    weighted by size, the spread pooled with the calls' own means, the
    largest |x|, the non-finite values summed. On the device, no sync."""
    v = torch.stack(values)
    n, mean = v[:, 5], v[:, 0]
    used = n > 0  # an empty output's row is NaN: it weighs nothing
    zero = torch.zeros_like(n)
    total = n.sum()
    mean_all = torch.where(used, n * mean, zero).sum() / total
    spread = torch.where(used, (n - 1).clamp_min(0) * v[:, 1].square() + n * (mean - mean_all).square(), zero).sum()
    return torch.stack([
        mean_all,
        (spread / (total - 1)).sqrt(),
        torch.where(used, v[:, 2], torch.full_like(n, float("-inf"))).max(),
        torch.where(used, n * v[:, 3], zero).sum() / total,
        v[:, 4].sum(),
        total,
    ])


def _nothing(args, kwargs):
    return None


# A tensor inside a torch.func transform (vmap's batched one, grad's
# wrapper): statistics of it would be traced into the transform, and come
# out as batched tensors that no row can hold (torch asserts inside).
_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda tensor: False)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class _TakenOff:
    """A stand-in's entry (timed.put_on) with a hook handle's `remove()`."""

    __slots__ = ("entry",)

    def __init__(self, entry):
        self.entry = entry

    def remove(self):
        timed.take_off(self.entry)


class _Watched:
    __slots__ = ("name", "type", "values", "calls", "shape", "dtype", "trained")

    def __init__(self, name, type_name):
        self.name, self.type = name, type_name
        self.values: list = []
        self.calls = 0
        self.shape = self.dtype = None
        self.trained = False


class ActivationStats:
    def __init__(self):
        self.on = False
        self.every = 1
        self.glob = "*"
        self.disabled = None
        self.plan: list = []  # (module ref, _Watched)
        self.handles: list = []
        self.waiting: list = []

    def turn_on(self, glob: str, every: int) -> dict:
        if every < 1:
            raise ValueError("--every must be 1 or more")
        was_on = self.on
        # Before the plan: see models.hold.
        models.hold(self.take_off_plain)
        # The clock finds the models where it has none yet.
        TRACER.add_listener(self)
        found = TRACER.live_models()
        plan, names = self._plan(found, glob)
        if found and not plan:
            # A request refused leaves the running watch as it was.
            if not was_on:
                TRACER.remove_listener(self)
                models.release(self.take_off_plain)
            from rankscope._probe.torch.trace import UserError

            raise UserError(models.no_match(glob, names, found))
        self._detach()
        # No model yet: as the trace does, it waits for the models the step
        # clock finds (`boundary`).
        self.plan, self.glob, self.every = plan, glob, every
        self.disabled = None
        self.on = True
        return self.describe()

    def take_off_plain(self) -> bool:
        """dynamo begins to compile the program's code (`models.hold`): the
        hooks come off, and the plan is made again at the next boundary,
        with compiled modules only."""
        had = bool(self.handles)
        self._detach()
        self.plan = []
        return had

    @staticmethod
    def _plan(found, glob) -> tuple[list, list]:
        """(module ref, _Watched) for each module of `found` that `glob`
        matches, and every name it was matched against."""
        plan, names = [], []
        for model in found:
            for name, module in models.outside_compiled(model):
                qualified = models.qualified(model, name)
                names.append(qualified)
                if glob in ("*", "") or fnmatch.fnmatchcase(qualified, glob) or (name and fnmatch.fnmatchcase(name, glob)):
                    plan.append((weakref.ref(module), _Watched(qualified, type(module).__name__)))
        return plan, names

    def turn_off(self) -> dict:
        self.on = False
        self._detach()
        models.release(self.take_off_plain)
        TRACER.remove_listener(self)
        described = self.describe()
        self.disabled = None  # said once: a look from now on turns it on
        return described

    def failed(self, reason: str) -> None:
        self.disabled = reason
        self.on = False
        self._detach()
        models.release(self.take_off_plain)

    def _detach(self):
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()

    # Not heard (see trace.EVENTS): the boundary is enough.
    optimizer_pre = optimizer_post = None

    def boundary(self, step):
        """The step that ended gives its rows; the next one is hooked if sampled."""
        if self.handles and not capturing():
            self._finish(step - 1)
        self._detach()
        self.waiting = _drain(self.waiting, self._rows)
        if self.on and not self.plan and TRACER.models:
            # Turned on before there was a model: the clock has found them.
            found = TRACER.live_models()
            self.plan, names = self._plan(found, self.glob)
            if found and not self.plan:
                TRACER.remove_listener(self, wait_s=0)
                self.failed(models.no_match(self.glob, names, found))
                return
        if self.on and step % self.every == 0:
            for ref, watched in self.plan:
                module = ref()
                if module is not None:
                    watched.values, watched.calls, watched.trained = [], 0, False
                    hook = self._hook(watched)
                    if module.__dict__.get("_compiled_call_impl") is not None:
                        # Compiled in place (`module.compile()`): its hooks run
                        # inside the compiled call, so a stand-in goes on that
                        # call instead, as the trace's does (timed.boundary).
                        entry = timed.put_on(module, lambda inner, hook=hook: timed.seen(inner, _nothing, lambda args, out: hook(None, args, out)))
                        if entry is not None:
                            self.handles.append(_TakenOff(entry))
                    else:
                        self.handles.append(module.register_forward_hook(hook))

    def _hook(self, watched):
        owner = self

        def post(module, args, output):
            try:
                if watched.calls and _in_backward():
                    # An activation checkpoint's recompute, inside the
                    # backward: the same output again (see stand_in.rs).
                    return
                tensor = next((t for t in _tensors(output) if t.is_floating_point()), None)
                if tensor is None or (tensor.is_cuda and capturing()) or _wrapped(tensor):
                    return
                # A step that trains says what its training calls saw: a
                # validation pass (without grad) in it would mix another
                # data set's activations in. A step with no training call
                # (an inference loop) keeps its calls.
                if torch.is_grad_enabled():
                    if not watched.trained:
                        watched.values, watched.calls, watched.trained = [], 0, True
                elif watched.trained:
                    return
                with torch.no_grad():
                    watched.values.append(_activation(_local(tensor).detach()))
                watched.calls += 1
                watched.shape, watched.dtype = "x".join(map(str, tensor.shape)), str(tensor.dtype).removeprefix("torch.")
            except Exception as exc:  # noqa: BLE001
                owner.failed(f"the forward hook of {watched.name} failed: {type(exc).__name__}: {exc}")

        return post

    def _finish(self, step):
        seen = [(w, _calls(w.values) if len(w.values) > 1 else w.values[0]) for _, w in self.plan if w.values]
        if not seen:
            return
        stacked = torch.stack([v.to(seen[0][1].device) for _, v in seen])
        resolve, now = _to_host(stacked)
        meta = (time.time(), step, [(w.name, w.type, w.calls, w.shape, w.dtype) for w, _ in seen])
        if now:
            self._rows(resolve(), meta)
        else:
            self.waiting.append((resolve, meta))

    def _rows(self, values, meta):
        wall, step, described = meta
        rows = []
        for (name, type_name, calls, shape, dtype), (mean, std, max_abs, zero_frac, nonfinite, _) in zip(described, values):
            rows.append([wall, step, name, type_name, calls, shape, dtype, mean, std, max_abs, zero_frac, int(nonfinite)])
        tables.extend("activation_stats", rows)

    def describe(self) -> dict:
        described = {
            "on": self.on,
            "every": self.every,
            "modules": self.glob,
            "count": len(self.plan) if self.on else 0,
            "rows": tables.sizes().get("activation_stats", 0),
            "disabled": self.disabled,
            "numbered": TRACER._numbering(),
        }
        if self.on and not self.plan:
            described["note"] = NO_MODEL_YET
        return described


GRADS = GradStats()
ACTIVATIONS = ActivationStats()
