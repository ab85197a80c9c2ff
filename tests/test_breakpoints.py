"""Breakpoints that record and go on (CPython 3.12+ through sys.monitoring),
set into a loop that is already running."""

import json
import sys
import time

import pytest

from conftest import line_of

LOOP = """
import time

def train():
    step = 0
    loss = 0.0
    while True:
        step += 1

        loss = 1.0 / step  # @body
        time.sleep(0.005)

print("READY", flush=True)
train()
"""


def version_of(python):
    import subprocess

    out = subprocess.run([python, "-c", "import sys; print(sys.version_info[1])"], capture_output=True, text=True).stdout
    return (3, int(out))


def snapshots(cli, pid):
    result = cli(pid, "snapshots", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_for(predicate, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture
def loop(python, spawn):
    if version_of(python) < (3, 12):
        pytest.skip("breakpoints need 3.12+ for now (see test_breakpoints_say_311_is_not_supported)")
    return spawn(python, LOOP)


def test_a_breakpoint_in_a_running_loop_records_snapshots(loop, cli):
    body = line_of(LOOP, "body")
    added = cli(loop.pid, "break", "add", f"target.py:{body}")
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip() == f"breakpoint 1 at {loop.script}:{body}"
    snaps = wait_for(lambda: [s for s in snapshots(cli, loop.pid) if s["hit"] >= 3])
    first = snapshots(cli, loop.pid)[0]
    assert first["bp_id"] == 1 and first["thread"] == "MainThread"
    assert [f["func"] for f in first["frames"][:2]] == ["train", "<module>"]
    assert first["frames"][0]["lineno"] == body
    names = {l["name"] for l in first["frames"][0]["locals"]}
    assert {"step", "loss"} <= names
    listing = cli(loop.pid, "break", "list").stdout
    assert f"target.py:{body}" in listing and "hits" in listing

    assert cli(loop.pid, "break", "rm", "1").returncode == 0
    count = len(snapshots(cli, loop.pid))
    time.sleep(0.3)
    assert len(snapshots(cli, loop.pid)) == count
    assert loop.alive()


def test_condition_max_and_logpoint(loop, cli):
    body = line_of(LOOP, "body")
    cond = cli(loop.pid, "break", "add", f"target.py:{body}", "--if", "step % 2 == 0", "--max", "3", "--log", "step {step} loss {loss:.3f}")
    assert cond.returncode == 0, cond.stderr
    snaps = wait_for(lambda: len(snapshots(cli, loop.pid)) >= 3 and snapshots(cli, loop.pid))
    time.sleep(0.3)
    snaps = snapshots(cli, loop.pid)
    assert len(snaps) == 3
    steps = [int(s["log"].split()[1]) for s in snaps]
    assert all(step % 2 == 0 for step in steps)
    assert snaps[0]["log"].startswith(f"step {steps[0]} loss ")
    assert "No breakpoints." in cli(loop.pid, "break", "list").stdout  # --max removed it


def test_a_line_without_code_moves_to_the_next_one(loop, cli):
    body = line_of(LOOP, "body")
    added = cli(loop.pid, "break", "add", f"target.py:{body - 1}")
    assert added.returncode == 0, added.stderr
    assert f"line {body - 1} has no code; the breakpoint is on line {body}" in added.stderr


def test_bad_input_changes_nothing(loop, cli):
    bad = cli(loop.pid, "break", "add", f"target.py:{line_of(LOOP, 'body')}", "--if", "step >")
    assert bad.returncode == 1 and "the condition does not compile" in bad.stderr
    # A file not imported (yet) is not an error: the breakpoint waits for it.
    pending = cli(loop.pid, "break", "add", "nowhere.py:3")
    assert pending.returncode == 0 and "pending: nowhere.py is not imported yet" in pending.stderr
    assert cli(loop.pid, "break", "rm", "1").returncode == 0
    form = cli(loop.pid, "break", "add", "target.py")
    assert form.returncode == 1 and "is not FILE:LINE" in form.stderr
    assert "No breakpoints." in cli(loop.pid, "break", "list").stdout


def test_a_failing_condition_disables_itself_and_never_reaches_the_program(loop, cli):
    body = line_of(LOOP, "body")
    assert cli(loop.pid, "break", "add", f"target.py:{body}", "--if", "no_such_name > 1").returncode == 0
    listing = wait_for(lambda: (out := cli(loop.pid, "break", "list").stdout) and "[disabled]" in out and out)
    assert "disabled after 5 errors; last: NameError" in listing
    assert snapshots(cli, loop.pid) == []
    assert loop.alive()


def test_clear_gives_the_monitoring_tool_back(loop, cli):
    body = line_of(LOOP, "body")
    cli(loop.pid, "break", "add", f"target.py:{body}")
    tools = "import sys; [sys.monitoring.get_tool(i) for i in range(6)]"
    assert "'rankscope'" in cli(loop.pid, "eval", tools).stdout
    cleared = cli(loop.pid, "break", "clear")
    assert cleared.stdout.strip() == "removed 1 breakpoints"
    assert "'rankscope'" not in cli(loop.pid, "eval", tools).stdout


def test_breakpoints_say_311_is_not_supported(default_python, spawn, cli):
    if version_of(default_python) >= (3, 12):
        pytest.skip("the default Python has sys.monitoring")
    target = spawn(default_python, LOOP)
    result = cli(target.pid, "break", "add", f"target.py:{line_of(LOOP, 'body')}")
    assert result.returncode == 1
    assert "breakpoints need CPython 3.12 or later for now" in result.stderr


MODEL = """
import time

class Attention:
    def forward(self, x):
        scaled = x * 2  # @forward
        return scaled

def train():
    layer = Attention()
    step = 0
    while True:
        step += 1
        layer.forward(step)
        time.sleep(0.005)

print("READY", flush=True)
train()
"""


def test_a_function_breakpoint_and_hit_counts(python, spawn, cli):
    if version_of(python) < (3, 12):
        pytest.skip("breakpoints need 3.12+ for now")
    target = spawn(python, MODEL)
    added = cli(target.pid, "break", "add", "target.py:Attention.forward", "--hit", "5", "--every", "1", "--max", "2")
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip() == f"breakpoint 1 at {target.script}:{line_of(MODEL, 'forward')}"
    snaps = wait_for(lambda: len(snapshots(cli, target.pid)) == 2 and snapshots(cli, target.pid))
    xs = [int({l["name"]: l["repr"] for l in s["frames"][0]["locals"]}["x"]) for s in snaps]
    assert xs[0] >= 5 and xs[1] == xs[0] + 1  # from the 5th pass on, two hits
    assert [f["func"] for f in snaps[0]["frames"][:2]] == ["forward", "train"]
    ambiguous = cli(target.pid, "break", "add", "target.py:nothing_here")
    assert ambiguous.returncode == 1 and "no function 'nothing_here'" in ambiguous.stderr


def test_snapshots_are_tables(loop, cli):
    body = line_of(LOOP, "body")
    assert cli(loop.pid, "break", "add", f"target.py:{body}", "--max", "3").returncode == 0
    wait_for(lambda: len(snapshots(cli, loop.pid)) == 3)
    hits = cli(loop.pid, "query", "SELECT bp_id, hit, func, lineno FROM python.snapshots ORDER BY hit", "--format", "json")
    assert hits.returncode == 0, hits.stderr
    assert json.loads(hits.stdout) == [{"bp_id": 1, "hit": h, "func": "train", "lineno": body} for h in (1, 2, 3)]
    steps = cli(loop.pid, "query", "SELECT hit, repr FROM python.snapshot_locals WHERE bp_id = 1 AND name = 'step' ORDER BY hit", "--format", "csv")
    values = [int(line.split(",")[1]) for line in steps.stdout.split()[1:]]
    assert len(values) == 3 and values == sorted(values)


LATER = """
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
print("READY", flush=True)
while not os.path.exists("go"):
    time.sleep(0.01)
import later_mod
while True:
    later_mod.compute(3)
    time.sleep(0.005)
"""

LATER_MOD = """
def compute(x):
    doubled = x * 2  # @compute
    return doubled
"""


def test_a_breakpoint_in_a_module_not_imported_yet_arms_on_import(python, spawn, cli):
    if version_of(python) < (3, 12):
        pytest.skip("breakpoints need 3.12+ for now")
    target = spawn(python, LATER)
    (target.script.parent / "later_mod.py").write_text(LATER_MOD)
    line = line_of(LATER_MOD, "compute")
    added = cli(target.pid, "break", "add", f"later_mod.py:{line}")
    assert added.returncode == 0, added.stderr
    assert "pending: later_mod.py is not imported yet" in cli(target.pid, "break", "list").stdout
    (target.script.parent / "go").write_text("")
    snaps = wait_for(lambda: snapshots(cli, target.pid))
    assert snaps[0]["frames"][0]["func"] == "compute" and snaps[0]["frames"][0]["lineno"] == line
    assert "pending" not in cli(target.pid, "break", "list").stdout
    assert cli(target.pid, "break", "clear").returncode == 0
    assert "_ArmOnImport" not in cli(target.pid, "eval", "import sys; [type(f).__name__ for f in sys.meta_path]").stdout


def test_snapshots_outlive_the_process(python, spawn, cli, tmp_path):
    if version_of(python) < (3, 12):
        pytest.skip("breakpoints need 3.12+ for now")
    run = tmp_path / "run"
    target = spawn(python, LOOP, env={"RANKSCOPE_RUN_DIR": str(run)})
    assert cli(target.pid, "break", "add", f"target.py:{line_of(LOOP, 'body')}", "--max", "2").returncode == 0
    wait_for(lambda: len(snapshots(cli, target.pid)) == 2)
    target.kill()  # SIGKILL: nothing runs at exit
    result = cli("query", "SELECT pid, rank, hit, func FROM python.snapshots ORDER BY hit", "--run", run, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"pid": target.pid, "rank": 0, "hit": h, "func": "train"} for h in (1, 2)]
    names = cli("query", "SELECT DISTINCT name FROM python.snapshot_locals ORDER BY name", "--run", run, "--format", "csv")
    assert "step" in names.stdout.split()
