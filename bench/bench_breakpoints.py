"""What an armed breakpoint costs code that never reaches it (CPython 3.11+).

A call-heavy pure-Python workload (recursive fib and list comprehensions)
runs in a fresh interpreter under these arms, alternating, K rounds:

- ``none``: no probe at all (the baseline);
- ``breakpoint``: the probe started and one breakpoint armed through the
  same code the CLI reaches (`rankscope._probe.breakpoints.add`), in a
  function the workload never calls;
- ``settrace``: a Python-level global trace function like pdb's, which
  looks each new frame up in a breakpoint table and declines it;
- ``cleared``: the breakpoint armed, then `break clear`;
- ``running``: a breakpoint (whose condition is never true) set from
  another thread into the workload's loop while it runs; then, as
  ``running-after``, a new call of the workload with it still armed;
- ``dap``: the probe started, then `rankscope dap --stdio --pid` with this
  script as the editor (initialize, attach, one setBreakpoints in the same
  never-called function, configurationDone) while the workload waits for a
  go line; the session stays attached (the adapter long-polling the probe)
  for the whole run, then disconnects;
- ``debugpy``: the workload started by ``python -m debugpy --listen
  --wait-for-client`` with this script as the editor (a small DAP client
  over TCP) and one breakpoint set in the same never-called function, as a
  VS Code user would have it; skipped when the target has no debugpy.

Targets (from the issue): breakpoint <= 1 % on 3.12+ and <= 2 % on 3.11,
and the same for a breakpoint set through `rankscope dap`; cleared back to
idle; on 3.11 a running frame pays for tracing while it runs, and nothing
after.

    .venv/bin/python bench/bench_breakpoints.py [--python .cache/venvs/py3.12/bin/python] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import tempfile
import time

from _common import BenchError, ROOT, base_env, machine, median, private_dir, read_line, run_main, stop_target, tool, wait_for_probe
from _dap import ATTACH, DapClient, disconnect, free_port, handshake

WORKLOAD = r"""
import json, os, sys, time

def never_called(x):
    y = x + 1  # the breakpoint's line
    return y

def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)

def work(reps, ready=None):
    if ready is not None:
        ready()  # returns once a breakpoint is armed into this running frame
    t0 = time.perf_counter()
    total = 0
    for i in range(reps):
        total += fib(18)  # the "running" arm's breakpoint line
        total += sum([j * 2 for j in range(200)])
    return time.perf_counter() - t0

# "debugpy" runs like "none": that debugger is set up from outside.
arm = sys.argv[1]
reps = int(sys.argv[2])
ready = None
if arm in ("breakpoint", "cleared", "running", "dap"):
    import rankscope
    rankscope.start()
    from rankscope._probe import breakpoints
    if arm == "dap":
        # The breakpoint comes from outside, through `rankscope dap`, as
        # an editor sets it; the go line says it is armed.
        print("ready", flush=True)
        sys.stdin.readline()
    elif arm == "running":
        import threading
        line = work.__code__.co_firstlineno + 6
        def ready():
            # From another thread, as the CLI's request would come: the
            # loop is already running when its breakpoint arrives. It never
            # records (the condition is false): this measures the mechanism.
            adder = threading.Thread(target=breakpoints.add, args=(f"{__file__}:{line}", "False"))
            adder.start()
            adder.join()
    else:
        breakpoints.add(f"{__file__}:{never_called.__code__.co_firstlineno + 1}")
    if arm == "cleared":
        breakpoints.clear()
elif arm == "settrace":
    table = {("never_called", __file__)}
    def tracer(frame, event, arg):
        if (frame.f_code.co_name, frame.f_code.co_filename) in table:
            return tracer
        return None
    sys.settrace(tracer)

work(5)  # warm up
result = {"wall": work(reps, ready)}
if arm == "running":
    # A new call, the breakpoint still armed: the running frame's trace (3.11) is gone.
    result["after"] = work(reps)
print(json.dumps(result), flush=True)
if arm == "dap":
    # Alive until the session is over: a disconnect that races the
    # process's exit would measure nothing and could fail either way.
    sys.stdin.readline()
"""

ARMS = ("none", "breakpoint", "dap", "debugpy", "settrace", "cleared", "running")

# A debugger's start-up and handshake must end within this, and then the
# workload's run within as much again (seconds at the default --reps).
SESSION_TIMEOUT = 60.0


def breakpoint_line() -> int:
    """The line of never_called's body in WORKLOAD, as written to disk."""
    lines = WORKLOAD.splitlines()
    for number, text in enumerate(lines, 1):
        if text.startswith("def never_called("):
            return number + 1
    raise BenchError("never_called not found in the workload")


def set_breakpoint(dap: DapClient, script: str, line: int) -> None:
    """The one breakpoint, in never_called; the adapter must arm it there."""
    seq = dap.send("setBreakpoints", {"source": {"path": script}, "breakpoints": [{"line": line}]})
    bps = dap.response(seq, "setBreakpoints").get("body", {}).get("breakpoints", [])
    # debugpy moves a breakpoint off a line with no code to the next one
    # with code and still calls it verified: a moved one would measure some
    # other breakpoint.
    if len(bps) != 1 or not bps[0].get("verified") or bps[0].get("line") != line:
        raise BenchError(f"{dap.name} did not verify the breakpoint at {script}:{line}: {bps}")


