"""The CUDA paths of the torch and memory features, on a real GPU: the
trace's GPU time (CUDA events read later) and the caching allocator's
deltas per module, the loss read without a device sync, `memory` with its
CUDA lines, torch's memory history exported, and a CUDA out-of-memory
error's record. Every test here skips where torch has no CUDA device (CI
never has one)."""

from __future__ import annotations

import functools
import json
import pickle
import subprocess
import time

import pytest

import test_torch_health as health
from conftest import query_json, require_torch
from test_torch import run_steps

CUDA_TRAIN = """
import time
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(inplace=True), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
# A loss module, so that the trace finds the loss (a loss computed with
# nn.functional is not seen), read from the GPU without a sync.
criterion = nn.MSELoss()
target = torch.zeros(512, 1, device="cuda")
done = 0


def train_step():
    global done
    x = torch.randn(512, 256, device="cuda")
    loss = criterion(model(x), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    done += 1


budget = 0
print("READY", flush=True)
while True:
    if budget > 0:
        train_step()
        budget -= 1
        if budget == 0:
            torch.cuda.synchronize()
            print(f"DONE {done}", flush=True)
    else:
        time.sleep(0.002)
"""


@functools.cache
def _has_cuda(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "True"


@pytest.fixture
def cuda_python(python):
    require_torch(python)
    if not _has_cuda(python):
        pytest.skip("no CUDA device here")
    return python


def test_trace_on_cuda_has_gpu_time_memory_deltas_and_the_loss(cuda_python, spawn, cli):
    target = spawn(cuda_python, CUDA_TRAIN)
    assert cli(target.pid, "torch", "trace", "on", "--backward").returncode == 0
    run_steps(cli, target, 8, 8)
    # A row waits for its CUDA events and is handed over at a later step.
    rows = query_json(
        cli,
        target.pid,
        "SELECT module, stage, count(*) AS n, count(gpu_ms) AS timed, min(gpu_ms) AS low, "
        "count(alloc_delta_mb) AS a, max(peak_delta_mb) AS peak FROM python.torch_trace GROUP BY 1, 2 ORDER BY 1, 2",
    )
    forward = {r["module"]: r for r in rows if r["stage"] == "forward"}
    assert set(forward) >= {"0", "1", "2", "3", "4"}, rows
    for name in ("0", "2", "4"):
        r = forward[name]
        assert r["timed"] == r["n"] >= 5 and r["low"] > 0, r
        assert r["a"] == r["n"], r
    # fc2 of a 512 x 1024 batch leaves a 2 MB activation for backward.
    assert forward["2"]["peak"] >= 1.9, forward["2"]
    # Backward: GPU time from events recorded in the gradient hooks, no memory deltas.
    backward = {r["module"]: r for r in rows if r["stage"] == "backward"}
    assert set(backward) >= {"0", "2", "4"}, rows
    for r in backward.values():
        assert r["timed"] == r["n"] >= 5 and r["low"] > 0 and r["a"] == 0, r
    steps = query_json(cli, target.pid, "SELECT step, loss, forward_ms FROM python.torch_steps WHERE sampled ORDER BY step")
    assert len(steps) >= 5 and all(s["loss"] is not None and s["loss"] > 0 for s in steps[:5]), steps
    off = cli(target.pid, "torch", "trace", "off")
    assert off.returncode == 0, off.stderr


def test_memory_shows_cuda_and_exports_its_history(cuda_python, spawn, cli, tmp_path):
    target = spawn(cuda_python, CUDA_TRAIN)
    run_steps(cli, target, 2, 2)
    shown = cli(target.pid, "memory")
    assert shown.returncode == 0, shown.stderr
    assert "cuda:0: allocated" in shown.stdout, shown.stdout
    assert cli(target.pid, "memory", "track", "on", "--cuda").returncode == 0
    run_steps(cli, target, 2, 4)
    out = tmp_path / "snapshot.pickle"
    exported = cli(target.pid, "memory", "export", "cuda", out)
    assert exported.returncode == 0, exported.stderr
    snapshot = pickle.loads(out.read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0], "PyTorch's memory_viz reads these"
    assert cli(target.pid, "memory", "track", "off", "--cuda").returncode == 0
    # Turned on and off from the probe's threads, torch's history printed a
    # warning of its own into the program's stderr (torch 2.11, an H100).
    target.proc.kill()
    target.proc.wait()
    err = target.proc.stderr.read().decode(errors="replace")
    assert "callback is not found" not in err, err


def test_tracking_leaves_the_programs_own_cuda_history_on(cuda_python, spawn, cli):
    source = CUDA_TRAIN.replace("print(\"READY\"", "torch.cuda.memory._record_memory_history(max_entries=1000)\nprint(\"READY\"", 1)
    assert source != CUDA_TRAIN
    target = spawn(cuda_python, source)
    if cli(target.pid, "eval", "hasattr(torch._C, '_cuda_isHistoryEnabled')").stdout.strip() != "True":
        pytest.skip("this torch cannot say whether its memory history is on")
    run_steps(cli, target, 2, 2)
    assert cli(target.pid, "memory", "track", "on", "--cuda").returncode == 0
    assert cli(target.pid, "memory", "track", "off", "--cuda").returncode == 0
    state = cli(target.pid, "eval", "torch._C._cuda_isHistoryEnabled()")
    assert state.stdout.strip() == "True", state.stdout + state.stderr


def test_a_cuda_out_of_memory_error_leaves_the_allocator_in_its_record(cuda_python, spawn, cli):
    source = """
import time, torch
x = torch.ones(1 << 20, device="cuda")
print("READY", flush=True)
while not globals().get("go"):
    time.sleep(0.01)
hog = torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
"""
    target = spawn(cuda_python, source)
    assert cli(target.pid, "eval", "go = True").returncode == 0
    assert target.proc.wait(timeout=120) == 1
    run_dir = target.script.parent / "run"
    record = json.loads(next(run_dir.glob("crash-*.json")).read_text())
    assert any(e["type"].endswith("OutOfMemoryError") for e in record["exceptions"]), record["exceptions"]
    cuda = record["memory"]["cuda"]
    assert cuda and cuda[0]["device"] == "cuda:0" and cuda[0]["ooms"] >= 1 and cuda[0]["allocated_mb"] >= 3.9, cuda
    largest = record["memory"]["largest_tensors"]
    assert largest and largest[0]["device"] == "cuda:0", largest


def test_the_timeline_has_cuda_figures_without_a_look(cuda_python, spawn, cli):
    """The native sampler finds the CUDA driver loaded and its watcher adds
    CUDA's figures on the interval; with the trace on, the step clock adds
    them at steps too."""
    target = spawn(cuda_python, CUDA_TRAIN, env={"RANKSCOPE_MEMORY_INTERVAL_S": "0.2"})
    run_steps(cli, target, 5, 5)
    sql = "SELECT count(*) AS n, max(cuda_allocated_mb) AS mb FROM python.memory WHERE source = 'interval' AND cuda_allocated_mb IS NOT NULL"
    deadline = time.monotonic() + 20
    while (rows := query_json(cli, target.pid, sql))[0]["n"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rows[0]["n"] >= 2 and rows[0]["mb"] > 0, rows
    assert cli(target.pid, "torch", "trace", "on").returncode == 0
    run_steps(cli, target, 200, 205)
    steps = query_json(cli, target.pid, "SELECT step, cuda_allocated_mb, cuda_peak_mb FROM python.memory WHERE source = 'step'")
    assert steps and all(r["step"] is not None and r["cuda_peak_mb"] >= r["cuda_allocated_mb"] > 0 for r in steps), steps


# The training-health features on a GPU, with test_torch_health.py's
# MLP and its traps moved to CUDA (`--cuda`). There the NaN watch waits
# for its flag at the optimizer's pre-hook, before the update: the search
# must name the module that made the NaN, not the first one of a model
# whose weights the update made non-finite (what reading it a step later,
# without the wait, named on an H100).


def _named_at_its_step(cli, target, done: int, wanted: str) -> str:
    """One step past `done`, the one with the NaN: `torch nan` says
    `wanted` at once (the check waited for the GPU before the update)."""
    run_steps(cli, target, 1, done + 1)
    text = health.on(cli, target.pid, "nan")
    assert wanted in text, text
    return text


def test_a_forward_nan_on_a_gpu_is_named_with_its_module_and_step(cuda_python, spawn, cli):
    target = spawn(cuda_python, health.TRAIN, args=["--nan-forward", "4", "--cuda"])
    assert "nan watch: armed" in health.on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 4, 4)
    assert "no non-finite loss or gradient seen" in health.on(cli, target.pid, "nan")
    text = _named_at_its_step(cli, target, 4, "step 4: first non-finite in forward, module boom (Boom): its output (256 non-finite)")
    assert "of its checks waited for the GPU" in text, text
    rows = query_json(cli, target.pid, "SELECT step, stage, module FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(4, "forward", "boom")], rows


def test_a_backward_nan_on_a_gpu_is_named_with_its_module_and_step(cuda_python, spawn, cli):
    target = spawn(cuda_python, health.TRAIN, args=["--nan-backward", "2", "--cuda"])
    health.on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 2, 2)
    _named_at_its_step(cli, target, 2, "step 2: first non-finite in backward, module back (Back)")
    rows = query_json(cli, target.pid, "SELECT step, stage, module FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(2, "backward", "back")], rows


def test_a_trip_and_its_replays_on_a_gpu_change_nothing(cuda_python, spawn, cli, tmp_path):
    # Dropout draws from the GPU's generator: the replay puts back the
    # step's CUDA RNG state, and the program's after it.
    flags = ["--nan-backward", "2", "--dropout", "--loss", "noisy", "--cuda"]
    target = spawn(cuda_python, health.TRAIN, args=flags)
    health.on(cli, target.pid, "nan", "on")
    health.on(cli, target.pid, "trace", "on")
    run_steps(cli, target, 6, 6)
    rows = query_json(cli, target.pid, "SELECT step, stage, module FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(2, "backward", "back")], rows
    health.assert_same_bits(cuda_python, cli, target, tmp_path, 6, flags, timeout=180)


def test_grads_on_a_gpu_fill_their_table_and_change_nothing(cuda_python, spawn, cli, tmp_path):
    target = spawn(cuda_python, health.TRAIN, args=["--cuda"])
    health.on(cli, target.pid, "grads", "--every", "2")
    run_steps(cli, target, 6, 6)
    # Read on the GPU and copied out without a sync: a step's rows come at a later boundary.
    sql = "SELECT step, param, norm, max_abs, nonfinite, weight_norm, update_ratio FROM python.grad_stats ORDER BY step, param"
    rows, done = query_json(cli, target.pid, sql), 6
    if {r["step"] for r in rows} != {0, 2, 4}:
        run_steps(cli, target, 2, 8)
        rows, done = [r for r in query_json(cli, target.pid, sql) if r["step"] <= 4], 8
    assert sorted({r["step"] for r in rows}) == [0, 2, 4], rows
    for r in rows:
        assert r["norm"] > 0 and 0 < r["max_abs"] <= r["norm"] and r["nonfinite"] == 0, r
        assert r["weight_norm"] > 0 and 0 < r["update_ratio"] < 1, r
        if r["step"] == 0:
            # SGD's first step: the update is lr x the gradient.
            update = r["update_ratio"] * r["weight_norm"]
            assert abs(update - 0.01 * r["norm"]) <= 1e-3 * 0.01 * r["norm"], r
    health.on(cli, target.pid, "grads", "off")
    run_steps(cli, target, 2, done + 2)
    probed = tmp_path / "probed.pt"
    assert cli(target.pid, "eval", f"save({str(probed)!r})").returncode == 0
    reference = health.reference_run(cuda_python, tmp_path, done + 2, "--cuda")
    result = subprocess.run([cuda_python, "-c", health.SAME_BITS, str(probed), str(reference), str(done + 2)], capture_output=True, text=True, timeout=180)
    assert result.stdout.strip() == "EQUAL", result.stderr


# A whole training step captured in a CUDA graph (fixed shapes, a
# capturable Adam) with the trace, the NaN watch and the gradient
# statistics on from the start: their hooks run in the warm-up and inside
# the capture, where nothing may be recorded, copied out, queried or
# waited on (a query inside a capture invalidates it). The replays run no
# Python at all. The program ends as without rankscope, bit for bit, and
# the features are still on, not turned off by an error.
CAPTURE = """
import sys, time
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
static_x = torch.zeros(32, 64, device="cuda")
static_y = torch.zeros(32, 1, device="cuda")
data = torch.Generator().manual_seed(1)


def feed():
    static_x.copy_(torch.randn(32, 64, generator=data))
    static_y.copy_(torch.randn(32, 1, generator=data))


def step():
    optimizer.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(model(static_x), static_y)
    loss.backward()
    optimizer.step()
    return loss


side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        feed()
        step()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_loss = step()
losses = []
for _ in range(20):
    feed()
    graph.replay()
    losses.append(static_loss.detach().clone())
torch.cuda.synchronize()
torch.save({"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}, sys.argv[1])
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""

SAME = (
    "import sys, torch; a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2]); "
    "assert all(torch.equal(x, y) for x, y in zip(a['losses'], b['losses'])) and len(a['losses']) == len(b['losses']) == 20, 'losses differ'; "
    "assert all(torch.equal(a['params'][k], b['params'][k]) for k in a['params']), 'parameters differ'; "
    "print('EQUAL')"
)


def test_a_step_captured_in_a_cuda_graph_runs_as_without_rankscope(cuda_python, spawn, cli, tmp_path):
    alone = spawn(cuda_python, CAPTURE, probe=False, args=[str(tmp_path / "alone.pt")])
    probed = spawn(cuda_python, CAPTURE, env={"RANKSCOPE_TORCH": "trace,nan,grads"}, args=[str(tmp_path / "probed.pt")])
    for target in (alone, probed):
        assert target.proc.poll() is None, target.proc.stderr.read().decode(errors="replace")
    status = json.loads(cli(probed.pid, "torch", "--format", "json").stdout)
    trace, features = status["trace"], status["features"]
    assert trace["on"] and not trace["disabled"], trace
    assert features["nan"]["armed"] and features["grads"]["on"] and not features["grads"]["disabled"], features
    result = subprocess.run([cuda_python, "-c", SAME, str(tmp_path / "probed.pt"), str(tmp_path / "alone.pt")], capture_output=True, text=True, timeout=180)
    assert result.stdout.strip() == "EQUAL", result.stderr
