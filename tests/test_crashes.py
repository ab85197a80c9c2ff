"""Crash records: an uncaught exception leaves its frames and locals on disk,
and `rankscope crashes` reads them after the process is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import line_of
from test_errors import assert_hinted_error

CRASH = """
import sys

class Checkpoint:
    def __repr__(self):
        return "Checkpoint(step=41)"

def load(path):
    ckpt = Checkpoint()
    batch_size = 4096
    table = {"a": 1}
    return table[path]  # @raise

def main():
    paths = ["missing.pt"]
    load(paths[0])

print("READY", flush=True)
main()
"""


def run_target(python: str, source: str, run_dir: Path, endpoint_dir: str, probe: bool = True, workdir: str | None = None):
    """Runs `source` to completion; returns (CompletedProcess, script path)."""
    workdir = workdir or tempfile.mkdtemp(prefix="rs-target-", dir="/tmp")
    script = Path(workdir) / "target.py"
    script.write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE") and k != "PYTHONFAULTHANDLER"}
    env["RANKSCOPE_DIR"] = endpoint_dir
    env["RANKSCOPE_RUN_DIR"] = str(run_dir)
    if probe:
        env["RANKSCOPE"] = "1"
    result = subprocess.run([python, "-u", str(script)], capture_output=True, text=True, env=env, cwd=workdir, timeout=60)
    assert result.stdout.startswith("READY"), (result.stdout, result.stderr)
    return result, script


def records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("crash-*.json"))]


def crashes_json(cli, run_dir: Path) -> list[dict]:
    result = cli("crashes", "--format", "json", env={"RANKSCOPE_RUN_DIR": str(run_dir)})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_uncaught_exception_is_recorded_and_the_program_behaves_the_same(python, cli, endpoint_dir, tmp_path):
    workdir = tempfile.mkdtemp(prefix="rs-target-", dir="/tmp")
    plain, _ = run_target(python, CRASH, tmp_path / "plain", endpoint_dir, probe=False, workdir=workdir)
    probed, script = run_target(python, CRASH, tmp_path / "run", endpoint_dir, workdir=workdir)
    assert plain.returncode == probed.returncode == 1
    assert probed.stderr == plain.stderr
    assert "KeyError: 'missing.pt'" in probed.stderr
    assert not (tmp_path / "plain").exists()

    [record] = records(tmp_path / "run")
    assert record["source"] == "excepthook"
    assert record["thread"] == "MainThread"
    assert record["rank"] == 0 and isinstance(record["pid"], int)
    [exc] = record["exceptions"]
    assert exc["type"] == "KeyError" and exc["message"] == "'missing.pt'"
    innermost = exc["frames"][-1]
    assert innermost["func"] == "load"
    assert innermost["file"] == str(script)
    assert innermost["lineno"] == _line(CRASH, "raise")
    assert innermost["source"] == "return table[path]  # @raise"
    local = {entry["name"]: entry["repr"] for entry in innermost["locals"]}
    assert local["ckpt"] == "Checkpoint(step=41)"
    assert local["batch_size"] == "4096"
    assert local["path"] == "'missing.pt'"
    assert [f["func"] for f in exc["frames"]] == ["<module>", "main", "load"]
    # A clean-enough exit leaves no empty native log behind.
    assert list((tmp_path / "run").glob("native-*.log")) == []

    [row] = crashes_json(cli, tmp_path / "run")
    assert row["id"] == 1 and row["type"] == "KeyError" and row["location"] == f"{script}:{_line(CRASH, 'raise')}"


def _line(source: str, marker: str) -> int:
    for number, line in enumerate(textwrap.dedent(source).splitlines(), start=1):
        if f"# @{marker}" in line:
            return number
    raise AssertionError(marker)


def test_show_prints_the_traceback_with_source_and_locals(default_python, cli, endpoint_dir, tmp_path):
    run_target(default_python, CRASH, tmp_path, endpoint_dir)
    result = cli("crashes", "show", "1", "--run", tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Traceback (most recent call last):" in out
    assert "return table[path]  # @raise" in out
    assert "ckpt = Checkpoint(step=41)" in out
    assert "paths = ['missing.pt']" in out
    # Innermost frame last, then the exception.
    assert out.index("in main") < out.index("in load") < out.index("KeyError: 'missing.pt'")

    listing = cli("crashes", env={"RANKSCOPE_RUN_DIR": str(tmp_path)})
    assert listing.returncode == 0, listing.stderr
    assert "KeyError: 'missing.pt'" in listing.stdout and "target.py:" in listing.stdout


CHAINED = """
def parse(text):
    return int(text)

