"""`rankscope PID memory`: the process's memory now and over time, the
tensors and who holds them, what grew and where it was allocated, and what
an out-of-memory error leaves behind; on real processes (torch on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

from conftest import kill_tree, launch_torchrun, line_of, query_json, require_torch
from test_torch import run_steps, torch_python  # noqa: F401 - a fixture

LEAK = """
import time
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
kept = []
done = 0


def train_step():
    global done
    x = torch.randn(32, 64)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    kept.append(torch.randn(256))  # @leak
    done += 1


def hold():
    stray = torch.ones(1000, 10)
    global budget
    print("READY", flush=True)
    while True:
        if budget > 0:
            train_step()
            budget -= 1
            if budget == 0:
                print(f"DONE {done}", flush=True)
        else:
            time.sleep(0.002)


budget = 0
hold()
"""


def memory_json(cli, pid, *args) -> dict:
    result = cli(pid, "memory", *args, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_leak_is_named_by_its_line_and_its_holder(torch_python, spawn, cli):
    target = spawn(torch_python, LEAK)
    run_steps(cli, target, 2, 2)
    on = cli(target.pid, "memory", "track", "on", "--python")
    assert on.returncode == 0, on.stderr
    assert "tracking: Python (tracemalloc)" in on.stdout
    run_steps(cli, target, 50, 52)
    diff = cli(target.pid, "memory", "diff")
    assert diff.returncode == 0, diff.stderr
    leak_line = line_of(LEAK, "leak")
    # Each growing allocation is put at the line of the user's own code
    # under it; the leak keeps one tensor per step: 50 blocks at least,
    # more than any other line of the program.
    sites = [line.split() for line in diff.stdout.splitlines() if " blocks " in line]
    ours = [(int(words[2]), words[4]) for words in sites if words[4].rsplit("/", 1)[-1].startswith("target.py:")]
    assert ours and max(ours)[1].endswith(f"target.py:{leak_line}") and max(ours)[0] >= 50, diff.stdout
    again = memory_json(cli, target.pid, "diff")["sites"]
    assert not any(s["lineno"] == leak_line and s["count_diff"] >= 50 for s in again), "a second diff starts from the first"

    kept = query_json(cli, target.pid, "SELECT holder, shape, dtype, device, kind, bytes FROM python.tensors WHERE holder LIKE 'kept[%' ORDER BY bytes")
    assert len(kept) == 52, kept
    assert {(r["shape"], r["dtype"], r["device"], r["kind"], r["bytes"]) for r in kept} == {("256", "float32", "cpu", "global", 1024)}
    assert {r["holder"] for r in kept} == {f"kept[{i}]" for i in range(52)}
    off = cli(target.pid, "memory", "track", "off")
    assert off.returncode == 0 and "tracking: off" in off.stdout
    again = cli(target.pid, "memory", "diff")
    assert again.returncode != 0 and "memory tracking is off" in again.stderr and "hint:" in again.stderr


def test_tracking_leaves_the_programs_own_tracemalloc_as_it_was(python, spawn, cli):
    # A program that traces its own allocations: `track on` reads its
    # tracemalloc, and `track off` leaves it tracing, with its own depth.
    source = """
import time
import tracemalloc

tracemalloc.start(3)
kept = []
print("READY", flush=True)
while True:
    kept.append(bytearray(100))
    del kept[:-1000]
    time.sleep(0.005)
