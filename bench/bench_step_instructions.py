"""Instructions a training step costs, counted by callgrind: the MLP of
bench_torch_health.py with nothing on, with the step clock alone, and with
the NaN watch armed (or `grads --every 10`, or the trace: `trace` is `--every 1`,
`trace20` `--every 20`), in the training thread only.

Timing this machine's 1.5 ms step moves by 5-10 us between runs, more than
most changes to the probe's per-step work; the count of instructions run
moves less, and callgrind's cache model (``--cache``) says how much of the
rest is the misses of code and data gone cold after the step's kernels.
What the probe does by the clock rather than by the step (the step row
every 20 ms, the hand-over of rows every 250 ms) runs at almost every
step under valgrind, whose steps take 50 times as long, and more or less
often with the machine's load: a mode's count moves by up to 15,000
instructions a step between runs. Compare modes within one run, and
builds in runs made side by side.
Each mode runs in its own process under valgrind, which counts only the
measured steps (instrumentation switched on with ``callgrind_control``
once the warm-up is done); the modes run side by side, one a core, which
changes no count. A run takes a few minutes.

    python bench/bench_step_instructions.py [--steps 50] [--modes off,clock,nan,grads,trace,trace20]
                                            [--cache] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TARGET = r"""
import os, sys, time
import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)
layers = []
for _ in range(4):
    layers += [nn.Linear(256, 256), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(256, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
x, y = torch.randn(64, 256), torch.randn(64, 1)


def step():
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


mode, steps, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for _ in range(20):
    step()
if mode == "nan":
    from rankscope._probe.torch.nan import WATCH
    WATCH.turn_on()
elif mode == "grads":
    from rankscope._probe.torch.stats import GRADS
    GRADS.turn_on(10)
elif mode == "clock":
    # The step clock with a listener that is never called.
    from rankscope._probe.torch.stats import GRADS
    GRADS.turn_on(10**9)
elif mode.startswith("trace"):
    # trace, trace20: `torch trace on [--every 20]`, forward only.
    from rankscope._probe.torch.trace import TRACER
    TRACER.turn_on(int(mode[5:] or 1), "*", False, wait_s=0)
for _ in range(20):
    step()
open(marker + ".ready", "w").close()
while not os.path.exists(marker + ".go"):
    time.sleep(0.1)
for _ in range(steps):
    step()
open(marker + ".done", "w").close()
time.sleep(600)
"""

EVENTS = re.compile(r"^events:\s*(.*)$", re.M)
TOTALS = re.compile(r"^totals:\s*(.*)$", re.M)


def wait_for(path: Path, proc: subprocess.Popen, limit: float = 1800) -> None:
    end = time.monotonic() + limit
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the target under valgrind exited ({proc.returncode}) before {path.name}")
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {path.name}")
        time.sleep(0.5)


def count(python: str, mode: str, steps: int, cache: bool, work: Path, keep: Path | None) -> dict:
    script = work / "target.py"
    script.write_text(TARGET)
    marker = work / f"mark_{mode}"
    out = work / f"cg_{mode}.out"
    # The probe's work that runs by the clock (the run store's flushes, the
    # memory sampler) would run more often in a step slowed 50x, and by how
    # much depends on the machine's load: put off past the run. The step
    # row, told every 20 ms, still runs at every step counted here (once in
    # about 13 steps of 1.5 ms outside valgrind), in every mode the clock runs.
    env = {**os.environ, "RANKSCOPE": "1", "OMP_NUM_THREADS": "1", "RANKSCOPE_STORE_FLUSH_S": "86400",
           "RANKSCOPE_MEMORY_INTERVAL_S": "86400"}
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
           f"--callgrind-out-file={out}"] + (["--cache-sim=yes"] if cache else []) + [python, str(script), mode,
                                                                                   str(steps), str(marker)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(Path(str(marker) + ".ready"), proc)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        Path(str(marker) + ".go").touch()
        wait_for(Path(str(marker) + ".done"), proc)
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        time.sleep(2)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    # The dump of the first thread (the training thread): <out>.1-01.
    dump = Path(f"{out}.1-01")
    text = dump.read_text()
    if keep is not None:
        # For callgrind_annotate --inclusive=yes, or kcachegrind.
        shutil.copy(dump, keep / f"callgrind.{mode}.out")
    names = EVENTS.search(text).group(1).split()
    values = [int(v) for v in TOTALS.search(text).group(1).split()]
    return dict(zip(names, values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--modes", default="off,clock,nan")
    parser.add_argument("--cache", action="store_true", help="simulate the caches too (slower)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--keep", type=Path, help="a folder to keep each mode's callgrind dump in")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (callgrind) is not installed: apt install valgrind")
    modes = args.modes.split(",")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rankscope-cg-") as tmp:
        def one(mode: str) -> dict:
            work = Path(tmp) / mode
            work.mkdir()
            return count(args.python, mode, args.steps, args.cache, work, args.keep)

        with ThreadPoolExecutor(max_workers=max(1, min(len(modes), os.cpu_count() or 1))) as pool:
            results = dict(zip(modes, pool.map(one, modes)))
    base = results[modes[0]]
    print(f"MLP: 4 x Linear(256, 256) + ReLU, batch 64, Adam, CPU, 1 thread; {args.steps} steps counted per mode, "
          f"training thread only")
    for mode in modes:
        got = results[mode]
        per = {k: (got[k] - base.get(k, 0)) / args.steps for k in got}
        line = f"{mode:6s} {got['Ir'] / args.steps:12,.0f} instructions/step  {per['Ir']:+10,.0f} vs {modes[0]}"
        line += f"  ({per['Ir'] / (base['Ir'] / args.steps) * 100:+.2f} %)"
        if "I1mr" in got:
            misses = per["I1mr"] + per["D1mr"] + per["D1mw"]
            last = per.get("ILmr", 0) + per.get("DLmr", 0) + per.get("DLmw", 0)
            # callgrind's own estimate of cycles: Ir + 10 a first-level miss + 100 a last-level one.
            estimate = per["Ir"] + 10 * misses + 100 * last
            line += f"  L1 misses {misses:+8,.0f}/step  est. cycles {estimate:+10,.0f}"
        print(line)


if __name__ == "__main__":
    main()
