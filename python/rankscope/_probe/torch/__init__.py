"""The probe's torch features: ``rankscope PID torch ...`` (``POST
/v1/torch``). Their tables are the run store's (``tables.py``), read
through ``GET /v1/table`` without Python.

Nothing here imports torch, nor anything else at module level: the modules
that do (``models``, ``trace``) are imported only once the program has
imported torch itself (``'torch' in sys.modules``, done initialising).
``RANKSCOPE_TORCH`` read at interpreter start waits for that import.
"""

import os
import sys

NOT_IMPORTED = "torch is not imported in this process"
NOT_IMPORTED_HINT = (
    "rankscope never imports torch itself; ask again once the program has imported it "
    "(RANKSCOPE_TORCH=trace at start turns the trace on when it does)"
)
TABLES = ("torch_trace", "torch_steps")


def torch_ready() -> bool:
    module = sys.modules.get("torch")
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def handle(request_text: str) -> str:
    """``{"action": "status" | "trace_on" | "trace_off", ...}`` -> JSON:
    ``{"ok": ...}``, or ``{"error": ..., "hint": ...}`` for the user."""
    import json

    try:
        request = json.loads(request_text)
        if request.get("action") == "collectives" and request.get("switch") == "flight":
            # Flight Recorder's rows (`python.flight_recorder`, `cluster bt`):
            # none in a process without torch.distributed, torch or not.
            from rankscope._probe.torch.collectives import flight

            return json.dumps({"ok": flight(tail=max(1, int(request.get("tail") or 16)))})
        if not torch_ready():
            return json.dumps({"error": NOT_IMPORTED, "hint": NOT_IMPORTED_HINT, "not_imported": True})
        from rankscope._probe.torch import trace

        action = request.get("action", "status")
        if action == "anchors":
            from rankscope._probe.torch.align import ANCHORS

            return json.dumps({"ok": ANCHORS.turn_on() if request.get("switch") == "on" else ANCHORS.describe()})
        shift = request.get("shift")
        try:
            shifted = _shift(int(shift)) if shift is not None else None
            if action == "status":
                result = _status()
            elif action == "trace_on":
                result = trace.TRACER.turn_on(
                    int(request.get("every") or 1), str(request.get("modules") or "*"), bool(request.get("backward"))
                )
                result["status"] = _status()
            elif action == "trace_off":
                result = trace.TRACER.turn_off()
                result["status"] = _status()
            elif action in ("nan", "grads", "activations", "collectives"):
                result = _feature(action, request)
            else:
                return json.dumps({"error": f"unknown torch action {action!r}", "hint": "status, trace_on, trace_off, nan, grads, activations or collectives"})
        except trace.UserError as err:
            return json.dumps({"error": str(err), "hint": "`rankscope PID torch` lists the models and their modules"})
        except LookupError as err:
            return json.dumps({"error": str(err), "hint": "collectives are recorded once the program uses torch.distributed"})
        finally:
            if shift is not None:
                # The feature that needed the anchors keeps the clock now.
                from rankscope._probe.torch.align import ANCHORS

                ANCHORS.done()
        if shifted is not None and isinstance(result, dict):
            result["step_shift"] = int(shift) if shifted else None
        return json.dumps({"ok": _no_nan(result)}, default=_json_value)
    except (ValueError, TypeError) as err:
        return json.dumps({"error": f"bad torch request: {err}", "hint": "send JSON with an action"})


def _shift(by: int) -> bool:
    """`cluster torch` moving this rank's step number so that every rank
    numbers its steps alike (see align.py), before the feature goes on."""
    from rankscope._probe.torch.align import ANCHORS

    return ANCHORS.shift(by)


def _json_value(value):
    return str(value)


