"""What the memory features cost.

1. The timeline: the same MLP training step as bench_torch_trace.py, in two
   targets started together, one with the memory sampler at its default
   (`RANKSCOPE_MEMORY_INTERVAL_S=1`, here 0.1 to make it ten times as
   busy) and one without it (`=0`); rounds alternate between them. Target:
   <= 0.5 % of step time.
2. `python.tensors` over a process holding --tensors live tensors (a list
   of small tensors and a model): the query's time through the installed
   CLI, and the target's peak RSS growth over three scans (VmHWM read
   before the first and after the last; it includes the first request's
   imports).
   Targets: <= 1 s and <= 5 MB.
3. `memory track on --python` (tracemalloc, 16 frames) on an
   allocation-heavy pure-Python loop: slowdown against tracking off, in one
   target, alternating. tracemalloc's own cost is the figure: reported.
4. `memory track on --cuda` (torch's CUDA memory history: every CUDA
   allocation and free with its Python stack) on a small model's training
   step on a GPU: slowdown against tracking off, in one target,
   alternating, each round's steps ended by a synchronize. Reported;
   skipped where torch has no CUDA device.

    .venv/bin/python bench/bench_memory.py [--rounds 10] [--tensors 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import statistics
import subprocess
import time

from _common import BenchError, ask, base_env, machine, private_dir, run_main, start_target, stop_target, tool
from bench_torch_trace import TARGET as MLP

HOLDER = r"""
import sys, time
import torch
n = int(sys.argv[1])
kept = [torch.zeros(4) for _ in range(n)]
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
print("ready", flush=True)
for line in sys.stdin:
    print(hwm(), flush=True)
"""

ALLOCS = r"""
import json, sys, time
def work(n):
    out = []
    for i in range(n):
        out.append({"i": i, "s": str(i), "t": (i, i + 1)})
    return len(out)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    t0 = time.perf_counter()
    work(n)
    print(json.dumps(time.perf_counter() - t0), flush=True)
