"""How long an editor waits to attach to a running process: `rankscope dap`
against debugpy's attach by PID.

Each run starts a fresh target, a simple loop with a probe from its start
(`RANKSCOPE=1`; the bench waits for its ready line and its probe's
`<RANKSCOPE_DIR>/<pid>.json`), and times from starting the debugger's
command to the answer to the editor's first `threads`, this script being
the editor (initialize, attach, the `initialized` event, configurationDone,
threads). Arms, alternating, a new target for every run:

- ``rankscope --stdio``: `rankscope dap --stdio --pid PID`, as an editor
  that starts its adapter does it; then `disconnect`, and the adapter must
  exit by itself (that time is printed too);
- ``rankscope --listen``: `rankscope dap --listen 127.0.0.1:0 --pid PID`, the
  editor connecting to the port it prints (VSCode's "Remote Attach");
- ``debugpy --pid``: `python -m debugpy --listen 127.0.0.1:PORT --pid PID`,
  which injects debugpy into the target through gdb, then the editor
  connecting to PORT. debugpy can be injected once per process, hence the
  fresh targets (the rankscope arms get them too, to be fair). Reported as
  unavailable, with the reason, where gdb or ptrace is not to be had.

Target (from the issue): attach <= 500 ms on a probed process.

    .venv/bin/python bench/bench_dap.py [--python PY] [--runs 10] [--warmup 1]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from _common import BenchError, base_env, machine, median, private_dir, read_line, run_main, start_target, stop_target, tool, wait_for_probe
from _dap import ATTACH, DapClient, disconnect, free_port, handshake

TARGET = r"""
import sys, time
import rankscope
if rankscope.endpoint() is None or "rankscope._native" not in sys.modules:
    print("no probe: was RANKSCOPE=1 set?", flush=True)
    sys.exit(1)

def step(i):
    return sum(j * j for j in range(200)) + i

print("ready", flush=True)
i = 0
while True:
    step(i)
    i += 1
    time.sleep(0.001)
