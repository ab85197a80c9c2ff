"""What a step is where a loop is more than one forward, one backward and
one optimizer step: two optimizers stepped one after the other (Muon with
AdamW, a GAN's two), in two lines or in a loop over a list, and gradient
accumulation. A step ends at the last optimizer of the loop, so each
step's rows hold that loop's gradients, whichever optimizer updates them;
its loss is the mean of the losses seen in it."""

from __future__ import annotations

import json
import time

import pytest

from conftest import require_torch

LOOP = """
import json, sys, time
import torch
import torch.nn as nn

torch.manual_seed(0)
MODE = sys.argv[1]
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
criterion = nn.MSELoss()
micro = 1
if MODE == "accumulate":
    optimizers = [torch.optim.Adam(model.parameters(), lr=1e-2)]
    micro = 4
elif MODE == "validate":
    optimizers = [torch.optim.Adam(model.parameters(), lr=1e-2)]
elif MODE in ("aux", "aux-first"):
    # A second optimizer stepped every fourth loop, after the first (or
    # before it, so that it is the first seen stepping).
    head_bias = model[2].bias
    optimizers = [torch.optim.Adam([p for p in model.parameters() if p is not head_bias], lr=1e-2), torch.optim.SGD([head_bias], lr=0.1)]
elif MODE == "nested":
    # An optimizer whose step is another's (ZeroRedundancyOptimizer's is).
    class Outer(torch.optim.Optimizer):
        def __init__(self, inner):
            self.inner = inner
            super().__init__(inner.param_groups, {})

        def step(self, closure=None):
            self.inner.step()

    optimizers = [Outer(torch.optim.Adam(model.parameters(), lr=1e-2))]
else:
    # An optimizer that keeps no count first, as Muon's usual partner
    # order has it: the steps' numbers come from the program's start.
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizers = [torch.optim.SGD(matrices, lr=0.05), torch.optim.Adam(vectors, lr=1e-2)]
norms, losses = [], []
for it in range(12):
    for opt in optimizers:
        opt.zero_grad()
    seen = []
    for _ in range(micro):
        x, y = torch.randn(8, 8), torch.randn(8, 4)
        loss = criterion(model(x), y)
        seen.append(loss.item())
        (loss / micro).backward()
    total = 0.0
    for value in seen:
        total += value
    losses.append(total / micro)
    norms.append({name: p.grad.norm().item() for name, p in model.named_parameters()})
    if MODE == "list":
        for opt in optimizers:
            opt.step()
    elif MODE == "two":
        optimizers[0].step()
        optimizers[1].step()
    elif MODE == "aux":
        optimizers[0].step()
        if it % 4 == 3:
            optimizers[1].step()
    elif MODE == "aux-first":
        if it % 4 == 0:
            optimizers[1].step()
        optimizers[0].step()
    else:
        optimizers[0].step()
    if MODE == "validate":
        # A validation pass between steps, on a larger batch, without grad.
        with torch.no_grad():
            criterion(model(torch.randn(32, 8)), torch.randn(32, 4))
print("RESULT " + json.dumps({"norms": norms, "losses": losses}), flush=True)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""

PARAMS = ["0.bias", "0.weight", "2.bias", "2.weight"]


def query(cli, pid, sql):
    result = cli(pid, "query", sql, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("mode", ["two", "list", "nested"])
def test_a_step_of_two_optimizers_ends_after_the_last_and_holds_its_loops_gradients(python, spawn, cli, mode):
    require_torch(python)
    target = spawn(python, LOOP, args=[mode], env={"RANKSCOPE_TORCH": "trace,grads,every=1"}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    steps = query(cli, target.pid, "SELECT step, optimizer_ms FROM python.torch_steps ORDER BY step")
    # One step a loop: the first two ended at the first optimizer seen,
    # before the second was known to step at its rate and after it, so the
    # third is longer.
    assert [r["step"] for r in steps] == list(range(12)), steps
    rows = query(cli, target.pid, "SELECT step, param, norm FROM python.grad_stats WHERE step >= 3 ORDER BY step, param")
    got = {}
    for r in rows:
        got.setdefault(r["step"], []).append((r["param"], r["norm"]))
    assert sorted(got) == list(range(3, 12)), rows
    for step, params in got.items():
        assert [name for name, _ in params] == PARAMS, (step, params)
        for name, norm in params:
            # Both optimizers' parameters, from the loop the step numbers.
            assert norm == pytest.approx(program["norms"][step][name], rel=1e-5), (step, name, norm, program["norms"][step])
    described = json.loads(cli(target.pid, "torch", "--format", "json").stdout)
    assert described["step"] == 12 and described["step_source"] == "optimizer", described


def test_an_optimizer_stepped_every_few_loops_does_not_mark_steps(python, spawn, cli):
    require_torch(python)
    target = spawn(python, LOOP, args=["aux"], env={"RANKSCOPE_TORCH": "trace,grads,every=1"}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    steps = query(cli, target.pid, "SELECT step FROM python.torch_steps ORDER BY step")
    assert [r["step"] for r in steps] == list(range(12)), steps
    rows = query(cli, target.pid, "SELECT step, param, norm FROM python.grad_stats WHERE step >= 1 AND param <> '2.bias' ORDER BY step, param")
    assert [(r["step"], r["param"]) for r in rows] == [(step, name) for step in range(1, 12) for name in PARAMS if name != "2.bias"], rows
    for r in rows:
        assert r["norm"] == pytest.approx(program["norms"][r["step"]][r["param"]], rel=1e-5), r


def test_an_optimizer_stepped_every_few_loops_and_seen_first_gives_way(python, spawn, cli):
    """The first optimizer seen stepping marks steps until one is seen
    that steps more often: where the clock starts in the loop (ranks start
    theirs at different points) does not decide what a step is."""
    require_torch(python)
    target = spawn(python, LOOP, args=["aux-first"], env={"RANKSCOPE_TORCH": "trace,grads,every=1"}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    steps = [r["step"] for r in query(cli, target.pid, "SELECT step FROM python.torch_steps ORDER BY step")]
    # The loop's first step ended at the auxiliary one; the second showed
    # the other stepping twice to its once; from the third, one step a
    # loop, numbered by the Adam's own count as the loop numbers them.
    assert steps[-9:] == list(range(3, 12)), steps
    rows = query(cli, target.pid, "SELECT step, param, norm FROM python.grad_stats WHERE step >= 3 AND param <> '2.bias' ORDER BY step, param")
    assert [(r["step"], r["param"]) for r in rows] == [(step, name) for step in range(3, 12) for name in PARAMS if name != "2.bias"], rows
    for r in rows:
        assert r["norm"] == pytest.approx(program["norms"][r["step"]][r["param"]], rel=1e-5), r
    described = json.loads(cli(target.pid, "torch", "--format", "json").stdout)
    assert described["step"] == 12 and described["trace"]["numbered"] == "optimizer", described


def test_under_gradient_accumulation_a_steps_loss_is_its_micro_batches_mean(python, spawn, cli):
    require_torch(python)
    # A warning of the probe's own (float() of a loss that needs grad) would
    # be the program's stderr: made an error, it turns the trace off.
    quiet = {"PYTHONWARNINGS": "error::UserWarning:rankscope._probe.torch.trace"}
    target = spawn(python, LOOP, args=["accumulate"], env={"RANKSCOPE_TORCH": "trace,every=1", **quiet}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    rows = query(cli, target.pid, "SELECT step, loss, samples FROM python.torch_steps ORDER BY step")
    assert [r["step"] for r in rows] == list(range(12)), rows
    # (Step 0 was run before the probe had seen the model.)
    for r in rows[1:]:
        # To the bit: the four micro-batches' losses summed in their order.
        assert r["loss"] == program["losses"][r["step"]], (r, program["losses"])
        assert r["samples"] == 32, r
    assert json.loads(cli(target.pid, "torch", "--format", "json").stdout)["trace"]["errors"] == 0


# Four micro-batches a step, each waiting 30 ms for its data.
SLOW_DATA = """
import sys, time
import torch
import torch.nn as nn

