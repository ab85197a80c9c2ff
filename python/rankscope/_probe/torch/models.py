"""Finding the program's models and optimizers, and describing them.

Imported only once the program has imported torch (see ``__init__``).
Optimizers are found in the collector's lists (instances of ``torch.optim.Optimizer``),
and the models through their parameter groups: a model is a root module
(one that is no other module's child) holding a parameter an optimizer
updates. Without an optimizer, every root module with parameters counts.
Loss modules (``nn.modules.loss._Loss``) that are roots are kept apart:
their outputs are the step's loss.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from rankscope import _native

# A row of `rankscope PID torch` lists this many top-level children.
MAX_CHILDREN_SHOWN = 20
# The module tree `torch` shows: this deep, this many rows at most.
MAX_TREE_DEPTH = 3
MAX_TREE_ROWS = 60
# Hyperparameters printed per param group (tensors and long lists are left out).
_SCALAR_TYPES = (bool, int, float, str, type(None))


def _roots(modules: list) -> list:
    children = {id(child) for module in modules for child in module.children()}
    return [module for module in modules if id(module) not in children]


def discover(objects: list | None = None) -> tuple[list, list, list]:
    """(models, optimizers, loss modules) of the program as it is now
    (`objects`: what ``gc.get_objects()`` gave the caller already, else the
    collector's lists are walked natively)."""
    module_type, optimizer_type = torch.nn.Module, torch.optim.Optimizer
    if objects is None:
        # The collector's lists walked in place: no list of every object.
        objects = _native.gc_instances((module_type, optimizer_type))
    # type(), not isinstance(): isinstance falls back to an object's
    # __class__, which some objects answer with a warning (torch's own
    # deprecated `reduce_op`) or with code of their own. Each type is
    # asked once (set(map(type, ...)) runs in C), then a comprehension keeps
    # the objects of the types that matter.
    kinds = set(map(type, objects))
    module_kinds = {kind for kind in kinds if issubclass(kind, module_type)}
    optimizer_kinds = {kind for kind in kinds if issubclass(kind, optimizer_type)}
    modules = [obj for obj in objects if type(obj) in module_kinds]
    found_optimizers = [obj for obj in objects if type(obj) in optimizer_kinds]
    roots = _roots(modules)
    loss_type = torch.nn.modules.loss._Loss
    losses = [root for root in roots if isinstance(root, loss_type)]
    if found_optimizers:
        updated = {id(p) for opt in found_optimizers for group in opt.param_groups for p in group["params"]}
        models = [root for root in roots if any(id(p) in updated for p in root.parameters())]
    else:
        models = [root for root in roots if not isinstance(root, loss_type) and next(root.parameters(), None) is not None]
    models = _without_parts(models)
    _label(models)
    return models, found_optimizers, losses


def _without_parts(models: list) -> list:
    """The models less any that another holds under another name: a module
    whose parameters are exactly those of another model's submodule (the
    eager original of a ``torch.jit.script``ed child, which jit keeps alive,
    and whose parameters the scripted child shares) is no model of its own.
    Two models that share some weights (a tied embedding and head made
    apart) are both kept."""
    if len(models) < 2:
        return models
    owned = [{id(p) for p in model.parameters()} for model in models]
    parts = []
    for i, model in enumerate(models):
        first = next(iter(owned[i]), None)
        for j, other in enumerate(models):
            if j == i or first not in owned[j] or not owned[i] < owned[j]:
                continue
            # A submodule of the other with these very parameters.
            if any(
                {id(p) for p in sub.parameters()} == owned[i]
                for sub in other.modules()
                if sub is not other and any(id(p) == first for p in sub.parameters())
            ):
                parts.append(model)
                break
    return [model for model in models if not any(model is part for part in parts)]


# id(model) -> the label its modules' names start with, where the program
# has more than one model (a GAN's two): their own names (`main.0`) would
# be alike. Set by each `discover`.
_LABELS: dict = {}


def _label(found: list) -> None:
    global _LABELS
    if len(found) < 2:
        _LABELS = {}
        return
    labels, used = {}, set()
    for model in found:
        label = label_in_main(model) or root_name(model)
        n = 1
        while (label if n == 1 else f"{label}#{n}") in used:
            n += 1
        label = label if n == 1 else f"{label}#{n}"
        used.add(label)
        labels[id(model)] = label
    _LABELS = labels


# What torch.compile's wrapper calls the module it wraps, with the dot.
_WRAPPED = "_orig_mod."


def qualified(model, name: str) -> str:
    """The name the tables give `model`'s module (or parameter) `name`
    (as ``named_modules()`` names it; "" for the root): the name itself,
    the root by its class; with several models, each name after its
    model's label (the variable in ``__main__`` that holds it, else its class).
    The module ``torch.compile`` wrapped goes by its own names: ``root``,
    not ``_orig_mod.root`` (the wrapper's), as the program's code and its
    saved checkpoints of the uncompiled model name it."""
    if name.startswith(_WRAPPED) or name == _WRAPPED[:-1]:
        if is_compiled(model):
            name = name[len(_WRAPPED):]
    label = _LABELS.get(id(model))
    if label is None:
        return name or root_name(model)
    return f"{label}.{name}" if name else label


def params_with_grads(optimizer) -> list:
    """The optimizer's parameters that have a gradient this step."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def completed_steps(optimizer) -> int | None:
    """How many steps the optimizer has taken, where it keeps that count
    (per-parameter ``state['step']``, as Adam does), read without a device
    sync: None for a count on a GPU, or an optimizer without one (SGD)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            value = state.get("step") if state else None
            if isinstance(value, (int, float)):
                return int(value)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
                return int(value.item())
            return None
    return None


def _hyperparameters(group: dict) -> dict:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, _SCALAR_TYPES):
            out[key] = value
        elif isinstance(value, tuple) and all(isinstance(v, _SCALAR_TYPES) for v in value):
            out[key] = list(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
            out[key] = value.item()
    return out


def label_in_main(obj) -> str | None:
    """The name of a variable of ``__main__`` that holds `obj`."""
    main = sys.modules.get("__main__")
    for name, value in list(getattr(main, "__dict__", {}).items()):
        if value is obj and not name.startswith("__"):
            return name
    return None


def describe_optimizer(optimizer) -> dict:
    return {
        "type": type(optimizer).__name__,
        "name": label_in_main(optimizer),
        "param_groups": [
            {"params": len(group["params"]), "hyperparameters": _hyperparameters(group)} for group in optimizer.param_groups
        ],
        "completed_steps": completed_steps(optimizer),
    }


def _count(params) -> tuple[int, int]:
    total = trainable = 0
    for p in params:
        n = p.numel()
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def describe_model(model, found_optimizers: list) -> dict:
    params = list(model.parameters())
    total, trainable = _count(params)
    own = {id(p) for p in params}
    children = []
    for name, child in list(model.named_children())[:MAX_CHILDREN_SHOWN]:
        child_total, _ = _count(child.parameters())
        children.append({"name": name, "type": type(child).__name__, "parameters": child_total})
    return {
        "name": qualified(model, ""),
        "type": type(model).__name__,
        "submodules": sum(1 for _ in model.modules()) - 1,
        "parameters": total,
        "trainable": trainable,
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        "devices": sorted({str(p.device) for p in params}),
        "children": children,
        "children_total": sum(1 for _ in model.children()),
        "tree": module_tree(model),
        "optimizers": [
            i for i, opt in enumerate(found_optimizers) if any(id(p) in own for g in opt.param_groups for p in g["params"])
        ],
        "training": model.training,
    }


def module_tree(model) -> dict:
    """The model's modules to ``MAX_TREE_DEPTH``, as rows of name, type,
    depth and parameters. A run of numbered siblings of one type and size
    (``blocks.0`` to ``blocks.11``) is one row, ``blocks.0-11`` with its
    ``repeat``, and the modules under it are named with a ``*``
    (``blocks.*.attn``): the names ``--modules`` globs take."""
    rows: list = []
    left_out = 0

    def walk(module, prefix: str, depth: int) -> None:
        nonlocal left_out
        children = list(module.named_children())
        sizes = [_count(child.parameters())[0] for _, child in children]
        i = 0
        while i < len(children):
            name, child = children[i]
            j = i + 1
            if name.isdigit():
                while (
                    j < len(children)
                    and children[j][0].isdigit()
                    and type(children[j][1]) is type(child)
                    and sizes[j] == sizes[i]
                ):
                    j += 1
            if len(rows) >= MAX_TREE_ROWS:
                left_out += j - i
            else:
                label = name if j - i == 1 else f"{name}-{children[j - 1][0]}"
                rows.append({"name": prefix + label, "type": type(child).__name__, "depth": depth, "parameters": sizes[i], "repeat": j - i})
                if depth < MAX_TREE_DEPTH:
                    walk(child, prefix + (name if j - i == 1 else "*") + ".", depth + 1)
            i = j

    walk(model, "", 1)
    return {"rows": rows, "left_out": left_out, "max_depth": MAX_TREE_DEPTH}


def is_compiled(module) -> bool:
    """Whether `module` is what ``torch.compile`` returned for a module (its
    ``OptimizedModule`` wrapper), or a module compiled in place
    (``module.compile()``). Nothing is compiled while dynamo was never
    imported, and it is not imported here."""
    if getattr(module, "__dict__", {}).get("_compiled_call_impl") is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


# A glob that matches nothing is answered with this many of the names it
# could have matched.
NAMES_SHOWN = 12


def outside_compiled(model):
    """`model.named_modules()`, less those inside a torch.compile'd module
    (the compiled module itself is its boundary): a hook or stand-in inside
    a compiled region is traced into its graph, so putting it on or taking
    it off would make dynamo compile again."""
    compiled = []  # prefixes of the compiled modules seen
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in compiled):
            continue
        if is_compiled(module):
            compiled.append(name + "." if name else "")
        elif COMPILED_CALLERS:
            continue
        yield name, module


