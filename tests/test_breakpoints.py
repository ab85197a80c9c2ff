"""Breakpoints that record and go on, set into a loop that is already
running: one suite for both mechanisms (sys.monitoring on 3.12+,
instrumented code objects and a per-thread trace on 3.11)."""

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
    names = {name for name, _, _ in first["frames"][0]["locals"]}
    assert {"step", "loss"} <= names
    listing = cli(loop.pid, "break", "list").stdout
    assert listing.split()[:5] == ["ID", "WHERE", "PASSES", "HITS", "DETAILS"]
    [row] = [line.split() for line in listing.splitlines() if f"target.py:{body}" in line]
    assert row[0] == "1" and int(row[2]) >= int(row[3]) >= 3  # passes, hits

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
    # A file that is neither loaded nor on disk: a typo, not a pending breakpoint.
    missing = cli(loop.pid, "break", "add", "nowhere.py:3")
    assert missing.returncode == 1 and "no loaded code comes from 'nowhere.py', and no such file is found" in missing.stderr
    beyond = cli(loop.pid, "break", "add", "target.py:9999")
    assert beyond.returncode == 1 and "has no code at or after line 9999" in beyond.stderr
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


def test_clear_puts_everything_back(loop, python, cli):
    codes = "{name: id(f.__code__) for name, f in list(globals().items()) if type(f).__name__ == 'function'}"
    tools = "import sys; [sys.monitoring.get_tool(i) for i in range(6)]"
    monitoring = version_of(python) >= (3, 12)
    before = cli(loop.pid, "eval", codes).stdout
    cli(loop.pid, "break", "add", f"target.py:{line_of(LOOP, 'body')}")
    wait_for(lambda: snapshots(cli, loop.pid))
    if monitoring:
        assert "'rankscope'" in cli(loop.pid, "eval", tools).stdout
    else:
        assert cli(loop.pid, "eval", codes).stdout != before  # train() got an instrumented copy
    cleared = cli(loop.pid, "break", "clear")
    assert cleared.stdout.strip() == "removed 1 breakpoints"
    assert cli(loop.pid, "eval", codes).stdout == before
    if monitoring:
        assert "'rankscope'" not in cli(loop.pid, "eval", tools).stdout
    count = len(snapshots(cli, loop.pid))
    time.sleep(0.3)
    assert len(snapshots(cli, loop.pid)) == count and loop.alive()


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
    target = spawn(python, MODEL)
    added = cli(target.pid, "break", "add", "target.py:Attention.forward", "--hit", "5", "--every", "1", "--max", "2")
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip() == f"breakpoint 1 at {target.script}:{line_of(MODEL, 'forward')}"
    snaps = wait_for(lambda: len(snapshots(cli, target.pid)) == 2 and snapshots(cli, target.pid))
    xs = [int({name: text for name, text, _ in s["frames"][0]["locals"]}["x"]) for s in snaps]
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
    # The issue's own query: the hit frame's locals as a map column.
    by_key = cli(loop.pid, "query", "SELECT hit, locals['step'] AS step, locals['loss'] AS loss FROM python.snapshots WHERE bp_id = 1 ORDER BY hit", "--format", "json")
    assert by_key.returncode == 0, by_key.stderr
    mapped = json.loads(by_key.stdout)
    assert [int(r["step"]) for r in mapped] == values and all(float(r["loss"]) > 0 for r in mapped)
    whole = cli(loop.pid, "query", "SELECT * FROM python.snapshots", "--format", "csv")
    assert whole.returncode == 0 and "step: " in whole.stdout, whole.stderr


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
    run = tmp_path / "run"
    # The store's regular flush is a minute away: the hits must not wait for it.
    target = spawn(python, LOOP, env={"RANKSCOPE_RUN_DIR": str(run), "RANKSCOPE_STORE_FLUSH_S": "60"})
    assert cli(target.pid, "break", "add", f"target.py:{line_of(LOOP, 'body')}", "--max", "2").returncode == 0
    wait_for(lambda: len(snapshots(cli, target.pid)) == 2)
    # The hits reach the run store's files within 20 ms: the files alone
    # answer this.
    on_disk = lambda: cli("query", "SELECT count(*) AS n FROM python.snapshots", "--run", run, "--format", "csv").stdout.split()  # noqa: E731
    wait_for(lambda: on_disk() == ["n", "2"], timeout=10)
    assert list((run / "tables" / "snapshots").glob("*.arrows")), "spilled as Arrow streams"
    target.kill()  # SIGKILL: nothing runs at exit
    result = cli("query", "SELECT pid, rank, hit, func FROM python.snapshots ORDER BY hit", "--run", run, "--format", "json")
    assert result.returncode == 0, result.stderr
    # A process of no job: no rank, as `list` shows it.
    assert json.loads(result.stdout) == [{"pid": target.pid, "rank": None, "hit": h, "func": "train"} for h in (1, 2)]
    names = cli("query", "SELECT DISTINCT name FROM python.snapshot_locals ORDER BY name", "--run", run, "--format", "csv")
    assert "step" in names.stdout.split()
    # The locals map column, as live: `locals['step']`.
    steps = cli("query", "SELECT hit, locals['step'] AS step FROM python.snapshots ORDER BY hit", "--run", run, "--format", "json")
    assert steps.returncode == 0, steps.stderr
    assert [r["step"] is not None for r in json.loads(steps.stdout)] == [True, True], steps.stdout