def load(text):
    try:
        parse(text)
    except ValueError as e:
        raise RuntimeError("config is broken") from e

print("READY", flush=True)
load("x1")
"""


def test_the_exception_chain_is_kept(default_python, cli, endpoint_dir, tmp_path):
    run_target(default_python, CHAINED, tmp_path, endpoint_dir)
    [record] = records(tmp_path)
    assert [(e["type"], e["via"]) for e in record["exceptions"]] == [("ValueError", None), ("RuntimeError", "cause")]
    assert record["exceptions"][0]["frames"][-1]["func"] == "parse"
    out = cli("crashes", "show", "1", "--run", tmp_path).stdout
    assert out.index("ValueError: invalid literal") < out.index("direct cause") < out.index("RuntimeError: config is broken")


THREAD = """
import threading

def work():
    shard = 17
    raise OSError("disk gone")

t = threading.Thread(target=work, name="loader")
print("READY", flush=True)
t.start()
t.join()
print("MAIN DONE", flush=True)
"""


def test_exception_in_a_thread_is_recorded(python, endpoint_dir, tmp_path):
    result, _ = run_target(python, THREAD, tmp_path, endpoint_dir)
    assert result.returncode == 0
    assert "MAIN DONE" in result.stdout
    assert "OSError: disk gone" in result.stderr  # threading's own hook still ran
    [record] = records(tmp_path)
    assert record["source"] == "threading.excepthook"
    assert record["thread"] == "loader"
    innermost = record["exceptions"][-1]["frames"][-1]
    assert innermost["func"] == "work"
    assert {"name": "shard", "repr": "17", "type": "int"} in innermost["locals"]


USER_HOOK = """
import os, sys
import rankscope

def my_hook(exc_type, exc, tb):
    sys.stderr.write(f"USER HOOK SAW {exc_type.__name__}\\n")
    sys.stderr.flush()
    {after}

