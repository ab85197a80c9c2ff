"""`rankscope cluster`: every rank of a job at once. Light ranks (plain
Python with a launcher's environment) for the shapes of failure; a real
torchrun job for the real thing."""

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import kill_tree, launch_torchrun, require_torch

RANK = """
import ctypes, os, time
RANK_VALUE = int(os.environ["RANK"])

def wait_for_peers():
    while True:
        time.sleep(0.05)  # @peers

def load_batch():
    while True:
        time.sleep(0.05)  # @loader

print("READY", flush=True)
if os.environ.get("HOLD_GIL") == str(RANK_VALUE):
    ctypes.PyDLL(None).sleep(60)
load_batch() if RANK_VALUE == 2 else wait_for_peers()
"""


@pytest.fixture
def job(default_python, spawn, tmp_path):
    """start(world_size, **env) -> (job id, run dir, targets by rank)."""

    def start(world_size=4, **env):
        job_id = f"job-{uuid.uuid4().hex[:8]}"
        run = tmp_path / "run"
        targets = {}
        for rank in range(world_size):
            targets[rank] = spawn(
                default_python,
                RANK,
                env={
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "TORCHELASTIC_RUN_ID": job_id,
                    "RANKSCOPE_RUN_DIR": str(run),
                    **env,
                },
            )
        return job_id, run, targets

    return start


def test_two_torchrun_jobs_without_an_id_are_two_jobs(default_python, spawn, cli, tmp_path):
    # torchrun names a job started without --rdzv-id "none": two of them at
    # once were one job, their ranks mixed. Their rendezvous tells them apart.
    run = tmp_path / "run"
    for port, size in (("29611", 3), ("29612", 2)):
        for rank in range(size):
            spawn(default_python, RANK, env={
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size), "TORCHELASTIC_RUN_ID": "none",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANKSCOPE_RUN_DIR": str(run),
            })
    both = cli("cluster", "list", "--run", run)
    assert both.returncode != 0 and "none-127.0.0.1-29611" in both.stderr and "none-127.0.0.1-29612" in both.stderr, both.stderr
    first = cli("cluster", "list", "--run", run, "--job", "none-127.0.0.1-29611")
    assert first.returncode == 0, first.stderr
    assert "job none-127.0.0.1-29611 (3 ranks)" in first.stdout and first.stdout.count(" running ") == 3, first.stdout


def test_list_bt_eval_and_query_across_ranks(job, cli):
    job_id, run, targets = job()
    listing = cli("cluster", "list", "--run", run)
    assert listing.returncode == 0, listing.stderr
    assert f"job {job_id} (4 ranks)" in listing.stdout
    assert listing.stdout.count(" running ") == 4

    bt = cli("cluster", "bt", "--run", run)
    assert bt.returncode == 0, bt.stderr
    lines = bt.stdout.splitlines()
    [majority] = [l for l in lines if l.strip().startswith("ranks 0-1,3 (3): wait_for_peers (target.py:")]
    [outlier] = [l for l in lines if l.strip().startswith("rank  2 (1): load_batch (target.py:")]
    assert "differs" in outlier and "differs" not in majority
    assert lines.index(majority) < lines.index(outlier)  # bigger groups first

    ev = cli("cluster", "eval", "--run", run, "--ranks", "0,2", "RANK_VALUE * 10")
    assert ev.returncode == 0, ev.stderr
    assert ev.stdout.splitlines() == [f"== rank 0 (pid {targets[0].pid})", "0", f"== rank 2 (pid {targets[2].pid})", "20"]

    q = cli("cluster", "query", "--run", run, "SELECT rank, count(*) AS frames FROM python.backtrace GROUP BY rank ORDER BY rank", "--format", "json")
    assert q.returncode == 0, q.stderr
    assert [r["rank"] for r in json.loads(q.stdout)] == [0, 1, 2, 3]


