"""`rankscope PID profile`: a live process sampled from outside for a while,
written as a flame graph (SVG), speedscope, a Chrome/Perfetto trace, folded
stacks and a top table; each output parsed back and checked for what a user
looks for: the hot function, the idle thread, a thread stuck holding the
GIL, and a process with no probe at all."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import assert_slices_nest, require_torch

WORKLOAD = """
import re, sys, threading, time

def burn(n):
    total = 0
    for i in range(n):
        total += i * i
    return total

def napper():
    while True:
        time.sleep(0.05)

def stuck():
    # A regular expression that backtracks for minutes: one C call that
    # holds the GIL the whole time.
    re.match(r"(a+)+$", "a" * 40 + "b")

threading.Thread(target=napper, name="napper", daemon=True).start()
print("READY", flush=True)
if "--stuck" in sys.argv:
    threading.Thread(target=stuck, name="stuck", daemon=True).start()
while True:
    burn(20000)
"""


def profile(cli, pid, *args, timeout=60):
    result = cli(pid, "profile", "--duration", "1.5", *args, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result


def folded_counts(path) -> dict[str, int]:
    counts = {}
    for line in path.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        counts[stack] = int(count)
    return counts


def test_the_hot_function_dominates_in_every_format(python, spawn, cli, tmp_path, speedscope_schema):
    target = spawn(python, WORKLOAD)
    out = tmp_path / "p.folded"
    done = profile(cli, target.pid, "-o", out)
    assert re.search(r"wrote .*p\.folded \(folded stacks\): \d+ samples over 1\.\d s", done.stdout), done.stdout
    counts = folded_counts(out)
    main = {s: c for s, c in counts.items() if s.startswith(f"pid {target.pid};MainThread ({target.pid});")}
    hot = sum(c for s, c in main.items() if ";burn (script.py:" in s or "burn (" in s.rsplit(";", 1)[-1])
    assert sum(main.values()) >= 20 and hot / sum(main.values()) > 0.8, main
    napping = {s: c for s, c in counts.items() if ";napper (" in s}
    # Between two sleeps it runs Python for a moment: most samples, not all, are idle.
    idle = sum(c for s, c in napping.items() if s.endswith(" [idle]"))
    assert napping and idle / sum(napping.values()) > 0.8, napping
    assert not any("rankscope-" in s or "/_probe/" in s for s in counts), "the probe's own threads and frames are left out"

    bare = tmp_path / "bare.folded"
    profile(cli, target.pid, "-o", bare, "--no-prefix", "--no-lines", "--no-idle")
    lines = bare.read_text().splitlines()
    assert lines and not any(line.startswith("pid ") or "[idle]" in line for line in lines), lines[:5]
    assert any(line.startswith("<module> (") and "burn (" in line and ":" not in line.split(" (")[1] for line in lines), lines[:5]

    top = profile(cli, target.pid, "--top", "3").stdout
    rows = top.splitlines()
    assert re.match(rf"pid {target.pid}: \d+ samples of 2 threads over 1\.\d s at 100 Hz \(\d+ idle\)", rows[0]), top
    assert rows[1].split() == ["self%", "total%", "function"], top
    first = rows[2].split()
    assert first[2:] == ["burn", f"({target.script.name})"] or first[2:4] == ["sleep", "(time)"] or "napper" in rows[2], top
    assert 3 <= len(rows) <= 5, top  # --top 3: at most three functions

    svg = tmp_path / "p.svg"
    profile(cli, target.pid, "-o", svg)
    root = ET.fromstring(svg.read_bytes())
    assert root.tag.endswith("svg")
    titles = [t.text or "" for t in root.iter() if t.tag.endswith("title")]
    assert any(t.startswith("burn (") for t in titles), titles[:10]

    scope = tmp_path / "p.speedscope.json"
    profile(cli, target.pid, "-o", scope)
    data = json.loads(scope.read_text())
    assert data["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    # What speedscope itself publishes as its file format.
    speedscope_schema.validate(data)
    frames = data["shared"]["frames"]
    assert all(type(f["name"]) is str for f in frames)
    names = [p["name"] for p in data["profiles"]]
    assert names[-1] == f"pid {target.pid} · all threads" and any("MainThread" in n for n in names) and any("napper" in n for n in names), names
    for p in data["profiles"]:
        assert p["type"] == "sampled" and p["unit"] == "seconds" and len(p["samples"]) == len(p["weights"]) > 0
        assert all(0 <= i < len(frames) for s in p["samples"] for i in s)
        assert abs(p["endValue"] - sum(p["weights"])) < 1e-6

    trace = tmp_path / "p.json"
    profile(cli, target.pid, "-o", trace)
    events = json.loads(trace.read_text())["traceEvents"]
    meta = {(e["name"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", 0)] == f"pid {target.pid}", meta
    assert meta[("thread_name", target.pid)] == f"MainThread ({target.pid})", meta
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(e["dur"] >= 0 and e["pid"] == target.pid and isinstance(e["ts"], (int, float)) for e in slices)
    assert_slices_nest(events)
    burns = [e for e in slices if e["name"].startswith("burn (") and e["tid"] == target.pid]
    outer = [e for e in slices if e["name"].startswith("<module> (") and e["tid"] == target.pid]
    # Frames nest: the module's slices hold the calls made from it.
    assert burns and outer and sum(e["dur"] for e in outer) >= sum(e["dur"] for e in burns) * 0.9


def test_a_thread_holding_the_gil_in_c_is_still_profiled(python, spawn, cli, tmp_path):
    target = spawn(python, WORKLOAD, args=["--stuck"])
    out = tmp_path / "gil.folded"
    profile(cli, target.pid, "-o", out, "--gil")
    counts = folded_counts(out)
    stuck = sum(c for s, c in counts.items() if ";stuck (" in s)
    assert stuck >= 20 and stuck / sum(counts.values()) > 0.8, counts


def test_the_profile_is_a_table_live_and_after_the_process_is_gone(python, spawn, cli, tmp_path):
    run = tmp_path / "run"
    target = spawn(python, WORKLOAD, env={"RANKSCOPE_RUN_DIR": str(run)})
    done = profile(cli, target.pid, "--top", "1")
    assert f"python.profile: kept in {run}/tables/profile" in done.stderr, done.stderr
    sql = "SELECT thread, func, sum(samples) AS n FROM python.profile WHERE NOT idle GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 1"
    live = cli(target.pid, "query", sql, "--format", "json")
    assert live.returncode == 0, live.stderr
    [top] = json.loads(live.stdout)
    assert (top["thread"], top["func"]) == ("MainThread", "burn") and top["n"] >= 20, top
    # One row per stack and thread: the stack is folded text, outermost first.
    stacks = json.loads(cli(target.pid, "query", "SELECT stack, depth, idle FROM python.profile WHERE thread = 'napper'", "--format", "json").stdout)
    assert stacks and all(r["stack"].count(";") == r["depth"] - 1 and "napper (" in r["stack"] for r in stacks), stacks
    assert any(r["idle"] for r in stacks), stacks
    target.kill()  # SIGKILL: the table was written by the CLI, not by the process
    after = cli("query", "--run", run, "SELECT pid, func, sum(samples) AS n FROM python.profile WHERE NOT idle GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 1", "--format", "json")
    assert after.returncode == 0, after.stderr
    assert [(r["pid"], r["func"]) for r in json.loads(after.stdout)] == [(target.pid, "burn")], after.stdout


PHASES = """
import os, sys, time

