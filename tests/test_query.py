"""SQL over the live process: python.backtrace, python.threads, process.*."""

import json
import os
import socket
import subprocess
import time

from conftest import line_of, query_json

TARGET = """
import os, threading, time
os.environ["MY_API_TOKEN"] = "hunter2"
os.environ["PLAIN_SETTING"] = "visible"

def leaf():
    print("READY", flush=True)
    while True:
        time.sleep(0.05)  # @leaf

def middle():
    leaf()

threading.Thread(target=lambda: time.sleep(3600), name="sleeper", daemon=True).start()
middle()
"""


def test_backtrace_query_filters_on_depth(python, spawn, cli):
    target = spawn(python, TARGET)
    rows = query_json(cli, target.pid, "SELECT thread_name, depth, func, file, lineno, frame_type FROM python.backtrace WHERE depth < 3 AND thread_name = 'MainThread' ORDER BY depth")
    assert [r["func"] for r in rows] == ["leaf", "middle", "<module>"]
    assert [r["depth"] for r in rows] == [0, 1, 2]
    assert rows[0]["lineno"] == line_of(TARGET, "leaf")
    assert {r["frame_type"] for r in rows} == {"Python"}


def test_the_sql_string_and_time_functions_people_reach_for_work(default_python, spawn, cli):
    """substr, regexp_replace, split_part and date_trunc on a live table:
    paths and times are what a query cuts up."""
    target = spawn(default_python, TARGET)
    rows = query_json(cli, target.pid, "SELECT substr(func, 1, 3) AS head, substring(func FROM 2 FOR 2) AS mid, regexp_replace(file, '^.*/', '') AS base, split_part(file, '/', 2) AS top, date_trunc('minute', ts) <= ts AS t FROM python.backtrace WHERE depth = 0 AND thread_name = 'MainThread'")
    assert rows and rows[0]["head"] == "lea" and rows[0]["mid"] == "ea" and rows[0]["t"] is True, rows
    assert rows[0]["base"].endswith(".py") and "/" not in rows[0]["base"], rows


def test_every_table_carries_pid_rank_host_and_ts(python, spawn, cli):
    target = spawn(python, TARGET, env={"RANK": "3", "WORLD_SIZE": "8"})
    for table in ["python.backtrace", "python.threads", "process.info", "process.env"]:
        rows = query_json(cli, target.pid, f"SELECT pid, rank, host, ts FROM {table} LIMIT 1")
        assert rows, table
        row = rows[0]
        assert row["pid"] == target.pid and row["rank"] == 3, (table, row)
        assert row["host"] == socket.gethostname() and row["ts"], (table, row)


def test_a_process_of_no_job_has_no_rank_in_its_rows(default_python, spawn, cli):
    # `list` shows such a process's rank as "-": its rows must not say rank 0.
    target = spawn(default_python, BIG_TABLE.replace("100_000", "10"))
    for table in ["python.backtrace", "python.torch_steps"]:
        rows = query_json(cli, target.pid, f"SELECT pid, rank FROM {table} LIMIT 1")
        assert rows and rows[0]["rank"] is None and rows[0]["pid"] == target.pid, (table, rows)


