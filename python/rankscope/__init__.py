"""rankscope: look inside a live Python (and PyTorch) process.

Importing this package does nothing but define functions; the probe's server
starts only when asked (``start()``, ``RANKSCOPE=1``, or ``rankscope run``).
"""

import os
import sys

__all__ = ["start", "stop", "endpoint", "on_error", "step", "__version__"]

_atexit_registered = False
_publish_later = False
# Set by the probe's torch features while one is on (see step()).
_step_hook = None


def _load_native():
    # Imported on first use so that `import rankscope` stays cheap.
    from rankscope import _native

    return _native


def __getattr__(name: str):
    if name == "__version__":
        return _load_native().__version__
    raise AttributeError(name)


def start(listen: str | None = None) -> dict:
    """Start the probe in this process and return where it listens.

    ``listen`` (or ``RANKSCOPE_LISTEN``) also opens a TCP port: ``PORT`` or
    ``:PORT`` binds loopback only, ``HOST:PORT`` binds that host. TCP clients
    must send the token written (mode 0600) next to the unix socket.
    Starting twice returns the running probe's endpoint.

    The program sees the same world afterwards, from any thread: nothing is
    imported into it but rankscope's own modules (``threading`` included:
    importing it on a thread other than the main one would make that thread
    threading's main thread), and no hook it can read is replaced
    (docs/architecture.md lists what is checked).
    """
    global _atexit_registered
    native = _load_native()
    if listen is None:
        listen = os.environ.get("RANKSCOPE_LISTEN") or None
    _install_crash_recorder(native)
    # Also enters the job's registry when this process is a rank of one.
    info = native.start(sys.version.split()[0], listen)
    _watch_torch_rank()
    _torch_from_env()
    if not _atexit_registered:
        from rankscope._probe.unseen import builtin

        builtin("atexit").register(stop)
        os.register_at_fork(after_in_child=native.forget_after_fork)
        _atexit_registered = True
    _forget_own_paths()
    if not _publish_later:
        native.publish()
    return dict(info)


def _forget_own_paths() -> None:
    # Importing rankscope's subpackages cached finders for its own folders
    # in sys.path_importer_cache; the program's cache stays as it was.
    own = os.path.dirname(os.path.abspath(__file__))
    for path in [p for p in sys.path_importer_cache if isinstance(p, str) and (p == own or p.startswith(own + os.sep))]:
        sys.path_importer_cache.pop(path, None)


def _install_crash_recorder(native) -> None:
    # Uncaught exceptions (with locals) and native crashes go to the run
    # directory; a failure here must not stop the probe or the program.
    try:
        native.enable_crash_hook()
        from rankscope._probe import native_log

        native_log.enable()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"rankscope: crash recording not enabled: {exc}\n")


def _watch_torch_rank() -> None:
    # torch.distributed may assign the rank later; nothing here may stop the probe.
    try:
        from rankscope._probe import torch_rank

        torch_rank.watch()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"rankscope: rank from torch.distributed not followed: {exc}\n")


def _torch_from_env() -> None:
    # RANKSCOPE_TORCH=trace: on now if the program has imported torch
    # (a probe started with the interpreter also waits for that import).
    if os.environ.get("RANKSCOPE_TORCH"):
        try:
            from rankscope._probe import torch as probe_torch

            probe_torch.from_env(at_start=False)
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(f"rankscope: RANKSCOPE_TORCH not followed: {exc}\n")


def step() -> None:
    """Marks the end of a training step, for programs whose optimizer does
    not (no ``torch.optim`` optimizer, or several steps per optimizer step).
    Costs one attribute read while no torch feature is on. Once called, it
    alone marks steps for ``rankscope PID torch``."""
    hook = _step_hook
    if hook is not None:
        hook()


def on_error():
    """Records an exception leaving a function or block, then re-raises it.

    ``@rankscope.on_error()`` or ``with rankscope.on_error():``; the record
    goes where uncaught exceptions go (see ``rankscope crashes``).
    """
    from rankscope._probe import crashes

    return crashes.on_error()


def _start_injected() -> None:
    """Run by the bootstrap that ``rankscope inject`` puts in the target."""
    global _staged_from
    # The staging directory leaves sys.path when this returns; breakpoints
    # on 3.11 may need the `bytecode` staged beside rankscope later.
    _staged_from = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    global _publish_later
    # The bootstrap publishes once it has taken its directory off sys.path:
    # the waiting CLI (and the user after it) must not see the world before.
    _publish_later = True
    try:
        start()
    finally:
        _publish_later = False


# Where `rankscope inject` staged this package (None when installed normally).
_staged_from: str | None = None


def stop() -> bool:
    """Stop the probe: close and remove its socket and end its server thread."""
    native = sys.modules.get("rankscope._native")
    if native is None:
        return False
    # Also marks this rank's registry entry exited (or crashed).
    return bool(native.stop())


def endpoint() -> str | None:
    """The unix socket of the running probe, or None."""
    native = sys.modules.get("rankscope._native")
    return native.endpoint() if native is not None else None