def phase_a():
    sum(i * i for i in range(2000))

def phase_b():
    sum(i * i for i in range(2000))

flag = sys.argv[1]
print("READY", flush=True)
while not os.path.exists(flag):
    phase_a()
print("B", flush=True)
while True:
    phase_b()
"""


def test_the_live_table_is_the_last_profile_and_the_run_store_keeps_them_all(python, spawn, cli, tmp_path):
    # The issue's own query summed every profile ever taken of the PID.
    run, flag = tmp_path / "run", tmp_path / "flag"
    target = spawn(python, PHASES, args=[str(flag)], env={"RANKSCOPE_RUN_DIR": str(run)})
    profile(cli, target.pid, "--top", "1")
    flag.touch()
    target.wait_for_line("B")
    profile(cli, target.pid, "--top", "1")
    sql = "SELECT func, sum(samples) AS n FROM python.profile WHERE func IN ('phase_a', 'phase_b') GROUP BY 1 ORDER BY 1"
    live = cli(target.pid, "query", sql, "--format", "json")
    assert live.returncode == 0, live.stderr
    assert [r["func"] for r in json.loads(live.stdout)] == ["phase_b"], live.stdout
    kept = cli("query", "--run", run, sql, "--format", "json")
    assert [r["func"] for r in json.loads(kept.stdout)] == ["phase_a", "phase_b"], kept.stdout


def test_a_process_that_exits_while_profiled_keeps_its_profile_in_its_run_directory(python, spawn, cli, tmp_path):
    # Its run directory was read from its environment after sampling: gone
    # with it, so the profile went to the default run directory.
    run = tmp_path / "run"
    source = 'import time\nprint("READY", flush=True)\nend = time.time() + 1\nwhile time.time() < end:\n    sum(i * i for i in range(1000))\n'
    target = spawn(python, source, probe=False, env={"RANKSCOPE_RUN_DIR": str(run)})
    done = cli(target.pid, "profile", "--duration", "5", "--top", "1")
    assert done.returncode == 0, done.stderr
    assert f"python.profile: kept in {run}/tables/profile" in done.stderr, done.stderr
    kept = cli("query", "--run", run, "SELECT pid, sum(samples) AS n FROM python.profile GROUP BY 1", "--format", "json")
    [row] = json.loads(kept.stdout)
    assert row["pid"] == target.pid and row["n"] > 10, row


def test_a_low_rate_ends_at_the_duration_asked(python, spawn, cli):
    # The last tick's whole interval was waited out: 1.0 s for 0.3 s asked.
    target = spawn(python, WORKLOAD, probe=False)
    started = time.monotonic()
    done = cli(target.pid, "profile", "--duration", "0.3", "--rate", "1", "--top", "1")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert took < 0.9 and "over 0.3 s" in done.stdout, (took, done.stdout)


def test_the_probe_samples_its_own_process_when_asked(python, spawn, cli, tmp_path):
    """GIVEN a probed process (as one where reading its memory from outside
    is refused, or a rank on another machine, would be), WHEN it is profiled
    --inside, THEN its probe samples it without stopping it and hands back
    the fold: the hot function dominates, the probe's own threads and
    frames are left out, and the probe keeps the profile in its run store."""
    run = tmp_path / "run"
    target = spawn(python, WORKLOAD, env={"RANKSCOPE_RUN_DIR": str(run)})
    out = tmp_path / "inside.folded"
    done = profile(cli, target.pid, "--inside", "-o", out)
    assert "through its probe" in done.stderr and "kept by the probe" in done.stderr, done.stderr
    counts = folded_counts(out)
    main = {s: c for s, c in counts.items() if s.startswith(f"pid {target.pid};MainThread ({target.pid});")}
    hot = sum(c for s, c in main.items() if "burn (" in s.rsplit(";", 1)[-1])
    assert sum(main.values()) >= 20 and hot / sum(main.values()) > 0.8, main
    assert any(";napper (" in s for s in counts), counts
    assert not any("rankscope-" in s or "/_probe/" in s for s in counts), "the probe's own threads and frames are left out"
    kept = cli("query", "--run", run, "SELECT pid, func, sum(samples) AS n FROM python.profile WHERE NOT idle GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 1", "--format", "json")
    assert kept.returncode == 0, kept.stderr
    assert [(r["pid"], r["func"]) for r in json.loads(kept.stdout)] == [(target.pid, "burn")], kept.stdout
    assert target.alive()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_ends_a_profile_inside_early_and_still_writes(python, spawn, rankscope_bin, endpoint_dir, tmp_path, stop):
    """GIVEN a probe sampling its own process for a minute (--inside), WHEN
    the user presses Ctrl-C (or `timeout` sends SIGTERM), THEN the probe
    stops at once and the CLI writes what it has, as an outside profile does."""
    target = spawn(python, WORKLOAD)
    out = tmp_path / "early.svg"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    command = subprocess.Popen([rankscope_bin, str(target.pid), "profile", "--inside", "--duration", "60", "-o", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert "Ctrl-C ends early" in command.stderr.readline()
        time.sleep(1.5)  # what is sampled before the Ctrl-C: the profile's content, not a wait for readiness
        started = time.monotonic()
        command.send_signal(stop)
        stdout, stderr = command.communicate(timeout=30)
    finally:
        command.kill()
    assert time.monotonic() - started < 10 and command.returncode == 0, stderr
    wrote = re.match(rf"wrote {re.escape(str(out))} \(flame graph\): (\d+) samples over (\d+\.\d) s", stdout)
    assert wrote and int(wrote.group(1)) > 0 and float(wrote.group(2)) < 10, stdout
    assert "burn (" in out.read_text()
    assert target.alive()


def connection_threads(pid) -> int:
    """The probe's connection threads in `pid`: one per request in progress."""
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "rankscope-conn"
        except OSError:
            pass  # the thread ended
    return count


