"""What the probe costs a target in disk, memory and threads.

(a) Size of the installed probe library, `rankscope/_native*.so`: it is what
    every probed process maps. maturin strips it already; a stripped copy is
    measured too to confirm nothing is left to strip. (The `rankscope` CLI is
    printed for information: it carries the SQL engine and is never loaded
    into a target.)
(b) Memory and threads added to a small target (it imports nothing heavy:
    one extra thread with a few locals, main blocked reading stdin). The
    benchmark reads the target's /proc/PID/status and /proc/PID/task at each
    step: before `rankscope.start()`, after it, and after each of several
    rounds of CLI requests (`bt`, `bt --locals`, `eval`, a `query`), which
    load the probe's Python helpers and start its deadline watchdog. The same
    program without the probe (no `rankscope.start()`, no requests) is the
    baseline, read at the same steps; the arms alternate, --repeat times,
    and medians are printed. Repeated request rounds also show whether RSS
    keeps growing.

Targets (from the issue): probe library <= 10 MB; RSS added <= 10 MB.

    .venv/bin/python bench/bench_footprint.py [--rounds 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BenchError, base_env, machine, median, private_dir, start_target, stop_target, tool, run_main

TARGET = r"""
import sys, threading
mode = sys.argv[1]
release = threading.Event()

def worker(rows):
    table = {i: "x" * i for i in range(rows)}
    label = "a worker with a few locals"
    release.wait()

threading.Thread(target=worker, args=(20,), name="worker", daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "start":
        if mode == "probe":
            import rankscope
            rankscope.start()
            assert "rankscope._native" in sys.modules and rankscope.endpoint()
        print("started", flush=True)
"""

TARGET_MB = 10.0
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM", "VmSize")


def read_status(pid: int) -> dict[str, float]:
    """The target's memory figures (MiB) and its thread count, from /proc."""
    values: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in STATUS_FIELDS:
            values[key] = int(rest.split()[0]) / 1024  # kB -> MiB
    values["threads"] = settled_threads(pid)
    return values


def settled_threads(pid: int) -> int:
    """Threads in /proc/PID/task, once a just-finished request thread is gone."""
    count = len(list(Path(f"/proc/{pid}/task").iterdir()))
    for _ in range(40):
        time.sleep(0.025)
        again = len(list(Path(f"/proc/{pid}/task").iterdir()))
        if again == count:
            break
        count = again
    return count


def cli(args: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(args[1:])} exited {proc.returncode}: {proc.stderr.strip()[:500]}")


def one_target(mode: str, rounds: int, rankscope: str) -> list[tuple[str, dict[str, float]]]:
    """Start the target in `mode` ("probe" or "baseline"); the readings at each step."""
    endpoint_dir = private_dir("rankscope-bench-fp-")
    env = base_env(RANKSCOPE_DIR=endpoint_dir)
    proc = None
    steps = []
    try:
        proc, _ = start_target(TARGET, env, args=(mode,))
        pid = proc.pid
        steps.append(("before start()", read_status(pid)))
        proc.stdin.write("start\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "started":
            raise BenchError(f"{mode} target did not start its probe")
        steps.append(("after start(), idle", read_status(pid)))
        requests = [
            ["bt"],
            ["bt", "--locals"],
            ["eval", "sum(range(1000))"],
            ["query", "SELECT count(*) FROM python.backtrace"],
        ]
        for r in range(1, rounds + 1):
            if mode == "probe":
                for request in requests:
                    cli([rankscope, str(pid), *request], env)
            if r in (1, rounds):
                steps.append((f"after {r} round{'s' if r > 1 else ''} of requests", read_status(pid)))
    finally:
        stop_target(proc)
        shutil.rmtree(endpoint_dir, ignore_errors=True)
    return steps


def library_sizes() -> None:
    spec = importlib.util.find_spec("rankscope")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the rankscope package is not installed in this interpreter")
    package = Path(list(spec.submodule_search_locations)[0])
    libs = sorted(package.glob("_native*.so"))
    if not libs:
        raise BenchError(f"no _native*.so in {package}")
    lib = libs[0]
    size = lib.stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / lib.name
        shutil.copy2(lib, copy)
        subprocess.run(["strip", str(copy)], check=True)
        stripped = copy.stat().st_size
    cli_path = Path(tool("rankscope"))
    print("(a) sizes on disk")
    print(f"    probe library {lib}")
    print(f"      installed {size / 1e6:8.3f} MB ({size} bytes)")
    print(f"      strip(1)   {stripped / 1e6:8.3f} MB ({stripped} bytes), {(size - stripped)} bytes less")
    verdict = "met" if size <= TARGET_MB * 1e6 else "NOT met"
    print(f"    target: probe library <= {TARGET_MB:.0f} MB: {size / 1e6:.3f} MB, {size / (TARGET_MB * 1e6):.1%} of it, {verdict}")
    print(f"    for information, the CLI (never loaded by a target): {cli_path} {cli_path.stat().st_size / 1e6:.1f} MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of CLI requests against the probed target (default 5)")
    ap.add_argument("--repeat", type=int, default=3, help="targets of each kind, alternating; medians (default 3)")
    args = ap.parse_args()
    rankscope = tool("rankscope")
    print(f"machine: {machine()}")
    library_sizes()

    readings = {"probe": [], "baseline": []}
    for _ in range(args.repeat):
        for mode in ("probe", "baseline"):
            readings[mode].append(one_target(mode, args.rounds, rankscope))

    def med(mode: str, step: int, field: str) -> float:
        return median([run[step][1][field] for run in readings[mode]])

    labels = [label for label, _ in readings["probe"][0]]
    print()
    print(f"(b) memory (MiB) and threads of the target; medians of {args.repeat} targets of each kind")
    print(f"    {'step':34} {'':>9} {'VmRSS':>8} {'RssAnon':>8} {'RssFile':>8} {'VmHWM':>8} {'VmSize':>8} {'threads':>7}")
    for i, label in enumerate(labels):
        for mode in ("baseline", "probe"):
            cells = " ".join(f"{med(mode, i, f):8.2f}" for f in STATUS_FIELDS)
            print(f"    {label:34} {mode:>9} {cells} {med(mode, i, 'threads'):7.0f}")
        added = " ".join(f"{med('probe', i, f) - med('baseline', i, f):+8.2f}" for f in STATUS_FIELDS)
        print(f"    {'':34} {'added':>9} {added} {med('probe', i, 'threads') - med('baseline', i, 'threads'):+7.0f}")

    last = len(labels) - 1
    rss_added = med("probe", last, "VmRSS") - med("baseline", last, "VmRSS")
    hwm_added = med("probe", last, "VmHWM") - med("baseline", last, "VmHWM")
    growth = med("probe", last, "VmRSS") - med("probe", 2, "VmRSS")
    print()
    print(f"    RSS added by start() alone: {med('probe', 1, 'VmRSS') - med('probe', 0, 'VmRSS'):+.2f} MiB (same target, before/after)")
    print(f"    RSS growth from request round 1 to round {args.rounds}: {growth:+.2f} MiB")
    limit = TARGET_MB * 1e6 / 2**20  # 10 MB in MiB
    verdict = "met" if max(rss_added, hwm_added) <= limit else "NOT met"
    print(
        f"    target: RSS added <= {TARGET_MB:.0f} MB ({limit:.2f} MiB): {rss_added:+.2f} MiB after {args.rounds} rounds"
        f" (peak {hwm_added:+.2f} MiB), {verdict}"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