"""



def timeline(rounds, steps, endpoint):
    procs = {}
    for label, interval in (("sampler off", "0"), ("sampler on", "1")):
        env = base_env(RANKSCOPE="1", RANKSCOPE_DIR=endpoint, RANKSCOPE_RUN_DIR=os.path.join(endpoint, "run"),
                       OMP_NUM_THREADS="1", RANKSCOPE_MEMORY_INTERVAL_S=interval)
        procs[label], _ = start_target(MLP, env, ("256", "4", "mlp", "cpu"))
    times = {label: [] for label in procs}
    try:
        for _ in range(rounds):
            for label, proc in procs.items():
                ask(proc, 20)
                times[label].append(ask(proc, steps)[0])  # (wall, thread CPU) a step
        # What one sample costs, whoever pays: the two reads of /proc, for a
        # process as big as this one (torch imported).
        pid = procs["sampler off"].pid
        cost = {}
        for name in ("status", "smaps_rollup"):
            t0 = time.perf_counter()
            for _ in range(50):
                with open(f"/proc/{pid}/{name}") as f:
                    f.read()
            cost[name] = (time.perf_counter() - t0) / 50
    finally:
        for proc in procs.values():
            stop_target(proc)
    base, sampled = min(times["sampler off"]), min(times["sampler on"])
    paired = (statistics.median(s / b for s, b in zip(times["sampler on"], times["sampler off"])) - 1) * 100
    print(f"timeline: MLP step {base * 1e3:.3f} ms without the sampler, {sampled * 1e3:.3f} ms with it (every 1 s, the default): "
          f"{(sampled / base - 1) * 100:+.2f} % (paired median {paired:+.2f} %; target <= 0.5 %; two processes side by side, so noisy)")
    average = cost["status"] + cost["smaps_rollup"] / 10
    print(f"timeline: /proc/PID/status {cost['status'] * 1e6:.0f} us, smaps_rollup {cost['smaps_rollup'] * 1e6:.0f} us (one sample in ten): "
          f"{average * 1e6:.0f} us a sample on the sampler's own thread, {average * 100:.3f} % of a core at 1 s")


# The issue's own query (five columns of every row, sorted), and a count
# that reads two columns: the probe is asked for the columns a query reads.
TENSOR_QUERIES = (
    ("the issue's top 20", "SELECT shape, dtype, device, mb, holder FROM python.tensors ORDER BY mb DESC LIMIT 20"),
    ("a count", "SELECT count(*) AS n, sum(bytes) AS b, count(holder) AS named FROM python.tensors"),
)


def tensors(n, endpoint, rankscope):
    env = base_env(RANKSCOPE="1", RANKSCOPE_DIR=endpoint, RANKSCOPE_RUN_DIR=os.path.join(endpoint, "run"), OMP_NUM_THREADS="1")
    cli_env = base_env(RANKSCOPE_DIR=endpoint)
    count = named = None
    for label, sql in TENSOR_QUERIES:
        # A target each: VmHWM is the peak since the process began.
        proc, _ = start_target(HOLDER, env, (str(n),), timeout=120)
        try:
            before = ask(proc, "hwm")
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                result = subprocess.run([rankscope, str(proc.pid), "query", sql, "--format", "json"], env=cli_env, capture_output=True, text=True, timeout=120)
                walls.append(time.perf_counter() - t0)
                if result.returncode != 0:
                    raise BenchError(result.stderr)
            after = ask(proc, "hwm")
            rows = json.loads(result.stdout)
            if "named" in rows[0]:
                count, named = rows[0]["n"], rows[0]["named"]
        finally:
            stop_target(proc)
        print(f"python.tensors, {label}: {min(walls) * 1e3:.0f} ms for the whole query (median {statistics.median(walls) * 1e3:.0f} ms; "
              f"target <= 1 s); the target's peak RSS growth over three scans: {(after - before) / 1024:.1f} MB (target <= 5 MB)")
    print(f"python.tensors: {count} storages, {named} named")


def _probed(source, endpoint, rankscope, timeout=30.0):
    """A target with the probe on, and `cli(*words)` for it (raises on an error)."""
    env = base_env(RANKSCOPE="1", RANKSCOPE_DIR=endpoint, RANKSCOPE_RUN_DIR=os.path.join(endpoint, "run"))
    proc, _ = start_target(source, env, timeout=timeout)
    cli_env = base_env(RANKSCOPE_DIR=endpoint)

    def cli(*words):
        result = subprocess.run([rankscope, str(proc.pid), *words], env=cli_env, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise BenchError(result.stderr)

    return proc, cli


def tracking(rounds, endpoint, rankscope):
    proc, cli = _probed(ALLOCS, endpoint, rankscope)
    times = {"off": [], "on": []}
    try:
        for _ in range(rounds):
            for mode in ("off", "on"):
                cli("memory", "track", mode, "--python")
                ask(proc, 20000)
                times[mode].append(ask(proc, 200000))
        cli("memory", "track", "off", "--python")
    finally:
        stop_target(proc)
    print(f"memory track on --python: {min(times['on']) / min(times['off']):.2f}x on an allocation-heavy loop "
          f"({min(times['off']) * 1e3:.1f} -> {min(times['on']) * 1e3:.1f} ms; that is tracemalloc's own cost, 16 frames)")


CUDA_LOOP = r"""
import json, sys, time
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.GELU())], nn.Linear(1024, 1)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x, y = torch.randn(256, 1024, device="cuda"), torch.randn(256, 1, device="cuda")
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    print(json.dumps((time.perf_counter() - t0) / n), flush=True)
"""


def tracking_cuda(rounds, steps, endpoint, rankscope):
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        print("memory track on --cuda: skipped, no CUDA device here")
        return
    proc, cli = _probed(CUDA_LOOP, endpoint, rankscope, timeout=120)
    times = {"off": [], "on": []}
    try:
        ask(proc, 20)  # cuBLAS and the allocator warmed up
        for _ in range(rounds):
            for mode in ("off", "on"):
                cli("memory", "track", mode, "--cuda")
                ask(proc, 5)
                times[mode].append(ask(proc, steps))
        cli("memory", "track", "off", "--cuda")
    finally:
        stop_target(proc)
    paired = statistics.median(on / off for on, off in zip(times["on"], times["off"]))
    print(f"memory track on --cuda: {(paired - 1) * 100:+.2f} % a step (paired median of {rounds} rounds; "
          f"best rounds {min(times['off']) * 1e3:.3f} -> {min(times['on']) * 1e3:.3f} ms), "
          "7 x Linear(1024) + AdamW, batch 256; torch's memory history with its stacks")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--only", choices=("timeline", "tensors", "tracking", "tracking-cuda"), help="one part of the bench")
    args = ap.parse_args()
    rankscope = tool("rankscope")
    endpoint = private_dir("rs-bench-memory-")
    print(f"machine: {machine()}")
    if args.only in (None, "timeline"):
        timeline(args.rounds, args.steps, endpoint)
    if args.only in (None, "tensors"):
        tensors(args.tensors, endpoint, rankscope)
    if args.only in (None, "tracking"):
        tracking(args.rounds, endpoint, rankscope)
    if args.only in (None, "tracking-cuda"):
        tracking_cuda(args.rounds, args.steps, endpoint, rankscope)
    return 0


if __name__ == "__main__":
    run_main(main)
