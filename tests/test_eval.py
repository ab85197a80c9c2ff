"""Eval and repl: code runs in the target's __main__, output comes back here."""

import threading

from conftest import query_json  # noqa: F401

COUNTER = """
import time
model_cfg = {"layers": 4, "hidden": 256}
counter = 41
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def test_eval_returns_value_and_output_here_not_in_the_target(python, spawn, cli):
    target = spawn(python, COUNTER)
    result = cli(target.pid, "eval", "print('side effect'); import sys; print('err', file=sys.stderr); len(model_cfg)")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "side effect\n2\n"
    assert result.stderr == "err\n"
    target.kill()
    target_stdout = "".join(target.output)
    assert "side effect" not in target_stdout


def test_eval_sees_and_changes_main_state_across_calls(python, spawn, cli):
    target = spawn(python, COUNTER)
    first = cli(target.pid, "eval", "counter += 1; counter")
    second = cli(target.pid, "eval", "counter")
    assert (first.stdout, second.stdout) == ("42\n", "42\n")
    defined = cli(target.pid, "eval", "def double(x):\n    return 2 * x")
    assert defined.returncode == 0 and defined.stdout == ""
    assert cli(target.pid, "eval", "double(counter)").stdout == "84\n"


def test_eval_exception_comes_back_as_traceback_with_nonzero_exit(python, spawn, cli):
    target = spawn(python, COUNTER)
    result = cli(target.pid, "eval", "model_cfg['missing']")
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "KeyError: 'missing'" in result.stderr
    assert "evaluate.py" not in result.stderr, "probe frames leak into the user's traceback"
    assert target.alive()


def test_eval_syntax_error_is_reported_and_harmless(python, spawn, cli):
    target = spawn(python, COUNTER)
    result = cli(target.pid, "eval", "def broken(:")
    assert result.returncode == 1
    assert "SyntaxError" in result.stderr
    assert cli(target.pid, "eval", "counter").stdout == "41\n"


def test_eval_timeout_interrupts_runaway_code_and_the_target_lives(python, spawn, cli):
    target = spawn(python, COUNTER)
    result = cli(target.pid, "eval", "while True: pass", "--timeout", "1")
    assert result.returncode == 1
    assert "interrupted after 1s" in result.stderr
    assert target.alive()
    assert cli(target.pid, "eval", "counter").stdout == "41\n"


def test_eval_system_exit_does_not_end_the_target(python, spawn, cli):
    target = spawn(python, COUNTER)
    result = cli(target.pid, "eval", "raise SystemExit(3)")
    assert result.returncode == 1
    assert "SystemExit" in result.stderr
    assert target.alive()


READS_STDIN = """
import sys, time
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def test_exit_in_an_eval_is_refused_and_leaves_the_programs_stdin_open(python, spawn, cli):
    # site's exit() closes sys.stdin before it raises SystemExit: the
    # program's stdin was closed, and its next read failed.
    target = spawn(python, READS_STDIN)
    for code in ("exit()", "quit(3)"):
        result = cli(target.pid, "eval", code)
        assert result.returncode == 1 and "closes the program's sys.stdin" in result.stderr, result.stderr
    assert cli(target.pid, "eval", "sys.stdin.closed").stdout == "False\n"
    # A name of the program's own called exit is its own.
    assert cli(target.pid, "eval", "exit = lambda: 'mine'").returncode == 0
    assert cli(target.pid, "eval", "exit()").stdout == "'mine'\n"


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def test_an_eval_that_prints_without_end_keeps_a_bounded_part_and_says_so(python, spawn, cli):
    # All of it was kept while the eval ran: 1.8 GB of the target's memory
    # for a reply that carries 1 MiB.
    target = spawn(python, COUNTER)
    before = peak_rss_kb(target.pid)
    result = cli(target.pid, "eval", "--timeout", "2", "while True: print('x' * 100000)")
    assert result.returncode == 1 and "interrupted after 2s" in result.stderr, result.stderr[-500:]
    assert len(result.stdout) <= (1 << 20) + 1000, len(result.stdout)
    assert "was cut at 1048576 characters" in result.stderr, result.stderr[-500:]
    grown = peak_rss_kb(target.pid) - before
    assert grown < 64_000, f"the target's peak RSS grew {grown} kB"
    assert target.alive()


