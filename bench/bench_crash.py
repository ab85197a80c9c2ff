"""How long recording a crash takes: 30 frames with 20 locals each.

What the crashing process spends in rankscope before it exits: building the
record (every frame's locals through the safe reprs) and writing it durably
(temp file, fsync, rename, fsync of the directory). Baseline, in the same
run: `traceback.format_exception` of the same exception, which Python's own
hook does anyway.

Target (from the issue): <= 50 ms per crash. Until an exception goes
uncaught the cost is zero (no tracing, no per-call hooks): that is the idle
figure of bench_idle.py.

    .venv/bin/python bench/bench_crash.py [--runs 50]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback

from _common import machine, median, p90, run_main


def nested(depth: int):
    # 20 locals per frame: numbers, strings, containers, an object.
    a0, a1, a2, a3, a4 = depth, depth * 1.5, str(depth), [depth] * 8, {"depth": depth}
    b0, b1, b2, b3, b4 = (depth, depth), set(range(5)), b"bytes" * 4, None, True
    c0, c1, c2, c3, c4 = "x" * 300, list(range(100)), {i: str(i) for i in range(10)}, object(), range(depth)
    d0, d1, d2, d3 = 3 + 4j, frozenset({1, 2}), bytearray(16), ValueError("inner")
    if depth == 1:
        raise RuntimeError("shape mismatch")
    return nested(depth - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="rankscope-bench-crash-")
    os.environ["RANKSCOPE_RUN_DIR"] = run_dir
    from rankscope._probe import crashes

    print(f"machine: {machine()}")
    try:
        nested(29)  # with the module frame of main(): 30 frames
    except RuntimeError as caught:
        exc = caught
    frames = 0
    tb = exc.__traceback__
    while tb is not None:
        frames += 1
        tb = tb.tb_next
    ours, theirs = [], []
    try:
        for _ in range(args.runs):
            # A new exception object each time: a recorded one is not recorded twice.
            try:
                nested(29)
            except RuntimeError as fresh:
                exc = fresh
            t0 = time.perf_counter()
            path = crashes.record(exc, "bench")
            ours.append((time.perf_counter() - t0) * 1000)
            if path is None:
                print("error: the crash was not recorded", file=sys.stderr)
                return 1
            t0 = time.perf_counter()
            traceback.format_exception(type(exc), exc, exc.__traceback__)
            theirs.append((time.perf_counter() - t0) * 1000)
        size = os.path.getsize(path)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"crash: {frames} frames, 20 locals each; record {size} bytes")
    print(f"{'':40} {'median':>8} {'p90':>8}   (ms, {args.runs} runs)")
    print(f"{'rankscope record (build + fsync write)':40} {median(ours):8.2f} {p90(ours):8.2f}")
    print(f"{'baseline: traceback.format_exception':40} {median(theirs):8.2f} {p90(theirs):8.2f}")
    print(f"ratio record / format_exception (medians): {median(ours) / median(theirs):.1f}")
    verdict = "met" if median(ours) <= 50 else "NOT met"
    print(f"target: a 30-frame, 20-locals crash recorded in <= 50 ms: {median(ours):.2f} ms, {verdict}")
    return 0


if __name__ == "__main__":
    run_main(main)