def test_a_profile_inside_ends_when_the_cli_that_asked_is_killed(python, spawn, rankscope_bin, endpoint_dir, tmp_path):
    """GIVEN a probe sampling its own process for a minute, WHEN the CLI
    that asked is killed (no Ctrl-C reaches the probe), THEN the sampling
    ends within a second or so, rather than going on for nobody."""
    target = spawn(python, WORKLOAD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    command = subprocess.Popen([rankscope_bin, str(target.pid), "profile", "--inside", "--duration", "60", "-o", str(tmp_path / "gone.svg")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert "Ctrl-C ends early" in command.stderr.readline()
        deadline = time.monotonic() + 10
        while connection_threads(target.pid) == 0:
            assert time.monotonic() < deadline, "the probe never began sampling"
            time.sleep(0.05)
    finally:
        command.kill()
        command.wait()
    deadline = time.monotonic() + 10
    while connection_threads(target.pid) > 0:
        assert time.monotonic() < deadline, "the probe samples on for a CLI that is gone"
        time.sleep(0.1)
    assert target.alive()
    # The probe still answers, and can sample again.
    assert cli_profile_inside_works(rankscope_bin, target.pid, env)


def cli_profile_inside_works(rankscope_bin, pid, env) -> bool:
    done = subprocess.run([rankscope_bin, str(pid), "profile", "--inside", "--duration", "0.5", "--top", "3"], capture_output=True, text=True, env=env, timeout=60)
    return done.returncode == 0 and "burn (" in done.stdout


TORCH_LOOP = """
import time
import torch
from torch import nn

torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
print("READY", flush=True)
while True:
    loss = model(torch.randn(32, 64)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(0.02)
"""


def test_each_sample_carries_the_torch_step_while_the_probe_knows_it(python, spawn, cli, tmp_path):
    require_torch(python)
    run = tmp_path / "run"
    # The trace's step clock on from the start: the probe knows the step.
    target = spawn(python, TORCH_LOOP, env={"RANKSCOPE_RUN_DIR": str(run), "RANKSCOPE_TORCH": "trace,every=1000"})
    profile(cli, target.pid, "--top", "1")
    steps = json.loads(cli(target.pid, "query", "SELECT count(DISTINCT step) AS n, min(step) AS first, max(step) AS last FROM python.profile WHERE step IS NOT NULL", "--format", "json").stdout)[0]
    # About 20 ms a step over 1.5 s: dozens of steps, each told to the sampler.
    assert steps["n"] >= 10 and steps["last"] - steps["first"] >= 10, steps
    now = json.loads(cli(target.pid, "torch", "--format", "json").stdout)["step"]
    assert steps["last"] <= now, (steps, now)
    # The Chrome/Perfetto trace has the steps as a lane of their own.
    trace = tmp_path / "steps.json"
    profile(cli, target.pid, "-o", trace)
    events = json.loads(trace.read_text())["traceEvents"]
    lane = [e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == "torch steps"]
    marked = [e for e in events if e["ph"] == "X" and e.get("cat") == "torch" and [e["tid"]] == lane]
    assert len(marked) >= 10 and all(e["name"] == f"step {e['args']['step']}" and e["dur"] > 0 for e in marked), marked[:3]
    numbers = [e["args"]["step"] for e in marked]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers), numbers
    # A step's slice ends where the next begins, at the latest.
    assert_slices_nest(events)

    # Off: the probe knows no step, and the next profile's samples carry none.
    assert cli(target.pid, "torch", "trace", "off").returncode == 0
    profile(cli, target.pid, "--top", "1")
    last = json.loads(cli(target.pid, "query", "SELECT count(step) AS stepped, sum(samples) AS n FROM python.profile WHERE ts = (SELECT max(ts) FROM python.profile)", "--format", "json").stdout)[0]
    assert last["n"] > 0 and last["stepped"] == 0, last


def test_a_process_without_a_probe_is_profiled(python, spawn, cli, tmp_path):
    target = spawn(python, WORKLOAD, probe=False)
    out = tmp_path / "bare.txt"
    profile(cli, target.pid, "-o", out)
    assert "burn (" in out.read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--duration", "0"], "--duration must be a positive number of seconds"),
        (["--rate", "0"], "--rate must be between 1 and 10000"),
        (["--duration", "-1"], "--duration must be a positive number of seconds, not -1"),
        (["--rate", "-5"], "--rate must be between 1 and 10000 samples a second, not -5"),
        (["--rate", "0.05"], "--rate must be between 1 and 10000 samples a second, not 0.05"),
        (["--duration", "1e20"], "--duration must be at most 2592000 seconds (30 days), not 100000000000000000000"),
        (["-o", "p.png"], "cannot tell the format of p.png"),
        (["--idle", "--no-idle"], "--idle and --no-idle contradict each other"),
        (["--native", "--inside"], "--native and --inside do not go together"),
    ],
)
def test_bad_arguments_get_one_line_and_a_hint(python, spawn, cli, args, message):
    target = spawn(python, WORKLOAD)
    result = cli(target.pid, "profile", *args)
    assert result.returncode != 0
    assert message in result.stderr and "hint:" in result.stderr, result.stderr


