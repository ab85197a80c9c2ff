"""Started by ``rankscope.pth`` at interpreter start when RANKSCOPE is set.

A probe that cannot start must never stop the program: it says why on stderr
in one line and lets the program run.
"""

import os
import sys

_FALSE = {"", "0", "false", "no", "off"}
_ran = False


def start_from_env() -> None:
    global _ran
    # Once: `site` may read the same site-packages twice (a venv's, listed
    # again), and with it this .pth, which said each warning twice.
    if _ran or os.environ.get("RANKSCOPE", "").strip().lower() in _FALSE:
        return
    _ran = True
    try:
        import rankscope

        rankscope.start()
        # The program has not run yet: wrapping threading's hook and watching
        # for torch.distributed now is part of the world it starts in (a
        # later start() leaves both alone).
        from rankscope._probe import crashes, torch_rank
        from rankscope._probe import torch as probe_torch

        crashes.install_thread_hook()
        torch_rank.watch_imports()
        probe_torch.from_env(at_start=True)
    except Exception as exc:  # noqa: BLE001 - the target must run on regardless
        sys.stderr.write(f"rankscope: probe not started: {exc}\n")
