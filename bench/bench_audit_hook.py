"""What the crash recorder's audit hook costs a program whose operations are audited.

The probe records uncaught exceptions through a C audit hook
(`crash_hook.rs`) instead of replacing `sys.excepthook`. Once any audit
hook exists, CPython builds the argument tuple of every audited operation
(`compile`, `exec`, `open`, `os.listdir`, `socket.*`, `pickle.find_class`,
`sys._getframe`, ...) and calls the hooks, ours compares one string. This
runs a workload made of nothing but the cheapest audited operation
(`sys._getframe`), alternately with the probe started
(`RANKSCOPE=1`) and without it, K pairs with the order swapped every other
pair, and prints the per-pair slowdown. Real programs do far fewer audited
operations per second than this, so the figure is an upper bound.

    .venv/bin/python bench/bench_audit_hook.py [--pairs 7] [--reps 2000000]
"""

import argparse
import json
import subprocess
import sys

from _common import BenchError, base_env, machine, median, private_dir, run_main

WORKLOAD = r"""
import json, os, sys, time

reps = int(sys.argv[1])
getframe = sys._getframe
t0 = time.perf_counter()
for _ in range(reps):
    # The cheapest audited operation there is: the hook's share is largest here.
    getframe()
    getframe()
    getframe()
wall = time.perf_counter() - t0
print(json.dumps({"wall": wall, "probe": "rankscope._native" in sys.modules}))
"""


def run_once(with_probe: bool, reps: int) -> float:
    env = base_env(RANKSCOPE_DIR=private_dir("rs-bench-audit-"))
    if with_probe:
        env["RANKSCOPE"] = "1"
    out = subprocess.run([sys.executable, "-c", WORKLOAD, str(reps)], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise BenchError(f"workload failed: {out.stderr.strip()}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["probe"] != with_probe:
        raise BenchError(f"expected probe={with_probe}, the run says {result['probe']}")
    return result["wall"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--reps", type=int, default=2000000)
    args = parser.parse_args()
    print(machine())
    slowdowns, without, with_ = [], [], []
    for pair in range(args.pairs):
        order = [False, True] if pair % 2 == 0 else [True, False]
        times = {probe: run_once(probe, args.reps) for probe in order}
        without.append(times[False])
        with_.append(times[True])
        slowdowns.append(times[True] / times[False] - 1)
    ops = 3 * args.reps
    print(f"audited operations per run: {ops} (sys._getframe, the cheapest there is)")
    print(f"without probe: median {median(without):.3f} s ({median(without) / ops * 1e9:.0f} ns/op)")
    print(f"with probe:    median {median(with_):.3f} s ({median(with_) / ops * 1e9:.0f} ns/op)")
    print(f"slowdown per pair: median {median(slowdowns) * 100:+.2f} % (min {min(slowdowns) * 100:+.2f} %, max {max(slowdowns) * 100:+.2f} %)")
    return 0


if __name__ == "__main__":
    run_main(main)
