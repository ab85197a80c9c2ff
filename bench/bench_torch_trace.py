"""What `rankscope PID torch trace on` costs a training step.

A small MLP (Linear+ReLU layers, Adam, batch 64, CPU, one torch thread)
trains in a target with the probe on. Rounds alternate between no trace,
`trace on --every 1`, `--every 20`, and `--every 1 --backward`, each set
through the installed CLI (`rankscope PID torch trace on|off`), and time
--steps steps each. Each round is timed twice: by the wall clock and by the
training thread's own CPU time (`time.thread_time`), which leaves out the
time the thread spent waiting for a core: on a shared 2-core machine that
wait is most of the noise, and the hooks run on this thread, so their cost
is all in it. A mode's figure is the median over rounds of its paired
ratio against no trace in the same round; the best rounds' ratio is
printed beside it.

Targets (from the issue): forward only, <= 3 % at --every 1 and <= 0.5 % at
--every 20; --backward: reported.

    .venv/bin/python bench/bench_torch_trace.py [--width 256] [--layers 4] [--rounds 40] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import random

from _common import ask, base_env, machine, overhead_table, private_dir, probe_cli, run_main, start_target, stop_target, tool

TARGET = r"""
import json, sys, time
import torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
width, layers, batch = int(sys.argv[1]), int(sys.argv[2]), 64
blocks = []
for _ in range(layers):
    blocks += [nn.Linear(width, width), nn.ReLU()]
model = nn.Sequential(*blocks, nn.Linear(width, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
x = torch.randn(batch, width)
y = torch.randn(batch, 1)

def step():
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()

for _ in range(50):
    step()
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        step()
    print(json.dumps([(time.perf_counter() - t0) / n, (time.thread_time() - c0) / n]), flush=True)
"""

MODES = {
    "no trace": None,
    "--every 1": ["--every", "1"],
    "--every 20": ["--every", "20"],
    "--every 1 --backward": ["--every", "1", "--backward"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    rankscope = tool("rankscope")
    endpoint = private_dir("rs-bench-torch-")
    env = base_env(RANKSCOPE="1", RANKSCOPE_DIR=endpoint, RANKSCOPE_RUN_DIR=os.path.join(endpoint, "run"), OMP_NUM_THREADS="1")
    proc, _ = start_target(TARGET, env, (str(args.width), str(args.layers)))
    cli = probe_cli(rankscope, [proc.pid], base_env(RANKSCOPE_DIR=endpoint))

    def measure(n):
        return ask(proc, n)

    times: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    try:
        order = list(MODES.items())
        for round_no in range(args.rounds):
            # A fresh order each round: a mode never always follows the same one.
            random.Random(round_no).shuffle(order)
            for mode, flags in order:
                cli("torch", "trace", "off")
                # Every mode makes the same two requests (each walks gc.get_objects()).
                cli("torch", "trace", "on", *flags) if flags is not None else cli("torch")
                measure(25)  # warm up; the hooks go on at the first boundary
                times[mode].append(measure(args.steps))
        cli("torch", "trace", "off")
    finally:
        stop_target(proc)

    print(f"machine: {machine()}")
    print(f"MLP: {args.layers} x Linear({args.width}, {args.width}) + ReLU, batch 64, Adam, CPU, 1 thread; "
          f"{args.rounds} rounds x {args.steps} steps per mode, alternating")
    overhead_table(times, "no trace", {"--every 1": 3.0, "--every 20": 0.5})
    return 0


if __name__ == "__main__":
    run_main(main)