# ---- code that dynamo compiles, calling plain modules

# Set once dynamo compiles a function of the program's (`torch.compile(fn)`,
# not a module's own code), or any code while a stand-in of ours sat on a
# plain module's `forward` (one not compiled itself): such code may call
# plain modules, and a stand-in there is seen by dynamo: a graph break (an
# error that ended the program under `fullgraph=True`), and a compile again
# each time one is put on or taken off. From then on stand-ins go on
# compiled modules' boundaries only (`outside_compiled`), and the features
# say so.
COMPILED_CALLERS = False
# Each feature's `take_off_plain()`: its stand-ins taken off plain modules
# now, True where it had any on.
_HOLDERS: list = []
# Called once each at the program's next `torch.compile` call, before it.
_BEFORE_COMPILE: list = []
_COMPILE_WATCHED = "_rankscope_compile_watched"
_WATCHING_DYNAMO = False


def hold(take_off_plain) -> None:
    """A feature puts stand-ins on modules (or will): dynamo's compiles are
    watched from now on (`_compile_starts`). `take_off_plain()` takes its
    stand-ins off plain modules and keeps them off from then on; True
    where it had any on."""
    if take_off_plain not in _HOLDERS:
        _HOLDERS.append(take_off_plain)
    _watch_dynamo()