def check_not_stopped(msg: dict) -> None:
    # A stop waits for an editor's `continue` that never comes.
    if msg.get("type") == "event" and msg.get("event") == "stopped":
        raise BenchError(f"the target stopped ({msg.get('body')}): the breakpoint is meant never to be hit")


def run_dap(rankscope: str, python: str, script: str, reps: int, env: dict[str, str], line: int) -> float:
    """One run of the workload with a breakpoint set through `rankscope dap`,
    this process being the editor; returns the workload's wall."""
    # Files, not pipes, for what is read only on failure: nobody drains them.
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as adapter_err:
        proc = subprocess.Popen(
            [python, script, "dap", str(reps)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
        )
        adapter = dap = None

        def stderr_tails() -> str:
            err.seek(0)
            adapter_err.seek(0)
            return (
                f"target stderr: {err.read().decode(errors='replace').strip()[-500:]}; "
                f"adapter stderr: {adapter_err.read().decode(errors='replace').strip()[-500:]}"
            )

        try:
            deadline = time.monotonic() + SESSION_TIMEOUT
            if not read_line(proc.stdout, deadline, "the target's ready line").startswith("ready"):
                raise BenchError("the target exited before it was ready")
            wait_for_probe(env["RANKSCOPE_DIR"], proc.pid)
            dap, adapter = DapClient.spawn(
                [rankscope, "dap", "--stdio", "--pid", str(proc.pid)], deadline, env=env, stderr=adapter_err, name="rankscope dap"
            )
            handshake(dap, "rankscope", ATTACH, configure=lambda d: set_breakpoint(d, script, line))
            proc.stdin.write("go\n")
            proc.stdin.flush()
            # While the workload runs, the adapter's messages are read (so it
            # never blocks writing to us) until the target's result comes.
            dap.deadline = deadline = time.monotonic() + SESSION_TIMEOUT
            result = None
            while result is None:
                for msg in dap.backlog:
                    check_not_stopped(msg)
                dap.backlog.clear()
                readable = select.select([proc.stdout, dap.sock], [], [], max(0.0, deadline - time.monotonic()))[0]
                if proc.stdout in readable:
                    result = read_line(proc.stdout, deadline, "the workload's result")
                    if not result:
                        raise BenchError("the target exited before printing its result")
                elif dap.sock in readable:
                    msg = dap.read("the adapter's events")
                    if msg is None:
                        raise BenchError("rankscope dap ended the session while the workload ran")
                    check_not_stopped(msg)
                elif time.monotonic() > deadline:
                    raise BenchError("the workload did not finish in time")
            disconnect(dap, adapter, timeout=10.0)
            proc.stdin.close()
            proc.wait(timeout=10)
        except (BenchError, subprocess.TimeoutExpired) as e:
            raise BenchError(f"arm dap: {e}; {stderr_tails()}") from None
        finally:
            if dap is not None:
                dap.close()
            stop_target(adapter)
            stop_target(proc)
        if proc.returncode != 0:
            raise BenchError(f"arm dap failed (rc={proc.returncode}): {stderr_tails()}")
        return json.loads(result)["wall"]


def run_debugpy(python: str, script: str, reps: int, env: dict[str, str], line: int) -> tuple[float, float]:
    """One run of the workload under debugpy, this process being the editor.

    Returns (the workload's wall, seconds from spawn until the program was
    let go by configurationDone), the second being what debugpy adds before
    the user's code starts, which the workload's wall does not see.
    """
    port = free_port()
    # Files, not pipes: debugpy's adapter is a child of the target and may
    # hold inherited pipe ends open after the target has exited.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [python, "-m", "debugpy", "--listen", f"127.0.0.1:{port}", "--wait-for-client", script, "debugpy", str(reps)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
        )

        def stderr_tail() -> str:
            err.seek(0)
            return err.read().decode(errors="replace").strip()[-500:]

        deadline = t0 + SESSION_TIMEOUT
        try:
            dap = DapClient.connect("127.0.0.1", port, deadline, alive=lambda: proc.poll() is None, name="debugpy")
            try:
                marks = handshake(dap, "debugpy", ATTACH, configure=lambda d: set_breakpoint(d, script, line))
                started = marks["configurationDone"] - t0
                dap.deadline = time.monotonic() + SESSION_TIMEOUT
                # Keep reading while the workload runs, so debugpy never
                # blocks on a full socket, until the session ends.
                for msg in dap.drain():
                    check_not_stopped(msg)
                    if msg.get("type") == "event" and msg.get("event") == "terminated":
                        break
                if not dap.closed:
                    try:
                        dap.send("disconnect")
                    except BenchError:
                        pass  # the adapter left first: nothing to end
            finally:
                dap.close()
            proc.wait(timeout=max(1.0, dap.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_target(proc)
            raise BenchError(f"arm debugpy: the target did not exit after its session ended: {stderr_tail()}") from None
        except BenchError as e:
            stop_target(proc)
            raise BenchError(f"arm debugpy: {e}; target stderr: {stderr_tail()}") from None
        if proc.returncode != 0:
            raise BenchError(f"arm debugpy failed (rc={proc.returncode}): {stderr_tail()}")
        out.seek(0)
        lines = out.read().decode(errors="replace").strip().splitlines()
        if not lines:
            raise BenchError(f"arm debugpy printed nothing: {stderr_tail()}")
        return json.loads(lines[-1])["wall"], started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=str(ROOT / ".cache" / "venvs" / "py3.12" / "bin" / "python"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    if not os.path.exists(args.python):
        raise BenchError(f"{args.python} not found: give a CPython 3.12+ with rankscope installed (--python)")
    script = os.path.join(tempfile.mkdtemp(prefix="rankscope-bench-bp-"), "workload.py")
    with open(script, "w") as f:
        f.write(WORKLOAD)
    env = base_env(RANKSCOPE_DIR=private_dir("rankscope-bench-bp-"))
    rankscope = tool("rankscope")
    version = subprocess.run([args.python, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {machine()}")
    print(f"target interpreter: {args.python} ({version})")
    arms = ARMS
    probe = subprocess.run([args.python, "-c", "import debugpy; print(debugpy.__version__)"], capture_output=True, text=True)
    if probe.returncode == 0:
        print(f"debugpy {probe.stdout.strip()}")
    else:
        arms = tuple(a for a in ARMS if a != "debugpy")
        print(f"note: debugpy is not importable by {args.python}: the debugpy arm is skipped")
    line = breakpoint_line()
    walls = {arm: [] for arm in arms}
    debugpy_startup = []
    for round_ in range(args.rounds):
        order = arms if round_ % 2 == 0 else tuple(reversed(arms))
        for arm in order:
            if arm == "debugpy":
                wall, started = run_debugpy(args.python, script, args.reps, env, line)
                walls[arm].append(wall)
                debugpy_startup.append(started)
                continue
            if arm == "dap":
                walls[arm].append(run_dap(rankscope, args.python, script, args.reps, env, line))
                continue
            out = subprocess.run([args.python, script, arm, str(args.reps)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise BenchError(f"arm {arm} failed: {out.stderr.strip()[-500:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            walls[arm].append(result["wall"])
            if "after" in result:
                walls.setdefault("running-after", []).append(result["after"])
    base = median(walls["none"])
    print(f"\nmedians of {args.rounds} rounds, workload wall s")
    for arm in [*arms, "running-after"]:
        m = median(walls[arm])
        print(f"{arm:12} {m:8.3f}   {m / base:5.3f}x   {100 * (m / base - 1):+6.2f}%")
    # Judged on per-round ratios: the arms of a round run back to back, so a
    # change in the machine's load mostly cancels inside the round.
    def paired(arm):
        return 100 * (median([a / b for a, b in zip(walls[arm], walls["none"])]) - 1)

    also = f", debugpy {paired('debugpy'):+.1f}%" if "debugpy" in walls else ""
    print(
        f"per-round median slowdown: breakpoint {paired('breakpoint'):+.2f}%, dap {paired('dap'):+.2f}%, "
        f"cleared {paired('cleared'):+.2f}%, settrace {paired('settrace'):+.1f}%{also}"
    )
    noise = 100 * (max(walls["none"]) / min(walls["none"]) - 1)
    print(f"noise: the baseline runs alone span {noise:.1f}% (max/min)")
    limit = 1 if "3.11" not in version else 2
    for arm, what in (("breakpoint", "one armed breakpoint elsewhere"), ("dap", "the same breakpoint set through rankscope dap")):
        slowdown = paired(arm)
        print(f"target: {what} <= {limit} %: {slowdown:+.2f}%, {'met' if slowdown <= limit else 'NOT met'}")
    print(
        f"a breakpoint set into the running loop (never recording): {paired('running'):+.1f}% while that frame runs, "
        f"{paired('running-after'):+.1f}% for the next call (on 3.11 the running frame is traced, then the trace goes)"
    )
    print(f"ratio settrace / breakpoint: {median(walls['settrace']) / median(walls['breakpoint']):.2f}x")
    print(f"ratio dap / breakpoint: {median(walls['dap']) / median(walls['breakpoint']):.2f}x")
    if "debugpy" in walls:
        print(f"ratio debugpy / breakpoint: {median(walls['debugpy']) / median(walls['breakpoint']):.2f}x")
        print(f"ratio debugpy / dap: {median(walls['debugpy']) / median(walls['dap']):.2f}x")
        # Outside the workload's wall: what debugpy costs before user code runs.
        print(f"debugpy start-up, spawn to configurationDone: {median(debugpy_startup):.3f} s median")
    return 0


if __name__ == "__main__":
    run_main(main)
