"""`rankscope PID repl` in a real terminal (a pty, as a person uses it):
pasted blocks, Ctrl-C while code runs, Ctrl-C at the prompt, Ctrl-D."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time

import pytest

TARGET = """
import time
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")
PASTE_START, PASTE_END = b"\x1b[200~", b"\x1b[201~"


class Terminal:
    """The REPL on the slave side of a pty, as its controlling terminal, so
    that Ctrl-C is turned into SIGINT by the line discipline as in a shell."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))

        def controlling_tty():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=controlling_tty)
        os.close(slave)
        self.raw = b""
        self.seen = 0  # what expect() has consumed

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def text(self) -> str:
        return ANSI.sub(b"", self.raw).decode(errors="replace")

    def expect(self, wanted: str, timeout: float = 20.0) -> str:
        """Waits for `wanted` after what the last expect consumed; returns the
        text between."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            at = text.find(wanted, self.seen)
            if at >= 0:
                between = text[self.seen : at]
                self.seen = at + len(wanted)
                return between
            left = deadline - time.monotonic()
            assert left > 0, f"no {wanted!r} in the terminal; it shows:\n{text[self.seen:]}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: the REPL exited and closed the pty
                    chunk = b""
                if not chunk:
                    assert False, f"the REPL exited (rc={self.proc.wait()}) before {wanted!r}:\n{text[self.seen:]}"
                self.raw += chunk

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        os.close(self.master)


@pytest.fixture
def repl(rankscope_bin, endpoint_dir, tmp_path):
    """repl(pid) -> a Terminal at the REPL's first prompt."""
    started: list[Terminal] = []

    def _repl(pid: int) -> Terminal:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
        env.update(RANKSCOPE_DIR=endpoint_dir, TERM="xterm", HOME=str(tmp_path))  # history goes to tmp_path
        terminal = Terminal([rankscope_bin, str(pid), "repl"], env)
        started.append(terminal)
        terminal.expect("Ctrl-D leaves.")
        terminal.expect(">>> ")
        return terminal

    yield _repl
    for terminal in started:
        terminal.close()


def eval_in(cli, pid: int, code: str) -> str:
    result = cli(pid, "eval", code)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def wait_for_global(cli, pid: int, name: str) -> None:
    """Polls the target (from another connection) until the REPL's code has set `name`."""
    deadline = time.monotonic() + 20
    while eval_in(cli, pid, f"{name!r} in globals()") != "True":
        assert time.monotonic() < deadline, f"the REPL's code never set {name}"
        time.sleep(0.05)


@pytest.mark.parametrize("bracketed", [False, True], ids=["plain-paste", "bracketed-paste"])
def test_a_pasted_block_runs_every_line_in_order(python, spawn, cli, repl, bracketed):
    target = spawn(python, TARGET)
    terminal = repl(target.pid)
    lines = b"a = 40\rb = a + 2\rprint(b)\r"
    if bracketed:
        assert "\x1b[?2004h" in terminal.raw.decode(errors="replace"), "the REPL should turn bracketed paste on"
        # The paste arrives as one edit; the Enter after it runs it.
        terminal.write(PASTE_START + lines + PASTE_END)
        terminal.write(b"\r")
    else:
        terminal.write(lines)
    terminal.expect("42\n")
    terminal.expect(">>> ")
    assert eval_in(cli, target.pid, "(a, b)") == "(40, 42)"


@pytest.mark.parametrize("bracketed", [False, True], ids=["plain-paste", "bracketed-paste"])
def test_a_pasted_multiline_block_still_works(python, spawn, cli, repl, bracketed):
    target = spawn(python, TARGET)
    terminal = repl(target.pid)
    block = b"def double(x):\r    return 2 * x\r\rtotal = 0\rfor i in range(4):\r    total += double(i)\r\rprint('total', total)\r"
    terminal.write(PASTE_START + block + PASTE_END + b"\r" if bracketed else block)
    terminal.expect("total 12\n")
    terminal.expect(">>> ")
    assert eval_in(cli, target.pid, "double(21), total") == "(42, 12)"


