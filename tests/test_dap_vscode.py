"""A second, independent DAP client: Microsoft's own
`@vscode/debugadapter-testsupport` (from the npm registry, run by node)
runs the configuration sequence an editor runs against `rankscope dap
--listen`, then a breakpoint in a running loop, its stack, scopes and
variables, continue and disconnect (tests/js/vscode_debugclient.js). The
test skips where node, npm or the registry cannot be had."""

import json
import os
import re
import selectors
import subprocess
import time
from pathlib import Path

from conftest import line_of

LOOP = """
import time

def work(step):
    x = step * 2  # @x
    return x + 1

def train():
    step = 0
    while True:
        step += 1
        work(step)
        if step % 50 == 0:
            print("tick", step, flush=True)
        time.sleep(0.002)

print("READY", flush=True)
train()
"""

SCRIPT = Path(__file__).parent / "js" / "vscode_debugclient.js"


def listening_port(adapter: subprocess.Popen, timeout: float = 30) -> int:
    """Reads the adapter's stderr until it says where it listens."""
    deadline = time.monotonic() + timeout
    seen = []
    with selectors.DefaultSelector() as selector:
        selector.register(adapter.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = adapter.stderr.readline().decode(errors="replace")
            if not line:
                raise AssertionError(f"the adapter exited (rc={adapter.wait()}): {''.join(seen)}")
            seen.append(line)
            found = re.search(r"attach the editor to 127\.0\.0\.1:(\d+)", line)
            if found:
                return int(found.group(1))
    raise AssertionError(f"the adapter did not say where it listens within {timeout}s: {''.join(seen)}")


def ticks_after(target, seen: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while True:
        line = target.wait_for_line("tick", timeout=max(0.1, deadline - time.monotonic()))
        if int(line.split()[1]) > seen:
            return int(line.split()[1])
        assert time.monotonic() < deadline, "the loop did not go on"


def test_microsofts_debugclient_runs_an_editor_session(debugadapter_testsupport, default_python, spawn, rankscope_bin, endpoint_dir, cli):
    target = spawn(default_python, LOOP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    # Port 0: the adapter picks a free one and says which.
    adapter = subprocess.Popen(
        [rankscope_bin, "dap", "--listen", "127.0.0.1:0", "--pid", str(target.pid)], stderr=subprocess.PIPE, env=env, bufsize=0
    )
    try:
        port = listening_port(adapter)
        config = {"modules": debugadapter_testsupport, "port": port, "path": str(target.script), "line": line_of(LOOP, "x")}
        run = subprocess.run(["node", str(SCRIPT), json.dumps(config)], capture_output=True, text=True, timeout=120)
        report = run.stdout + run.stderr
        assert run.returncode == 0, report
        assert run.stdout.rstrip().endswith("PASS"), report
        stages = [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("ok ")]
        assert [s.split(" ")[0] for s in stages] == [
            "start",
            "initialize",
            "attach",
            "setBreakpointsRequest",
            "stopped",
            "stackTraceRequest",
            "threadsRequest",
            "scopesRequest",
            "evaluateRequest",
            "continueRequest",
            "disconnectRequest",
        ], report
        first, second = (int(m) for m in re.findall(r"step=(\d+)", run.stdout))
        assert second > first, report
        # The session ended; the adapter waits for the next editor.
        assert adapter.poll() is None
    finally:
        adapter.kill()
        adapter.wait()
        adapter.stderr.close()
    # The target lives on, its loop running, with no breakpoint left.
    assert target.alive()
    ticks_after(target, second)
    listed = cli(target.pid, "break", "list", "--format", "json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stdout + listed.stderr