torch.manual_seed(0)


class Returns(nn.Module):
    # A model that returns its loss, as Hugging Face's do given labels.
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def forward(self, x, labels):
        return nn.functional.mse_loss(self.net(x), labels)


returns = sys.argv[1] == "returns"
model = Returns() if returns else nn.Linear(8, 1)
criterion = nn.MSELoss()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(8):
    for micro in range(4):
        time.sleep(0.03)
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        loss = model(x, y) if returns else criterion(model(x), y)
        (loss / 4).backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("model", ["returns", "loss-module"])
def test_under_gradient_accumulation_the_data_wait_is_every_micro_batchs(python, spawn, cli, model):
    require_torch(python)
    # It was the first micro-batch's only: 30 ms of the 120.
    target = spawn(python, SLOW_DATA, args=[model], env={"RANKSCOPE_TORCH": "trace,every=1"}, wait=False)
    assert target.proc.wait(timeout=120) == 0
    result = cli("query", "--run", target.script.parent / "run", "SELECT step, step_ms, dataloader_wait_ms FROM python.torch_steps WHERE step > 0 ORDER BY step", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == 7, rows
    for row in rows:
        assert 4 * 30 <= row["dataloader_wait_ms"] <= row["step_ms"], rows


GAN = """
import json, time
import torch
import torch.nn as nn

torch.manual_seed(0)
netG = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
netD = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
bce = nn.BCEWithLogitsLoss()
optD = torch.optim.Adam(netD.parameters(), lr=1e-3)
optG = torch.optim.Adam(netG.parameters(), lr=1e-3)
ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
norms, losses = [], []
for it in range(12):
    real, z = torch.randn(8, 8), torch.randn(8, 4)
    optD.zero_grad()
    fake = netG(z)
    real_loss, fake_loss = bce(netD(real), ones), bce(netD(fake.detach()), zeros)
    (real_loss + fake_loss).backward()
    seen = {"netD." + name: p.grad.norm().item() for name, p in netD.named_parameters()}
    optD.step()
    optG.zero_grad()
    g_loss = bce(netD(fake), ones)
    g_loss.backward()
    seen.update({"netG." + name: p.grad.norm().item() for name, p in netG.named_parameters()})
    optG.step()
    norms.append(seen)
    total = 0.0
    for value in (real_loss.item(), fake_loss.item(), g_loss.item()):
        total += value
    losses.append(total / 3)
print("RESULT " + json.dumps({"norms": norms, "losses": losses}), flush=True)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_gans_two_models_are_named_apart_and_its_step_ends_after_the_generators_update(python, spawn, cli):
    require_torch(python)
    target = spawn(python, GAN, env={"RANKSCOPE_TORCH": "trace,grads,every=1"}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    # Each model's modules after the variable that holds it: both are a
    # Sequential of Linear, ReLU, Linear, whose own names are alike.
    modules = query(cli, target.pid, "SELECT DISTINCT module FROM python.torch_trace ORDER BY module")
    assert [r["module"] for r in modules] == [f"{net}{child}" for net in ("netD", "netG") for child in ("", ".0", ".1", ".2")], modules
    rows = query(cli, target.pid, "SELECT step, param, module, norm FROM python.grad_stats WHERE step >= 3 ORDER BY step, param")
    got = {}
    for r in rows:
        got.setdefault(r["step"], {})[r["param"]] = r["norm"]
        assert r["param"].startswith(r["module"] + "."), r
    assert sorted(got) == list(range(3, 12)), rows
    for step, params in got.items():
        # The discriminator's update and the generator's, of the same loop.
        assert sorted(params) == sorted(program["norms"][step]), params
        for name, norm in params.items():
            assert norm == pytest.approx(program["norms"][step][name], rel=1e-5), (step, name)
    # The models and optimizers by their variables.
    text = cli(target.pid, "torch").stdout
    assert "model netG: " in text and "model netD: " in text, text
    assert {line.split(":")[0].split(" ", 2)[2] for line in text.splitlines() if line.startswith("optimizer ")} == {"(optD)", "(optG)"}, text
    steps = query(cli, target.pid, "SELECT step, loss FROM python.torch_steps WHERE step >= 3 ORDER BY step")
    assert [r["loss"] for r in steps] == program["losses"][3:], (steps, program["losses"])


def test_a_validation_pass_between_steps_is_not_the_steps_loss_or_batch(python, spawn, cli):
    require_torch(python)
    target = spawn(python, LOOP, args=["validate"], env={"RANKSCOPE_TORCH": "trace,every=1"}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    rows = query(cli, target.pid, "SELECT step, loss, samples FROM python.torch_steps WHERE step >= 1 ORDER BY step")
    assert [r["step"] for r in rows] == list(range(1, 12)), rows
    for r in rows:
        # The training batch's loss and size, not theirs mixed with the
        # validation's (a batch of 32 without grad).
        assert r["samples"] == 8, r
        assert r["loss"] == pytest.approx(program["losses"][r["step"]], rel=1e-6), (r, program["losses"])


# Models that come mid-run: an inference loop (steps marked by
# rankscope.step()) that swaps its model for another, and a training loop
# that adds a second model with its own optimizer.
COMING = """
import sys, time
import torch
import torch.nn as nn
import rankscope

torch.manual_seed(0)
MODE = sys.argv[1]
netA = nn.Sequential(nn.Linear(4, 4))
optimizers = [torch.optim.Adam(netA.parameters(), lr=1e-3)] if MODE == "second" else []
netB = None
print("READY", flush=True)
for it in range(100000):
    if it == 20:
        if MODE == "swap":
            netA = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))  # the first is freed
        else:
            netB = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
            optimizers.append(torch.optim.Adam(netB.parameters(), lr=1e-3))
    x = torch.randn(2, 4)
    if MODE == "swap":
        with torch.no_grad():
            netA(x)
        rankscope.step()
    else:
        for opt in optimizers:
            opt.zero_grad()
        loss = netA(x).pow(2).mean() + (netB(x).pow(2).mean() if netB is not None else 0)
        loss.backward()
        for opt in optimizers:
            opt.step()
    time.sleep(0.005)
