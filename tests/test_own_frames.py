"""rankscope's own frames (its wrappers and hooks) stay out of the user's
stacks unless asked for with --all-frames, and frame numbers count only the
frames shown."""

import json
import uuid

import pytest

from conftest import line_of, require_torch

WRAPPED = """
import time, rankscope

@rankscope.on_error()
def train():
    step = 3
    print("READY", flush=True)
    while True:
        time.sleep(0.05)  # @train

train()  # @call
"""


def main_block(bt_stdout: str) -> str:
    return bt_stdout.split('"MainThread"')[1].split("\nThread ")[0]


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "outside"])
def test_bt_leaves_out_rankscope_frames_unless_all_frames(python, spawn, cli, probe):
    target = spawn(python, WRAPPED, probe=probe)
    script = target.script
    bt = cli(target.pid, "bt")
    assert bt.returncode == 0, bt.stderr
    assert ("read from outside" in bt.stderr) is not probe
    shown = main_block(bt.stdout)
    assert f"#0  train ({script}:{line_of(WRAPPED, 'train')})" in shown
    assert f"#1  <module> ({script}:{line_of(WRAPPED, 'call')})" in shown
    assert "rankscope" not in shown and "wrapper" not in shown

    everything = main_block(cli(target.pid, "bt", "--all-frames").stdout)
    assert f"#0  train ({script}:" in everything
    # on_error's wrapper, from rankscope's package, between the user's frames.
    wrapper = [line for line in everything.splitlines() if line.strip().startswith("#1 ")]
    assert len(wrapper) == 1 and "wrapper (" in wrapper[0] and "/rankscope/_probe/crashes.py:" in wrapper[0], everything
    assert f"#2  <module> ({script}:" in everything


def test_backtrace_depth_counts_the_frames_shown(python, spawn, cli):
    target = spawn(python, WRAPPED)
    sql = "SELECT depth, func FROM python.backtrace WHERE thread_name = 'MainThread' ORDER BY depth"
    shown = json.loads(cli(target.pid, "query", sql, "--format", "json").stdout)
    assert shown == [{"depth": 0, "func": "train"}, {"depth": 1, "func": "<module>"}]
    every = json.loads(cli(target.pid, "query", "--all-frames", sql, "--format", "json").stdout)
    assert [r["func"] for r in every] == ["train", "wrapper", "<module>"]
    assert [r["depth"] for r in every] == [0, 1, 2]
    # count(*) is answered by counts alone (push-down): the same frames are counted.
    count = "SELECT count(*) AS n FROM python.backtrace"
    assert json.loads(cli(target.pid, "query", count, "--format", "json").stdout) == [{"n": 2}]
    assert json.loads(cli(target.pid, "query", "--all-frames", count, "--format", "json").stdout) == [{"n": 3}]
    # --frame takes the same numbers: frame 1 is the module, not the wrapper.
    assert cli(target.pid, "eval", "--frame", "0", "step").stdout == "3\n"
    assert cli(target.pid, "eval", "--frame", "1", "__name__, train.__name__").stdout == "('__main__', 'train')\n"


def test_cluster_bt_leaves_out_rankscope_frames(default_python, spawn, cli, tmp_path):
    run = tmp_path / "run"
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    for rank in range(2):
        spawn(default_python, WRAPPED, env={"RANK": str(rank), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": job_id, "RANKSCOPE_RUN_DIR": str(run)})
    train, call = line_of(WRAPPED, "train"), line_of(WRAPPED, "call")
    bt = cli("cluster", "bt", "--run", run)
    assert bt.returncode == 0, bt.stderr
    assert f"ranks 0-1 (2): train (target.py:{train}) <- <module> (target.py:{call})" in bt.stdout
    every = cli("cluster", "bt", "--run", run, "--all-frames")
    assert f"ranks 0-1 (2): train (target.py:{train}) <- wrapper (crashes.py:" in every.stdout
    q = cli("cluster", "query", "--run", run, "SELECT rank, count(*) AS n FROM python.backtrace GROUP BY rank ORDER BY rank", "--format", "json")
    assert json.loads(q.stdout) == [{"rank": 0, "n": 2}, {"rank": 1, "n": 2}], q.stderr
    q = cli("cluster", "query", "--all-frames", "--run", run, "SELECT rank, count(*) AS n FROM python.backtrace GROUP BY rank ORDER BY rank", "--format", "json")
    assert json.loads(q.stdout) == [{"rank": 0, "n": 3}, {"rank": 1, "n": 3}], q.stderr


IN_INIT = """
import os, sys, threading, time
import torch.distributed as dist

def show_when_waiting():
    # READY once the main thread is inside init_process_group (rank 1 never comes).
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if names.count("init_process_group") >= 2:
            print("READY", flush=True)
            return
        time.sleep(0.02)

threading.Thread(target=show_when_waiting, daemon=True).start()

def setup():
    world = "two ranks"
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=2)  # @init

setup()
"""


def test_the_init_process_group_wrapper_is_not_in_the_users_stack(default_python, spawn, cli, tmp_path):
    require_torch(default_python)
    target = spawn(default_python, IN_INIT, env={"STORE": str(tmp_path / "store")}, wait=False)
    target.wait_for_line("READY", timeout=120)
    bt = cli(target.pid, "bt")
    assert bt.returncode == 0, bt.stderr
    shown = main_block(bt.stdout)
    assert "torch_rank.py" not in shown
    assert f"setup ({target.script}:{line_of(IN_INIT, 'init')})" in shown
    assert "init_process_group (" in shown and "distributed_c10d.py" in shown
    everything = main_block(cli(target.pid, "bt", "--all-frames").stdout)
    assert "/rankscope/_probe/torch_rank.py:" in everything
    # The user's frame by the number bt gave it.
    [setup_line] = [line for line in shown.splitlines() if f"setup ({target.script}:" in line]
    number = setup_line.split()[0].lstrip("#")
    assert cli(target.pid, "eval", "--frame", number, "world").stdout == "'two ranks'\n"