def release(take_off_plain) -> None:
    """The feature's stand-ins are off: with no feature holding any,
    dynamo's callback goes too (no hook of ours stays)."""
    global _WATCHING_DYNAMO
    if take_off_plain in _HOLDERS:
        _HOLDERS.remove(take_off_plain)
    if not _HOLDERS and _WATCHING_DYNAMO:
        handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
        remove = getattr(handler, "remove_start_callback", None)
        if remove is not None:
            with contextlib.suppress(ValueError):  # (already gone)
                remove(_compile_starts)
            _WATCHING_DYNAMO = False
    _unwatch_compile()


def before_compile(call) -> None:
    """`call()` runs at the program's next `torch.compile` call, before it
    (`module.compile()` calls it too): nothing is compiled until then."""
    if call not in _BEFORE_COMPILE:
        _BEFORE_COMPILE.append(call)
    _watch_compile()


def forget_before_compile(call) -> None:
    if call in _BEFORE_COMPILE:
        _BEFORE_COMPILE.remove(call)
    _unwatch_compile()


def _watch_dynamo() -> None:
    """dynamo's compile-start callback, registered once dynamo is imported
    (it is not imported here: before the program's first `torch.compile`
    call, a stand-in on it registers the callback after that call, and the
    compile itself waits for the compiled code's first call)."""
    global _WATCHING_DYNAMO
    if _WATCHING_DYNAMO:
        return
    handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
    register = getattr(handler, "register_start_callback", None)
    if register is None:
        _watch_compile()
        return
    register(_compile_starts)
    _WATCHING_DYNAMO = True
    _compiled_before()