"""
    target = spawn(python, source)
    on = cli(target.pid, "memory", "track", "on", "--python")
    assert on.returncode == 0 and "tracking: Python (tracemalloc)" in on.stdout, on.stderr
    assert cli(target.pid, "memory", "diff").returncode == 0
    off = cli(target.pid, "memory", "track", "off")
    assert off.returncode == 0 and "tracking: off" in off.stdout, off.stderr
    state = cli(target.pid, "eval", "(tracemalloc.is_tracing(), tracemalloc.get_traceback_limit())")
    assert state.stdout.strip() == "(True, 3)", state.stdout + state.stderr
    # One the probe started itself goes off with it.
    assert cli(target.pid, "eval", "tracemalloc.stop()").returncode == 0
    assert cli(target.pid, "memory", "track", "on", "--python").returncode == 0
    assert cli(target.pid, "eval", "tracemalloc.get_traceback_limit()").stdout.strip() == "16"
    assert cli(target.pid, "memory", "track", "off").returncode == 0
    assert cli(target.pid, "eval", "tracemalloc.is_tracing()").stdout.strip() == "False"


def test_a_diff_of_a_program_that_allocates_nothing_names_none_of_the_probes_allocations(python, spawn, cli):
    # The diff's own imports (tracemalloc, the memory helper's modules)
    # came first, at importlib's frames.
    target = spawn(python, 'import time\nprint("READY", flush=True)\nwhile True:\n    time.sleep(0.01)\n')
    assert cli(target.pid, "memory", "track", "on", "--python").returncode == 0
    for _ in range(2):
        sites = memory_json(cli, target.pid, "diff")["sites"]
        assert not [s for s in sites if "importlib" in s["file"] or "/rankscope/" in s["file"] or "fnmatch" in s["file"]], sites


BIG_LEAK = """
import time
import torch

kept, names = [], []
done = 0


def train_step():
    global done
    kept.append(torch.zeros(65536))  # @tensors
    names.append("x" * 4000 + str(done))  # @strings
    done += 1


budget = 0
print("READY", flush=True)
while True:
    if budget > 0:
        train_step()
        budget -= 1
        if budget == 0:
            print(f"DONE {done}", flush=True)
    else:
        time.sleep(0.002)