PAUSING = """
import threading, time

ticks = 0

def ticker():
    global ticks
    while True:
        ticks += 1
        time.sleep(0.01)

def train():
    step = 0
    while True:
        step += 1
        loss = 1.0 / step  # @pause
        total = loss * 2  # @next
        time.sleep(0.005)

threading.Thread(target=ticker, name="ticker", daemon=True).start()
print("READY", flush=True)
train()
"""


def ticks(cli, pid):
    return int(cli(pid, "eval", "ticks").stdout.strip())


def test_pause_attach_and_step(python, spawn, cli):
    target = spawn(python, PAUSING)
    line = line_of(PAUSING, "pause")
    added = cli(target.pid, "break", "add", f"target.py:{line}", "--pause", "--max", "1")
    assert added.returncode == 0, added.stderr
    wait_for(lambda: "'session'" in cli(target.pid, "eval", "import sys; sys.modules['rankscope._probe.pause'].paused()").stdout)
    # The other threads run on while MainThread waits.
    first = ticks(cli, target.pid)
    wait_for(lambda: ticks(cli, target.pid) > first)
    session = cli(target.pid, "attach", input="p step\nn\np loss\nw\nc\n", timeout=60)
    assert session.returncode == 0, session.stderr
    out = session.stdout
    assert "paused at" in out and f"target.py({line})train()" in out
    assert f"target.py({line_of(PAUSING, 'next')})train()" in out  # `n` stepped one line
    steps = [ln for ln in out.splitlines() if ln.startswith("(Pdb) ") and ln[6:].strip().replace(".", "", 1).isdigit()]
    assert steps, out
    assert "rankscope/_probe" not in out  # never stepped into the probe
    # After `c` the loop runs again: a second breakpoint records.
    assert cli(target.pid, "break", "add", f"target.py:{line}", "--max", "2").returncode == 0
    wait_for(lambda: len([s for s in snapshots(cli, target.pid) if s["bp_id"] == 2]) == 2)
    assert target.alive()