def _compiled_before() -> None:
    """Code of the program's that dynamo compiled before its callback was
    registered (a feature turned on mid-run): dynamo's own record of the
    code it took (`convert_frame.input_codes`, weak references); where it
    has none, the callback finds out at the next compile."""
    global COMPILED_CALLERS
    if COMPILED_CALLERS:
        return
    try:
        seen = sys.modules["torch._dynamo.convert_frame"].input_codes.seen
        codes = [ref() for ref in list(seen)]
    except (KeyError, AttributeError, TypeError):
        return
    if any(code is not None and _programs_function(code) for code in codes):
        COMPILED_CALLERS = True
        for take_off_plain in list(_HOLDERS):
            try:
                take_off_plain()
            except Exception:  # noqa: BLE001 - the flag keeps them off
                pass


def _compile_starts(args=None) -> None:
    """dynamo begins to compile a frame, before it traces anything. Where
    the frame is the program's own code (a compiled function, not torch's
    wrapper of a compiled module), code dynamo compiles may call plain
    modules: the features' stand-ins come off them, and stay off. Where
    which frame cannot be told, that is done only if one was on."""
    global COMPILED_CALLERS
    if COMPILED_CALLERS or not _HOLDERS:
        return
    program = _compiling_programs_code()
    if program is False:
        return  # a compiled module's boundary: its own tree is left alone
    took = False
    for take_off_plain in list(_HOLDERS):
        try:
            took = take_off_plain() or took
        except Exception:  # noqa: BLE001 - the compile goes on; the flag keeps them off
            took = True
    if took or program:
        COMPILED_CALLERS = True


_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"


def _compiling_programs_code():
    """Whether the code dynamo is about to compile is the program's (True)
    or torch's own (False: `torch.compile(module)` and `module.compile()`
    compile a wrapper in `torch/_dynamo`); None where it cannot be found.
    Read from dynamo's frame that holds it (`code`, in convert_frame.py),
    a few frames above this callback."""
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        if frame.f_code.co_filename.endswith("convert_frame.py") and "code" in frame.f_code.co_varnames:
            code = frame.f_locals.get("code")
            if hasattr(code, "co_filename"):
                return _programs_function(code)
        frame = frame.f_back
    return None


# The code dynamo makes to go on after a graph break, named for the
# function it broke in.
_RESUMED = "torch_dynamo_resume_in_"
_MODULE_CALLS = frozenset(("forward", "_call_impl", "_wrapped_call_impl"))


def _programs_function(code) -> bool:
    """Whether dynamo compiling `code` is compiling a function of the
    program's (which may call any module), not a module's own method (a
    compiled module's forward is compiled as a frame of its own, and so
    are its methods after a graph break) nor torch's code."""
    if code.co_filename.startswith(_TORCH_DIR):
        return False
    name = code.co_name
    if name.startswith(_RESUMED):
        return name[len(_RESUMED):].rsplit("_at_", 1)[0] not in _MODULE_CALLS
    return not _a_modules_method(code)


def _a_modules_method(code) -> bool:
    """Whether `code` is a method of a module class (any subclass of
    nn.Module the program has defined or imported)."""
    stack, seen = [torch.nn.Module], set()
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub in seen:
                continue
            seen.add(sub)
            stack.append(sub)
            for value in vars(sub).values():
                if getattr(getattr(value, "__func__", value), "__code__", None) is code:
                    return True
    return False


