"""A real multi-rank job: torchrun with the gloo backend on CPU, one rank
crashing. Skipped when torch is not installed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import kill_tree, launch_torchrun, require_torch


TRAIN = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
activations = torch.ones(3)
if rank == 1:
    step = 41
    weights = torch.ones(4)
    activations + weights  # @crash
dist.barrier()
"""


@pytest.fixture
def torchrun(default_python, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    started = []

    def _run(**env):
        proc = launch_torchrun(
            default_python, script, 2, endpoint_dir, tmp_path / "run", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(proc)
        return proc, script

    yield _run
    for proc in started:
        kill_tree(proc.pid)
        proc.wait()


# `srun torchrun ...`: the launcher has the scheduler's task rank too
# (SLURM_PROCID); it registered as rank 0 of a job of its own, which
# `cluster crashes` then took for the job that ran last.
SRUN = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "778"}


@pytest.mark.parametrize("under", ["torchrun", "srun"])
def test_the_crashing_rank_is_recorded_with_its_rank(torchrun, cli, tmp_path, under):
    proc, script = torchrun(**(SRUN if under == "srun" else {}))
    assert proc.wait(timeout=120) != 0
    # The workers alone are the job's ranks.
    assert len(list((tmp_path / "run" / "ranks").glob("*.json"))) == 2
    sql = "SELECT id, rank, exc_type, message, func FROM python.crashes ORDER BY id"
    result = cli("query", sql, "--run", tmp_path / "run", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    [row] = [r for r in rows if r["rank"] == 1]
    assert row["exc_type"] == "RuntimeError" and "size of tensor" in row["message"] and row["func"] == "<module>"
    # torchrun's own process records the echo of it, without a rank: that
    # record is the launcher's, left out unless asked for.
    # (rank 0 may record its barrier failing once rank 1 is gone: a rank's crash all the same)
    assert None not in [r["rank"] for r in rows]
    everything = json.loads(cli("query", sql.replace("func", "func, launcher"), "--all", "--run", tmp_path / "run", "--format", "json").stdout)
    [launcher] = [r for r in everything if r["rank"] is None]
    assert launcher["exc_type"].endswith("ChildFailedError") and launcher["launcher"] is True
    listing = cli("crashes", "--run", tmp_path / "run")
    assert "RuntimeError" in listing.stdout and "ChildFailedError" not in listing.stdout
    assert "1 record of the job launcher" in listing.stderr
    [marked] = [l for l in cli("crashes", "--all", "--run", tmp_path / "run").stdout.splitlines() if "ChildFailedError" in l]
    assert " launcher " in marked
    # The job is over: `cluster crashes` shows it all the same.
    ended = cli("cluster", "crashes", "--run", tmp_path / "run")
    assert ended.returncode == 0, ended.stderr
    assert "RuntimeError" in ended.stdout and "ChildFailedError" not in ended.stdout
    shown = cli("crashes", "show", str(row["id"]), "--run", tmp_path / "run").stdout
    assert "step = 41" in shown
    assert "weights = Tensor(shape=[4], dtype=torch.float32, device=cpu, min=1, max=1, mean=1, nan=0, inf=0)" in shown


WAIT = """
import time
import torch.distributed as dist

dist.init_process_group("gloo")
while True:
    time.sleep(0.05)
"""


def test_a_launcher_stopped_with_sigterm_leaves_no_crash(default_python, endpoint_dir, cli, tmp_path):
    """SIGTERM to torchrun is how a job is ended: torch raises its
    SignalException in the launcher, which is no crash of the user's program."""
    require_torch(default_python)
    script = tmp_path / "wait.py"
    script.write_text(WAIT)
    run = tmp_path / "run"
    proc = launch_torchrun(default_python, script, 2, endpoint_dir, run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            listing = cli("cluster", "list", "--run", run, "--format", "json")
            if listing.returncode == 0 and [r["state"] for r in json.loads(listing.stdout)] == ["running", "running"]:
                break
            assert time.monotonic() < deadline and proc.poll() is None, listing.stdout + listing.stderr
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) != 0
        assert "SignalException" in proc.stderr.read()
    finally:
        kill_tree(proc.pid)
        proc.wait()
    [row] = json.loads(cli("crashes", "--all", "--run", run, "--format", "json").stdout)
    assert row["type"].endswith("SignalException") and row["launcher"] is True and row["rank"] is None
    assert json.loads(cli("crashes", "--run", run, "--format", "json").stdout) == []
    listing = cli("crashes", "--run", run)
    assert listing.returncode == 0, listing.stderr
    assert "No crashes recorded." in listing.stdout and "SignalException" not in listing.stdout
    assert "1 record of the job launcher (torchrun's own exit) left out; --all shows them" in listing.stderr
    ended = cli("cluster", "crashes", "--run", run)
    assert ended.returncode == 0, ended.stderr
    assert "No crashes recorded." in ended.stdout
    assert "SignalException" in cli("cluster", "crashes", "--all", "--run", run).stdout
    assert cli("query", "SELECT count(*) AS n FROM python.crashes", "--run", run, "--format", "json").stdout.strip() == '[{"n":0}]'


def test_a_held_rank_is_debugged_by_rank_number(torchrun, cli, tmp_path):
    proc, _ = torchrun(RANKSCOPE_ON_ERROR="socket", RANKSCOPE_HOLD_TIMEOUT="60")
    try:
        # torchrun holds back its workers' stderr until they exit: the
        # socket appearing is the signal that rank 1 waits.
        deadline = time.monotonic() + 120
        while not list((tmp_path / "run").glob("debug-rank1-pid*.sock")):
            assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never held for a debugger"
            time.sleep(0.05)
        session = cli("debug", "--rank", "1", input="p step\np rank\np activations.shape\nq\n", env={"RANKSCOPE_RUN_DIR": str(tmp_path / "run")})
        assert session.returncode == 0, session.stderr
        assert "(Pdb rank 1) 41" in session.stdout
        assert "(Pdb rank 1) 1\n" in session.stdout  # p rank
        assert "torch.Size([3])" in session.stdout
        assert proc.wait(timeout=120) != 0
    finally:
        kill_tree(proc.pid)


def test_rankscope_run_gives_every_worker_a_probe(default_python, rankscope_bin, endpoint_dir, cli, tmp_path):
    require_torch(default_python)
    script = tmp_path / "wait.py"
    script.write_text("import time, torch.distributed as dist\ndist.init_process_group('gloo')\ntime.sleep(120)\n")
    # No RANKSCOPE=1 here: `rankscope run` is what turns the probe on.
    proc = launch_torchrun(
        default_python, script, 2, endpoint_dir, tmp_path / "run", prefix=(rankscope_bin, "run", "--"), probe=False,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            listing = cli("cluster", "list", "--run", tmp_path / "run")
            if listing.stdout.count(" running ") == 2:
                break
            assert time.monotonic() < deadline and proc.poll() is None, listing.stdout + listing.stderr
            time.sleep(0.3)
        assert "(2 ranks)" in listing.stdout
    finally:
        kill_tree(proc.pid)
        proc.wait()


SPAWNED = """
import os, sys, time
import torch.distributed as dist

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=2)
print("READY", flush=True)
while True:
    time.sleep(0.05)  # @after_init
"""


def test_a_rank_given_to_init_process_group_replaces_the_environments(default_python, spawn, cli, tmp_path):
    """No launcher variables at all (as with mp.spawn): every process starts
    as rank 0 of nothing, and init_process_group(rank=...) puts it right."""
    from conftest import require_torch

    require_torch(default_python)
    run = tmp_path / "run"
    env = {"STORE": str(tmp_path / "store"), "RANKSCOPE_RUN_DIR": str(run)}
    targets = [spawn(default_python, SPAWNED, env=env, args=[str(r)], wait=False) for r in (0, 1)]
    for target in targets:
        target.wait_for_line("READY", timeout=120)
    for rank, target in enumerate(targets):
        meta = json.loads(cli("list", "--format", "json").stdout)
        [mine] = [m for m in meta if m["pid"] == target.pid]
        assert mine["rank"] == rank
    listing = cli("cluster", "list", "--run", run, "--job", "(no job id)")
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[2:]]
    assert [(r[0], r[3]) for r in rows] == [("0", str(targets[0].pid)), ("1", str(targets[1].pid))]
    ev = cli("cluster", "eval", "--run", run, "--job", "(no job id)", "import torch.distributed as d; d.get_rank()")
    assert ev.stdout.splitlines()[1::2] == ["0", "1"]