def test_a_pid_that_is_not_python(cli):
    result = cli("1", "profile", "--duration", "0.5")
    assert result.returncode != 0 and "hint:" in result.stderr, result.stderr


def test_the_kept_profile_of_a_process_without_a_probe_is_read_by_the_command_named(python, spawn, cli, tmp_path):
    """GIVEN a process without a probe, WHEN it is profiled, THEN the command
    the CLI names to read python.profile back works as written."""
    run = tmp_path / "run dir"  # a space: the command must quote it
    target = spawn(python, WORKLOAD, probe=False, env={"RANKSCOPE_RUN_DIR": str(run)})
    done = profile(cli, target.pid, "--top", "1")
    named = re.search(r"^python\.profile: kept in .*\(`(rankscope .*)`\)$", done.stderr, re.M)
    assert named, done.stderr
    words = shlex.split(named.group(1))
    assert words[0] == "rankscope"
    result = cli(*words[1:])
    assert result.returncode == 0, f"{named.group(1)}\n{result.stderr}"
    assert "burn" in result.stdout, result.stdout


def test_an_output_folder_that_is_missing_is_said_before_sampling(python, spawn, cli, tmp_path):
    """GIVEN -o in a folder that does not exist, WHEN a long profile is
    asked for, THEN it fails at once (not after the duration) with one line
    and a hint; a write that still fails says its reason once."""
    target = spawn(python, WORKLOAD)
    started = time.monotonic()
    missing = cli(target.pid, "profile", "--duration", "60", "-o", tmp_path / "missing" / "x.svg", timeout=30)
    assert time.monotonic() - started < 20
    assert missing.returncode != 0
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), missing.stderr
    assert f"no folder {tmp_path / 'missing'}" in lines[0] and "mkdir -p" in lines[1], missing.stderr

    # A folder named like the output, or a folder that takes no new files:
    # also said before sampling, once.
    (tmp_path / "dir.svg").mkdir()
    for path in [tmp_path / "dir.svg", "/proc/x.svg"]:
        started = time.monotonic()
        failed = cli(target.pid, "profile", "--duration", "60", "-o", path, timeout=30)
        assert time.monotonic() - started < 20
        assert failed.returncode != 0
        assert failed.stderr.count("cannot write") == 1 and "hint: " in failed.stderr, failed.stderr
    assert not (tmp_path / "dir.svg" / "x").exists() and list((tmp_path).iterdir()) == [tmp_path / "dir.svg"]


