"""rankscope: look inside a live Python (and PyTorch) process.

Importing this package does nothing but define functions; the probe's server
starts only when asked (``start()``, ``RANKSCOPE=1``, or ``rankscope run``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["start", "stop", "endpoint", "on_error", "__version__"]

_atexit_registered = False


def _load_native():
    # Imported on first use so that `import rankscope` stays cheap.
    import importlib

    return importlib.import_module("rankscope._native")


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
    """
    global _atexit_registered
    native = _load_native()
    if listen is None:
        listen = os.environ.get("RANKSCOPE_LISTEN") or None
    # threading must be imported on the main thread before any probe thread
    # touches it, or it would take a probe thread for the main one.
    import threading  # noqa: F401

    _install_crash_recorder()
    info = native.start(sys.version.split()[0], listen)
    _register_in_job(info["socket"], info.get("token_file"))
    if not _atexit_registered:
        import atexit

        atexit.register(stop)
        os.register_at_fork(after_in_child=native.forget_after_fork)
        _atexit_registered = True
    return dict(info)


def _install_crash_recorder() -> None:
    # Uncaught exceptions (with locals) and native crashes go to the run
    # directory; a failure here must not stop the probe or the program.
    try:
        from rankscope._probe import crashes

        crashes.install()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"rankscope: crash recording not enabled: {exc}\n")


def _register_in_job(socket_path: str, token_file: str | None) -> None:
    # A rank of a job enters the job's registry; nothing here may stop the probe.
    try:
        from rankscope._probe import registry

        registry.register(socket_path, token_file)
        from rankscope._probe import torch_rank

        torch_rank.watch()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"rankscope: not registered in the job: {exc}\n")


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
    start()


# Where `rankscope inject` staged this package (None when installed normally).
_staged_from: str | None = None


def stop() -> bool:
    """Stop the probe: close and remove its socket and end its server thread."""
    native = sys.modules.get("rankscope._native")
    if native is None:
        return False
    registry = sys.modules.get("rankscope._probe.registry")
    if registry is not None:
        registry.leave()
    return bool(native.stop())


def endpoint() -> str | None:
    """The unix socket of the running probe, or None."""
    native = sys.modules.get("rankscope._native")
    return native.endpoint() if native is not None else None
