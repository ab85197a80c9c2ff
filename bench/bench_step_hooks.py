"""What the torch features cost a step, measured inside one process: the
step clock alone, the trace, the NaN watch, gradient statistics; and,
warm, the clock's hooks per optimizer step and a timed stand-in per
module call.

The CLI benches (bench_torch_trace.py, bench_torch_health.py) switch
features through the installed CLI in a separate target; this one runs
the MLP (4 x Linear(256) + ReLU, batch 64, Adam, 1 thread) in its own
process and switches each feature with the probe's own handler, so that
the per-step figure and each phase of the step (zero_grad, forward,
backward, optimizer) come from the training thread's CPU time with no
second process in the way.

Each round runs the feature off and on (alternating which goes first):
40 steps to settle (a sampled step's one-time costs, the first copies, go
there), then 40 steps timed one by one. A timed step's excess is its time
less the median step of the same round's block with the feature off, and
it is filed by the step's place in the sampling cycle (the clock's step
mod 40: sampled steps, and the steps before them, cost more); a mode's
figure is the mean over the 40 places of each place's median. Medians of
single steps shed the machine's interruptions, which swung the means of
whole blocks (the first version of this bench) by 5-15 us a step. The
`none` mode switches nothing: its figure is the harness's own error, in
the same run.

To compare two builds in the same session, install one into a folder
(`pip install --no-deps --target DIR WHEEL`) and run this again with
`PYTHONPATH=DIR`, alternating: the machine's own speed moves by more than
10 % within minutes.

    .venv/bin/python bench/bench_step_hooks.py [--rounds 60] [--modes none,clock,trace1,trace20,nan,grads]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import machine, run_main

BLOCK = 40
WARM = 40
CYCLE = 40  # a multiple of every sampling period here (1, 8, 10, 20)
PHASES = ("zero_grad", "forward", "backward", "optimizer")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--modes", default="none,clock,trace1,trace20,nan,grads")
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
        "none": (lambda: None, lambda: None),
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

    cpu = time.thread_time_ns
    own_step = [0]

    def step():
        """The step's CPU ns, and each phase's ns (zero_grad, forward,
        backward, optimizer)."""
        whole = cpu()
        a = clock()
        opt.zero_grad()
        b = clock()
        loss = loss_fn(model(x), y)
        c = clock()
        loss.backward()
        d = clock()
        opt.step()
        e = clock()
        own_step[0] += 1
        return (cpu() - whole, b - a, c - b, d - c, e - d)

    for _ in range(300):
        step()

    print(f"machine: {machine()}")
    print(f"MLP 4 x Linear(256) + ReLU, batch 64, Adam, 1 thread; {args.rounds} rounds x {BLOCK} steps timed per state")
    for mode in modes:
        on, off = switches[mode]
        # place in the cycle -> [excess ns of the whole step, then of each phase]
        places: list = [[[] for _ in range(1 + len(PHASES))] for _ in range(CYCLE)]
        base = []
        for r in range(args.rounds):
            timed_steps = {}
            for state in (False, True) if r % 2 == 0 else (True, False):
                (on if state else off)()
                for _ in range(WARM):
                    step()
                steps = []
                for _ in range(BLOCK):
                    told = trace.TRACER.step if state else None
                    place = (told if told is not None else own_step[0]) % CYCLE
                    steps.append((place, step()))
                timed_steps[state] = steps
            medians = [statistics.median(times[i] for _, times in timed_steps[False]) for i in range(1 + len(PHASES))]
            base.append(medians[0])
            for place, times in timed_steps[True]:
                for i, spent in enumerate(times):
                    places[place][i].append(spent - medians[i])
        off()
        figure = [statistics.mean(statistics.median(p[i]) for p in places if p[i]) for i in range(1 + len(PHASES))]
        step_base = statistics.median(base)
        worst = max(range(CYCLE), key=lambda k: statistics.median(places[k][0]) if places[k][0] else float("-inf"))
        split = ", ".join(f"{name} {figure[1 + i] / 1e3:+.1f}" for i, name in enumerate(PHASES))
        print(
            f"{mode:8s} {figure[0] / 1e3:+7.2f} us a step ({figure[0] / step_base * 100:+.2f} % of {step_base / 1e3:.0f} us); "
            f"by phase (us): {split}; dearest place {worst}: {statistics.median(places[worst][0]) / 1e3:+.0f} us"
        )

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

    # A module's first call in a step (its count is 0: the usual module),
    # and a further one (a shared layer, an RNN cell), which asks whether a
    # backward runs (an activation checkpoint's recompute; stand_in.rs).
    def calls(count_before, n=200_000):
        started = clock()
        for _ in range(n):
            acc[1] = count_before
            relu(value)
        return (clock() - started) / n

    for name, count_before in (("a module's first call in a step", 0), ("a further call", 1)):
        plain, stood = [], []
        for _ in range(7):
            plain.append(calls(count_before))
            handle = timed.put_on(relu, lambda inner: timed.timed(inner, acc, 0))
            stood.append(calls(count_before))
            timed.take_off(handle)
        print(f"warm: a timed stand-in {statistics.median(stood) - statistics.median(plain):+.0f} ns, {name}")
    return 0


if __name__ == "__main__":
    run_main(main)