"""

TARGET_MS = 500.0

# debugpy's attach runs gdb and starts an adapter process: seconds, not ms.
RUN_TIMEOUT = 60.0

ARMS = ("rankscope --stdio", "rankscope --listen", "debugpy --pid")

# The times taken in a run, from the command's start to each answer.
PHASES = ("initialize", "initialized", "configurationDone", "attach", "threads")


def first_threads(dap: DapClient, adapter_id: str, t0: float) -> dict[str, float]:
    """The editor's side of an attach up to the first `threads` answer;
    returns the ms from t0 to each answer (PHASES)."""
    marks = handshake(dap, adapter_id, ATTACH)
    answer = dap.response(dap.send("threads"), "threads")
    marks["threads"] = time.monotonic()
    names = [t.get("name") for t in answer.get("body", {}).get("threads", [])]
    # An empty answer would be a fast attach to nothing.
    if "MainThread" not in names:
        raise BenchError(f"{dap.name}: threads answered {names}, without MainThread")
    return {phase: (marks[phase] - t0) * 1e3 for phase in PHASES}


def tail(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace").strip()[-500:]


def debugpy_said(f) -> str:
    """Why `python -m debugpy --pid` failed, in a line: its output ends with
    tracebacks that quote gdb's whole command, the reason is above them
    (gdb's "ptrace: Operation not permitted.", debugpy's "Code injection
    ... failed")."""
    f.seek(0)
    lines = f.read().decode(errors="replace").splitlines()
    reasons = [line.strip()[:200] for line in lines if re.search(r"ptrace|not permitted|denied|failed|No such|not found", line)]
    return " / ".join(dict.fromkeys(reasons[:4])) or " / ".join(lines[-3:])[-500:]


def run_stdio(rankscope: str, pid: int, env: dict[str, str]) -> tuple[dict[str, float], float]:
    """Returns the phases, and the ms from `disconnect` to the adapter's exit."""
    with tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        dap, adapter = DapClient.spawn(
            [rankscope, "dap", "--stdio", "--pid", str(pid)], t0 + RUN_TIMEOUT, env=env, stderr=err, name="rankscope dap --stdio"
        )
        try:
            phases = first_threads(dap, "rankscope", t0)
            gone = disconnect(dap, adapter, timeout=10.0)
        except BenchError as e:
            raise BenchError(f"{e}; adapter stderr: {tail(err)}") from None
        finally:
            dap.close()
            stop_target(adapter)
        return phases, gone * 1e3


def run_listen(rankscope: str, pid: int, env: dict[str, str]) -> dict[str, float]:
    # Port 0 and the address it prints: no race for a free port, and the
    # editor connects once the adapter listens instead of polling for it.
    t0 = time.monotonic()
    deadline = t0 + RUN_TIMEOUT
    adapter = subprocess.Popen(
        [rankscope, "dap", "--listen", "127.0.0.1:0", "--pid", str(pid)], env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    dap = None
    seen = []
    try:
        while True:
            line = read_line(adapter.stderr, deadline, "rankscope dap --listen's address")
            if not line:
                raise BenchError(f"rankscope dap --listen exited (rc={adapter.wait(10)}): {''.join(seen)[-500:]}")
            seen.append(line)
            if "attach the editor to " in line:
                host, _, port = line.split("attach the editor to ", 1)[1].split()[0].rpartition(":")
                break
        dap = DapClient.connect(host, int(port), deadline, alive=lambda: adapter.poll() is None, name="rankscope dap --listen")
        phases = first_threads(dap, "rankscope", t0)
        # It stays for the next editor: the answer is all there is to await.
        dap.response(dap.send("disconnect"), "disconnect")
        return phases
    finally:
        if dap is not None:
            dap.close()
        # --listen serves one editor after another until its process exits.
        stop_target(adapter)
        adapter.stderr.close()


def debugpy_adapters(port: int) -> list[int]:
    """The pids of debugpy adapters serving `port`. The adapter that the
    injected debugpy starts daemonizes (double fork, setsid): no process
    group of ours holds it, only its command line names the port."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        mine = any(a.endswith(b"debugpy/adapter") for a in argv)
        if mine and b"--port" in argv and argv[argv.index(b"--port") + 1 :][:1] == [str(port).encode()]:
            pids.append(int(entry))
    return pids


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_debugpy(python: str, pid: int, env: dict[str, str]) -> dict[str, float]:
    port = free_port()
    # A file, not a pipe: gdb and the launcher write more than anyone reads.
    with tempfile.TemporaryFile() as out:
        t0 = time.monotonic()
        launcher = subprocess.Popen(
            [python, "-m", "debugpy", "--listen", f"127.0.0.1:{port}", "--pid", str(pid)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            # Its own group, so that gdb, its child, goes with it.
            start_new_session=True,
        )
        dap = None
        try:
            # The launcher exits 0 once gdb has injected; a failure (no
            # ptrace, no gdb) exits non-zero before anything listens.
            dap = DapClient.connect(
                "127.0.0.1",
                port,
                t0 + RUN_TIMEOUT,
                alive=lambda: launcher.poll() in (None, 0),
                name="debugpy",
                interval=0.01,
            )
            phases = first_threads(dap, "debugpy", t0)
            try:
                dap.send("disconnect")
            except BenchError:
                pass  # gone already: nothing left to end
            return phases
        except BenchError as e:
            raise BenchError(f"{e}; `python -m debugpy --pid` said: {debugpy_said(out)}") from None
        finally:
            if dap is not None:
                dap.close()
            try:
                os.killpg(launcher.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            launcher.wait(timeout=10)
            for adapter in debugpy_adapters(port):
                kill_pid(adapter)


def debugpy_unavailable(python: str) -> str | None:
    """Why the debugpy arm cannot run here, or None."""
    probe = subprocess.run([python, "-c", "import debugpy; print(debugpy.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"debugpy is not importable by {python} (pip install debugpy)"
    if shutil.which("gdb") is None:
        return "gdb is not on PATH: debugpy attaches by PID through it"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the target's interpreter, with rankscope (and debugpy) installed")
    ap.add_argument("--runs", type=int, default=10, help="timed runs of each arm (default 10)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each arm first (default 1)")
    args = ap.parse_args()

    rankscope = tool("rankscope")
    endpoint_dir = private_dir("rankscope-bench-dap-")
    # Python code is run from bytecode compiled once, in the warm-up, as
    # after `pip install` (which compiles): with PYTHONDONTWRITEBYTECODE and
    # a stale cache, the first attach (it imports the probe's debugger)
    # would time the compiler on every run. Private, so the venvs are not
    # written to.
    pycache = private_dir("rankscope-bench-dap-pyc-")
    env = base_env(RANKSCOPE_DIR=endpoint_dir, PYTHONPYCACHEPREFIX=pycache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    target_env = dict(env, RANKSCOPE="1")
    version = subprocess.run([args.python, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {machine()}")
    print(f"target interpreter: {args.python} ({version}); rankscope: {rankscope}")
    arms = ARMS
    unavailable = debugpy_unavailable(args.python)
    if unavailable is None:
        print(f"debugpy: {subprocess.run([args.python, '-m', 'debugpy', '--version'], capture_output=True, text=True).stdout.strip()}; gdb: {shutil.which('gdb')}")
    phases = {arm: [] for arm in arms}
    exits = []
    debugpy_worked = False
    try:
        for round_ in range(args.warmup + args.runs):
            order = arms if round_ % 2 == 0 else tuple(reversed(arms))
            for arm in order:
                if arm == "debugpy --pid" and unavailable is not None:
                    continue
                # Its stderr would carry debugpy's warnings about frozen modules.
                target, _ = start_target(TARGET, target_env, python=args.python, stderr=subprocess.DEVNULL)
                try:
                    wait_for_probe(endpoint_dir, target.pid)
                    if arm == "rankscope --stdio":
                        got, gone = run_stdio(rankscope, target.pid, env)
                    elif arm == "rankscope --listen":
                        got, gone = run_listen(rankscope, target.pid, env), None
                    else:
                        try:
                            got, gone = run_debugpy(args.python, target.pid, env), None
                        except BenchError as e:
                            if debugpy_worked:
                                raise
                            # Never worked here: gdb or ptrace is not allowed
                            # (a container without CAP_SYS_PTRACE, Yama).
                            unavailable = str(e)
                            continue
                        debugpy_worked = True
                    if target.poll() is not None:
                        raise BenchError(f"{arm}: the target died during the attach (rc={target.returncode})")
                finally:
                    stop_target(target)
                if round_ >= args.warmup:
                    phases[arm].append(got)
                    if gone is not None:
                        exits.append(gone)
    finally:
        shutil.rmtree(endpoint_dir, ignore_errors=True)
        shutil.rmtree(pycache, ignore_errors=True)

    print()
    print(f"{args.runs} runs of each arm, alternating, a fresh target each ({args.warmup} untimed first)")
    print("ms from starting the command to the answer to the first `threads`")
    print(f"{'arm':22} {'median':>9} {'min':>9} {'max':>9}")
    measured = [arm for arm in arms if phases[arm]]
    for arm in measured:
        total = [p["threads"] for p in phases[arm]]
        print(f"{arm:22} {median(total):9.1f} {min(total):9.1f} {max(total):9.1f}")
    if unavailable is not None:
        print(f"{'debugpy --pid':22} unavailable: {unavailable}")
    print()
    print("medians, ms from the start to each answer:")
    print(f"{'arm':22} " + " ".join(f"{p:>17}" for p in PHASES))
    for arm in measured:
        print(f"{arm:22} " + " ".join(f"{median([p[phase] for p in phases[arm]]):17.1f}" for phase in PHASES))
    print(f"rankscope --stdio: disconnect to the adapter's exit: {median(exits):.1f} ms median, {max(exits):.1f} max")
    print()
    ours = {arm: median([p["threads"] for p in phases[arm]]) for arm in measured}
    if "debugpy --pid" in ours:
        for arm in ARMS[:2]:
            print(f"ratio {arm} / debugpy --pid (medians): {ours[arm] / ours['debugpy --pid']:.3f}")
    worst = max(ours[arm] for arm in ARMS[:2])
    print(f"target: attach <= {TARGET_MS:.0f} ms: {worst:.1f} ms (the slower rankscope arm's median), {'met' if worst <= TARGET_MS else 'NOT met'}")
    return 0


if __name__ == "__main__":
    run_main(main)
