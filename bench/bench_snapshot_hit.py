"""What one breakpoint hit costs: a snapshot of a frame with 20 locals.

A function with 20 locals is called N times with a breakpoint on its last
line that records at every hit (through the code the CLI reaches,
`rankscope._probe.breakpoints.add`); the same calls without the breakpoint
are the baseline, in the same interpreter. The cost per hit is the
difference divided by the hits. Any CPython 3.11+.

Target (from the issue): <= 50 us per snapshot hit with 20 locals.

    .venv/bin/python bench/bench_snapshot_hit.py [--python .cache/venvs/py3.12/bin/python] [--calls 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

from _common import BenchError, ROOT, base_env, machine, private_dir, run_main

TARGET = r"""
import json, sys, time
import rankscope
rankscope.start()
from rankscope._probe import breakpoints
from rankscope._probe import snapshots

def step(i):
    a0, a1, a2, a3, a4 = i, i * 1.5, str(i), [i] * 4, {"i": i}
    b0, b1, b2, b3, b4 = (i, i), None, True, b"x" * 8, 3 + 4j
    c0, c1, c2, c3, c4 = "y" * 50, list(range(10)), {1: 2}, frozenset({1}), range(3)
    d0, d1, d2, d3 = i + 1, i + 2, i + 3, i + 4
    return d3  # @hit

def run(calls):
    t0 = time.perf_counter()
    for i in range(calls):
        step(i)
    return time.perf_counter() - t0

calls = int(sys.argv[1])
run(200)
rounds = []
for _ in range(5):
    base = run(calls)
    bp = breakpoints.add(f"{__file__}:{step.__code__.co_firstlineno + 5}", max_hits=None)
    armed = run(calls)
    hits = breakpoints.remove(bp["id"])["hits"]
    snapshots._table.clear()
    rounds.append({"base": base, "armed": armed, "hits": hits})
print(json.dumps(rounds))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=str(ROOT / ".cache" / "venvs" / "py3.12" / "bin" / "python"))
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--no-spill", action="store_true", help="leave out the write to the run directory, to see its share")
    args = ap.parse_args()
    if not os.path.exists(args.python):
        raise BenchError(f"{args.python} not found: give a CPython 3.11+ with rankscope installed (--python)")
    work = tempfile.mkdtemp(prefix="rankscope-bench-hit-")
    script = os.path.join(work, "target.py")
    with open(script, "w") as f:
        f.write(TARGET)
    env = base_env(RANKSCOPE_DIR=private_dir("rankscope-bench-hit-"), RANKSCOPE_RUN_DIR=os.path.join(work, "run"))
    if args.no_spill:
        env["RANKSCOPE_STORE"] = "0"  # the run store keeps its rows in memory only
    command = [args.python, script, str(args.calls)]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchError(out.stderr.strip()[-800:])
    rounds = json.loads(out.stdout.strip().splitlines()[-1])
    version = subprocess.run([args.python, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {machine()}")
    print(f"target interpreter: {version}; {args.calls} calls per arm, 5 rounds")
    per_hit = []
    for r in rounds:
        if r["hits"] != args.calls:
            raise BenchError(f"expected {args.calls} hits, got {r['hits']}")
        cost = (r["armed"] - r["base"]) / r["hits"] * 1e6
        per_hit.append(cost)
        print(f"  baseline {r['base'] * 1e6 / args.calls:7.2f} us/call   with a snapshot at every call {r['armed'] * 1e6 / args.calls:8.2f} us/call   -> {cost:6.1f} us per hit")
    per_hit.sort()
    median = per_hit[len(per_hit) // 2]
    print(f"target: a snapshot hit with 20 locals <= 50 us: {median:.1f} us (median), {'met' if median <= 50 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    run_main(main)
