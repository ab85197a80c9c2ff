"""What the torch features' GPU paths pay, part by part, on a CUDA device:
the unit costs of the calls the trace makes per module call (the
allocator's counters, a timing event on the current stream) and the NaN
watch per step (a one-value read, which waits for the device), then a
cProfile of 100 training steps of bench_torch_trace.py's GPT per
RANKSCOPE_TORCH mode, where those calls show up among torch's own.

The unit costs are timed in this process (2,000 calls each, after one);
each profile runs in a target of its own with the probe on. Without CUDA
it says so and stops. scripts/device-check runs it on a lent GPU machine.

    python bench/bench_torch_cuda_units.py [--modes none,trace,nan] [--top 15] [--width 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from _common import base_env, machine, private_dir, run_main
from bench_torch_trace import TARGET

# The GPT's training body, profiled: TARGET up to its stdin loop, then
# 30 steps to warm up and 100 under cProfile.
PROFILED = TARGET.split('print("ready", flush=True)')[0] + r"""
import cProfile, pstats
for _ in range(30):
    step()
sync()
t0, c0 = time.perf_counter(), time.thread_time()
for _ in range(100):
    step()
sync()
print(f"{(time.perf_counter() - t0) * 10:.3f} ms/step wall, {(time.thread_time() - c0) * 10:.3f} ms/step thread CPU (unprofiled)")
profile = cProfile.Profile()
profile.enable()
for _ in range(100):
    step()
sync()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(int(sys.argv[5]))
"""


def unit_costs() -> None:
    import torch

    from rankscope._probe.torch import trace

    def unit(name, fn, n=2000):
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        print(f"  {name:58s} {(time.perf_counter() - start) / n * 1e6:8.2f} us")

    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream()
    kept = torch.cuda.Event(enable_timing=True)
    one = torch.ones((), device=device)

    def rankscope_event():
        # The trace's own: an event from its pool, given back as a read row does.
        trace._spare([trace._cuda_event(device)])

    print("unit costs (2,000 calls each):")
    unit("torch._C._cuda_memoryStats(0) (the trace's counters)", lambda: torch._C._cuda_memoryStats(device.index))
    unit("torch.cuda.memory_allocated(0)", lambda: torch.cuda.memory_allocated(device.index))
    unit("a new Event(enable_timing) recorded on current_stream()", lambda: torch.cuda.Event(enable_timing=True).record(torch.cuda.current_stream()))
    unit("torch.cuda.current_stream()", torch.cuda.current_stream)
    unit("a kept event's record(stream)", lambda: kept.record(stream))
    unit("trace._cuda_event (kept events, stream by id)", rankscope_event)
    unit("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    unit("bool() of a 0-d CUDA tensor (waits for the device)", lambda: bool(one))


def profiles(modes, args) -> None:
    endpoint = private_dir("rs-bench-cuda-units-")
    for mode in modes:
        env = base_env(RANKSCOPE="1", RANKSCOPE_DIR=endpoint, RANKSCOPE_RUN_DIR=os.path.join(endpoint, "run"))
        if mode != "none":
            env["RANKSCOPE_TORCH"] = mode
        argv = [sys.executable, "-c", PROFILED, str(args.width), str(args.layers), "gpt", "cuda", str(args.top)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        print(f"\nRANKSCOPE_TORCH={mode if mode != 'none' else '(unset)'}:")
        print(done.stdout.rstrip() if done.returncode == 0 else f"  failed (rc {done.returncode}): {done.stderr.strip()[-400:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,trace,nan", help="RANKSCOPE_TORCH values to profile, comma-separated (none: unset)")
    ap.add_argument("--top", type=int, default=15, help="functions shown per profile, by own time")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    print(f"machine: {machine()}")
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        print("skipped: no CUDA device here")
        return 0
    unit_costs()
    print(f"\nGPT: {args.layers} blocks, d={args.width}, context 64, batch 8, Adam, CUDA; 100 steps profiled after 130")
    profiles([m for m in args.modes.split(",") if m], args)
    return 0


if __name__ == "__main__":
    run_main(main)
