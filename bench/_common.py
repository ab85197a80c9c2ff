"""Helpers shared by the benchmarks: where the tools are, starting a target,
simple statistics. Standard library only.

The benchmarks are meant to be run with the project's virtual environment
(`.venv/bin/python bench/...`), so the tools are looked up next to that
interpreter first, then on PATH.
"""

from __future__ import annotations

import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class BenchError(Exception):
    """Something went wrong while measuring (not a missed target)."""


def tool(name: str) -> str:
    """The executable `name`: next to this interpreter, else on PATH."""
    beside = Path(sys.prefix) / "bin" / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise BenchError(f"{name} not found next to {sys.executable} nor on PATH")
    return found


def private_dir(prefix: str) -> str:
    """A fresh endpoint directory for one target (mode 0700, under /tmp)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def start_target(
    source: str,
    env: dict[str, str],
    args: tuple[str, ...] = (),
    ready: str = "ready",
    timeout: float = 30.0,
    python: str | None = None,
    stderr=None,
):
    """Run `source` (with `args` as sys.argv[1:]) with `python` (default: this
    interpreter) and wait for a stdout line starting with `ready` (the target
    prints it once it is set up: no sleeps here). `stderr` is Popen's.

    Returns (process, the ready line). The process keeps stdin and stdout
    pipes so a benchmark can talk to it line by line.
    """
    proc = subprocess.Popen(
        [python or sys.executable, "-c", source, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        bufsize=1,
    )
    deadline = time.monotonic() + timeout
    try:
        line = read_line(proc.stdout, deadline, f"the target's {ready!r} line")
        while line and not line.startswith(ready):
            line = read_line(proc.stdout, deadline, f"the target's {ready!r} line")
    except BenchError:
        stop_target(proc)
        raise
    if not line.startswith(ready):
        stop_target(proc)
        raise BenchError(f"target exited (rc={proc.returncode}) before printing {ready!r}")
    return proc, line.strip()


def read_line(stream, deadline: float, what: str = "a line") -> str:
    """One line from a child's pipe, or "" at its end; a BenchError past
    `deadline` (time.monotonic()).

    Bytes are taken one at a time from the descriptor, never read ahead:
    the stream's own buffer stays empty, so `stream.readline()` (as `ask`
    does) still sees the next line, and select() never waits on a line
    that already sits in a buffer."""
    fd = stream.fileno()
    line = bytearray()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"timed out waiting for {what}")
        if not select.select([fd], [], [], left)[0]:
            continue
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode(errors="replace")


def wait_for_probe(endpoint_dir: str, pid: int, timeout: float = 10.0) -> Path:
    """The probe's metadata file `<endpoint_dir>/<pid>.json`, once it is there.

    A client that finds no probe for a pid injects one (`rankscope dap`
    does), so a benchmark that means to use the probe the target started
    waits for the file its probe writes."""
    meta = Path(endpoint_dir) / f"{pid}.json"
    deadline = time.monotonic() + timeout
    while not meta.exists():
        if time.monotonic() > deadline:
            raise BenchError(f"process {pid} wrote no probe metadata ({meta}) within {timeout:.0f} s")
        time.sleep(0.005)
    return meta


def stop_target(proc) -> None:
    """Kill a target and reap it; safe to call twice."""
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    proc.wait(timeout=10)


def base_env(**extra: str) -> dict[str, str]:
    """This environment without any RANKSCOPE* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env.update(extra)
    return env


def median(xs):
    return statistics.median(xs)


def p90(xs):
    """90th percentile, nearest-rank."""
    ordered = sorted(xs)
    return ordered[max(0, -(-len(ordered) * 9 // 10) - 1)]


def machine() -> str:
    """One line about where this ran: CPU, cores, load (the machine may be busy)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpu}; {os.cpu_count()} cores; load average {load}; "
        f"Python {platform.python_version()}; {platform.system()} {platform.release()}"
    )


def run_main(main) -> None:
    """Exit with main()'s status; a BenchError is one line on stderr and 1."""
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def ask(proc, line) -> object:
    """Send one line to a target that answers each with one JSON line."""
    proc.stdin.write(f"{line}\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()
    if not answer:
        raise BenchError("the target exited")
    return json.loads(answer)


def overhead_table(times: dict, base_mode: str, targets: dict, judge: str = "thread CPU") -> None:
    """Prints each mode against `base_mode`, from rounds of `[wall, thread
    CPU]` seconds per step, one per mode per round, taken alternately. The
    figure judged is the median of the per-round paired ratios of thread
    CPU time (the hooks run on the timed thread; waiting for a core, this
    machine's noise, is left out), or with judge="wall" of wall-clock time:
    on a GPU the thread spins while it waits for the device (a sync), so
    its CPU time counts the device's work too; the other is printed beside."""
    base = times[base_mode]
    main, other = (0, 1) if judge == "wall" else (1, 0)
    other_name = "thread CPU" if judge == "wall" else "wall"

    def paired(mode, i):
        return (statistics.median(t[i] / b[i] for t, b in zip(times[mode], base)) - 1) * 100

    print(f"{base_mode:22s} {statistics.median(b[main] for b in base) * 1e3:8.3f} ms/step {judge} "
          f"(median round; {other_name} {statistics.median(b[other] for b in base) * 1e3:.3f})")
    for mode in times:
        if mode == base_mode:
            continue
        judged = paired(mode, main)
        us = (statistics.median(t[main] - b[main] for t, b in zip(times[mode], base))) * 1e6
        best = (min(t[main] for t in times[mode]) / min(b[main] for b in base) - 1) * 100
        target = targets.get(mode)
        verdict = "" if target is None else (f"  target <= {target} %: " + ("met" if judged <= target else "NOT met"))
        print(f"{mode:22s} {judged:+6.2f} % {judge} ({us:+6.1f} us/step; best rounds {best:+6.2f} %; "
              f"{other_name}: paired median {paired(mode, other):+6.2f} %){verdict}")


def probe_cli(rankscope: str, pids, env: dict[str, str]):
    """`cli(*words)`: `rankscope PID *words` for each of `pids`; a failure is a BenchError."""

    def cli(*words):
        for pid in pids:
            result = subprocess.run([rankscope, str(pid), *words], capture_output=True, text=True, env=env, timeout=60)
            if result.returncode != 0:
                raise BenchError(f"rankscope {' '.join(words)}: {result.stderr.strip()}")

    return cli