sys.excepthook = my_hook
rankscope.start()
print("READY", flush=True)
level = 3
raise LookupError("no such shard")
"""


def test_a_users_previous_excepthook_still_runs(python, endpoint_dir, tmp_path):
    result, _ = run_target(python, USER_HOOK.replace("{after}", "pass"), tmp_path, endpoint_dir, probe=False)
    assert "USER HOOK SAW LookupError" in result.stderr
    assert "Traceback" not in result.stderr  # the user's hook replaced the default one
    assert result.returncode == 1
    [record] = records(tmp_path)
    assert record["exceptions"][-1]["type"] == "LookupError"


def test_the_record_survives_a_kill_in_a_later_hook(python, cli, endpoint_dir, tmp_path):
    source = USER_HOOK.replace("{after}", "os.kill(os.getpid(), 9)")
    result, _ = run_target(python, source, tmp_path, endpoint_dir, probe=False)
    assert result.returncode == -signal.SIGKILL
    assert "USER HOOK SAW LookupError" in result.stderr
    [row] = crashes_json(cli, tmp_path)
    assert row["type"] == "LookupError" and row["message"] == "no such shard"


SEGFAULT = """
import ctypes
print("READY", flush=True)
ctypes.string_at(0)
"""


def test_a_native_crash_is_listed(python, cli, endpoint_dir, tmp_path):
    result, _ = run_target(python, SEGFAULT, tmp_path, endpoint_dir)
    assert result.returncode == -signal.SIGSEGV
    assert records(tmp_path) == []
    [log] = tmp_path.glob("native-*.log")
    assert "Fatal Python error: Segmentation fault" in log.read_text()

    listing = cli("crashes", "--run", tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "native crash: Fatal Python error: Segmentation fault" in listing.stdout
    [row] = crashes_json(cli, tmp_path)
    assert row["kind"] == "native" and row["pid"] == int(log.stem.split("-")[1])
    shown = cli("crashes", "show", "1", "--run", tmp_path)
    assert "Segmentation fault" in shown.stdout and "target.py" in shown.stdout


def test_forked_workers_leave_no_empty_native_log(default_python, endpoint_dir, tmp_path):
    # A DataLoader's workers are forked and leave by os._exit, past atexit:
    # each left an empty native-<pid>.log in the run directory.
    source = """
    import multiprocessing as mp
    print("READY", flush=True)

    def work(q, i):
        q.put(i * i)

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        workers = [ctx.Process(target=work, args=(q, i)) for i in range(3)]
        for w in workers:
            w.start()
        print(sorted(q.get() for _ in workers), flush=True)
        for w in workers:
            w.join()
        print("codes", [w.exitcode for w in workers], flush=True)
    """
    plain, _ = run_target(default_python, source, tmp_path / "plain", endpoint_dir, probe=False)
    probed, _ = run_target(default_python, source, tmp_path / "run", endpoint_dir)
    assert probed.returncode == plain.returncode == 0, probed.stderr
    assert probed.stdout == plain.stdout and "codes [0, 0, 0]" in probed.stdout, probed.stdout
    assert probed.stderr == plain.stderr
    assert list((tmp_path / "run").glob("native-*.log")) == []


def test_faulthandler_set_up_by_the_user_is_left_alone(default_python, endpoint_dir, tmp_path):
    source = """
    import faulthandler, sys
    faulthandler.enable(file=sys.stderr)
    import rankscope
    rankscope.start()
    print("READY", flush=True)
    print("SAME", faulthandler.is_enabled(), flush=True)
    """
    result, _ = run_target(default_python, source, tmp_path, endpoint_dir, probe=False)
    assert result.returncode == 0, result.stderr
    assert "SAME True" in result.stdout
    assert list(tmp_path.glob("native-*.log")) == []


ON_ERROR = """
import rankscope

@rankscope.on_error()
def step(n):
    scale = n * 2
    raise ArithmeticError(f"step {n} diverged")

print("READY", flush=True)
try:
    step(5)
except ArithmeticError as exc:
    print("CAUGHT", exc, flush=True)

with rankscope.on_error():
    marker = "in block"
    step(6)
