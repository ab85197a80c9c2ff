"""Built-in modules the probe uses without adding them to ``sys.modules``.

Starting a probe (``rankscope inject``, ``rankscope.start()``) must leave the
program's world as it was: a program that never imported ``atexit`` or
``faulthandler`` must not find them in ``sys.modules`` afterwards. Both are
built into the interpreter and keep their state in the interpreter, not in
the module object, so a private instance made the way the import system
makes built-in modules registers exit callbacks and turns on the fault
handler exactly as the public one would. A module the program already
imported is used as it is.
"""

import sys


def builtin(name: str):
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    import _imp  # built in and imported at interpreter start

    machinery = sys.modules["_frozen_importlib"]
    spec = machinery.ModuleSpec(name, machinery.BuiltinImporter, origin="built-in")
    module = _imp.create_builtin(spec)
    _imp.exec_builtin(module)
    return module
