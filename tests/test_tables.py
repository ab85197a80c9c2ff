"""Tables fit the terminal: on a TTY every line of a table is at most as wide
as the terminal and long cells end in `…`; piped, nothing is cut. The CLI runs
under a real pseudo-terminal with a set size."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import termios
import time

from test_crashes import run_target

LONG_CRASH = """
print("READY", flush=True)
raise ValueError("shard " + "0123456789" * 30 + " is corrupt")
"""

LONG_ARGV = """
import sys, time
print("READY", flush=True)
while True:
    time.sleep(0.05)  # @loop
"""


def on_tty(rankscope_bin: str, args: list[str], env: dict[str, str], columns: int) -> str:
    """stdout of `rankscope ARGS` written to a pty `columns` wide (stderr is a pipe)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([rankscope_bin, *map(str, args)], stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
        os.close(master)
    return out.decode().replace("\r\n", "\n")


def cli_env(endpoint_dir: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE") and k != "COLUMNS"}
    env["RANKSCOPE_DIR"] = endpoint_dir
    env.update(extra)
    return env


def assert_fits(text: str, columns: int) -> None:
    lines = text.splitlines()
    assert lines, "nothing printed"
    too_wide = [line for line in lines if len(line) > columns]
    assert not too_wide, f"wider than {columns}:\n" + "\n".join(too_wide)
    assert "…" in text, text


def test_crash_tables_fit_the_terminal_and_pipes_get_everything(default_python, rankscope_bin, cli, endpoint_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    jobs = [f"a-rather-long-torchelastic-run-id-{n}-{'f' * 20}" for n in (1, 2)]
    for job in jobs:
        run_target(default_python, LONG_CRASH, home / ".local/state/rankscope/runs" / job, endpoint_dir)
    # No run directory named: every job's directory under HOME, with a JOB column.
    env = cli_env(endpoint_dir, HOME=str(home))
    listing = on_tty(rankscope_bin, ["crashes"], env, 100)
    assert_fits(listing, 100)
    assert listing.splitlines()[0].split() == ["ID", "TIME", "RANK", "PID", "JOB", "EXCEPTION", "LOCATION"]
    assert len(listing.splitlines()) == 3

    piped = cli("crashes", env={"HOME": str(home), "RANKSCOPE_RUN_DIR": ""})
    assert piped.returncode == 0, piped.stderr
    assert "…" not in piped.stdout
    assert all(job in piped.stdout for job in jobs)
    assert piped.stdout.count("0123456789" * 30 + " is corrupt") == 2
    full = json.loads(cli("crashes", "--format", "json", env={"HOME": str(home), "RANKSCOPE_RUN_DIR": ""}).stdout)
    assert [row["job"] for row in full] == jobs

    # query's boxed table: COLUMNS wins over the terminal's own size.
    sql = "SELECT id, job, message, path FROM python.crashes ORDER BY id"
    boxed = on_tty(rankscope_bin, ["query", sql], {**env, "COLUMNS": "72"}, 200)
    assert_fits(boxed, 72)
    assert boxed.startswith("+") and boxed.splitlines()[1].startswith("| id ")
    widths = {len(line) for line in boxed.splitlines()}
    assert len(widths) == 1, boxed  # the borders still line up
    piped = cli("query", sql, env={"HOME": str(home), "RANKSCOPE_RUN_DIR": ""})
    assert "…" not in piped.stdout and piped.stdout.count("0123456789" * 30) == 2


def test_process_and_breakpoint_tables_fit_the_terminal(default_python, spawn, rankscope_bin, cli, endpoint_dir):
    from conftest import line_of

    target = spawn(default_python, LONG_ARGV, args=["--config", "/very/long/path/" + "segment/" * 30 + "config.yaml"])
    env = cli_env(endpoint_dir)
    listing = on_tty(rankscope_bin, ["list"], env, 60)
    assert_fits(listing, 60)
    assert str(target.pid) in listing
    assert "segment/" * 30 in cli("list").stdout

    condition = " and ".join(f"len(sys.argv) > {n}" for n in range(12))
    added = cli(target.pid, "break", "add", f"target.py:{line_of(LONG_ARGV, 'loop')}", "--if", condition)
    assert added.returncode == 0, added.stderr
    breaks = on_tty(rankscope_bin, [str(target.pid), "break", "list"], env, 60)
    assert_fits(breaks, 60)
    assert breaks.splitlines()[0].split() == ["ID", "WHERE", "PASSES", "HITS", "DETAILS"]
    assert condition in cli(target.pid, "break", "list").stdout
    [bp] = json.loads(cli(target.pid, "break", "list", "--format", "json").stdout)
    assert bp["condition"] == condition