"""


def test_a_leak_of_tensors_ranks_by_their_data_not_their_objects(torch_python, spawn, cli):
    # Each step keeps a 256 KB tensor and a 4 KB string. tracemalloc sees
    # the string's 4 KB and the tensor object's hundred-odd bytes; the
    # tensor's data is torch's allocation. The diff counts it at the line
    # that made the tensor, so that line leads.
    target = spawn(torch_python, BIG_LEAK)
    run_steps(cli, target, 2, 2)
    on = cli(target.pid, "memory", "track", "on", "--python")
    assert on.returncode == 0, on.stderr
    run_steps(cli, target, 20, 22)
    diff = memory_json(cli, target.pid, "diff")
    tensors_at, strings_at = line_of(BIG_LEAK, "tensors"), line_of(BIG_LEAK, "strings")
    version = subprocess.run([torch_python, "-c", "import sys; print(sys.version_info[:2] >= (3, 12))"], capture_output=True, text=True, check=True)
    if version.stdout.strip() != "True":
        # 3.11's tracemalloc cannot place a tensor's object: the diff says so.
        assert "CPython 3.11" in diff["tensor_note"], diff
        text = cli(target.pid, "memory", "diff")
        assert "tensor data not counted by site" in text.stdout, text.stdout
        return
    assert diff["tensor_note"] is None, diff
    top = diff["sites"][0]
    assert top["lineno"] == tensors_at and top["file"].endswith("target.py"), diff["sites"][:3]
    assert top["tensor_count_diff"] == 20, top
    assert abs(top["tensor_diff_mb"] - 20 * 65536 * 4 / 2**20) < 1e-6, top
    assert top["total_diff_mb"] >= top["tensor_diff_mb"] > 4.9, top
    strings = [s for s in diff["sites"] if s["lineno"] == strings_at]
    assert strings and strings[0]["tensor_count_diff"] == 0 and 0.07 < strings[0]["size_diff_mb"] < 0.2, strings
    assert diff["tensor_scan_complete"] is True
    # The text says so on the line of the leak.
    run_steps(cli, target, 4, 26)
    text = cli(target.pid, "memory", "diff")
    assert text.returncode == 0, text.stderr
    line = next(l for l in text.stdout.splitlines() if f"target.py:{tensors_at}" in l and "blocks" in l)
    assert "(+4 tensors, +1.0 MB of tensor data)" in line, text.stdout


def test_a_leak_between_two_steps(torch_python, spawn, cli, rankscope_bin, endpoint_dir):
    target = spawn(torch_python, LEAK)
    run_steps(cli, target, 2, 2)
    assert cli(target.pid, "memory", "track", "on", "--python").returncode == 0
    bad = cli(target.pid, "memory", "diff", "--steps", "9..5")
    assert bad.returncode != 0 and "is not a span" in bad.stderr and "hint:" in bad.stderr
    # The diff waits for step 30 to end while the training runs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    waiting = subprocess.Popen([rankscope_bin, str(target.pid), "memory", "diff", "--steps", "10..30", "--format", "json"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while "waiting for step 30" not in (line := waiting.stderr.readline()):
            assert line and time.monotonic() < deadline, line
        run_steps(cli, target, 40, 42)
        out, err = waiting.communicate(timeout=60)
    finally:
        waiting.kill()
    assert waiting.returncode == 0, err
    reply = json.loads(out)
    assert reply["state"] == "done" and reply["steps"] == [10, 30], reply
    leak = next(s for s in reply["sites"] if s["file"].endswith("target.py") and s["lineno"] == line_of(LEAK, "leak"))
    assert 20 <= leak["count_diff"] <= 24, leak  # 20 steps' tensors (and the list's growth)


def test_model_optimizer_and_a_local_are_named_as_holders(torch_python, spawn, cli):
    target = spawn(torch_python, LEAK)
    run_steps(cli, target, 3, 3)
    rows = query_json(cli, target.pid, "SELECT holder, kind, shape, requires_grad FROM python.tensors WHERE holder IS NOT NULL")
    by_holder = {r["holder"]: r for r in rows}
    assert by_holder["model.0.weight"]["kind"] == "parameter" and by_holder["model.0.weight"]["shape"] == "64x64"
    assert by_holder["model.0.weight"]["requires_grad"] is True
    assert by_holder["model.2.bias.grad"]["kind"] == "gradient"
    assert by_holder["optimizer.state[0.weight]['exp_avg']"]["kind"] == "optimizer state"
    assert by_holder["optimizer.state[2.bias]['exp_avg_sq']"]["shape"] == "8"
    assert by_holder["hold:stray"] == {"holder": "hold:stray", "kind": "local", "shape": "1000x10", "requires_grad": False}
    # Storages are counted once: a view adds to `views`, not a row.
    assert cli(target.pid, "eval", "view = kept[0][:10]").returncode == 0
    first = query_json(cli, target.pid, "SELECT holder, views, bytes FROM python.tensors WHERE holder = 'kept[0]' OR holder = 'view'")
    assert first == [{"holder": "kept[0]", "views": 2, "bytes": 1024}], first
    # A dict's item is named by its key; a tensor no name reaches (in a set)
    # by the type of what holds it.
    assert cli(target.pid, "eval", "by_key = {'w': torch.zeros(7)}; hidden = {torch.zeros(3000)}").returncode == 0
    others = query_json(cli, target.pid, "SELECT holder, bytes FROM python.tensors WHERE bytes IN (28, 12000) ORDER BY bytes")
    assert others == [{"holder": "by_key['w']", "bytes": 28}, {"holder": "referrer: set", "bytes": 12000}], others
    # An object's attributes (a trainer's), one level down, and the globals
    # of the program's own other modules are named too.
    made = cli(target.pid, "eval", "class Trainer: pass\ntrainer = Trainer(); trainer.history = [torch.zeros(11)]; trainer.best = torch.zeros(13)\n"
               "import sys, types; m = types.ModuleType('helper'); m.__file__ = '/srv/job/helper.py'; m.CACHE = [torch.zeros(17)]; sys.modules['helper'] = m; del m")
    assert made.returncode == 0, made.stderr
    named = query_json(cli, target.pid, "SELECT holder, kind, bytes FROM python.tensors WHERE bytes IN (44, 52, 68) ORDER BY bytes")
    assert named == [
        {"holder": "trainer.history[0]", "kind": "global", "bytes": 44},
        {"holder": "trainer.best", "kind": "global", "bytes": 52},
        {"holder": "helper.CACHE[0]", "kind": "global", "bytes": 68},
    ], named

    text = cli(target.pid, "memory")
    assert text.returncode == 0, text.stderr
    assert "process: RSS" in text.stdout and "USS" in text.stdout
    assert "tensors: " in text.stdout and "hold:stray" in text.stdout, text.stdout
    assert "since the last look" not in text.stdout
    again = cli(target.pid, "memory").stdout
    assert "since the last look" in again, again


MANY = """
import time
import torch

many = [torch.full((4,), float(i)) for i in range(6000)]
big = torch.zeros(1000)
tail = big[990:]
del big
print("READY", flush=True)
while True:
    time.sleep(0.01)
