"""How `rankscope cluster bt` and `cluster query` scale with the number of
ranks.

Simulated ranks: light Python processes that each run the real probe, with
a launcher's environment (RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID), most of
them in one function and one rank in another. For each size (16, 64, 256 by
default) the whole `rankscope cluster bt` command is timed, and
`cluster query "SELECT count(*) FROM python.backtrace"`. Baseline, in the
same run: `rankscope PID bt` on one rank, so the per-rank cost of the
fan-out can be read off: (cluster time) / (ranks x single time).

With torch installed, also a real 4-rank torchrun job (gloo, CPU).

Targets (from the issue): cluster bt over 256 ranks <= 1 s; over 4 real
torchrun ranks <= 50 ms; cost growing no faster than linearly.

    .venv/bin/python bench/bench_cluster.py [--sizes 16,64,256] [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from _common import BenchError, base_env, machine, median, private_dir, run_main, tool

RANK = r"""
import os, sys, time
def wait_for_peers():
    while True:
        time.sleep(0.5)
def load_batch():
    while True:
        time.sleep(0.5)
print("ready", flush=True)
sys.stdout.close()
load_batch() if os.environ["RANK"] == "1" else wait_for_peers()
"""

TRAIN = r"""
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
def train_step():
    if dist.get_rank() == 2:
        time.sleep(600)
    dist.barrier()
train_step()
"""


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = (time.perf_counter() - t0) * 1000
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[:400]}")
    return wall


def start_ranks(n: int, env: dict[str, str], source: str = RANK) -> tuple[str, list[subprocess.Popen]]:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    procs = []
    for rank in range(n):
        rank_env = dict(env, RANKSCOPE="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), TORCHELASTIC_RUN_ID=job)
        procs.append(subprocess.Popen([sys.executable, "-c", source], env=rank_env, stdout=subprocess.PIPE, text=True))
    for proc in procs:
        if not proc.stdout.readline().startswith("ready"):
            raise BenchError("a rank did not start")
    return job, procs


def stop(procs) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    rankscope = tool("rankscope")
    endpoint_dir = private_dir("rankscope-bench-cluster-")
    run_dir = tempfile.mkdtemp(prefix="rankscope-bench-cluster-run-")
    env = base_env(RANKSCOPE_DIR=endpoint_dir, RANKSCOPE_RUN_DIR=run_dir)
    print(f"machine: {machine()}")
    results = []
    try:
        for n in sizes:
            job, procs = start_ranks(n, env)
            try:
                bt = [rankscope, "cluster", "--job", job, "bt"]
                query = [rankscope, "cluster", "--job", job, "query", "SELECT count(*) FROM python.backtrace"]
                single = [rankscope, str(procs[0].pid), "bt"]
                out = subprocess.run(bt, env=env, capture_output=True, text=True).stdout
                if f"ranks 0,2-{n - 1} ({n - 1})" not in out or "rank  1 (1)" not in out:
                    raise BenchError(f"cluster bt over {n} ranks did not group as expected:\n{out[:1000]}")
                for cmd in (bt, query, single):
                    timed(cmd, env)
                walls = {"bt": [], "query": [], "single": []}
                for _ in range(args.runs):
                    walls["bt"].append(timed(bt, env))
                    walls["query"].append(timed(query, env))
                    walls["single"].append(timed(single, env))
                results.append((n, median(walls["bt"]), median(walls["query"]), median(walls["single"])))
            finally:
                stop(procs)
        torchrun = None
        if subprocess.run([sys.executable, "-c", "import torch.distributed"], capture_output=True).returncode == 0:
            # A run directory of its own: the simulated jobs' registries are not part of it.
            torch_run_dir = tempfile.mkdtemp(prefix="rankscope-bench-torchrun-run-")
            try:
                torchrun = bench_torchrun(rankscope, dict(env, RANKSCOPE_RUN_DIR=torch_run_dir), torch_run_dir, args.runs)
            finally:
                shutil.rmtree(torch_run_dir, ignore_errors=True)
    finally:
        shutil.rmtree(endpoint_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)

    print()
    print(f"medians of {args.runs} runs; wall ms of the whole command")
    print(f"{'ranks':>6} {'cluster bt':>11} {'cluster query':>14} {'single bt':>10} {'bt / (ranks x single)':>22}")
    for n, bt, query, single in results:
        print(f"{n:>6} {bt:11.1f} {query:14.1f} {single:10.1f} {bt / (n * single):22.3f}")
    if len(results) > 1:
        (n0, t0, *_), (n1, t1, *_) = results[0], results[-1]
        growth = (t1 / t0) / (n1 / n0)
        verdict = "met" if growth <= 1.0 else "NOT met"
        print(f"target: no faster than linear: time grew {t1 / t0:.1f}x for {n1 / n0:.0f}x the ranks ({growth:.2f} of linear), {verdict}")
    for n, bt, *_ in results:
        if n == 256:
            print(f"target: cluster bt over 256 ranks <= 1000 ms: {bt:.1f} ms, {'met' if bt <= 1000 else 'NOT met'}")
    if torchrun is not None:
        print(f"target: cluster bt over 4 torchrun ranks <= 50 ms: {torchrun:.1f} ms, {'met' if torchrun <= 50 else 'NOT met'}")
    else:
        print("torchrun: skipped (torch is not installed)")
    return 0


def bench_torchrun(rankscope: str, env: dict[str, str], run_dir: str, runs: int) -> float:
    work = tempfile.mkdtemp(prefix="rankscope-bench-torchrun-")
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(TRAIN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", script],
        env=dict(env, RANKSCOPE="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        cmd = [rankscope, "cluster", "--run", run_dir, "bt"]
        deadline = time.monotonic() + 120
        while "rank  2 (1)" not in subprocess.run(cmd, env=env, capture_output=True, text=True).stdout:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise BenchError("the torchrun job did not come up")
            time.sleep(0.5)
        timed(cmd, env)
        return median([timed(cmd, env) for _ in range(runs)])
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        # torchrun's workers have process groups of their own.
        subprocess.run(["pkill", "-9", "-f", script], check=False)
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    run_main(main)
