"""What the training-health features cost a step: the NaN/Inf watch armed
(no trip), `torch.autograd.detect_anomaly` for comparison, and gradient
statistics every 10 steps.

The same models as bench_torch_trace.py (the MLP, or --model gpt) train
in a target with the probe on. Rounds alternate between the modes, each
switched through the installed CLI
(`rankscope PID torch nan on|off`, `torch grads --every 10|off`, and
`eval "torch.autograd.set_detect_anomaly(True|False)"`), and time --steps
steps each, timed by the wall clock and by the training thread's CPU time;
a mode's figure is the median of its paired ratios against nothing on in
the same round (see bench_torch_trace.py).

Targets (from the issue): NaN watch armed <= 1 %; grads --every 10 <= 1 %;
detect_anomaly: reported, for comparison.

    .venv/bin/python bench/bench_torch_health.py [--model mlp|gpt] [--width W] [--layers 4] [--device cpu|cuda] [--rounds 40] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics

from _common import ask, base_env, machine, overhead_table, private_dir, probe_cli, run_main, start_target, stop_target, tool
from bench_torch_trace import TARGET, add_model_args, describe_model, judged_by, target_args  # the same models and loop

OFF = [("torch", "nan", "off"), ("torch", "grads", "off"), ("eval", "torch.autograd.set_detect_anomaly(False)")]
MODES = {
    "nothing on": [("torch",)],
    "nan watch armed": [("torch", "nan", "on")],
    "grads --every 10": [("torch", "grads", "--every", "10")],
    "detect_anomaly": [("eval", "torch.autograd.set_detect_anomaly(True)")],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    rankscope = tool("rankscope")
    endpoint = private_dir("rs-bench-health-")
    env = base_env(RANKSCOPE="1", RANKSCOPE_DIR=endpoint, RANKSCOPE_RUN_DIR=os.path.join(endpoint, "run"), OMP_NUM_THREADS="1")
    proc, _ = start_target(TARGET, env, target_args(args))
    cli = probe_cli(rankscope, [proc.pid], base_env(RANKSCOPE_DIR=endpoint))

    def measure(n):
        return ask(proc, n)

    times: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    try:
        for _ in range(args.rounds):
            for mode, requests in MODES.items():
                # Every mode makes the same number of requests.
                for words in OFF:
                    cli(*words)
                for words in requests:
                    cli(*words)
                measure(20)  # warm up; the hooks go on at the first boundary
                times[mode].append(measure(args.steps))
        for words in OFF:
            cli(*words)
    finally:
        stop_target(proc)

    print(f"machine: {machine()}")
    print(f"{describe_model(args)}; "
          f"{args.rounds} rounds x {args.steps} steps per mode, alternating")
    overhead_table(times, "nothing on", {"nan watch armed": 1.0, "grads --every 10": 1.0}, judge=judged_by(args))
    return 0


if __name__ == "__main__":
    run_main(main)
