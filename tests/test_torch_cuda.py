"""The CUDA paths of the torch and memory features, on a real GPU: the
trace's GPU time (CUDA events read later) and the caching allocator's
deltas per module, the loss read without a device sync, `memory` with its
CUDA lines, torch's memory history exported, and a CUDA out-of-memory
error's record. Every test here skips where torch has no CUDA device (CI
never has one)."""

from __future__ import annotations

import json
import pickle
import subprocess
import time

import pytest

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


@pytest.fixture
def cuda_python(python):
    require_torch(python)
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
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
    backward = [r for r in rows if r["stage"] == "backward"]
    assert backward and all(r["timed"] == 0 and r["a"] == 0 for r in backward), "backward has CPU time only"
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
