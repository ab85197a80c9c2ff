"""`rankscope cluster query` over many rows: what push-down saves.

Eight simulated ranks (light processes that each run the real probe, with a
launcher's environment) hold deep stacks: THREADS threads each DEPTH frames
deep, so that `python.backtrace` has about 1 M rows across the job. Timed,
as whole commands, alternating, R runs each:

- ``count``: `SELECT count(*) FROM python.backtrace`: it reads no column,
  so each probe is asked how many frames it has, and one number per rank
  crosses the wire;
- ``per-rank``: `SELECT rank, count(*) ... GROUP BY rank`: identity
  columns only, pushed down the same way;
- ``rows`` (the baseline): `SELECT count(func) FROM python.backtrace`: it
  reads a frame column, so every frame's row crosses the wire.

Target (from the issue): a cluster query counting 1 M rows over 8 probes
<= 300 ms.

    .venv/bin/python bench/bench_cluster_query.py [--ranks 8] [--threads 25] [--depth 5000] [--runs 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import uuid

from _common import BenchError, base_env, machine, median, private_dir, run_main, tool
from bench_cluster import stop, timed

RANK = r"""
import os, sys, threading
sys.setrecursionlimit(100_000)
depth, threads = int(os.environ["BENCH_DEPTH"]), int(os.environ["BENCH_THREADS"])
hold = threading.Event()

def deep(n):
    if n == 0:
        hold.wait()
        return
    deep(n - 1)

for _ in range(threads - 1):
    threading.Thread(target=deep, args=(depth,), daemon=True).start()
print("ready", flush=True)
sys.stdout.close()
deep(depth)
"""


def start_ranks(n: int, threads: int, depth: int, env: dict[str, str]) -> tuple[str, list[subprocess.Popen]]:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    procs = []
    for rank in range(n):
        rank_env = dict(
            env,
            RANKSCOPE="1",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(n),
            TORCHELASTIC_RUN_ID=job,
            BENCH_DEPTH=str(depth),
            BENCH_THREADS=str(threads),
        )
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=rank_env, stdout=subprocess.PIPE, text=True))
    for proc in procs:
        if not proc.stdout.readline().startswith("ready"):
            raise BenchError("a rank did not start")
    return job, procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=25)
    ap.add_argument("--depth", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rankscope = tool("rankscope")
    env = base_env(RANKSCOPE_DIR=private_dir("rankscope-bench-cq-"), RANKSCOPE_RUN_DIR=private_dir("rankscope-bench-cq-run-"))
    print(f"machine: {machine()}")
    job, procs = start_ranks(args.ranks, args.threads, args.depth, env)
    try:
        base = [rankscope, "cluster", "--job", job, "--timeout", "30", "query", "--format", "csv"]
        queries = {
            "count": "SELECT count(*) AS n FROM python.backtrace",
            "per-rank": "SELECT rank, count(*) AS n FROM python.backtrace GROUP BY rank",
            "rows": "SELECT count(func) AS n FROM python.backtrace",
        }
        answers = {}
        for name, sql in queries.items():
            out = subprocess.run([*base, sql], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise BenchError(f"{name}: {out.stderr.strip()[:400]}")
            answers[name] = out.stdout.split()
        total = int(answers["count"][1])
        if int(answers["rows"][1]) != total or sum(int(line.split(",")[1]) for line in answers["per-rank"][1:]) != total:
            raise BenchError(f"the queries disagree: {answers}")
        print(f"{args.ranks} ranks x {args.threads} threads x ~{args.depth} frames: python.backtrace holds {total:,} rows")
        walls = {name: [] for name in queries}
        for run in range(args.runs):
            order = list(queries) if run % 2 == 0 else list(reversed(queries))
            for name in order:
                walls[name].append(timed([*base, queries[name]], env))
    finally:
        stop(procs)
    rows = median(walls["rows"])
    print(f"\nmedian of {args.runs} runs, whole command, ms")
    for name, sql in queries.items():
        m = median(walls[name])
        print(f"{name:9} {m:9.1f}   {m / rows:5.2f}x the rows baseline   {sql}")
    count = median(walls["count"])
    print(f"target: cluster query counting {total / 1e6:.2f} M rows over {args.ranks} probes <= 300 ms: {count:.1f} ms, {'met' if count <= 300 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    run_main(main)