def test_a_pid_that_does_not_exist_is_named_plainly(python, spawn, cli):
    target = spawn(python, WORKLOAD, probe=False)
    pid = target.pid
    target.kill()  # reaped: the PID is free
    result = cli(pid, "profile", "--duration", "0.5")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"error: no process with PID {pid}", result.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: "), result.stderr


GIL_SLEEPER = """
import ctypes, threading, time

def hold():
    while True:
        ctypes.PyDLL(None).usleep(200000)  # PyDLL keeps the GIL while C sleeps

threading.Thread(target=hold, name="holder", daemon=True).start()
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def test_gil_and_idle_together_find_a_thread_that_waits_holding_the_gil(python, spawn, cli, tmp_path):
    """--gil and --idle are not exclusive: a thread blocked in C without
    letting the GIL go is both, and is what the two together find. Where no
    sample is both, the CLI says so rather than print an empty profile."""
    target = spawn(python, GIL_SLEEPER)
    out = tmp_path / "held.folded"
    profile(cli, target.pid, "--gil", "--idle", "-o", out)
    counts = folded_counts(out)
    held = sum(c for s, c in counts.items() if ";hold (" in s)
    assert held >= 20 and held / sum(counts.values()) > 0.8, counts
    # It stalls every other thread: --no-idle keeps it (it left only the
    # main thread's moments between its sleeps).
    busy_only = tmp_path / "busy.folded"
    profile(cli, target.pid, "--no-idle", "-o", busy_only)
    assert any(";hold (" in s for s in folded_counts(busy_only)), folded_counts(busy_only)

    # One thread, always running: never idle while it holds the GIL.
    busy = spawn(python, 'print("READY", flush=True)\nwhile True:\n    sum(i * i for i in range(1000))\n', probe=False)
    done = profile(cli, busy.pid, "--gil", "--idle", "--top", "3")
    assert re.search(r"note: --gil --idle left none of the \d+ samples", done.stderr), done.stderr


THREADS_ONE_AFTER_ANOTHER = """
import sys, threading, time


