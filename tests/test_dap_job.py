"""`rankscope dap --job` on a real 2-rank job (torchrun, gloo on CPU) whose
ranks all_reduce at every step: one session shows every rank's threads; a
breakpoint whose condition names a rank goes to that rank only and stops
only its thread; the stop says which rank, and the Debug Console says the
other rank waits for it, with the time left before gloo's timeout (the
program's own); rank 0 is seen waiting inside the all_reduce; after
disconnect the job goes on with no breakpoint left. Skipped without torch."""

import json
import os
import re
import subprocess
import threading
import time

import pytest

from conftest import kill_tree, launch_torchrun, line_of, query_json, require_torch
from dap_client import DapClient, load_schema

# No name `rank` in the program: `rank == 1` can only be the adapter's.
JOB = """
import datetime, os, time
import torch
import torch.distributed as dist

# The program's own collective timeout: the one the adapter reports.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
print(f"READY {dist.get_rank()} {os.getpid()}", flush=True)


def train_step(step, t):
    t.fill_(step)
    dist.all_reduce(t)  # @reduce
    return t


def main():
    t = torch.zeros(4)
    step = 0
    while True:
        step += 1
        train_step(step, t)
        if step % 50 == 0:
            print(f"rank {dist.get_rank()} step {step}", flush=True)
        time.sleep(0.002)


main()
"""

SCHEMA = load_schema()


