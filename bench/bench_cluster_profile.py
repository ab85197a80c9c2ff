"""`rankscope cluster profile` over 16 simulated ranks: how soon its output
is ready after the sampling duration ends.

16 plain Python processes with a launcher's environment (RANK, WORLD_SIZE,
TORCHELASTIC_RUN_ID), each a real probe in one job, half of them in a
Python loop and half asleep, are sampled for --duration seconds at 100 Hz;
the figure is the command's wall time minus the duration: finding the job,
starting 16 samplers, their last reads, merging the folds and writing the
SVG. The baseline, in the same run, is `rankscope PID profile` of one rank
for the same duration, measured the same way. Target (issue 13): <= 1 s.

    .venv/bin/python bench/bench_cluster_profile.py [--ranks 16] [--duration 5] [--runs 3]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time

from _common import BenchError, base_env, machine, median, private_dir, run_main, tool
from bench_cluster import start_ranks, stop

RANK = r"""
import os, sys, time
def spin():
    while True:
        sum(i * i for i in range(1000))
def nap():
    while True:
        time.sleep(0.05)
print("ready", flush=True)
sys.stdout.close()
spin() if int(os.environ["RANK"]) % 2 else nap()
"""


def after_duration(command: list[str], env: dict[str, str], duration: float) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise BenchError(f"{' '.join(command[:4])}...: {done.stderr.strip()[:300]}")
    return (time.perf_counter() - started - duration) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rankscope = tool("rankscope")
    run_dir = tempfile.mkdtemp(prefix="rankscope-bench-cprof-run-")
    env = base_env(RANKSCOPE_DIR=private_dir("rankscope-bench-cprof-"), RANKSCOPE_RUN_DIR=run_dir)
    out = tempfile.mkdtemp(prefix="rankscope-bench-cprof-out-")
    print(machine())
    procs = []
    try:
        _, procs = start_ranks(args.ranks, env, RANK)
        one, job_wide = [], []
        for _ in range(args.runs):
            one.append(after_duration([rankscope, str(procs[1].pid), "profile", "--duration", str(args.duration), "-o", f"{out}/one.svg"], env, args.duration))
            job_wide.append(after_duration([rankscope, "cluster", "profile", "--run", run_dir, "--duration", str(args.duration), "-o", f"{out}/job.svg"], env, args.duration))
    finally:
        stop(procs)
    print(f"sampling {args.duration:g} s at 100 Hz, {args.runs} runs, wall time past the duration (median):")
    print(f"{'one rank (profile)':28s} {median(one):7.1f} ms")
    verdict = "met" if median(job_wide) <= 1000 else "NOT met"
    print(f"{f'{args.ranks} ranks (cluster profile)':28s} {median(job_wide):7.1f} ms ({median(job_wide) / median(one):.1f}x one rank)  target <= 1000 ms: {verdict}")
    return 0


if __name__ == "__main__":
    run_main(main)