def work(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


print("READY", flush=True)
n = 0
while True:
    # One thread at a time: the system hands each the last one's id, and
    # each is started while the main thread's stack is in `join`.
    t = threading.Thread(target=work, args=(0.05,), name=f"worker-{n}")
    t.start()
    t.join()
    n += 1
"""


def test_each_thread_keeps_its_own_name_where_its_id_was_another_threads(python, spawn, cli, tmp_path):
    target = spawn(python, THREADS_ONE_AFTER_ANOTHER)
    out = tmp_path / "threads.folded"
    profile(cli, target.pid, "-o", out)
    counts = folded_counts(out)
    # pid N;worker-7 (OS id);work (...)...: each OS thread has one name, and the names differ.
    named: dict[str, set] = {}
    for stack in counts:
        thread = stack.split(";")[1]
        name, _, os_id = thread.rpartition(" (")
        named.setdefault(os_id, set()).add(name)
    workers = {os_id: names for os_id, names in named.items() if any(n.startswith("worker-") for n in names)}
    assert len(workers) >= 5, named
    assert all(len(names) == 1 for names in workers.values()), workers
    assert len({next(iter(names)) for names in workers.values()}) == len(workers), workers
    # A thread being started is not a sample of the main thread with no frame.
    assert not [s for s in counts if s.count(";") == 1], [s for s in counts if s.count(";") == 1]


# Steps of about a millisecond, every tenth with 50 ms in `marker`: the
# samples taken in `marker` carry that slow step's number, the one
# `python.torch_steps` gives it (not the step last told, up to ten back).
SLOW_EVERY_TENTH = """
import time
import torch
from torch import nn

torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

def marker():
    start = time.perf_counter()
    while time.perf_counter() - start < 0.05:
        pass

print("READY", flush=True)
it = 0
while True:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    if it % 10 == 0:
        marker()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    it += 1
"""


def test_samples_carry_the_step_they_were_taken_in(python, spawn, cli):
    require_torch(python)
    target = spawn(python, SLOW_EVERY_TENTH, env={"RANKSCOPE_TORCH": "trace,every=1000"})
    profile(cli, target.pid, "--top", "1")
    slow = {r["step"] for r in json.loads(cli(target.pid, "query", "SELECT step FROM python.torch_steps WHERE step_ms > 30", "--format", "json").stdout)}
    tagged = json.loads(cli(target.pid, "query", "SELECT step, sum(samples) AS n FROM python.profile WHERE func = 'marker' GROUP BY step", "--format", "json").stdout)
    total = sum(r["n"] for r in tagged)
    assert total >= 50 and slow, (tagged, slow)
    # (A sample read across a boundary may carry the step before.)
    inside = sum(r["n"] for r in tagged if r["step"] in slow)
    assert inside >= 0.9 * total, (tagged, sorted(slow)[-10:])


# A target that ends while its own probe samples it: the profile is what
# was taken until then, written, not lost with the connection.
ENDS_SOON = """
import time

def burn(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(500))

print("READY", flush=True)
burn(1.5)
"""


def test_a_target_that_exits_while_it_samples_itself_still_gives_its_profile(python, spawn, cli, tmp_path):
    target = spawn(python, ENDS_SOON)
    out = tmp_path / "ended.folded"
    started = time.monotonic()
    done = cli(target.pid, "profile", "--inside", "--duration", "30", "-o", out, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 20, "the sampling went on after the process ended"
    counts = {}
    for line in out.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        counts[stack] = int(n)
    assert sum(n for s, n in counts.items() if "burn" in s) >= 20, counts
    assert target.proc.wait(timeout=30) == 0