def _no_nan(value):
    """JSON has no NaN or infinities: they travel as text ("nan", "inf")."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def _feature(action: str, request: dict) -> dict:
    """``torch nan|grads|activations|collectives [on|off]``."""
    switch = request.get("switch")
    every = int(request.get("every") or 1)
    if action == "collectives":
        from rankscope._probe.torch.collectives import RECORDER

        if switch == "on":
            return RECORDER.turn_on()
        if switch == "off":
            return RECORDER.turn_off()
        from rankscope._probe.torch.collectives import flight

        described = RECORDER.describe()
        described["flight_recorder"] = flight(tail=4)
        return described
    if action == "nan":
        from rankscope._probe.torch.nan import WATCH

        if switch == "on":
            return WATCH.turn_on()
        return WATCH.turn_off() if switch == "off" else WATCH.describe()
    from rankscope._probe.torch import stats

    # Neither a switch nor an option: on where it is off, else only how it
    # stands (looking does not reset its options). One that turned itself
    # off after an error stays off for a look, which says why: turned on
    # again, it would fail again at its next step.
    looking = switch is None and request.get("every") is None and request.get("modules") is None
    if action == "grads":
        if switch == "off":
            return stats.GRADS.turn_off()
        if looking and (stats.GRADS.on or stats.GRADS.disabled):
            return stats.GRADS.describe()
        return stats.GRADS.turn_on(int(request.get("every") or 10))
    if switch == "off":
        return stats.ACTIVATIONS.turn_off()
    if looking and (stats.ACTIVATIONS.on or stats.ACTIVATIONS.disabled):
        return stats.ACTIVATIONS.describe()
    return stats.ACTIVATIONS.turn_on(str(request.get("modules") or "*"), every)


def _status() -> dict:
    import torch

    from rankscope._probe.torch import models, trace

    found, optimizers, losses = models.discover()
    tracer = trace.TRACER
    step, source = tracer.step, tracer.marker
    if not tracer.on or step is None:
        counts = [c for c in (models.completed_steps(opt) for opt in optimizers) if c is not None]
        step, source = (max(counts), "optimizer state") if counts else (None, None)
    return {
        "torch_version": torch.__version__,
        "cuda_initialized": torch.cuda.is_initialized(),
        "step": step,
        "step_source": source,
        "models": [models.describe_model(m, optimizers) for m in found],
        "optimizers": [models.describe_optimizer(opt) for opt in optimizers],
        "losses": [type(m).__name__ for m in losses],
        "trace": tracer.describe(),
        "features": _features(),
    }


def _features() -> dict:
    """The other features' state, where their modules were ever loaded."""
    out = {}
    nan = sys.modules.get("rankscope._probe.torch.nan")
    if nan is not None:
        out["nan"] = nan.WATCH.describe()
    stats = sys.modules.get("rankscope._probe.torch.stats")
    if stats is not None:
        out["grads"], out["activations"] = stats.GRADS.describe(), stats.ACTIVATIONS.describe()
    collectives = sys.modules.get("rankscope._probe.torch.collectives")
    if collectives is not None:
        out["collectives"] = collectives.RECORDER.describe()
    return out


def _parse_env(spec: str):
    # `every` None: not given, each feature's own default (the trace 1, grads 10).
    features, options, unknown = set(), {"every": None, "modules": "*", "backward": False}, []
    for token in filter(None, (t.strip() for t in spec.split(","))):
        key, eq, value = token.partition("=")
        if token in ("trace", "nan", "grads", "collectives"):
            features.add(token)
        elif token == "backward":
            options["backward"] = True
        elif eq and key == "every" and value.isdigit() and int(value) >= 1:
            options["every"] = int(value)
        elif eq and key == "modules" and value:
            options["modules"] = value
        else:
            unknown.append(token)
    return features, options, unknown


_said_unknown: list = []


def from_env(at_start: bool) -> None:
    """``RANKSCOPE_TORCH=trace[,every=N][,modules=GLOB][,backward]``: the
    trace goes on now if torch is imported, else (probe started with the
    interpreter) right after the program imports it."""
    spec = os.environ.get("RANKSCOPE_TORCH", "").strip()
    if not spec:
        return
    features, options, unknown = _parse_env(spec)
    # (Read at the probe's start and again after it: said once.)
    if unknown and not _said_unknown:
        _said_unknown.append(spec)
        sys.stderr.write(
            f"rankscope: RANKSCOPE_TORCH: ignored {', '.join(unknown)} (known: trace, nan, grads, collectives, every=N, modules=GLOB, backward)\n"
        )
    if not features:
        return

    def enable(_module=None, before_first_step=False):
        tracer = None
        if before_first_step and features - {"collectives"}:
            try:
                from rankscope._probe.torch.trace import TRACER as tracer

                # The program has only just imported torch, so no step is in
                # progress: the clock starts at step 0, which gets its row.
                tracer.before_first_step = True
            except Exception:  # noqa: BLE001 - each feature says why it is not on
                tracer = None
        try:
            _enable_each(features, options)
        finally:
            if tracer is not None:
                tracer.before_first_step = False

    if torch_ready():
        enable()
    elif at_start:
        from rankscope._probe.after_import import after_import

        after_import("torch", lambda module: enable(module, before_first_step=True))


def _enable_each(features: set, options: dict) -> None:
    for feature in sorted(features):
        try:
            if feature == "trace":
                from rankscope._probe.torch import trace

                trace.TRACER.turn_on(options["every"] or 1, options["modules"], options["backward"], wait_s=0)
            elif feature == "nan":
                from rankscope._probe.torch.nan import WATCH

                WATCH.turn_on()
            elif feature == "grads":
                from rankscope._probe.torch import stats

                stats.GRADS.turn_on(options["every"] or 10)
            elif feature == "collectives" and "torch.distributed.distributed_c10d" in sys.modules:
                from rankscope._probe.torch.collectives import RECORDER

                RECORDER.turn_on()
        except Exception as exc:  # noqa: BLE001 - the program runs on without the feature
            sys.stderr.write(f"rankscope: RANKSCOPE_TORCH={feature} not turned on: {exc}\n")