BIG_TABLE = """
import time
from rankscope import _native
rows = [(time.time(), i, True, 1.5, 0.1, 0.5, 0.6, 0.3, 2.25, 64, 1000.0) for i in range(100_000)]
for k in range(0, len(rows), 10_000):
    _native.table_extend("python.torch_steps", rows[k:k + 10_000])
del rows
print("READY", flush=True)
time.sleep(3600)
"""


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def test_a_live_query_of_a_big_table_costs_the_target_little_memory(default_python, spawn, cli):
    # The rows' JSON used to be built whole in the target: +65 MB of its
    # peak RSS for 100,000 rows (16 queries at once: +1.2 GB).
    target = spawn(default_python, BIG_TABLE, env={"RANKSCOPE_TABLE_ROWS": "100000"})
    # The store's first spill of those rows to disk is no part of the query's cost.
    segment = os.path.join(target.script.parent, "run", "tables", "torch_steps", f"{socket.gethostname()}-{target.pid}-0.arrows")
    sizes = [-1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (os.path.exists(segment) and os.path.getsize(segment) == sizes[-1] > 1_000_000):
        sizes.append(os.path.getsize(segment) if os.path.exists(segment) else -1)
        time.sleep(0.2)
    before = peak_rss_kb(target.pid)
    rows = query_json(cli, target.pid, "SELECT count(*) AS n, sum(step) AS s, max(loss) AS l FROM python.torch_steps")
    assert rows == [{"n": 100_000, "s": 4_999_950_000, "l": 2.25}], rows
    grown = peak_rss_kb(target.pid) - before
    assert grown < 16_000, f"the target's peak RSS grew {grown} kB while it answered"


def test_a_table_size_that_is_no_number_is_said_once_and_the_default_kept(default_python, spawn, cli):
    target = spawn(default_python, BIG_TABLE.replace("100_000", "3000"), env={"RANKSCOPE_TABLE_ROWS": "abc", "RANKSCOPE_STORE_MAX_MB": "-1"})
    # 0 used to keep one row a table, and a word was taken as no setting at all.
    assert query_json(cli, target.pid, "SELECT count(*) AS n FROM python.torch_steps") == [{"n": 3000}]
    target.proc.kill()
    target.proc.wait()
    said = target.proc.stderr.read().decode().splitlines()
    assert said == [
        "rankscope: RANKSCOPE_TABLE_ROWS=\"abc\" is not a whole number of at least 1; the default is kept",
        "rankscope: RANKSCOPE_STORE_MAX_MB=\"-1\" is not a whole number of at least 0; the default is kept",
    ], said


def test_threads_and_info_tables(python, spawn, cli):
    target = spawn(python, TARGET)
    threads = query_json(cli, target.pid, "SELECT thread_name, is_main, daemon, func FROM python.threads ORDER BY thread_name")
    assert {"thread_name": "sleeper", "is_main": False, "daemon": True, "func": "<lambda>"} in threads
    assert any(t["is_main"] and t["func"] == "leaf" for t in threads)
    info = query_json(cli, target.pid, "SELECT cmdline, python_version, uptime_s FROM process.info")
    assert len(info) == 1 and "target.py" in info[0]["cmdline"]
    assert info[0]["uptime_s"] >= 0


def test_env_hides_secret_values(python, spawn, cli):
    target = spawn(python, TARGET)
    rows = query_json(cli, target.pid, "SELECT name, value, hidden FROM process.env WHERE name IN ('MY_API_TOKEN', 'PLAIN_SETTING') ORDER BY name")
    assert rows == [
        {"name": "MY_API_TOKEN", "value": "<hidden>", "hidden": True},
        {"name": "PLAIN_SETTING", "value": "visible", "hidden": False},
    ]
    everything = cli(target.pid, "query", "SELECT * FROM process.env", "--format", "csv")
    assert "hunter2" not in everything.stdout


def test_show_tables_and_output_formats(default_python, spawn, cli):
    target = spawn(default_python, TARGET)
    shown = cli(target.pid, "query", "SHOW TABLES")
    assert shown.returncode == 0, shown.stderr
    for name in ["backtrace", "threads", "info", "env"]:
        assert name in shown.stdout
    table = cli(target.pid, "query", "SELECT func FROM python.backtrace WHERE depth = 0 AND thread_name = 'MainThread'")
    assert table.stdout.splitlines()[0].startswith("+-")
    assert "| leaf" in table.stdout
    csv = cli(target.pid, "query", "SELECT func, depth FROM python.backtrace WHERE thread_name = 'MainThread' AND depth = 0", "--format", "csv")
    assert csv.stdout == "func,depth\nleaf,0\n"
    as_json = cli(target.pid, "query", "SELECT count(*) AS n FROM python.threads", "--format", "json")
    assert json.loads(as_json.stdout)[0]["n"] >= 2


def test_bad_sql_gets_the_engine_message_and_nonzero_exit(default_python, spawn, cli):
    target = spawn(default_python, TARGET)
    result = cli(target.pid, "query", "SELEC func FROM python.backtrace")
    assert result.returncode != 0
    assert result.stderr.startswith("error: query failed:")
    assert "hint:" in result.stderr
    missing = cli(target.pid, "query", "SELECT * FROM python.nonexistent")
    assert missing.returncode != 0 and "nonexistent" in missing.stderr
    assert target.alive()


def test_a_run_dir_that_is_not_one_is_an_error_and_a_real_one_without_rows_is_not(default_python, spawn, cli, tmp_path):
    """GIVEN `query --run DIR`, WHEN DIR does not exist or holds nothing a
    run leaves, THEN one line and a hint, exit 1 (not an empty table); a
    live process's run directory with no rows of the table yet answers 0."""
    sql = "SELECT count(*) AS n FROM python.torch_steps"
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a run")
    for bad, says in ((tmp_path / "no_such_run", "no run directory at"), (stray, "is not a run directory")):
        result = cli("query", "--run", bad, sql)
        assert result.returncode != 0, result.stdout
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), result.stderr
        assert f"{bad}" in lines[0] and says in lines[0], result.stderr
        assert result.stdout == ""

    run = tmp_path / "run"
    spawn(default_python, TARGET, env={"RANKSCOPE_RUN_DIR": str(run)})
    result = cli("query", "--run", run, sql, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"n": 0}]