def test_a_killed_rank_shows_dead_and_the_others_still_answer(job, cli):
    job_id, run, targets = job()
    targets[3].proc.send_signal(signal.SIGKILL)
    targets[3].proc.wait()
    listing = cli("cluster", "list", "--run", run)
    [row] = [l for l in listing.stdout.splitlines() if l.split()[:1] == ["3"]]
    assert " dead " in row
    bt = cli("cluster", "bt", "--run", run)
    assert bt.returncode == 0, bt.stderr
    assert "ranks 0-1 (2): wait_for_peers" in bt.stdout
    assert "rank 3: no stacks (dead)" in bt.stdout
    q = cli("cluster", "query", "--run", run, "SELECT DISTINCT rank FROM python.threads ORDER BY rank", "--format", "csv")
    assert q.stdout.split() == ["rank", "0", "1", "2"]
    assert "rank 3 (dead)" in q.stderr
    # Every rank gone: no answer at all is an error, not "0 ranks answered".
    for target in targets.values():
        target.kill()
    gone = cli("cluster", "bt", "--run", run, "--job", job_id)
    assert gone.returncode != 0, gone.stdout
    assert f"no rank of job {job_id} answered" in gone.stderr and "hint:" in gone.stderr, gone.stderr
    assert "rank 3: no stacks (dead)" in gone.stdout


def test_a_rank_that_leaves_mid_command_gets_a_message_and_the_rest_answer(job, cli):
    _, run, targets = job(world_size=3)
    ev = cli("cluster", "eval", "--run", run, "import os; os._exit(0) if RANK_VALUE == 1 else RANK_VALUE")
    assert ev.returncode == 1
    lines = ev.stdout.splitlines()
    assert lines[:2] == [f"== rank 0 (pid {targets[0].pid})", "0"] and lines[-2:] == [f"== rank 2 (pid {targets[2].pid})", "2"]
    assert lines[2] == f"== rank 1 (pid {targets[1].pid})" and lines[3].startswith("error: ")
    targets[1].proc.wait(timeout=10)
    q = cli("cluster", "query", "--run", run, "SELECT rank, count(*) AS n FROM python.threads GROUP BY rank ORDER BY rank", "--format", "csv")
    assert q.returncode == 0, q.stderr
    assert [l.split(",")[0] for l in q.stdout.split()] == ["rank", "0", "2"] and "rank 1 (" in q.stderr


def test_a_rank_stuck_with_the_gil_is_read_from_outside(job, cli):
    _, run, _ = job(HOLD_GIL="1")
    started = time.monotonic()
    bt = cli("cluster", "bt", "--run", run, "--timeout", "1")
    assert bt.returncode == 0, bt.stderr
    assert time.monotonic() - started < 10
    assert "rank(s) 1 did not answer in time or run another rankscope version; their stacks were read from outside" in bt.stderr
    assert "rank  1 (1): <module> (target.py:" in bt.stdout  # stuck in the C call, at module level