class Output:
    """torchrun's stdout (both ranks print there, their lines may
    interleave), read on a thread so that the ranks never block on a full pipe."""

    def __init__(self, stream):
        self.text = ""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            with self._cond:
                self.text += chunk.decode(errors="replace")
                self._cond.notify_all()

    def wait(self, pattern: str, enough, timeout: float = 120):
        """Waits until the matches of `pattern` satisfy `enough(matches)`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = re.findall(pattern, self.text)
                if enough(found):
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"no {pattern!r} as wanted within {timeout}s; the job printed:\n{self.text[-2000:]}"
                self._cond.wait(left)

    def last_steps(self) -> dict[int, int]:
        with self._cond:
            steps: dict[int, int] = {}
            for rank, step in re.findall(r"rank (\d) step (\d+)", self.text):
                steps[int(rank)] = max(steps.get(int(rank), 0), int(step))
            return steps


@pytest.fixture
def job(default_python, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    stderr = open(tmp_path / "job.stderr", "wb")
    proc = launch_torchrun(default_python, script, 2, endpoint_dir, tmp_path / "run", stdout=subprocess.PIPE, stderr=stderr)
    try:
        output = Output(proc.stdout)
        ready = output.wait(r"READY (\d) (\d+)", lambda found: len(found) == 2)
        pids = {int(rank): int(pid) for rank, pid in ready}
        assert sorted(pids) == [0, 1], ready
        yield script, pids, output
    finally:
        kill_tree(proc.pid)
        proc.wait()
        stderr.close()


@pytest.fixture
def schema():
    if SCHEMA is None:
        pytest.skip("debugpy (for the DAP schema) or jsonschema is not installed; scripts/test installs them")
    return SCHEMA


def breakpoints_on(cli, pid) -> list:
    listed = cli(pid, "break", "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


def test_a_breakpoint_on_rank_1_stops_only_rank_1_and_rank_0_waits(job, schema, cli, rankscope_bin, endpoint_dir):
    script, pids, output = job
    reduce_line = line_of(JOB, "reduce")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    adapter = subprocess.Popen(
        [rankscope_bin, "dap", "--stdio", "--job"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0
    )

    def write(data: bytes) -> None:
        adapter.stdin.write(data)
        adapter.stdin.flush()

    client = DapClient(adapter.stdout.read, write, adapter.stdin.close, schema)
    try:
        client.request("initialize", {"clientID": "pytest", "adapterID": "rankscope", "linesStartAt1": True, "columnsStartAt1": True, "pathFormat": "path"})
        client.request("attach", {"type": "debugpy", "request": "attach", "justMyCode": True})
        client.event("initialized")

        # One session, every rank's threads.
        threads = {t["name"]: t["id"] for t in client.request("threads")["body"]["threads"]}
        assert {"rank 0 / MainThread", "rank 1 / MainThread"} <= set(threads), threads
        rank1_main = threads["rank 1 / MainThread"]
        source = {"path": str(script)}

        # A condition with a name the program does not have: each rank's
        # probe turns the breakpoint off after its first failures, and the
        # editor hears why (the breakpoint goes unverified) instead of
        # waiting for a stop that never comes.
        mark = client.mark()
        client.request("setBreakpoints", {"source": source, "breakpoints": [{"line": reduce_line, "condition": "my_rank == 1"}]})
        client.request("configurationDone")
        off = client.event("breakpoint", lambda b: b["breakpoint"].get("verified") is False, after=mark)
        assert "disabled after 5 errors" in off["body"]["breakpoint"]["message"], off
        assert "NameError" in off["body"]["breakpoint"]["message"], off
        # It went to every rank: each says so.
        for rank in (0, 1):
            said = client.event("output", lambda b: b["output"].startswith(f"[rank {rank}] ") and "is off" in b["output"], after=mark)["body"]["output"]
            assert said.startswith(f"[rank {rank}] rankscope: the breakpoint at job.py:{reduce_line} is off: disabled after 5 errors; last: NameError"), said
        assert not [e for e in client.events[mark:] if e["event"] == "stopped"]

        # `rank == 1` names a rank: the adapter sends the breakpoint to rank 1 only.
        mark = client.mark()
        reply = client.request("setBreakpoints", {"source": source, "breakpoints": [{"line": reduce_line, "condition": "rank == 1"}]})
        (bp,) = reply["body"]["breakpoints"]
        assert bp["verified"] and bp["line"] == reduce_line, bp
        stop = client.stopped(mark, "breakpoint", timeout=30)
        # The stop says which rank, on rank 1's thread.
        assert stop["threadId"] == rank1_main, (stop, threads)
        assert stop["description"] == f"rank 1: breakpoint at job.py:{reduce_line}", stop
        assert stop["hitBreakpointIds"] == [bp["id"]]
        (top,) = client.top(rank1_main)
        assert (top["name"], top["line"]) == ("train_step", reduce_line)
        assert client.request("evaluate", {"expression": "dist.get_rank()", "frameId": top["id"], "context": "watch"})["body"]["result"] == "1"
        # The Debug Console: the other rank waits, and how long gloo lets it (the program's 300 s).
        notice = client.event("output", lambda b: "is stopped" in b["output"], after=mark)["body"]
        assert notice["category"] == "console"
        assert re.fullmatch(
            r"rankscope: rank 1 is stopped: the other rank waits for it in its next collective; "
            r"gloo fails a collective that waits 5 min: about (5 min|4 min \d+ s) left \(until \d\d:\d\d:\d\d UTC\)\n",
            notice["output"],
        ), notice["output"]
        assert breakpoints_on(cli, pids[0]) == []
        assert [b["line"] for b in breakpoints_on(cli, pids[1])] == [reduce_line]

        # Rank 0 waits in the all_reduce for rank 1: its collective is in flight, and its stack is in it.
        deadline = time.monotonic() + 30
        while not (flying := query_json(cli, pids[0], "SELECT op, seq, caller FROM python.collectives WHERE state = 'in flight'")):
            assert time.monotonic() < deadline, "rank 0 has no collective in flight"
            time.sleep(0.1)
        (row,) = flying
        assert row["op"] == "all_reduce" and row["caller"].startswith(f"train_step (job.py:{reduce_line}"), row
        stack = cli(pids[0], "bt")
        assert stack.returncode == 0, stack.stderr
        assert "all_reduce" in stack.stdout and f"job.py:{reduce_line}" in stack.stdout, stack.stdout
        # It stays in that one while rank 1 is held.
        again = query_json(cli, pids[0], "SELECT seq FROM python.collectives WHERE state = 'in flight'")
        assert again == [{"seq": row["seq"]}], again
        assert not [e for e in client.events[mark:] if e["event"] == "stopped" and e["body"]["threadId"] != rank1_main]

        # Disconnect: rank 1 goes on, and with it the job.
        client.request("disconnect", {})
        assert client.wait_eof()
        assert adapter.wait(timeout=20) == 0
        assert not client.invalid, client.invalid
    finally:
        if adapter.poll() is None:
            adapter.kill()
        adapter.wait()
        for stream in (adapter.stdin, adapter.stdout, adapter.stderr):
            stream.close()

    seen = output.last_steps()
    output.wait(r"rank (\d) step (\d+)", lambda found: {int(r) for r, s in found if int(s) > max(seen.values(), default=0)} == {0, 1})
    assert breakpoints_on(cli, pids[0]) == [] and breakpoints_on(cli, pids[1]) == []