"""


def test_a_reply_of_many_rows_is_streamed_and_a_client_that_hangs_up_costs_nothing(torch_python, spawn, cli, endpoint_dir):
    """6000 rows are a reply of about 1 MB, which the probe writes as it
    makes it (no Content-Length); a client that reads its head and hangs up
    leaves the target running and answering."""
    target = spawn(torch_python, MANY)
    counted = query_json(cli, target.pid, "SELECT count(*) AS n, count(DISTINCT holder) AS named FROM python.tensors WHERE holder LIKE 'many[%'")
    assert counted == [{"n": 6000, "named": 6000}], counted
    # A slice alone holds its whole storage: the row says the storage's size.
    # Its base lives on too (the slice's `_base`): a second view, unnamed.
    some = query_json(cli, target.pid, "SELECT holder, shape, bytes, views FROM python.tensors WHERE holder IN ('many[5999]', 'tail') ORDER BY bytes")
    assert some == [{"holder": "many[5999]", "shape": "4", "bytes": 16, "views": 1}, {"holder": "tail", "shape": "10", "bytes": 4000, "views": 2}], some

    body = json.dumps({"action": "tensors"}).encode()
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(Path(endpoint_dir, f"{target.pid}.sock")))
        raw.sendall(b"POST /v1/memory HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        head = b""
        while len(head.partition(b"\r\n\r\n")[2]) < 20:
            chunk = raw.recv(4096)
            assert chunk, head
            head += chunk
    status, _, rest = head.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and b"content-length" not in status.lower(), status
    assert rest.startswith(b'{"ok":{"columns":'), rest[:80]
    assert target.proc.poll() is None
    assert cli(target.pid, "eval", "len(many)").stdout.strip() == "6000"
    again = query_json(cli, target.pid, "SELECT count(*) AS n FROM python.tensors")
    assert again == [{"n": 6001}], again


FAKE_CUDA = LEAK.replace(
    "torch.manual_seed(0)\n",
    """torch.manual_seed(0)
# torch has no CUDA on this machine: these three stand in for its caching
# allocator's counters, so that what rankscope does with them (rows at
# steps and on the interval, and the watcher's thread) can be checked. The
# real counters are checked in test_torch_cuda.py, on a GPU.
_allocator = {"allocated_bytes.all.current": 3 << 20, "reserved_bytes.all.current": 8 << 20, "allocated_bytes.all.peak": 5 << 20, "num_alloc_retries": 2, "num_ooms": 0}
torch.cuda.is_initialized = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.memory_stats = lambda device=None: dict(_allocator)
""",
).replace("    kept.append(torch.randn(256))  # @leak\n", "    time.sleep(0.02)\n")


def _threads(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass
    return names


def _rows_until(cli, pid, sql: str, enough, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = query_json(cli, pid, sql)
        if enough(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


ODD_TENSORS = """
import time
import torch


class Tagged(torch.Tensor):
    pass


sparse = torch.eye(4).to_sparse()
on_meta = torch.empty(1000, 1000, device="meta")
tagged = torch.ones(3).as_subclass(Tagged)
nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)
transposed = torch.ones(10, 10).t()
print("READY", flush=True)
while True:
    time.sleep(0.01)
"""


# A step paused between forward and backward: the activations autograd saved
# have no Python object, and are most of the step's memory. A second graph
# runs under saved_tensors_hooks (as offloading and checkpointing do): the
# scan must not run its unpack hook.
BETWEEN = """
import time
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 1))
unpacked = 0
go = False


def unpack(t):
    global unpacked
    unpacked += 1
    return t


def train_step(x):
    out = model(x)
    loss = out.square().mean()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        hooked = torch.randn(300, 100, requires_grad=True).exp().sum()
    print("READY", flush=True)
    while not go:
        time.sleep(0.02)
    loss.backward()
    hooked.backward()
    print("BACKWARD", flush=True)
    while True:
        time.sleep(0.05)


