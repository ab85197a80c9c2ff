"""`bt --native` and native rows in SQL: C frames interleaved with Python
frames where the interpreter called into them."""

import json

import pytest

from conftest import line_of

IN_C = """
import ctypes, time

def stuck_in_c():
    ctypes.CDLL(None).sleep(30)  # @call

print("READY", flush=True)
stuck_in_c()  # @outer
"""


def native_or_skip(result):
    if "built without native unwinding" in result.stderr:
        pytest.skip("this build has no native unwinding (libunwind-dev was missing)")
    assert result.returncode == 0, result.stderr
    return result


def test_native_frames_are_merged_where_python_called_into_c(python, spawn, cli):
    target = spawn(python, IN_C, probe=False)
    out = native_or_skip(cli(target.pid, "bt", "--native")).stdout
    lines = [line.strip() for line in out.splitlines()]
    sleep = lines.index("[native] sleep in libc.so.6")
    # Python frames carry the numbers `eval --frame` takes; native ones none.
    call = lines.index(f"#0  stuck_in_c ({target.script}:{line_of(IN_C, 'call')})")
    outer = lines.index(f"#1  <module> ({target.script}:{line_of(IN_C, 'outer')})")
    # Innermost first: libc's sleep, ctypes' C code, then the Python caller.
    assert sleep < call < outer
    between = lines[sleep + 1 : call]
    assert any("ffi_call" in line for line in between), between
    assert all(line.startswith("[native]") for line in between), between


def test_native_on_a_probed_process(default_python, spawn, cli):
    target = spawn(default_python, IN_C)
    result = native_or_skip(cli(target.pid, "bt", "--native"))
    assert "[native] sleep in libc.so.6" in result.stdout
    assert "read from outside" not in result.stderr


def test_native_rows_in_sql(default_python, spawn, cli):
    target = spawn(default_python, IN_C)
    sql = "SELECT depth, frame_type, func FROM python.backtrace WHERE thread_name = 'MainThread' ORDER BY depth"
    rows = json.loads(native_or_skip(cli(target.pid, "query", "--native", sql, "--format", "json")).stdout)
    kinds = {r["func"]: r["frame_type"] for r in rows}
    assert kinds["sleep"] == "Native" and kinds["stuck_in_c"] == "Python"
    assert [r["depth"] for r in rows] == list(range(len(rows)))

    plain = json.loads(cli(target.pid, "query", sql, "--format", "json").stdout)
    assert {r["frame_type"] for r in plain} == {"Python"}