def test_ctrl_c_interrupts_running_code_and_the_session_goes_on(python, spawn, cli, repl):
    target = spawn(python, TARGET)
    terminal = repl(target.pid)
    terminal.write(b"spins = 0\rwhile True:\r    spins += 1\r\r")
    deadline = time.monotonic() + 20
    while eval_in(cli, target.pid, "globals().get('spins', 0)") == "0":
        assert time.monotonic() < deadline, "the loop never started"
        time.sleep(0.05)
    terminal.write(b"\x03")
    shown = terminal.expect("KeyboardInterrupt\n")
    assert "Traceback (most recent call last):" in shown and "<rankscope-eval-" in shown
    assert "spins += 1" in shown  # the line it was running
    terminal.expect(">>> ")
    terminal.write(b"spins > 0\r")
    terminal.expect("True\n")
    # The program itself never saw it.
    assert target.alive()
    assert eval_in(cli, target.pid, "import threading; threading.main_thread().is_alive()") == "True"


def test_ctrl_c_on_code_blocked_in_c_says_so_and_a_second_one_gives_the_prompt_back(python, spawn, cli, repl):
    """No Python can wake a C call (here time.sleep) in a thread other than
    the main one: the REPL says so, a second Ctrl-C gives the prompt back,
    and KeyboardInterrupt lands in the target as soon as the call returns."""
    target = spawn(python, TARGET)
    terminal = repl(target.pid)
    started = time.monotonic()
    terminal.write(b"import time\r")
    terminal.expect(">>> ")
    terminal.write(b"try:\r    sleeping = True\r    time.sleep(8)\r    woke_up = True\rfinally:\r    ended = True\r\r")
    wait_for_global(cli, target.pid, "sleeping")
    terminal.write(b"\x03")
    terminal.expect("blocked in a call into C")
    terminal.write(b"\x03")
    terminal.expect("stopped waiting")
    terminal.expect(">>> ")
    assert time.monotonic() - started < 8, "the prompt should come back before the sleep ends"
    terminal.write(b"6 * 7\r")
    terminal.expect("42\n")
    wait_for_global(cli, target.pid, "ended")
    assert eval_in(cli, target.pid, "'woke_up' in globals()") == "False"
    assert target.alive()


def test_ctrl_c_at_the_prompt_clears_the_line_and_ctrl_d_leaves(python, spawn, cli, repl):
    target = spawn(python, TARGET)
    terminal = repl(target.pid)
    terminal.write(b"undefined_name_here")
    terminal.expect("undefined_name_here")
    terminal.write(b"\x03")
    terminal.expect("KeyboardInterrupt")
    terminal.expect(">>> ")
    terminal.write(b"1 + 1\r")
    terminal.expect("2\n")
    terminal.expect(">>> ")
    # Ctrl-C in the middle of a block drops the block.
    terminal.write(b"for i in range(3):\r")
    terminal.expect("... ")
    terminal.write(b"\x03")
    terminal.expect(">>> ")
    terminal.write(b"'i' in globals()\r")
    terminal.expect("False\n")
    # Keys typed while an eval runs meet a cooked terminal: wait for the prompt.
    terminal.expect(">>> ")
    terminal.write(b"\x04")
    assert terminal.proc.wait(timeout=10) == 0
    assert target.alive()


def test_exit_leaves_the_repl_and_the_target_keeps_its_stdin(python, spawn, cli, repl):
    # Sent to the target, site's exit() closed its sys.stdin.
    target = spawn(python, TARGET)
    terminal = repl(target.pid)
    terminal.write(b"exit()\r")
    assert terminal.proc.wait(timeout=10) == 0
    assert cli(target.pid, "eval", "__import__('sys').stdin.closed").stdout == "False\n"


def test_a_target_that_holds_the_gil_does_not_hang_the_prompt(default_python, spawn, repl):
    target = spawn(default_python, "import ctypes\nprint('READY', flush=True)\nctypes.PyDLL(None).sleep(120)\n")
    terminal = repl(target.pid)  # metadata is served without the GIL
    started = time.monotonic()
    terminal.write(b"1 + 1\r")
    terminal.expect("did not answer")
    terminal.expect(">>> ")
    assert time.monotonic() - started < 15
    terminal.write(b"\x04")
    assert terminal.proc.wait(timeout=10) == 0
