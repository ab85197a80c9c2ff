"""How long `rankscope inject PID` takes, and what 100 inject/stop cycles cost
the target.

The target runs from a virtual environment WITHOUT rankscope (as a job
started without it would), with 8 threads and a main thread that sleeps in
short steps. Each cycle times the whole `rankscope inject PID` command (until
the probe answers), then stops the probe through it
(`rankscope PID eval "rankscope.stop()"`), so the next cycle injects again.

Baseline, measured in the same run: what inject saves the user, a restart
of the interpreter with RANKSCOPE=1 up to a listening probe (here with the
target's work reduced to nothing, so the real saving is far larger).

Targets (from the issue): inject median <= 300 ms; after 100 cycles the
target still runs and its RSS grew by < 1 MB (measured from cycle 1, once
the library and the package are loaded).

    .venv/bin/python bench/bench_inject.py [--cycles 100]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from _common import BenchError, base_env, machine, median, p90, private_dir, stop_target, tool, run_main

TARGET = r"""
import threading, time
def worker():
    while True:
        time.sleep(0.2)
for i in range(8):
    threading.Thread(target=worker, name=f"worker-{i}", daemon=True).start()
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""

RESTART = "import rankscope; rankscope.start(); print('ready', flush=True)"


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise BenchError(f"no VmRSS for {pid}")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = (time.perf_counter() - t0) * 1000
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    return wall, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=100)
    args = ap.parse_args()

    rankscope = tool("rankscope")
    endpoint_dir = private_dir("rankscope-bench-inject-")
    env = base_env(RANKSCOPE_DIR=endpoint_dir)
    venv = tempfile.mkdtemp(prefix="rankscope-bench-bare-")
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", venv], check=True)
    bare_python = os.path.join(venv, "bin", "python")

    print(f"machine: {machine()}")
    print(f"target: {bare_python} (a venv without rankscope), 8 threads + main")
    proc = None
    try:
        proc = subprocess.Popen([bare_python, "-c", TARGET], env=env, stdout=subprocess.PIPE, text=True)
        if not proc.stdout.readline().startswith("ready"):
            raise BenchError("target did not start")
        pid = str(proc.pid)

        injects, restarts = [], []
        rss_after_first = None
        for cycle in range(args.cycles):
            wall, out = timed([rankscope, "inject", pid], env)
            if "probe started" not in out:
                raise BenchError(f"cycle {cycle}: inject said {out!r}")
            injects.append(wall)
            timed([rankscope, pid, "eval", "import rankscope; rankscope.stop()"], env)
            if cycle == 0:
                rss_after_first = rss_kb(proc.pid)
            # The baseline alternates with the inject so load hits both alike.
            t0 = time.perf_counter()
            restart = subprocess.Popen([sys.executable, "-c", RESTART], env=env, stdout=subprocess.PIPE, text=True)
            if not restart.stdout.readline().startswith("ready"):
                raise BenchError("restart baseline did not start")
            restarts.append((time.perf_counter() - t0) * 1000)
            restart.kill()
            restart.wait()
        rss_end = rss_kb(proc.pid)
        alive = proc.poll() is None
    finally:
        stop_target(proc)
        shutil.rmtree(endpoint_dir, ignore_errors=True)
        shutil.rmtree(venv, ignore_errors=True)

    print()
    print(f"{args.cycles} cycles; wall ms")
    print(f"{'':44} {'median':>8} {'p90':>8} {'min':>8}")
    print(f"{'rankscope inject PID (until the probe answers)':44} {median(injects):8.1f} {p90(injects):8.1f} {min(injects):8.1f}")
    print(f"{'baseline: restart with the probe':44} {median(restarts):8.1f} {p90(restarts):8.1f} {min(restarts):8.1f}")
    print(f"ratio inject / restart (medians): {median(injects) / median(restarts):.2f}")
    growth = rss_end - rss_after_first
    print(f"target RSS after cycle 1: {rss_after_first} kB, after cycle {args.cycles}: {rss_end} kB, growth {growth} kB")
    verdict = "met" if median(injects) <= 300 else "NOT met"
    print(f"target: inject median <= 300 ms: {median(injects):.1f} ms, {verdict}")
    verdict = "met" if alive and growth < 1024 else "NOT met"
    print(f"target: alive after {args.cycles} cycles and RSS growth < 1 MB: alive={alive}, {growth} kB, {verdict}")
    return 0


if __name__ == "__main__":
    run_main(main)
