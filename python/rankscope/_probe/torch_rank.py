"""The rank as torch.distributed assigns it.

The launcher's environment (RANK, SLURM_PROCID, ...) says where a process
stands before any user code runs; a program that passes `rank=` to
`init_process_group` itself (mp.spawn, a hand-made launcher) only says so
there. Once `init_process_group` returns, the probe's metadata, its entry in
the job's registry and its crash records take the rank and world size from
`torch.distributed`.

Nothing here imports torch: a finder that only watches waits for
`torch.distributed.distributed_c10d` to be imported by the program, and
wraps `init_process_group` there before `torch.distributed` re-exports it.
"""

import sys

_C10D = "torch.distributed.distributed_c10d"
_assigned: tuple[int, int] | None = None
_collectives_at_init = False


def assigned() -> tuple[int, int] | None:
    """(rank, world size) from torch.distributed, once it is initialised."""
    return _assigned


def _record() -> None:
    global _assigned
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    _assigned = (dist.get_rank(), dist.get_world_size())
    from rankscope import _native

    # Also moves the registry entry to the file of its rank.
    _native.set_rank(*_assigned)


def _wrap(c10d) -> None:
    import functools  # torch imported it already

    original = c10d.init_process_group
    if getattr(original, "__rankscope_wrapped__", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            _record()
            if _collectives_at_init:
                from rankscope._probe.torch import collectives

                collectives.at_init()
        except Exception:  # noqa: BLE001 - the group is up; the probe's bookkeeping must not undo that
            pass
        return result

    init_process_group.__rankscope_wrapped__ = True
    c10d.init_process_group = init_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = init_process_group


def watch() -> None:
    """At start: follow torch.distributed if the program imported it."""
    c10d = sys.modules.get(_C10D)
    if c10d is not None:
        _wrap(c10d)
        _record()  # already initialised before the probe started (inject)


def watch_imports() -> None:
    """With the interpreter (RANKSCOPE=1): also catch the program's import
    of c10d later, and wrap its collectives then (they record from
    ``init_process_group`` on; ``_probe/torch/collectives.py``). A probe
    started later leaves sys.meta_path alone."""
    if _C10D not in sys.modules:
        from rankscope._probe.after_import import after_import

        after_import(_C10D, _at_import)


def _at_import(c10d) -> None:
    global _collectives_at_init
    _wrap(c10d)
    from rankscope._probe.torch import collectives

    if collectives.by_default():
        collectives.at_import(c10d)
        _collectives_at_init = True
