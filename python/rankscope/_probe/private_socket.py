"""A unix socket only this user can connect to: the debugger sessions that
the probe serves (post-mortem, paused threads) run code in the process."""

from __future__ import annotations

import os
import socket


def listen(path: str) -> socket.socket:
    """Binds `path` with mode 0600 (a stale file there is replaced)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)
        old_umask = os.umask(0o177)
        try:
            server.bind(path)
        finally:
            os.umask(old_umask)
        server.listen(1)
    except BaseException:
        server.close()
        raise
    return server


def accept_one(server: socket.socket, path: str, timeout: float) -> socket.socket | None:
    """The first client within `timeout` (None if none came); the listening
    socket and its file are gone afterwards either way."""
    try:
        server.settimeout(timeout)
        try:
            conn, _ = server.accept()
        except OSError:  # socket.timeout included
            return None
        return conn
    finally:
        server.close()
        try:
            os.unlink(path)
        except OSError:
            pass