"""


def test_on_error_records_and_reraises(python, endpoint_dir, tmp_path):
    result, _ = run_target(python, ON_ERROR, tmp_path, endpoint_dir)
    assert "CAUGHT step 5 diverged" in result.stdout
    assert result.returncode == 1
    assert "ArithmeticError: step 6 diverged" in result.stderr
    found = records(tmp_path)
    # step(6) passed through both on_error()s and then sys.excepthook: one record.
    assert [(r["source"], r["exceptions"][-1]["message"]) for r in found] == [
        ("on_error", "step 5 diverged"),
        ("on_error", "step 6 diverged"),
    ]
    innermost = found[0]["exceptions"][-1]["frames"][-1]
    assert innermost["func"] == "step"
    assert {"name": "scale", "repr": "10", "type": "int"} in innermost["locals"]


def test_missing_run_dir_is_a_hinted_error(cli, tmp_path):
    assert_hinted_error(cli("crashes", "--run", tmp_path / "nope"), "no run directory", "RANKSCOPE_RUN_DIR")
    assert_hinted_error(cli("crashes", env={"RANKSCOPE_RUN_DIR": str(tmp_path / "nope")}), "no run directory")


def test_show_of_an_id_that_is_not_there(default_python, cli, endpoint_dir, tmp_path):
    run_target(default_python, CRASH, tmp_path, endpoint_dir)
    assert_hinted_error(cli("crashes", "show", "99", "--run", tmp_path), "no crash 99", "1 to 1")


@pytest.mark.parametrize("job_env", [{}, {"SLURM_JOB_ID": "4242"}, {"TORCHELASTIC_RUN_ID": "te-9", "SLURM_JOB_ID": "1"}])
def test_the_default_run_dir_is_the_same_on_both_sides(default_python, rankscope_bin, endpoint_dir, tmp_path, job_env):
    home = tmp_path / "home"
    home.mkdir()
    workdir = tempfile.mkdtemp(prefix="rs-target-", dir="/tmp")
    script = Path(workdir) / "target.py"
    script.write_text(textwrap.dedent(CRASH))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKSCOPE", "SLURM", "TORCHELASTIC"))}
    env.update(job_env, HOME=str(home), RANKSCOPE="1", RANKSCOPE_DIR=endpoint_dir, RANK="3")
    subprocess.run([default_python, str(script)], env=env, capture_output=True, timeout=60, cwd=workdir)
    job = job_env.get("TORCHELASTIC_RUN_ID") or job_env.get("SLURM_JOB_ID") or "local"
    [path] = (home / ".local/state/rankscope/runs" / job).glob("crash-*-rank3-pid*.json")
    # Listing with no --run reads every job's directory.
    listing = subprocess.run([rankscope_bin, "crashes", "--format", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    [row] = json.loads(listing.stdout)
    assert row["path"] == str(path) and row["rank"] == 3 and row["job"] == job


def test_empty_native_logs_of_dead_processes_are_cleaned(cli, tmp_path):
    from test_errors import free_pid

    dead = tmp_path / f"native-{free_pid()}.log"
    dead.write_text("")
    live = tmp_path / f"native-{os.getpid()}.log"
    live.write_text("")
    result = cli("crashes", "--run", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "No crashes recorded" in result.stdout
    assert not dead.exists()
    assert live.exists()


def test_crashes_are_a_table_after_the_processes_are_gone(default_python, cli, endpoint_dir, tmp_path):
    _, script = run_target(default_python, CRASH, tmp_path, endpoint_dir)
    native, _ = run_target(default_python, SEGFAULT, tmp_path, endpoint_dir)
    assert native.returncode == -signal.SIGSEGV
    result = cli(
        "query",
        "SELECT id, kind, rank, exc_type, message, file, lineno, source_line FROM python.crashes ORDER BY id",
        "--run",
        tmp_path,
        "--format",
        "json",
    )
    assert result.returncode == 0, result.stderr
    exception, segfault = json.loads(result.stdout)
    assert exception == {
        "id": 1,
        "kind": "exception",
        "rank": 0,
        "exc_type": "KeyError",
        "message": "'missing.pt'",
        "file": str(script),
        "lineno": _line(CRASH, "raise"),
        "source_line": "return table[path]  # @raise",
    }
    assert segfault["id"] == 2 and segfault["kind"] == "native"
    assert "Segmentation fault" in segfault["message"] and segfault["lineno"] > 0


def test_live_tables_need_a_process(cli, tmp_path):
    result = cli("query", "SELECT * FROM python.backtrace", "--run", tmp_path)
    assert_hinted_error(result, "python.backtrace is read from a live process", "rankscope PID query")


LIVE_THREAD_CRASH = """
import threading, time

def work(shard):
    raise OSError("disk gone")

t = threading.Thread(target=work, args=(17,), name="loader")
t.start()
t.join()
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_live_process_shows_its_own_crashes(python, spawn, cli):
    target = spawn(python, LIVE_THREAD_CRASH)
    result = cli(target.pid, "query", "SELECT thread, exc_type, message, func FROM python.crashes", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"thread": "loader", "exc_type": "OSError", "message": "disk gone", "func": "work"}]