def test_eval_from_file(python, spawn, cli, tmp_path):
    target = spawn(python, COUNTER)
    code = tmp_path / "snippet.py"
    code.write_text("total = sum(range(counter))\ntotal\n")
    result = cli(target.pid, "eval", "--file", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{sum(range(41))}\n"


def test_repl_keeps_state_and_accepts_multiline_blocks(python, spawn, cli):
    target = spawn(python, COUNTER)
    session = "x = 5\nfor i in range(2):\n    x += i\n\nx * 10\nmodel_cfg['hidden']\n"
    result = cli(target.pid, "repl", input=session)
    assert result.returncode == 0, result.stderr
    assert "60\n" in result.stdout
    assert "256\n" in result.stdout


# A main thread that keeps taking the GIL back: it lets it go for a moment
# (as file I/O does) and takes it again before a waiter runs.
BUSY_LOOP = """
import os
print("READY", flush=True)
n = 0
while True:
    n += 1
    if n % 500 == 0:
        os.path.exists("/nonexistent")
{extra}"""
PRINTER = BUSY_LOOP.format(extra='    if n % 5000 == 0:\n        print("tick", n, flush=True)\n')
BUSY = BUSY_LOOP.format(extra="")


def test_evals_that_end_while_the_program_prints_leave_it_running(python, spawn, cli):
    """GIVEN a busy program that prints all the time from its main thread,
    WHEN evals that print start and end over and over,
    THEN the program keeps running and its own output stays its own.
    print() holds a borrowed reference to sys.stdout while it writes: the
    stream the probe puts there for an eval's capture must outlive the eval
    (it did not, and the program segfaulted within a few evals)."""
    target = spawn(python, PRINTER)
    printed: list[bytes] = []
    drain = threading.Thread(target=lambda: printed.extend(iter(target.proc.stdout.readline, b"")), daemon=True)
    drain.start()
    for i in range(20):
        result = cli(target.pid, "eval", f"print('eval {i}'); sum(range(2_000_000))")
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"eval {i}\n1999999000000\n", result.stdout
        assert target.proc.poll() is None, f"the program died (exit {target.proc.returncode}) after eval {i}"
    target.proc.kill()
    drain.join(timeout=10)
    # The kill may cut the last print between its pieces (`-u`: print
    # writes "tick", " ", the number and the newline one by one): a line
    # without its newline is the kill's, and is left out.
    lines = [line.decode(errors="replace")[:-1] for line in printed if line.endswith(b"\n")]
    assert len(lines) > 10, lines
    assert all(line.startswith("tick ") for line in lines), [x for x in lines if not x.startswith("tick ")][:5]


def test_an_eval_that_sleeps_does_not_make_the_busy_program_step_aside(python, spawn, cli):
    """GIVEN a program whose main thread keeps taking the GIL back (the case
    the probe's nudger exists for), WHEN an eval sleeps for a second,
    THEN the main thread is not parked for it: the eval is not waiting for
    the GIL, so stepping aside would only cost the program. (It was parked
    about seven times, at each step of the nudger's back-off.)"""
    target = spawn(python, BUSY)
    parks = "__import__('rankscope._native', fromlist=['_']).gil_parks()"
    before = cli(target.pid, "eval", parks)
    assert before.returncode == 0, before.stderr
    slept = cli(target.pid, "eval", "__import__('time').sleep(1.0)")
    assert slept.returncode == 0, slept.stderr
    after = cli(target.pid, "eval", parks)
    assert after.returncode == 0, after.stderr
    # Getting the GIL for each eval may take a park or two; a sleep, none.
    assert int(after.stdout) - int(before.stdout) <= 3, (before.stdout, after.stdout)