def _watch_compile() -> None:
    own = torch.__dict__.get("compile")
    if not callable(own) or getattr(own, _COMPILE_WATCHED, None) is not None:
        return

    @functools.wraps(own)
    def compile(*args, **kwargs):
        calls = list(_BEFORE_COMPILE)
        _BEFORE_COMPILE.clear()
        for call in calls:
            try:
                call()
            except Exception:  # noqa: BLE001 - the program's compile goes on
                pass
        try:
            return own(*args, **kwargs)
        finally:
            if torch.__dict__.get("compile") is compile:
                torch.compile = own
            if _HOLDERS:
                _watch_dynamo()

    setattr(compile, _COMPILE_WATCHED, own)
    torch.compile = compile


def _unwatch_compile() -> None:
    # Only where it is still ours, and nothing waits for it.
    if _BEFORE_COMPILE or (_HOLDERS and not _WATCHING_DYNAMO):
        return
    ours = torch.__dict__.get("compile")
    own = getattr(ours, _COMPILE_WATCHED, None)
    if own is not None:
        torch.compile = own


def no_match(glob: str, names: list, found: list = ()) -> str:
    """The error for a ``--modules`` glob that matches none of `names` (the
    qualified names it is matched against), listing the first few; and why
    a compiled model's modules are not among them, where one of `found` has one."""
    if COMPILED_CALLERS and not names:
        return ("no module can be traced: this process compiles code that calls its modules (torch.compile of a"
                " function), and dynamo would trace a stand-in on them; compile the model itself"
                " (torch.compile(model) or model.compile()) to have it timed at its boundary")
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    text = f"no module matches {glob!r}; modules: {', '.join(names[:NAMES_SHOWN])}{more}"
    if COMPILED_CALLERS:
        text += (" (this process compiles code that calls modules (torch.compile of a function): only compiled"
                 " modules are traced, at their boundary, since dynamo would trace a stand-in on any other)")
    elif any(is_compiled(m) for model in found for m in model.modules()):
        text += " (a torch.compile'd module is watched at its boundary only: a hook inside it would make dynamo recompile)"
    return text


def root_name(model) -> str:
    """How the root is named in the trace: its class (its children go by
    their qualified names, as ``named_modules()`` gives them); a compiled
    model by the class of the module it wraps."""
    if is_compiled(model):
        return type(getattr(model, "_orig_mod", model)).__name__
    return type(model).__name__


def grad_scaler_kinds() -> tuple:
    """The GradScaler classes: torch.amp's, and torch.cuda.amp's (older
    torch's, or a subclass of torch.amp's) only where the program imported
    it: asked for, it warns."""
    cuda_amp = sys.modules.get("torch.cuda.amp")
    return tuple(k for k in (getattr(torch.amp, "GradScaler", None), getattr(cuda_amp, "GradScaler", None))
                 if isinstance(k, type))


def find_grad_scaler(frame, frames: int, objects: int):
    """The program's GradScaler: in the locals of `frame` and the frames
    that called it (the training loop), and in the attributes of the
    objects they hold, two deep (a trainer's `scaler`, its
    accelerator's); None where there is none. At most `frames` frames
    and `objects` objects are looked at."""
    kinds = grad_scaler_kinds()
    if not kinds:
        return None
    seen, budget = set(), [objects]

    def look(value, depth):
        if budget[0] <= 0 or id(value) in seen:
            return None
        seen.add(id(value))
        budget[0] -= 1
        # By its type, not isinstance: that asks a proxy's `__class__`,
        # which may be the program's code.
        kind = type(value)
        if issubclass(kind, kinds):
            return value
        if depth == 0 or issubclass(kind, (type, type(sys))):
            return None
        try:
            attrs = object.__getattribute__(value, "__dict__")
        except AttributeError:
            return None
        if not isinstance(attrs, dict):
            return None
        for inner in list(attrs.values()):
            found = look(inner, depth - 1)
            if found is not None:
                return found
        return None

    for _ in range(frames):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            found = look(value, 2)
            if found is not None:
                return found
        frame = frame.f_back
    return None