TENSOR_CRASH = """
import torch

def step(batch):
    weights = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), -2.0, 0.5]])
    ids = torch.arange(6)
    big = torch.zeros(4096, 4096, dtype=torch.float16)
    return weights @ batch  # @raise

print("READY", flush=True)
step(torch.ones(2, 2))
"""


def test_tensors_in_a_crash_are_summarized_never_printed(default_python, cli, endpoint_dir, tmp_path):
    has_torch = subprocess.run([default_python, "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        pytest.skip("torch is not installed in the test environment (RANKSCOPE_TEST_TORCH=0?)")
    result, _ = run_target(default_python, TENSOR_CRASH, tmp_path, endpoint_dir)
    assert result.returncode == 1 and "RuntimeError" in result.stderr
    [record] = records(tmp_path)
    frame = record["exceptions"][-1]["frames"][-1]
    assert frame["func"] == "step" and frame["lineno"] == _line(TENSOR_CRASH, "raise")
    local = {entry["name"]: entry["repr"] for entry in frame["locals"]}
    assert local["weights"] == (
        "Tensor(shape=[2, 3], dtype=torch.float32, device=cpu, min=-2, max=3, mean=0.625, nan=1, inf=1)"
    )
    assert local["ids"] == "Tensor(shape=[6], dtype=torch.int64, device=cpu, min=0, max=5, mean=2.5, nan=0, inf=0)"
    assert local["batch"].startswith("Tensor(shape=[2, 2], dtype=torch.float32")
    # 16M elements: past the statistics bound, metadata only.
    assert local["big"] == "Tensor(shape=[4096, 4096], dtype=torch.float16, device=cpu)"
    shown = cli("crashes", "show", "1", "--run", tmp_path)
    assert "nan=1, inf=1" in shown.stdout


HOSTILE_LOCALS = """
import time

class Raises:
    def __repr__(self):
        raise ValueError("no repr for you")

class Forever:
    def __repr__(self):
        while True:
            pass

class Interrupts:
    def __repr__(self):
        raise KeyboardInterrupt

def go():
    broken, endless, rude = Raises(), Forever(), Interrupts()
    raise OSError("disk on fire")  # @raise

print("READY", flush=True)
go()
"""


def test_hostile_reprs_are_recorded_safely_and_the_error_still_reaches_the_user(python, endpoint_dir, tmp_path):
    started = time.monotonic()
    result, _ = run_target(python, HOSTILE_LOCALS, tmp_path, endpoint_dir)
    assert time.monotonic() - started < 20
    assert result.returncode == 1 and "OSError: disk on fire" in result.stderr
    [record] = records(tmp_path)
    local = {e["name"]: e["repr"] for e in record["exceptions"][-1]["frames"][-1]["locals"]}
    assert local["broken"] == "<__main__.Raises object: repr failed: ValueError>"
    assert local["endless"] == "<__main__.Forever object: repr took longer than 0.25s>"
    assert local["rude"] == "<__main__.Interrupts object: repr failed: KeyboardInterrupt>"


DEEP = """
import sys
sys.setrecursionlimit(2000)

def dive(n):
    if n == 0:
        raise RuntimeError("bottom")  # @raise
    return dive(n - 1)

print("READY", flush=True)
dive(900)
"""


def test_a_900_deep_stack_keeps_its_innermost_frames_with_a_note(python, cli, endpoint_dir, tmp_path):
    result, _ = run_target(python, DEEP, tmp_path, endpoint_dir)
    assert result.returncode == 1 and "RuntimeError: bottom" in result.stderr
    [record] = records(tmp_path)
    exc = record["exceptions"][-1]
    assert len(exc["frames"]) == 200 and exc["frames_omitted"] == 902 - 200
    assert exc["frames"][-1]["lineno"] == _line(DEEP, "raise")
    assert {"name": "n", "repr": "0", "type": "int"} in exc["frames"][-1]["locals"]
    shown = cli("crashes", "show", "1", "--run", tmp_path).stdout
    assert "[... 702 outer frames omitted: the record keeps the innermost 200]" in shown


def test_an_unwritable_run_dir_costs_one_line_and_nothing_else(python, endpoint_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    workdir = tempfile.mkdtemp(prefix="rs-target-", dir="/tmp")
    plain, _ = run_target(python, CRASH, tmp_path / "plain", endpoint_dir, probe=False, workdir=workdir)
    probed, _ = run_target(python, CRASH, blocker / "run", endpoint_dir, workdir=workdir)
    assert probed.returncode == plain.returncode == 1
    extra = [line for line in probed.stderr.splitlines() if line not in plain.stderr.splitlines()]
    assert len(extra) >= 1 and all(line.startswith("rankscope: ") for line in extra), extra
    assert any("crash not recorded: NotADirectoryError" in line for line in extra), extra
    assert probed.stderr.endswith(plain.stderr)


LIBRARY_CRASH = """
import json

def read_config(text):
    settings = {"strict": True}
    return json.loads(text)  # @call

print("READY", flush=True)
read_config("{not json")
"""


def test_the_location_is_the_users_frame_and_the_innermost_is_kept(python, cli, endpoint_dir, tmp_path):
    _, script = run_target(python, LIBRARY_CRASH, tmp_path, endpoint_dir)
    [record] = records(tmp_path)
    innermost = record["exceptions"][-1]["frames"][-1]
    # Raised in the standard library: the record keeps that frame as it was.
    assert innermost["file"].endswith("json/decoder.py") and innermost["func"] != "read_config"
    call = _line(LIBRARY_CRASH, "call")

    listing = cli("crashes", "--run", tmp_path)
    assert listing.returncode == 0, listing.stderr
    [row] = [l for l in listing.stdout.splitlines() if "JSONDecodeError" in l]
    assert row.endswith(f"{script}:{call}"), row
    assert "decoder.py" not in listing.stdout
    [entry] = crashes_json(cli, tmp_path)
    assert entry["location"] == f"{script}:{call}"
    assert entry["innermost"] == f"{innermost['file']}:{innermost['lineno']}"

    shown = cli("crashes", "show", "1", "--run", tmp_path).stdout
    assert f'File "{innermost["file"]}", line {innermost["lineno"]}' in shown
    assert shown.index("in read_config") < shown.index("decoder.py")

    sql = "SELECT func, file, lineno, user_func, user_file, user_lineno FROM python.crashes"
    result = cli("query", sql, "--run", tmp_path, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [
        {
            "func": innermost["func"],
            "file": innermost["file"],
            "lineno": innermost["lineno"],
            "user_func": "read_config",
            "user_file": str(script),
            "user_lineno": call,
        }
    ]


LAUNCHER = """
import sys
print("READY", flush=True)
raise SystemError("the launcher's own exit") if len(sys.argv) > 1 else KeyError("user")
"""


def test_a_launchers_record_is_marked_and_left_out_by_default(python, cli, endpoint_dir, tmp_path):
    """A process whose command line is torchrun's is a launcher, whatever its
    environment says (RANK included): its record is marked, and left out of
    `crashes` and python.crashes unless --all asks. Records of older probes
    (no `launcher` field) are told by their missing rank and their argv."""
    workdir = tempfile.mkdtemp(prefix="rs-target-", dir="/tmp")
    run_target(python, LAUNCHER, tmp_path, endpoint_dir, workdir=workdir)  # the user's crash
    launcher = Path(workdir) / "torchrun"
    launcher.write_text(textwrap.dedent(LAUNCHER))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env.update(RANKSCOPE="1", RANKSCOPE_DIR=endpoint_dir, RANKSCOPE_RUN_DIR=str(tmp_path), RANK="0")
    done = subprocess.run([python, str(launcher), "--nproc-per-node", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "SystemError: the launcher's own exit" in done.stderr
    user, marked = records(tmp_path)
    assert user["launcher"] is False and user["rank"] == 0
    assert marked["launcher"] is True and marked["rank"] is None

    def check(rows_default, rows_all, table, table_all):
        assert [r["type"] for r in rows_default] == ["KeyError"]
        assert [(r["id"], r["type"], r["launcher"]) for r in rows_all] == [(1, "KeyError", False), (2, "SystemError", True)]
        assert "KeyError" in table.stdout and "SystemError" not in table.stdout
        assert "1 record of the job launcher (torchrun's own exit) left out; --all shows them" in table.stderr
        [row] = [l for l in table_all.stdout.splitlines() if "SystemError" in l]
        assert row.split()[:1] == ["2"] and " launcher " in row
        sql = "SELECT id, launcher, exc_type FROM python.crashes ORDER BY id"
        default = json.loads(cli("query", sql, "--run", tmp_path, "--format", "json").stdout)
        assert default == [{"id": 1, "launcher": False, "exc_type": "KeyError"}]
        everything = json.loads(cli("query", sql, "--run", tmp_path, "--all", "--format", "json").stdout)
        assert everything == default + [{"id": 2, "launcher": True, "exc_type": "SystemError"}]

    def listings():
        rows_default = crashes_json(cli, tmp_path)
        rows_all = json.loads(cli("crashes", "--all", "--format", "json", "--run", tmp_path).stdout)
        return rows_default, rows_all, cli("crashes", "--run", tmp_path), cli("crashes", "--all", "--run", tmp_path)

    check(*listings())
    shown = cli("crashes", "show", "2", "--run", tmp_path).stdout
    assert "Crash 2 of 2: the job launcher (torchrun's own process, not a rank)" in shown

    # What an older probe wrote: no field, no rank, the launcher's argv.
    [path] = [p for p in sorted(tmp_path.glob("crash-*.json")) if json.loads(p.read_text())["launcher"]]
    old = json.loads(path.read_text())
    del old["launcher"]
    path.write_text(json.dumps(old))
    check(*listings())


# A CUDA OOM's record describes the device that ran out. The allocator's
# message names it; the process-wide OOM counts may point elsewhere (an
# earlier OOM on another GPU that the program caught). Checked on the
# record's own helper, since no GPU is here to run out.
OOM_DEVICE = r"""
import json
from rankscope._probe.crashes import _oom_device
devices = [
    {"device": "cuda:0", "ooms": 3, "reserved_mb": 900.0},
    {"device": "cuda:1", "ooms": 1, "reserved_mb": 100.0},
]
message = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB "
           "of which 1.00 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch")
print(json.dumps([
    _oom_device(message, devices),
    _oom_device(message.replace("GPU 1", "GPU 7"), devices),  # not a device here: by the counts
    _oom_device("out of memory", devices),
    _oom_device("out of memory", []),
]))
"""


def test_a_cuda_oom_record_describes_the_device_its_message_names(python):
    result = subprocess.run([python, "-c", OOM_DEVICE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [1, 0, 0, None]


# A rank that aborts in C with the GIL let go (as gloo's C++ exception in
# a collective does), while another thread waits (as a DataLoader's feeder
# thread does): faulthandler marks no thread as current. The record names
# the rank from its registry entry, the main thread's own line, and the
# rank is not also said to have vanished without a record.
ABORTS = """
import ctypes, threading, time
threading.Thread(target=threading.Event().wait, daemon=True, name="feeder").start()
print("READY", flush=True)
time.sleep(0.3)
ctypes.CDLL(None).abort()  # @abort
"""


def test_an_abort_with_the_gil_let_go_is_the_ranks_record(python, spawn, cli):
    target = spawn(python, ABORTS, env={"RANK": "1", "WORLD_SIZE": "2"})
    assert target.proc.wait(timeout=30) != 0
    run_dir = target.script.parent / "run"
    listed = cli("crashes", "--run", run_dir)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert len(rows) == 1 and "vanished" not in listed.stdout, listed.stdout
    assert rows[0][3:5] == ["1", str(target.pid)], listed.stdout
    assert rows[0][-1] == f"{target.script}:{line_of(ABORTS, 'abort')}", listed.stdout