train_step(torch.randn(512, 256))
"""


def test_tensors_saved_for_backward_are_found_and_named_by_their_node(torch_python, spawn, cli):
    target = spawn(torch_python, BETWEEN)
    rows = query_json(cli, target.pid, "SELECT holder, kind, shape, bytes, views FROM python.tensors WHERE kind = 'saved for backward' ORDER BY bytes DESC")
    # ReLU's output, saved by ReLU and by the second Linear (one storage),
    # in the graph of the loss (made after `out`, from it).
    top = rows[0]
    assert top["shape"] == "512x4096" and top["bytes"] == 512 * 4096 * 4 and top["views"] == 2, rows
    assert top["holder"] == "AddmmBackward0.mat1, ReluBackward0.result in the graph of train_step:loss", rows
    # The hooked graph's saved tensor, as it is kept; its unpack hook never ran.
    assert {"holder": "ExpBackward0.result in the graph of train_step:hooked", "kind": "saved for backward", "shape": "300x100",
            "bytes": 120000, "views": 1} in rows, rows
    assert cli(target.pid, "eval", "unpacked").stdout.strip() == "0"
    # The input the first Linear saved is the program's local: its name wins.
    x = query_json(cli, target.pid, "SELECT holder, kind FROM python.tensors WHERE shape = '512x256'")
    assert x == [{"holder": "train_step:x", "kind": "local"}], x
    # After backward autograd has let them go: no row is left.
    assert cli(target.pid, "eval", "go = True").returncode == 0
    target.wait_for_line("BACKWARD")
    after = query_json(cli, target.pid, "SELECT count(*) AS n FROM python.tensors WHERE kind = 'saved for backward'")
    assert after == [{"n": 0}], after


def test_odd_tensors_get_rows_and_the_scan_goes_on(torch_python, spawn, cli):
    """Sparse, meta, nested, quantized and subclassed tensors: each gets a
    row (a nested tensor has no single shape), and none ends the scan."""
    target = spawn(torch_python, ODD_TENSORS)
    rows = query_json(cli, target.pid, "SELECT holder, shape, dtype, device, bytes FROM python.tensors WHERE holder IS NOT NULL ORDER BY holder")
    by = {r["holder"]: r for r in rows}
    assert by["nested"]["shape"] == "nested", rows
    assert by["on_meta"] == {"holder": "on_meta", "shape": "1000x1000", "dtype": "float32", "device": "meta", "bytes": 0}, rows
    assert by["sparse"]["shape"] == "4x4" and by["quantized"]["dtype"] == "quint8", rows
    assert by["tagged"]["shape"] == "3" and by["transposed"]["bytes"] == 400, rows
    assert target.proc.poll() is None


def test_cuda_figures_join_the_timeline_at_steps_and_on_the_interval(torch_python, spawn, cli):
    target = spawn(torch_python, FAKE_CUDA, env={"RANKSCOPE_MEMORY_INTERVAL_S": "0.2"})
    # Nothing has asked torch about CUDA yet, and no driver is loaded: no watcher.
    assert not any(name.startswith("rankscope-cuda") for name in _threads(target.pid))
    assert cli(target.pid, "torch", "trace", "on").returncode == 0
    run_steps(cli, target, 40, 40)
    columns = "step, source, cuda_allocated_mb, cuda_reserved_mb, cuda_peak_mb, cuda_alloc_retries, cuda_ooms"
    steps = query_json(cli, target.pid, f"SELECT CAST(ts AS BIGINT) AS t, {columns} FROM python.memory WHERE source = 'step' ORDER BY ts")
    # 40 steps of 20 ms or more, a row at most every 100 ms.
    assert 3 <= len(steps) < 40, steps
    gaps = [(b["t"] - a["t"]) / 1e6 for a, b in zip(steps, steps[1:])]
    # (Taken when each row was written, a little after its step was told.)
    assert min(gaps) >= 0.08, gaps
    assert all(r["cuda_allocated_mb"] == 3.0 and r["cuda_reserved_mb"] == 8.0 and r["cuda_peak_mb"] == 5.0 for r in steps), steps
    assert all(r["cuda_alloc_retries"] == 2 and r["cuda_ooms"] == 0 for r in steps), steps
    numbers = [r["step"] for r in steps]
    assert numbers == sorted(numbers) and numbers[0] >= 1 and numbers[-1] <= 40, numbers
    assert any(name.startswith("rankscope-cuda") for name in _threads(target.pid))

    # No steps now: the watcher writes them on the sampler's interval.
    assert cli(target.pid, "torch", "trace", "off").returncode == 0
    sql = f"SELECT {columns} FROM python.memory WHERE source = 'interval' AND cuda_allocated_mb IS NOT NULL"
    interval = _rows_until(cli, target.pid, sql, lambda rows: len(rows) >= 2)
    assert len(interval) >= 2 and all(r["cuda_reserved_mb"] == 8.0 for r in interval), interval
    # The plain interval rows (no GIL) go on beside them.
    plain = query_json(cli, target.pid, "SELECT count(*) AS n FROM python.memory WHERE source = 'interval' AND cuda_allocated_mb IS NULL")
    assert plain[0]["n"] >= 2, plain
    assert target.proc.poll() is None


def test_the_timeline_is_sampled_without_torch_and_objects_show_growth(python, spawn, cli):
    source = """