def test_quit_and_a_closed_session_resume_the_thread(python, spawn, cli, rankscope_bin, endpoint_dir):
    import os
    import signal
    import subprocess

    target = spawn(python, PAUSING)
    line = line_of(PAUSING, "pause")
    assert cli(target.pid, "break", "add", f"target.py:{line}", "--pause").returncode == 0
    # q detaches: the program is not ended (pdb's quit would raise BdbQuit in it).
    quit_session = cli(target.pid, "attach", input="q\n")
    assert quit_session.returncode == 0 and "detached; the thread goes on" in quit_session.stdout
    # The next pass pauses again; this time the client is interrupted (Ctrl-C).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    # SIGINT as a terminal gives it: a harness started in the background
    # (`cmd &` in a script) hands its children SIGINT ignored.
    attach = subprocess.Popen(
        [rankscope_bin, str(target.pid), "attach"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert b"paused at" in attach.stdout.readline() + attach.stdout.readline()
        attach.send_signal(signal.SIGINT)
        attach.wait(timeout=10)
    finally:
        attach.kill()
    # The loop may already be paused again at its next pass: clearing the
    # breakpoint lets such a thread go too.
    cli(target.pid, "break", "clear")
    # Resumed: no pause left, and the loop goes on (a new breakpoint records).
    wait_for(lambda: cli(target.pid, "eval", "import sys; sys.modules['rankscope._probe.pause'].paused()").stdout.strip() == "[]")
    assert cli(target.pid, "break", "add", f"target.py:{line_of(PAUSING, 'next')}", "--max", "1").returncode == 0
    wait_for(lambda: any(s["frames"][0]["lineno"] == line_of(PAUSING, "next") for s in snapshots(cli, target.pid)))
    assert target.alive()


def test_a_pause_nobody_attaches_to_times_out(python, spawn, cli):
    target = spawn(python, PAUSING)
    line = line_of(PAUSING, "pause")
    assert cli(target.pid, "break", "add", f"target.py:{line}", "--pause", "--pause-timeout", "1").returncode == 0
    listing = wait_for(lambda: "[paused: thread MainThread]" in (out := cli(target.pid, "break", "list").stdout) and out)
    assert "pause true" in listing
    # It resumes after 1 s, and pauses again at the next pass: the hit count grows.
    wait_for(lambda: int(cli(target.pid, "eval", "import sys; sys.modules['rankscope._probe.breakpoints']._handlers[1].hits").stdout) >= 2, timeout=15)
    assert "resumed after 1 s with no debugger" in cli(target.pid, "break", "list").stdout
    none = cli(target.pid, "attach", "--wait", "0.2", "--thread", "nobody")
    assert none.returncode == 1 and "no thread named \"nobody\" paused" in none.stderr


WATCHED = """
import time

def train_step(step, lr):
    lr = lr * 0.5 if step % 3 == 0 else lr  # @decay
    scaled = lr * 2
    return scaled

def train():
    step = 0
    while True:
        step += 1
        train_step(step, 0.1)
        time.sleep(0.005)

print("READY", flush=True)
train()
"""


def test_watch_records_each_change_with_its_line(python, spawn, cli):
    target = spawn(python, WATCHED)
    added = cli(target.pid, "watch", "target.py:train_step", "lr")
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip() == f"watch 1: changes of lr in {target.script}:train_step"
    snaps = wait_for(lambda: len(s := snapshots(cli, target.pid)) >= 2 and s)
    decay = line_of(WATCHED, "decay")
    for snap in snaps:
        assert snap["log"] == f"lr = 0.05 (was 0.1) changed by line {decay}"
        assert snap["changed_by"] == decay and snap["frames"][0]["func"] == "train_step"
        assert snap["frames"][0]["locals"] == [["lr", "0.05", "float"]]
    assert "watch" in cli(target.pid, "break", "list").stdout
    assert cli(target.pid, "break", "clear").returncode == 0


def test_watch_bad_input_changes_nothing(python, spawn, cli):
    target = spawn(python, WATCHED)
    not_local = cli(target.pid, "watch", "target.py:train_step", "nothing")
    assert not_local.returncode == 1
    assert "'nothing' is not a local of train_step (its locals: lr, scaled, step)" in not_local.stderr
    assert "no function 'nope'" in cli(target.pid, "watch", "target.py:nope", "lr").stderr
    assert "a watch is set on a function" in cli(target.pid, "watch", "target.py:3", "lr").stderr
    assert "no loaded code comes from 'elsewhere.py'" in cli(target.pid, "watch", "elsewhere.py:f", "x").stderr
    assert "No breakpoints." in cli(target.pid, "break", "list").stdout


TENSOR = """
import time
import torch

def train_step(weight, step):
    grad = torch.ones(3)
    if step % 2 == 0:
        weight.add_(grad)  # @inplace
    return weight.sum()

def train():
    weight = torch.zeros(3)
    step = 0
    while True:
        step += 1
        train_step(weight, step)
        time.sleep(0.005)

print("READY", flush=True)
train()
"""


def test_watch_a_tensor_records_in_place_changes(python, spawn, cli):
    from conftest import require_torch

    require_torch(python)
    target = spawn(python, TENSOR)
    added = cli(target.pid, "watch", "target.py:train_step", "weight", "--tensor")
    assert added.returncode == 0, added.stderr
    snaps = wait_for(lambda: len(s := snapshots(cli, target.pid)) >= 2 and s)
    inplace = line_of(TENSOR, "inplace")
    for snap in snaps[:2]:
        assert snap["changed_by"] == inplace, snap
        assert "weight changed in place (version " in snap["log"]
        assert "Tensor(shape=[3], dtype=torch.float32" in snap["log"] and "min=" in snap["log"]


COVERED = """
import os, time

def work(i):
    value = i * 2  # @work
    return value

def after():
    return "covered"  # @after

print("READY", flush=True)
i = 0
while not os.path.exists("stop"):
    i += 1
    work(i)
    if os.path.exists("go"):
        after()
    time.sleep(0.005)
"""


def test_coverage_keeps_working_beside_breakpoints(python, spawn, cli):
    import subprocess

    has_coverage = subprocess.run([python, "-c", "import coverage"], capture_output=True).returncode == 0
    if not has_coverage:
        pytest.skip(f"coverage is not installed for {python} (scripts/test installs it)")
    target = spawn(python, COVERED, runner=["-m", "coverage", "run", "--data-file=cov.data"])
    added = cli(target.pid, "break", "add", f"target.py:{line_of(COVERED, 'work')}", "--max", "3")
    assert added.returncode == 0, added.stderr
    wait_for(lambda: len(snapshots(cli, target.pid)) == 3)
    workdir = target.script.parent
    (workdir / "go").write_text("")
    time.sleep(0.2)
    (workdir / "stop").write_text("")
    assert target.proc.wait(timeout=30) == 0, target.proc.stderr.read().decode()
    report = subprocess.run([python, "-m", "coverage", "report", "-m", "--data-file=cov.data"], cwd=workdir, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    # Lines run after the breakpoint came and went were still recorded.
    missing = report.stdout.strip().splitlines()[-1].split()[-1]
    assert str(line_of(COVERED, "after")) not in missing.split(","), report.stdout


def test_a_breakpoint_in_a_torch_program_warns_nothing_into_it(python, spawn, cli):
    # Finding the functions to arm asked every object's __class__: torch's
    # deprecated reduce_op answered with a FutureWarning in the program's
    # stderr, and under -W error every breakpoint failed.
    from conftest import require_torch

    require_torch(python)
    # Warnings made errors once torch is in (torch's own import may warn
    # where numpy is missing).
    source = "import warnings\nimport torch.distributed\nwarnings.simplefilter('error')\n" + LOOP
    target = spawn(python, source)
    added = cli(target.pid, "break", "add", f"target.py:{line_of(source, 'body')}", "--max", "1")
    assert added.returncode == 0, added.stderr
    watched = cli(target.pid, "watch", "target.py:train", "loss")
    assert watched.returncode == 0, watched.stderr
    assert cli(target.pid, "break", "clear").returncode == 0
    target.proc.kill()
    target.proc.wait()
    # (torch's own import may warn, where numpy is missing: that is the program's.)
    said = target.proc.stderr.read().decode()
    assert "reduce_op" not in said and "rankscope" not in said, said