"""


@pytest.mark.parametrize("mode,module", [("swap", "2"), ("second", "netB.2")])
def test_a_model_that_comes_mid_run_is_traced(python, spawn, cli, mode, module):
    require_torch(python)
    target = spawn(python, COMING, args=[mode], env={"RANKSCOPE_TORCH": "trace,every=1"}, wait=False)
    target.wait_for_line("READY")
    deadline = time.monotonic() + 60
    while True:
        rows = query(cli, target.pid, f"SELECT count(*) AS n FROM python.torch_trace WHERE module = '{module}'")
        if rows[0]["n"] > 0:
            break
        assert time.monotonic() < deadline, query(cli, target.pid, "SELECT DISTINCT module FROM python.torch_trace")
        time.sleep(0.3)
    status = json.loads(cli(target.pid, "torch", "--format", "json").stdout)
    assert status["trace"]["on"], status


# A fine-tuning phase with an optimizer of its own, whose count starts
# again at 0. The trace is turned on a second time during it.
PHASES = """
import os, sys, time
import torch
import torch.nn as nn

torch.manual_seed(0)
go = sys.argv[1]
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
for phase, steps in ((1, 6), (2, 8)):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(steps):
        if phase == 2 and i == 3:
            print("WAITING", flush=True)
            while not os.path.exists(go):
                time.sleep(0.01)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print("DONE", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_second_trace_on_keeps_the_running_clocks_step_numbers(python, spawn, cli, tmp_path):
    require_torch(python)
    go = tmp_path / "go"
    target = spawn(python, PHASES, args=[str(go)], env={"RANKSCOPE_TORCH": "trace,every=1"}, wait=False)
    target.wait_for_line("WAITING")
    on = cli(target.pid, "torch", "trace", "on")
    assert on.returncode == 0, on.stderr
    go.touch()
    target.wait_for_line("DONE")
    steps = [r["step"] for r in query(cli, target.pid, "SELECT step FROM python.torch_steps ORDER BY ts")]
    # Numbered from the program's start, 14 steps in all: not sent back to
    # the fine-tuning optimizer's count (4 and on again) by the second
    # `trace on`. The step it came in is not seen whole, so has no row.
    assert steps == sorted(set(steps)) and steps[-1] == 13, steps
    assert 9 not in steps and {10, 11, 12} <= set(steps), steps


# A loss made by a function (no loss module, a model that returns logits)
# is the scalar the program calls backward on: as it is, or, under a
# GradScaler, divided by the scaler's own scale. A loss module used only
# for validation (without grad) does not stand in for it; under gradient
# accumulation with each micro-batch's loss divided by their number, the
# step's loss is their sum, as the program logs it. The program prints each
# step's loss and its final weights' bits, run with and without the trace.
FUNCTIONAL = """
import json, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

MODE = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if MODE == "scaler" else None
data = torch.Generator().manual_seed(1)
losses = []
criterion = nn.CrossEntropyLoss()
for it in range(12):
    if MODE == "accumulation":
        optimizer.zero_grad()
        total = 0.0
        for micro in range(4):
            x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
            loss = F.cross_entropy(model(x), y) / 4
            total += loss.item()
            loss.backward()
        losses.append(total)
        optimizer.step()
        continue
    x, y = torch.randn(16, 8, generator=data), torch.randint(0, 4, (16,), generator=data)
    optimizer.zero_grad()
    logits = model(x)
    if MODE == "arithmetic":
        loss = (logits - F.one_hot(y, 4)).pow(2).mean()
    else:
        loss = F.cross_entropy(logits, y)
    losses.append(loss.item())
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    if MODE == "validation" and it % 2:
        with torch.no_grad():
            criterion(model(x), y)
bits = [[v.hex() for v in p.detach().flatten().tolist()] for p in model.parameters()]
print("RESULT " + json.dumps({"losses": losses, "bits": bits}), flush=True)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("mode", ["cross_entropy", "arithmetic", "scaler", "validation", "accumulation"])
def test_a_loss_made_by_a_function_is_the_one_backward_was_called_on(python, spawn, cli, mode):
    require_torch(python)
    import subprocess

    if mode == "scaler" and subprocess.run([python, "-c", "import torch; torch.amp.GradScaler('cpu')"], capture_output=True).returncode != 0:
        pytest.skip("this torch has no GradScaler for the CPU")
    bare = spawn(python, FUNCTIONAL, args=[mode], wait=False)
    without = json.loads(bare.wait_for_line("RESULT").split(" ", 1)[1])
    quiet = {"PYTHONWARNINGS": "error::UserWarning:rankscope._probe.torch.trace"}
    target = spawn(python, FUNCTIONAL, args=[mode], env={"RANKSCOPE_TORCH": "trace,every=1", **quiet}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    # Nothing the program computes changed.
    assert program == without
    rows = query(cli, target.pid, "SELECT step, loss FROM python.torch_steps ORDER BY step")
    assert [r["step"] for r in rows] == list(range(12)), rows
    # (Step 0 ran before the probe had seen the model; step 1's forward
    # came before the stand-in went on.)
    for r in rows[2:]:
        assert r["loss"] == program["losses"][r["step"]], (r, program["losses"])
    assert json.loads(cli(target.pid, "torch", "--format", "json").stdout)["trace"]["errors"] == 0


# Steps whose optimizer step is skipped: by the program on a non-finite
# loss (its guard clears the gradients and goes on), or by a GradScaler
# that found an overflow. Each is a step of its own, ended where the
# program clears the gradients no optimizer step used, so the rows are
# numbered as the program counts its iterations.
SKIPS = """
import json, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

MODE = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3) if MODE == "scaler" else None
data = torch.Generator().manual_seed(1)
losses, skipped = [], []
for it in range(12):
    x, y = torch.randn(8, 16, generator=data), torch.randint(0, 4, (8,), generator=data)
    if MODE == "guard" and it == 5:
        x[0, 0] = float("nan")
    if scaler is not None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        optimizer.zero_grad()
    else:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        skipped.append(not torch.isfinite(loss).item())
        if skipped[-1]:
            optimizer.zero_grad()
            losses.append(None)
            continue
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
print("RESULT " + json.dumps({"losses": losses, "skipped": skipped}), flush=True)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("mode", ["guard", "scaler"])
def test_a_step_whose_optimizer_step_was_skipped_is_a_step_of_its_own(python, spawn, cli, mode):
    require_torch(python)
    import subprocess

    if mode == "scaler" and subprocess.run([python, "-c", "import torch; torch.amp.GradScaler('cpu')"], capture_output=True).returncode != 0:
        pytest.skip("this torch has no GradScaler for the CPU")
    target = spawn(python, SKIPS, args=[mode], env={"RANKSCOPE_TORCH": "trace,every=1"}, wait=False)
    program = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    assert any(program["skipped"]) and not all(program["skipped"]), program  # the premise
    rows = query(cli, target.pid, "SELECT step, loss, optimizer_ms FROM python.torch_steps ORDER BY step")
    assert [r["step"] for r in rows] == list(range(12)), rows
    for r in rows:
        skipped = program["skipped"][r["step"]]
        assert (r["optimizer_ms"] is None) == skipped, (r, program)
        # (The model is found at the first boundary: steps 0 and 1 have no loss.)
        if r["step"] >= 2 and program["losses"][r["step"]] is not None:
            assert r["loss"] == program["losses"][r["step"]], (r, program)