import time


class Sample:
    def __init__(self, i):
        self.i = i


grown = []
print("READY", flush=True)
while True:
    if len(grown) < 20000 and globals().get("grow"):
        grown.extend(Sample(i) for i in range(20000))
    time.sleep(0.01)
"""
    target = spawn(python, source, env={"RANKSCOPE_MEMORY_INTERVAL_S": "0.2"})
    deadline = time.monotonic() + 30
    while True:
        rows = query_json(cli, target.pid, "SELECT source, rss_mb, uss_mb, step FROM python.memory WHERE source = 'interval'")
        if len(rows) >= 3:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    assert all(r["rss_mb"] > 1 and r["step"] is None for r in rows), rows
    # USS (smaps_rollup, dear) is read one sample in ten, the first included.
    assert 0 < rows[0]["uss_mb"] <= rows[0]["rss_mb"] and all(r["uss_mb"] is None for r in rows[1:3]), rows
    summary = memory_json(cli, target.pid)
    assert summary["torch"] is False and summary["rss_mb"] > 1
    assert "torch is not imported" in cli(target.pid, "memory").stdout
    looks = query_json(cli, target.pid, "SELECT count(*) AS n FROM python.memory WHERE source = 'look'")
    assert looks[0]["n"] == 2

    query_json(cli, target.pid, "SELECT type, count FROM python.objects")  # the first look
    assert cli(target.pid, "eval", "grow = True").returncode == 0
    deadline = time.monotonic() + 30
    while cli(target.pid, "eval", "len(grown)").stdout.strip() != "20000":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    samples = query_json(cli, target.pid, "SELECT count, count_growth, mb_growth FROM python.objects WHERE type = '__main__.Sample'")
    assert samples == [{"count": 20000, "count_growth": 20000, "mb_growth": samples[0]["mb_growth"]}], samples
    assert samples[0]["mb_growth"] > 0.5
    assert query_json(cli, target.pid, "SELECT count(*) AS n FROM python.tensors") == [{"n": 0}]


def crash_after_a_timeline_row(cli, target) -> None:
    """Lets the target run out of memory (`go`) once the memory timeline
    has a row (the sampler's first), and waits for it to exit with 1."""
    deadline = time.monotonic() + 30
    while not query_json(cli, target.pid, "SELECT count(*) AS n FROM python.memory")[0]["n"]:
        assert time.monotonic() < deadline, "no memory timeline row"
        time.sleep(0.1)
    assert cli(target.pid, "eval", "go = True").returncode == 0
    assert target.proc.wait(timeout=60) == 1


def test_an_out_of_memory_error_leaves_the_memory_picture_in_its_record(python, spawn, cli):
    source = """
import resource, time
print("READY", flush=True)
while not globals().get("go"):
    time.sleep(0.01)
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))
hog = []
while True:
    hog.append(bytearray(16 << 20))
"""
    target = spawn(python, source)
    crash_after_a_timeline_row(cli, target)
    run_dir = target.script.parent / "run"
    listed = cli("crashes", "--format", "json", env={"RANKSCOPE_RUN_DIR": str(run_dir)})
    assert listed.returncode == 0, listed.stderr
    records = json.loads(listed.stdout)
    assert [r["type"] for r in records] == ["MemoryError"], records
    record = json.loads(next(run_dir.glob("crash-*.json")).read_text())
    memory = record["memory"]
    assert memory["rss_mb"] > 100 and memory["rss_peak_mb"] >= memory["rss_mb"] * 0.9, memory
    # How it got there: the timeline's last rows, oldest first.
    timeline = memory["timeline"]
    assert 1 <= len(timeline) <= 30, memory
    assert all(row["rss_mb"] > 0 for row in timeline) and timeline == sorted(timeline, key=lambda r: r["ts"]), timeline
    shown = cli("crashes", "show", "1", "--run", run_dir)
    assert shown.returncode == 0, shown.stderr
    assert "Memory at the crash: RSS" in shown.stdout and "rows of python.memory)" in shown.stdout, shown.stdout


def test_torchs_cpu_allocation_failure_leaves_the_memory_picture_too(torch_python, spawn, cli):
    # torch says a CPU allocation failed with a plain RuntimeError
    # ("DefaultCPUAllocator: can't allocate memory"), which got no timeline
    # and no largest tensors.
    source = """
import time
import torch
keep = [torch.ones(1024, 1024) for _ in range(4)]
print("READY", flush=True)
while not globals().get("go"):
    time.sleep(0.01)
torch.empty(1 << 50)
"""
    target = spawn(torch_python, source)
    crash_after_a_timeline_row(cli, target)
    record = json.loads(next((target.script.parent / "run").glob("crash-*.json")).read_text())
    memory = record["memory"]
    assert memory["timeline"], memory
    assert any(t["holder"].startswith("keep[") for t in memory["largest_tensors"]), memory["largest_tensors"]


HOG = """
import os, time
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
hog = b"x" * (400 << 20) if rank == 2 else b""
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "marks", f"rank{rank}"), "w").close()
while True:
    time.sleep(0.1)
"""


def test_cluster_memory_marks_the_rank_that_holds_more(default_python, cli, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    (tmp_path / "marks").mkdir()
    proc = launch_torchrun(default_python, script, 3, endpoint_dir, tmp_path / "run", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "marks").iterdir())) < 3:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = cli("cluster", "memory", "--run", tmp_path / "run")
        assert result.returncode == 0, result.stderr
        lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
        assert set(lines) == {"0", "1", "2"}, result.stdout
        assert "<-- RSS " in lines["2"] and "x the median" in lines["2"] and "CUDA" not in lines["2"], result.stdout
        assert "<--" not in lines["0"] and "<--" not in lines["1"]
        again = json.loads(cli("cluster", "memory", "--run", tmp_path / "run", "--format", "json").stdout)
        assert [r["rank"] for r in again] == [0, 1, 2]
        assert again[2]["memory"]["rss_mb"] > again[0]["memory"]["rss_mb"] + 300
        assert again[0]["memory"]["growth"]["seconds"] >= 0, "the second look knows the first"
    finally:
        kill_tree(proc.pid)
        proc.wait()


