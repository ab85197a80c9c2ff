"""Eval in a frame: `eval --thread T --frame N` runs code among a running
function's locals and globals, with the frame numbers `bt` prints."""

import json
import subprocess
import uuid

from conftest import line_of

TRAINING = """
import threading, time, weakref

class Token:
    pass

release = threading.Event()
token_ref = None

def train(epochs):
    global token_ref
    trainer = {"epochs_run": 7}
    lr = 0.1
    token = Token()
    token_ref = weakref.ref(token)
    print("READY", flush=True)
    while not release.is_set():
        time.sleep(0.02)  # @train
    print(f"LR {lr}", flush=True)
    return trainer["epochs_run"]

def main():
    config = "main-config"
    train(3)  # @main
    import gc
    gc.collect()
    # Nothing may hold train's frame once it returned: its locals go with it.
    print("TOKEN", "FREED" if token_ref() is None else "KEPT", flush=True)
    while True:
        time.sleep(0.05)

def loader():
    batch = [1, 2, 3]
    while True:
        time.sleep(0.05)  # @loader

threading.Thread(target=loader, name="loader", daemon=True).start()
main()  # @module
"""


def version_of(python):
    out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True).stdout
    return tuple(map(int, out.split()))


def test_bt_numbers_the_frames_that_eval_frame_takes(python, spawn, cli):
    target = spawn(python, TRAINING)
    bt = cli(target.pid, "bt")
    assert bt.returncode == 0, bt.stderr
    script = target.script
    main_block = bt.stdout.split('"MainThread"')[1].split("\nThread ")[0]
    assert f"#0  train ({script}:{line_of(TRAINING, 'train')})" in main_block
    assert f"#1  main ({script}:{line_of(TRAINING, 'main')})" in main_block
    assert f"#2  <module> ({script}:{line_of(TRAINING, 'module')})" in main_block
    loader_block = bt.stdout.split('"loader"')[1]
    assert f"#0  loader ({script}:{line_of(TRAINING, 'loader')})" in loader_block

    # The frames' locals, and their globals, by those numbers.
    assert cli(target.pid, "eval", "--frame", "0", "trainer['epochs_run'], lr, epochs").stdout == "(7, 0.1, 3)\n"
    assert cli(target.pid, "eval", "--frame", "1", "config").stdout == "'main-config'\n"
    assert cli(target.pid, "eval", "--frame", "0", "release.is_set(), type(token).__name__").stdout == "(False, 'Token')\n"
    # The main thread's frame 0 is what --thread alone and --frame alone name.
    assert cli(target.pid, "eval", "--thread", "MainThread", "lr").stdout == "0.1\n"
    # Without --frame: __main__, as before.
    assert cli(target.pid, "eval", "__name__").stdout == "'__main__'\n"
    missing = cli(target.pid, "eval", "lr")
    assert missing.returncode == 1 and "NameError" in missing.stderr


def test_another_thread_by_name_id_or_tid(python, spawn, cli):
    target = spawn(python, TRAINING)
    stacks = json.loads(cli(target.pid, "bt", "--format", "json").stdout)
    [loader] = [t for t in stacks["threads"] if t["name"] == "loader"]
    for spec in ("loader", hex(loader["thread_id"]), str(loader["thread_id"]), str(loader["native_id"])):
        result = cli(target.pid, "eval", "--thread", spec, "--frame", "0", "batch")
        assert (result.returncode, result.stdout) == (0, "[1, 2, 3]\n"), (spec, result.stderr)


def test_a_thread_or_frame_that_is_not_there_is_a_hinted_error(python, spawn, cli):
    target = spawn(python, TRAINING)
    no_thread = cli(target.pid, "eval", "--thread", "nosuch", "1")
    assert no_thread.returncode == 1
    error, hint = no_thread.stderr.splitlines()
    assert error == "error: no thread 'nosuch' runs Python code in this process"
    assert hint.startswith('hint: threads: "MainThread" (0x') and '"loader" (0x' in hint
    no_frame = cli(target.pid, "eval", "--frame", "9", "1")
    assert no_frame.returncode == 1
    error, hint = no_frame.stderr.splitlines()
    assert error.startswith('error: thread "MainThread" (0x') and error.endswith("has frames 0-2; there is no frame 9")
    assert hint == "hint: `rankscope PID bt` numbers each thread's frames, innermost first"
    assert no_frame.stdout == ""
    assert target.alive()


def test_writes_to_a_functions_locals_follow_the_python_version(python, spawn, cli):
    target = spawn(python, TRAINING)
    # An error in the frame: the traceback comes back, and no reference stays behind.
    failed = cli(target.pid, "eval", "--frame", "0", "token.missing")
    assert failed.returncode == 1 and "AttributeError" in failed.stderr
    wrote = cli(target.pid, "eval", "--frame", "0", "lr = 0.5")
    assert wrote.returncode == 0, wrote.stderr
    released = cli(target.pid, "eval", "release.set()")
    assert released.returncode == 0, released.stderr
    lr_line = target.wait_for_line("LR ")
    if version_of(python) >= (3, 13):
        # PEP 667: frame.f_locals writes through to the running function.
        assert lr_line == "LR 0.5"
        assert "note:" not in wrote.stderr
    else:
        assert lr_line == "LR 0.1"
        assert wrote.stderr.startswith("note: Python 3.1")
        assert "train() does not see the new lr" in wrote.stderr
    # Once train() returned, its frame and its locals were freed.
    assert target.wait_for_line("TOKEN ") == "TOKEN FREED"


def test_repl_in_a_frame(python, spawn, cli):
    target = spawn(python, TRAINING)
    session = cli(target.pid, "repl", "--frame", "0", input="scaled = lr * 10\nscaled\ntrainer['epochs_run']\n")
    assert session.returncode == 0, session.stderr
    banner, *rest = session.stdout.splitlines()
    assert f"code runs in frame 0: train ({target.script}:{line_of(TRAINING, 'train')}) in thread \"MainThread\"" in banner
    assert "1.0" in rest and "7" in rest
    bad = cli(target.pid, "repl", "--thread", "nosuch", input="1\n")
    assert bad.returncode == 1 and "error: no thread 'nosuch'" in bad.stderr and "hint: threads:" in bad.stderr


RANK_STEP = """
import os, time

def step():
    rank_local = int(os.environ["RANK"]) * 100
    print("READY", flush=True)
    while True:
        time.sleep(0.05)

step()
"""


def test_cluster_eval_in_a_frame(default_python, spawn, cli, tmp_path):
    run = tmp_path / "run"
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    targets = [
        spawn(default_python, RANK_STEP, env={"RANK": str(r), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": job_id, "RANKSCOPE_RUN_DIR": str(run)})
        for r in range(2)
    ]
    ev = cli("cluster", "eval", "--run", run, "--frame", "0", "rank_local + 1")
    assert ev.returncode == 0, ev.stderr
    assert ev.stdout.splitlines() == [f"== rank 0 (pid {targets[0].pid})", "1", f"== rank 1 (pid {targets[1].pid})", "101"]
    bad = cli("cluster", "eval", "--run", run, "--frame", "5", "1")
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert lines[0] == f"== rank 0 (pid {targets[0].pid})"
    assert lines[1].startswith("error: thread") and lines[1].endswith("there is no frame 5")
    assert lines[2].startswith("hint: `rankscope PID bt` numbers")
