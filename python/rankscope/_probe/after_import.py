"""Runs a callback once the program has imported a module, without
importing anything for it.

A meta-path finder that only watches: for a watched name it asks the
standard path finder for the spec and wraps that spec's loader so the
callback runs right after the module's code. Re-entrancy is guarded, any
failure in it means "not mine" (the import goes on as if it were not
there), and it leaves ``sys.meta_path`` when nothing is watched any more.
Installed only by a probe that starts with the interpreter: a probe started
later leaves ``sys.meta_path`` alone.
"""

import _thread
import sys


class _Watcher:
    _busy = _thread._local()

    def __init__(self):
        self.callbacks: dict[str, list] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.callbacks or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            # importlib.machinery's PathFinder, without importing importlib.
            spec = sys.modules["_frozen_importlib_external"].PathFinder.find_spec(name, path, target)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None
            original = spec.loader.exec_module

            def exec_module(module, _original=original):
                _original(module)
                for callback in self.callbacks.pop(name, ()):
                    try:
                        callback(module)
                    except Exception:  # noqa: BLE001 - the import succeeded; the probe's bookkeeping must not undo it
                        pass
                if not self.callbacks and self in sys.meta_path:
                    sys.meta_path.remove(self)

            spec.loader.exec_module = exec_module
            return spec
        except Exception:  # noqa: BLE001
            return None
        finally:
            self._busy.active = False


_watcher = _Watcher()


def after_import(name: str, callback) -> None:
    """`callback(module)` once the program's import of `name` has run (the
    caller checks that `name` is not imported yet)."""
    _watcher.callbacks.setdefault(name, []).append(callback)
    if _watcher not in sys.meta_path:
        sys.meta_path.insert(0, _watcher)