def test_a_stopped_rank_is_read_from_outside(job, cli):
    """GIVEN a rank stopped by SIGSTOP (its probe cannot answer, and it
    cannot be paused again), WHEN the job's stacks are asked for, THEN its
    stack is read from outside without pausing it, in its group."""
    _, run, targets = job(world_size=2)
    # READY comes just before the loop: stop the rank once it is in it.
    deadline = time.monotonic() + 10
    while "wait_for_peers (" not in cli(targets[1].pid, "bt").stdout:
        assert time.monotonic() < deadline, "rank 1 never reached its loop"
    os.kill(targets[1].pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{targets[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "rank 1 did not stop"
            time.sleep(0.01)
        bt = cli("cluster", "bt", "--run", run, "--timeout", "1", timeout=60)
        assert bt.returncode == 0, bt.stderr
        assert "ranks 0-1 (2): wait_for_peers (target.py:" in bt.stdout, bt.stdout + bt.stderr
        assert "no stacks" not in bt.stdout, bt.stdout
        assert f"PID {targets[1].pid} is stopped" in bt.stderr, bt.stderr
    finally:
        os.kill(targets[1].pid, signal.SIGCONT)


def test_bad_ranks_and_missing_jobs_are_hinted_errors(job, cli, tmp_path):
    job_id, run, _ = job(world_size=2)
    bad = cli("cluster", "eval", "--run", run, "--ranks", "0,9", "1")
    assert bad.returncode == 1
    assert f"rank 9 is not in job {job_id}" in bad.stderr and "its ranks are 0-1" in bad.stderr
    none = cli("cluster", "list", "--job", "no-such-job", "--run", run)
    assert none.returncode == 1 and "no job no-such-job found" in none.stderr and job_id in none.stderr


def test_cluster_break_sets_breakpoints_per_rank(job, cli):
    from conftest import line_of

    _, run, targets = job()
    peers = line_of(RANK, "peers")
    added = cli("cluster", "break", "add", f"target.py:{peers}", "--ranks", "1,3", "--if", "RANK_VALUE == 3", "--max", "2", "--run", run)
    assert added.returncode == 0, added.stderr
    for rank in (1, 3):
        assert f"== rank {rank} (pid {targets[rank].pid})\nbreakpoint 1 at {targets[rank].script}:{peers}" in added.stdout
    assert "== rank 0" not in added.stdout
    # Only rank 3's condition holds: its hits come back in one cluster query.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        q = cli("cluster", "query", "--run", run, "SELECT rank, hit, lineno FROM python.snapshots ORDER BY rank, hit", "--format", "json")
        if q.returncode == 0 and len(json.loads(q.stdout)) == 2:
            break
        time.sleep(0.1)
    assert json.loads(q.stdout) == [{"rank": 3, "hit": h, "lineno": peers} for h in (1, 2)]
    listing = cli("cluster", "break", "list", "--run", run)
    # Rank 3's went at --max; ranks 0 and 2 never had one; rank 1's condition never held.
    assert listing.stdout.count("No breakpoints.") == 3
    rank1 = listing.stdout.split(f"== rank 1 (pid {targets[1].pid})\n", 1)[1].splitlines()
    assert rank1[0].split() == ["ID", "WHERE", "PASSES", "HITS", "DETAILS"]
    assert rank1[1].split()[:2] == ["1", f"{targets[1].script}:{peers}"] and "if RANK_VALUE == 3" in rank1[1]
    [as_json] = [r for r in json.loads(cli("cluster", "break", "list", "--run", run, "--format", "json").stdout) if r["rank"] == 1]
    assert as_json["pid"] == targets[1].pid and [bp["id"] for bp in as_json["breakpoints"]] == [1]
    bad = cli("cluster", "break", "add", "target.py:peers_nowhere", "--run", run, "--ranks", "0")
    assert bad.returncode == 1 and "no function 'peers_nowhere'" in bad.stdout


def test_a_rank_with_another_rankscope_version_is_named_and_the_rest_answer(job, cli, endpoint_dir):
    from pathlib import Path

    _, run, targets = job(world_size=3)
    # What a rank started by another rankscope publishes: a different protocol.
    for entry in (run / "ranks" / f"rank1-pid{targets[1].pid}.json", Path(endpoint_dir) / f"{targets[1].pid}.json"):
        meta = json.loads(entry.read_text())
        meta.update(protocol=999, rankscope_version="9.9.9")
        entry.write_text(json.dumps(meta))
    listing = cli("cluster", "list", "--run", run)
    [row] = [l for l in listing.stdout.splitlines() if l.split()[:1] == ["1"]]
    assert "other-version" in row
    ev = cli("cluster", "eval", "--run", run, "RANK_VALUE")
    assert ev.returncode == 1
    assert ev.stdout.splitlines() == [
        f"== rank 0 (pid {targets[0].pid})", "0",
        f"== rank 1 (pid {targets[1].pid})", "error: other-version",
        f"== rank 2 (pid {targets[2].pid})", "2",
    ]
    q = cli("cluster", "query", "--run", run, "SELECT DISTINCT rank FROM python.threads ORDER BY rank", "--format", "csv")
    assert q.stdout.split() == ["rank", "0", "2"] and "rank 1 (other-version)" in q.stderr
    # Stacks do not depend on the probe's version: read from outside.
    bt = cli("cluster", "bt", "--run", run)
    assert "ranks 0-1 (2): wait_for_peers" in bt.stdout and "read from outside" in bt.stderr


TRAIN = """
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()

def next_batch():
    time.sleep(120)  # @loader

def train_step():
    if rank == 2:
        next_batch()
    dist.barrier()  # @barrier

train_step()
"""


def test_cluster_bt_finds_the_rank_that_is_not_in_the_collective(default_python, cli, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # The agent looks at its workers every 60 s: long enough to see the job
    # with one worker killed before torchrun tears the others down.
    proc = launch_torchrun(
        default_python, script, 4, endpoint_dir, tmp_path / "run", torchrun_args=("--monitor-interval", "60"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            bt = cli("cluster", "bt", "--run", tmp_path / "run")
            # Until every rank is past init_process_group, groups can form
            # around where each one is in its start-up: wait for the hang.
            lines = bt.stdout.splitlines()
            if any("rank  2 (1): next_batch" in l for l in lines) and any("ranks 0-1,3 (3): barrier" in l for l in lines):
                break
            assert time.monotonic() < deadline and proc.poll() is None, bt.stdout + bt.stderr
            time.sleep(0.5)
        [outlier] = [l for l in bt.stdout.splitlines() if "rank  2 (1)" in l]
        assert outlier.strip().startswith("rank  2 (1): next_batch (train.py:") and "differs" in outlier
        assert "train_step (train.py:" in outlier
        [majority] = [l for l in bt.stdout.splitlines() if "ranks 0-1,3 (3)" in l]
        assert "train_step (train.py:" in majority and "next_batch" not in majority

        # Rank 3 killed outright: it shows as dead, and the others still answer.
        listing = cli("cluster", "list", "--run", tmp_path / "run").stdout
        [row3] = [l.split() for l in listing.splitlines() if l.split()[:1] == ["3"]]
        os.kill(int(row3[3]), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while " dead " not in [l for l in cli("cluster", "list", "--run", tmp_path / "run").stdout.splitlines() if l.split()[:1] == ["3"]][0]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        bt = cli("cluster", "bt", "--run", tmp_path / "run")
        assert bt.returncode == 0, bt.stderr
        assert "rank 3: no stacks (dead)" in bt.stdout
        assert any(l.strip().startswith("ranks 0-1 (2): barrier") for l in bt.stdout.splitlines()), bt.stdout
        assert any(l.strip().startswith("rank  2 (1): next_batch") and "differs" in l for l in bt.stdout.splitlines()), bt.stdout
    finally:
        kill_tree(proc.pid)
        proc.wait()


CRASHING_RANK = """
import os, time
print("READY", flush=True)
if os.environ["RANK"] == "1":
    shard = 7
    raise RuntimeError("shape mismatch on rank 1")
while True:
    time.sleep(0.05)
"""


def test_cluster_crashes_lists_the_jobs_crashes_by_rank(default_python, spawn, cli, tmp_path):
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    run = tmp_path / "run"
    targets = [
        spawn(default_python, CRASHING_RANK, env={"RANK": str(r), "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": job_id, "RANKSCOPE_RUN_DIR": str(run)})
        for r in range(3)
    ]
    assert targets[1].proc.wait(timeout=30) == 1
    listing = cli("cluster", "list", "--run", run)
    [row] = [l for l in listing.stdout.splitlines() if l.split()[:1] == ["1"]]
    assert " crashed " in row
    crashes = cli("cluster", "crashes", "--run", run)
    assert crashes.returncode == 0, crashes.stderr
    assert f"job {job_id}: crashes recorded in {run}" in crashes.stdout
    assert "RuntimeError: shape mismatch on rank 1" in crashes.stdout


EXITING_RANK = """
import os, sys, time
print("READY", flush=True)
if os.environ["RANK"] == "1":
    sys.exit(3)  # no exception reaches a hook: no crash record
if os.environ["RANK"] == "2":
    sys.exit(0)
while True:
    time.sleep(0.05)
"""


def test_a_rank_that_exits_with_a_status_says_it_in_the_list(default_python, spawn, cli, tmp_path):
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    run = tmp_path / "run"
    targets = [
        spawn(default_python, EXITING_RANK, env={"RANK": str(r), "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": job_id, "RANKSCOPE_RUN_DIR": str(run)})
        for r in range(3)
    ]
    assert targets[1].proc.wait(timeout=30) == 3 and targets[2].proc.wait(timeout=30) == 0
    listing = cli("cluster", "list", "--run", run)
    rows = {l.split()[0]: l for l in listing.stdout.splitlines()[2:]}
    assert " exited (3) " in rows["1"] and " exited " in rows["2"] and "(0)" not in rows["2"], listing.stdout
    as_json = json.loads(cli("cluster", "list", "--run", run, "--format", "json").stdout)
    assert [(r["rank"], r["state"], r["exit_code"]) for r in as_json] == [(0, "running", None), (1, "exited", 3), (2, "exited", 0)], as_json
    # No record, but `cluster crashes` still names the rank that failed
    # (mp.spawn's workers end so: their wrapper catches the exception).
    crashes = cli("cluster", "crashes", "--run", run)
    assert crashes.returncode == 0, crashes.stderr
    assert f"rank 1 (pid {targets[1].pid}) exited with status 3 and no crash record" in crashes.stdout, crashes.stdout
    assert "rank 2" not in crashes.stdout, crashes.stdout
    # Another job in the same run directory is not told of it.
    other = f"job-{uuid.uuid4().hex[:8]}"
    for r in range(2):
        spawn(default_python, EXITING_RANK, env={"RANK": str(r + 2), "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": other, "RANKSCOPE_RUN_DIR": str(run)})
    theirs = cli("cluster", "crashes", "--run", run, "--job", other)
    assert theirs.returncode == 0, theirs.stderr
    assert "exited with status" not in theirs.stdout, theirs.stdout


def _crash_and_finish(default_python, spawn, job_id, message, env):
    """A three-rank job whose rank 1 raises `message`; the other ranks are
    killed once it has: the job is over."""
    source = CRASHING_RANK.replace("shape mismatch on rank 1", message)
    targets = [
        spawn(default_python, source, env={"RANK": str(r), "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": job_id, **env})
        for r in range(3)
    ]
    assert targets[1].proc.wait(timeout=30) == 1
    for target in targets:
        target.kill()


def test_cluster_crashes_after_the_job_ended_shows_the_last_job(default_python, spawn, cli, tmp_path):
    # One run directory for both jobs (a fixed RANKSCOPE_RUN_DIR): each job's own records only.
    run = tmp_path / "run"
    first, second = f"job-{uuid.uuid4().hex[:8]}", f"job-{uuid.uuid4().hex[:8]}"
    _crash_and_finish(default_python, spawn, first, "first job broke", {"RANKSCOPE_RUN_DIR": str(run)})
    _crash_and_finish(default_python, spawn, second, "second job broke", {"RANKSCOPE_RUN_DIR": str(run)})
    assert "no running job found" in cli("cluster", "list", "--run", run).stderr

    last = cli("cluster", "crashes", "--run", run)
    assert last.returncode == 0, last.stderr
    assert f"job {second}: crashes recorded in {run}" in last.stdout
    assert "second job broke" in last.stdout and "first job broke" not in last.stdout
    assert f"no job is running here; job {second} ran last" in last.stderr
    picked = cli("cluster", "crashes", "--run", run, "--job", first)
    assert picked.returncode == 0, picked.stderr
    assert "first job broke" in picked.stdout and "second job broke" not in picked.stdout
    [row] = json.loads(cli("cluster", "crashes", "--run", run, "--format", "json").stdout)
    assert row["rank"] == 1 and row["message"] == "second job broke"

    # The default run directories (one per job, under HOME): the newest job's.
    home = tmp_path / "home"
    home.mkdir()
    at_home = {"HOME": str(home), "RANKSCOPE_RUN_DIR": ""}
    third, fourth = f"job-{uuid.uuid4().hex[:8]}", f"job-{uuid.uuid4().hex[:8]}"
    _crash_and_finish(default_python, spawn, third, "third job broke", at_home)
    _crash_and_finish(default_python, spawn, fourth, "fourth job broke", at_home)
    newest = cli("cluster", "crashes", env=at_home)
    assert newest.returncode == 0, newest.stderr
    assert f"job {fourth}: crashes recorded in {home}/.local/state/rankscope/runs/{fourth}" in newest.stdout
    assert "fourth job broke" in newest.stdout and "third job broke" not in newest.stdout
    older = cli("cluster", "crashes", "--job", third, env=at_home)
    assert "third job broke" in older.stdout and "fourth job broke" not in older.stdout
    listing = json.loads(cli("cluster", "list", "--job", third, "--format", "json", env=at_home).stdout)
    assert [(r["rank"], r["state"]) for r in listing] == [(0, "dead"), (1, "crashed"), (2, "dead")]
