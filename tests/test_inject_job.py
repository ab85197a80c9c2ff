"""`rankscope inject LAUNCHER`: every rank of a job started without rankscope
gets a probe, and the job then answers `cluster` commands as if it had been
started with RANKSCOPE=1."""

import json
import os
import queue
import subprocess
import threading
import uuid
from pathlib import Path

from conftest import kill_tree, launch_torchrun, require_torch

# A launcher in plain Python: two ranks without a probe, a third with one,
# a worker below rank 0 (it inherits RANK, as DataLoader workers do), a
# helper without a rank, and a program that is not Python but has a rank.
LAUNCHER = """
import os, subprocess, sys, time

RANK_CODE = '''
import os, subprocess, sys, time
RANK_VALUE = int(os.environ["RANK"])
if RANK_VALUE == 0:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def train_loop():
    print("RANK-READY", flush=True)
    while True:
        time.sleep(0.05)
train_loop()
'''

ranks = []
for rank in range(3):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", TORCHELASTIC_RUN_ID=os.environ["JOB"])
    if rank == 2:
        env["RANKSCOPE"] = "1"
    ranks.append(subprocess.Popen([sys.executable, "-c", RANK_CODE], env=env, stdout=subprocess.PIPE, text=True))
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
subprocess.Popen(["sleep", "600"], env=dict(os.environ, RANK="7"))
for rank in ranks:
    assert rank.stdout.readline().startswith("RANK-READY")
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, stack = [], list(children.get(pid, []))
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(children.get(current, []))
    return found


def test_inject_a_launcher_injects_its_ranks_and_says_why_it_skipped_the_rest(python, spawn, cli):
    job = f"job-{uuid.uuid4().hex[:8]}"
    launcher = spawn(python, LAUNCHER, probe=False, env={"JOB": job})
    run = Path(launcher.script).parent / "run"
    try:
        result = cli("inject", launcher.pid, "--timeout", "20")
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert f"process {launcher.pid} (" in out and "runs a job; injecting its ranks" in out
        assert "injected 2 of 6;" in out, out
        rows = {line.split("pid")[1].split()[0]: line for line in out.splitlines() if " pid " in line}
        assert len(rows) == 6, out
        assert sum("injected (Python" in line for line in rows.values()) == 2
        lines = "\n".join(rows.values())
        assert "rank 2" in lines and "skipped: already probed" in lines
        assert "skipped: no rank in its environment" in lines
        assert "rank 7" in lines and "skipped: not CPython: sleep 600" in lines
        [worker] = [line for line in rows.values() if "a child of rank 0" in line]
        assert worker.split()[:2] == ["rank", "0"]

        listing = cli("cluster", "list", "--run", run)
        assert listing.returncode == 0, listing.stderr
        assert f"job {job} (3 ranks)" in listing.stdout
        assert listing.stdout.count(" running ") == 3, listing.stdout

        bt = cli("cluster", "bt", "--run", run)
        assert bt.returncode == 0, bt.stderr
        assert any(l.strip().startswith("ranks 0-2 (3): train_loop (<string>:") for l in bt.stdout.splitlines()), bt.stdout

        ev = cli("cluster", "eval", "--run", run, "RANK_VALUE * 10")
        assert ev.returncode == 0, ev.stderr
        assert [l for l in ev.stdout.splitlines() if not l.startswith("==")] == ["0", "10", "20"]

        q = cli("cluster", "query", "--run", run, "SELECT DISTINCT rank FROM python.backtrace ORDER BY rank", "--format", "json")
        assert q.returncode == 0, q.stderr
        assert [r["rank"] for r in json.loads(q.stdout)] == [0, 1, 2]

        # The launcher is not a rank: it got no probe.
        assert "has no rankscope probe" in cli(launcher.pid, "eval", "1").stderr
        # A second inject finds every rank probed.
        again = cli("inject", launcher.pid)
        assert again.returncode == 0, again.stderr
        assert "injected 0 of 6;" in again.stdout and again.stdout.count("skipped: already probed") == 3
        assert launcher.alive()
    finally:
        kill_tree(launcher.pid)


TRAIN = """
import time
import torch.distributed as dist

dist.init_process_group("gloo")

def wait_for_work():
    while True:
        time.sleep(0.05)

print("READY", dist.get_rank(), flush=True)
wait_for_work()
"""


def test_inject_a_torchrun_job_started_without_rankscope(default_python, cli, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    run = tmp_path / "run"
    proc = launch_torchrun(default_python, script, 2, endpoint_dir, run, probe=False, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        # Lines arrive through a reader thread so that a job that never gets
        # ready fails the test after a deadline instead of hanging it.
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put("")], daemon=True).start()
        ready = 0
        while ready < 2:
            try:
                line = lines.get(timeout=120)
            except queue.Empty:
                raise AssertionError("the ranks did not print READY within 120 s") from None
            assert line, f"torchrun exited (rc={proc.poll()}) before its ranks were ready"
            # Unbuffered ranks write "READY", " ", "0", "\n" one by one, so
            # two ranks' words can share a line: count words, not lines.
            ready += line.count("READY")
        assert not list(Path(endpoint_dir).glob("*.sock")), "nothing should have a probe before the inject"

        result = cli("inject", proc.pid, "--timeout", "30")
        assert result.returncode == 0, result.stdout + result.stderr
        workers = descendants(proc.pid)
        assert f"injected 2 of {len(workers)};" in result.stdout, result.stdout
        assert result.stdout.count("injected (Python") == 2

        listing = cli("cluster", "list", "--run", run)
        assert listing.returncode == 0, listing.stderr
        assert "(2 ranks)" in listing.stdout and listing.stdout.count(" running ") == 2, listing.stdout

        bt = cli("cluster", "bt", "--run", run)
        assert bt.returncode == 0, bt.stderr
        assert any(l.strip().startswith("ranks 0-1 (2): wait_for_work (train.py:") for l in bt.stdout.splitlines()), bt.stdout

        ev = cli("cluster", "eval", "--run", run, "dist.get_rank(), dist.get_world_size()")
        assert ev.returncode == 0, ev.stderr
        assert [l for l in ev.stdout.splitlines() if not l.startswith("==")] == ["(0, 2)", "(1, 2)"]
        assert proc.poll() is None
    finally:
        kill_tree(proc.pid)
        proc.wait()
