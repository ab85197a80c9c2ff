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
# Where this probe listens, kept for a process that joins a job later
# (torch.distributed gives it a world size after start).
_endpoint: tuple[str, str | None] | None = None


def _write(path: str, entry: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    # 0600: with a TCP endpoint the entry carries its token.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(entry, f)
    os.replace(tmp, path)


def register(socket_path: str, token_file: str | None = None) -> str | None:
    """Adds this process to its job's registry; None outside a job. With a
    TCP endpoint the entry names it and carries its token, so that the CLI
    on another machine that shares the run directory can reach this rank."""
    global _entry_path, _endpoint
    from rankscope._probe import crashes

    _endpoint = (socket_path, token_file)
    with open(socket_path[: -len(".sock")] + ".json") as f:
        meta = json.load(f)
    if not meta.get("job_id") and int(meta.get("world_size") or 1) <= 1:
        return None
    directory = os.path.join(crashes.run_dir(), "ranks")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"rank{meta['rank']}-pid{meta['pid']}.json")
    entry = dict(meta, socket=socket_path, state="running")
    if meta.get("tcp") and token_file:
        with open(token_file) as f:
            entry["token"] = f.read().strip()
    _write(path, entry)
    _entry_path = path
    return path


def update(meta_json: str) -> None:
    """New metadata (torch.distributed assigned the rank): the entry moves
    to the file of its new rank."""
    global _entry_path
    from rankscope._probe import crashes

    meta = json.loads(meta_json)
    old = _entry_path
    if old is None:
        if _endpoint is not None:
            register(*_endpoint)  # a world size above 1 makes it a rank of a job now
        return
    with open(old) as f:
        entry = json.load(f)
    entry.update(rank=meta["rank"], world_size=meta["world_size"])
    directory = os.path.join(crashes.run_dir(), "ranks")
    path = os.path.join(directory, f"rank{meta['rank']}-pid{meta['pid']}.json")
    _write(path, entry)
    _entry_path = path
    if path != old:
        os.unlink(old)


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


def job_entries() -> str:
    """The registry of this process's job (`GET /v1/job`): what a CLI that
    reached this rank by address needs to reach the others."""
    from rankscope._probe import crashes

    if _entry_path is None:
        return "[]"
    with open(_entry_path) as f:
        job_id = json.load(f).get("job_id")
    directory = os.path.join(crashes.run_dir(), "ranks")
    entries = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            continue
        if entry.get("job_id") == job_id:
            entries.append(entry)
    return json.dumps(entries)
