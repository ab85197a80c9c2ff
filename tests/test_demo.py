"""The README's first command: `rankscope demo` on a real sample program."""

import sys


def test_demo_walks_through_every_command_on_a_live_sample(cli):
    result = cli("demo", env={"RANKSCOPE_PYTHON": sys.executable}, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr  # tracebacks go to stderr, as for a user
    for expected in [
        "$ rankscope list",
        '"data-loader" (daemon',
        "train_step (",
        "model_cfg = {'layers': 4",
        "hello from inside\n(4, 0.0003)",
        "ZeroDivisionError: division by zero",
        "| backtrace",
        "| DEMO_API_TOKEN | <hidden>",
        "$ rankscope {pid} break add demo.py:forward --max 3",
        "snapshot 3: breakpoint 1, hit 3",
        "        weights = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, ... 26 more] (len=32)",
    ]:
        expected = expected.replace("{pid}", out.split("runs as PID ", 1)[1].split()[0]) if "{pid}" in expected else expected
        assert expected in out, f"{expected!r} missing from the demo's output"
    assert "s3cr3t" not in out