DEEP = """
import threading, time
hold = threading.Event()

def deep(n):
    if n == 0:
        hold.wait()
        return
    deep(n - 1)

threading.Thread(target=deep, args=(40,), name="worker", daemon=True).start()
print("READY", flush=True)
deep(25)
"""


def test_pushed_down_scans_agree_with_full_ones(python, spawn, cli):
    """Counts, depth limits and thread filters are answered by the probe
    itself; the answers must match what the full rows say."""
    import json

    target = spawn(python, DEEP)

    def rows(sql):
        out = cli(target.pid, "query", sql, "--format", "json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    full = rows("SELECT thread_name, depth, func, file FROM python.backtrace")
    [counted] = rows("SELECT count(*) AS n, min(pid) AS pid FROM python.backtrace")
    assert counted == {"n": len(full), "pid": target.pid}
    per_thread = rows("SELECT count(*) AS n FROM python.threads")
    assert per_thread == [{"n": len({r["thread_name"] for r in full})}]
    shallow = rows("SELECT thread_name, depth, func, file FROM python.backtrace WHERE depth < 3 AND thread_name = 'worker'")
    assert shallow == [r for r in full if r["depth"] < 3 and r["thread_name"] == "worker"]
    assert len(shallow) == 3 and shallow[0]["func"] == "wait"
    assert rows("SELECT count(*) AS n FROM python.backtrace WHERE depth <= 1")[0]["n"] == 2 * len({r["thread_name"] for r in full})


FORKS = """
import json, os
from rankscope import _native

def step_row(step):
    _native.table_append("torch_steps", [0.0, step, False, 1.0, None, None, None, None, None, None, None])

step_row(1)
r, w = os.pipe()
child = os.fork()
if child == 0:
    step_row(2)
    os.write(w, _native.store_describe().encode())
    os._exit(0)
os.waitpid(child, 0)
theirs = json.loads(os.read(r, 1 << 20))
ours = json.loads(_native.store_describe())
print(json.dumps([ours["rows"]["torch_steps"], theirs["rows"]["torch_steps"]]))
"""


def test_a_child_after_fork_keeps_its_rows_in_a_store_of_its_own(python, tmp_path):
    # The store is found by this process's id, which is read once and
    # again after a fork: a child that went on with its parent's store
    # would show the parent's rows as its own, and write into its files.
    env = {**os.environ, "RANKSCOPE_STORE": "0"}
    done = subprocess.run([python, "-c", FORKS], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [1, 1], done.stdout