# Steps' rows are kept natively and taken by the store (before a read, and
# on its own thread before each write to disk). A store that writes nothing
# to disk (RANKSCOPE_STORE=0) and that no one reads still keeps a bounded
# number: past 4,096 the thread that keeps them hands them over itself.
MANY_STEPS = """
import sys, time
import torch
import torch.nn as nn

model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.randn(8, 1)
for _ in range(int(sys.argv[1])):
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
print("DONE", flush=True)
while True:
    time.sleep(0.1)
"""


def test_rows_kept_for_a_store_that_writes_nothing_stay_bounded_and_all_reach_a_reader(python, spawn, cli):
    require_torch(python)
    steps = 9000
    target = spawn(python, MANY_STEPS, args=[str(steps)], env={"RANKSCOPE_TORCH": "trace,every=1", "RANKSCOPE_STORE": "0"},
                   wait=False)
    target.wait_for_line("DONE")
    kept = cli(target.pid, "eval", "__import__('rankscope._native').__dict__['_native'].torch_rows_kept()")
    assert kept.returncode == 0, kept.stderr
    step_rows, traced = eval(kept.stdout.strip())  # noqa: S307 - a tuple of two ints, printed by our own probe
    assert 0 < step_rows < 4096 and 0 < traced < 4096, kept.stdout
    rows = query(cli, target.pid, "SELECT count(*) AS n, min(step) AS first, max(step) AS last FROM python.torch_steps")
    # Every step, none lost or doubled on its way.
    assert rows[0]["n"] == rows[0]["last"] - rows[0]["first"] + 1 and rows[0]["last"] == steps - 1, rows
    assert rows[0]["n"] >= steps - 1, rows
    sampled = query(cli, target.pid, "SELECT count(*) AS n FROM python.torch_steps WHERE sampled")
    trace = query(cli, target.pid, "SELECT count(DISTINCT step) AS n FROM python.torch_trace")
    assert trace[0]["n"] == sampled[0]["n"] >= steps - 2, (trace, sampled)
