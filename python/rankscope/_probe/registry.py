"""The job's registry: one file per rank in ``<run dir>/ranks/``.

A rank writes its entry when its probe starts and marks it when the process
ends, "crashed" if it recorded a crash, else "exited". A rank killed outright
(SIGKILL, the OOM killer) leaves its entry saying "running" with a PID that
is gone: the CLI reports it as dead rather than missing. With a run
directory on a shared filesystem the same files describe a job across
machines.
"""

from __future__ import annotations

import json
import os
import time

_entry_path: str | None = None


def _write(path: str, entry: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(entry, f)
    os.replace(tmp, path)


def register(socket_path: str) -> str | None:
    """Adds this process to its job's registry; None outside a job."""
    global _entry_path
    from rankscope._probe import crashes

    with open(socket_path[: -len(".sock")] + ".json") as f:
        meta = json.load(f)
    if not meta.get("job_id") and int(meta.get("world_size") or 1) <= 1:
        return None
    directory = os.path.join(crashes.run_dir(), "ranks")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"rank{meta['rank']}-pid{meta['pid']}.json")
    _write(path, dict(meta, socket=socket_path, state="running"))
    _entry_path = path
    return path


def leave() -> None:
    """Marks this rank's entry as ended (at stop, or at exit)."""
    global _entry_path
    path, _entry_path = _entry_path, None
    if path is None:
        return
    from rankscope._probe import crashes

    try:
        with open(path) as f:
            entry = json.load(f)
        entry.update(state="crashed" if crashes.crashed() else "exited", ended_at=time.time())
        _write(path, entry)
    except (OSError, ValueError):
        pass
