"""What the torch features cost a step, measured inside one process: the
step clock alone, the trace, the NaN watch, gradient statistics; and,
warm, the clock's hooks per optimizer step and a timed stand-in per
module call.

The CLI benches (bench_torch_trace.py, bench_torch_health.py) switch
features through the installed CLI in a separate target; this one runs
the MLP (4 x Linear(256) + ReLU, batch 64, Adam, 1 thread) in its own
process and switches each feature with the probe's own handler between
blocks of 100 steps, alternating which goes first, so that the per-step
figure and each phase of the step (zero_grad, forward, backward,
optimizer) come from the training thread's CPU time with no second
process in the way. A mode's figure is the median of its paired
differences against nothing on in the same round.

To compare two builds in the same session, install one into a folder
(`pip install --no-deps --target DIR WHEEL`) and run this again with
`PYTHONPATH=DIR`, alternating: the machine's own speed moves by more than
10 % within minutes.

    .venv/bin/python bench/bench_step_hooks.py [--rounds 40] [--modes clock,trace1,trace20,nan,grads]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import machine, run_main

BLOCK = 100
WARM = 20
PHASES = ("zero_grad", "forward", "backward", "optimizer")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--modes", default="clock,trace1,trace20,nan,grads")
    args = ap.parse_args()
    import torch

    import rankscope

    torch.set_num_threads(1)
    rankscope.start()
    from rankscope._probe import torch as probe_torch
    from rankscope._probe.torch import timed, trace

    class Silent:
        """A listener that hears nothing: the clock alone."""

        optimizer_pre = optimizer_post = boundary = None

        def failed(self, reason):
            raise SystemExit(f"the clock failed: {reason}")

    silent = Silent()

    def ask(request):
        answer = json.loads(probe_torch.handle(json.dumps(request)))
        if "error" in answer:
            raise SystemExit(f"{request}: {answer['error']}")

    switches = {
        "clock": (lambda: trace.TRACER.add_listener(silent), lambda: trace.TRACER.remove_listener(silent)),
        "trace1": (lambda: ask({"action": "trace_on", "every": 1}), lambda: ask({"action": "trace_off"})),
        "trace20": (lambda: ask({"action": "trace_on", "every": 20}), lambda: ask({"action": "trace_off"})),
        "nan": (lambda: ask({"action": "nan", "switch": "on"}), lambda: ask({"action": "nan", "switch": "off"})),
        "grads": (lambda: ask({"action": "grads", "every": 10}), lambda: ask({"action": "grads", "switch": "off"})),
    }
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in switches:
            raise SystemExit(f"unknown mode {mode!r}; modes: {', '.join(switches)}")

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    loss_fn = torch.nn.MSELoss()
    clock = time.perf_counter_ns

    def step(phases=None):
        a = clock()
        opt.zero_grad()
        b = clock()
        loss = loss_fn(model(x), y)
        c = clock()
        loss.backward()
        d = clock()
        opt.step()
        e = clock()
        if phases is not None:
            for name, spent in zip(PHASES, (b - a, c - b, d - c, e - d)):
                phases[name] += spent

    for _ in range(300):
        step()

    print(f"machine: {machine()}")
    print(f"MLP 4 x Linear(256) + ReLU, batch 64, Adam, 1 thread; {args.rounds} rounds x {BLOCK} steps per state")
    for mode in modes:
        on, off = switches[mode]
        per = {True: [], False: []}
        phases = {state: dict.fromkeys(PHASES, 0) for state in (True, False)}
        for r in range(args.rounds):
            for state in (False, True) if r % 2 == 0 else (True, False):
                (on if state else off)()
                for _ in range(WARM):
                    step()
                started = time.thread_time_ns()
                for _ in range(BLOCK):
                    step(phases[state])
                per[state].append((time.thread_time_ns() - started) / BLOCK)
        off()
        base = statistics.median(per[False])
        excess = statistics.median(b - a for a, b in zip(per[False], per[True]))
        n = args.rounds * BLOCK
        split = ", ".join(f"{name} {(phases[True][name] - phases[False][name]) / n / 1e3:+.1f}" for name in PHASES)
        print(f"{mode:8s} {excess / 1e3:+7.2f} us a step ({excess / base * 100:+.2f} % of {base / 1e3:.0f} us); by phase (us): {split}")

    # Warm: the clock's hooks per optimizer step, and a stand-in per call.
    tiny = torch.nn.Linear(4, 4)
    tiny_opt = torch.optim.SGD(tiny.parameters(), lr=0.0)
    tiny(torch.randn(2, 4)).sum().backward()

    def opt_steps(n=20_000):
        started = clock()
        for _ in range(n):
            tiny_opt.step()
        return (clock() - started) / n

    blocks = {True: [], False: []}
    for _ in range(10):
        for state in (False, True):
            (trace.TRACER.add_listener if state else trace.TRACER.remove_listener)(silent)
            opt_steps(1000)
            blocks[state].append(opt_steps())
    trace.TRACER.remove_listener(silent)
    print(f"warm: the step clock {statistics.median(blocks[True]) - statistics.median(blocks[False]):+.0f} ns an optimizer step")

    relu, value, acc = torch.nn.ReLU(), torch.randn(4), [0, 0]

    def calls(n=200_000):
        started = clock()
        for _ in range(n):
            relu(value)
        return (clock() - started) / n

    plain, stood = [], []
    for _ in range(7):
        plain.append(calls())
        handle = timed.put_on(relu, lambda inner: timed.timed(inner, acc, 0))
        stood.append(calls())
        timed.take_off(handle)
    print(f"warm: a timed stand-in {statistics.median(stood) - statistics.median(plain):+.0f} ns a module call")
    return 0


if __name__ == "__main__":
    run_main(main)