def test_a_rank_killed_from_outside_is_named_with_its_last_rss(python, spawn, cli):
    # As the kernel's OOM killer leaves it: SIGKILL, no record, the registry
    # entry still "running"; the memory timeline on disk says how big it was.
    source = """
import time
hog = b"x" * (200 << 20)
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""
    env = {"RANK": "1", "WORLD_SIZE": "2", "RANKSCOPE_MEMORY_INTERVAL_S": "0.1", "RANKSCOPE_STORE_FLUSH_S": "0.1"}
    target = spawn(python, source, env=env)
    run_dir = target.script.parent / "run"
    deadline = time.monotonic() + 30
    # Until a row taken after the 200 MB were filled in is on disk (the first
    # sample may come while they are still being written).
    while not list((run_dir / "tables" / "memory").glob("*.arrows")) or target.pid not in [
        r["pid"] for r in json.loads(cli("query", "--run", run_dir, "SELECT DISTINCT pid FROM python.memory WHERE rss_mb > 200", "--format", "json").stdout or "[]")
    ]:
        assert time.monotonic() < deadline, "no memory row reached the disk"
        time.sleep(0.1)
    target.kill()
    listed = cli("crashes", "--run", run_dir)
    assert listed.returncode == 0, listed.stderr
    line = next((l for l in listed.stdout.splitlines() if "vanished" in l), "")
    assert line.startswith(f"rank 1 (pid {target.pid}) vanished without a record: last seen at "), listed.stdout
    rss = float(line.split("with RSS ")[1].split(" MB")[0])
    assert rss > 200, line
    assert "OOM killer" in line
