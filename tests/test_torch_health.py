"""The training's health, on a real training loop (torch on CPU): the
NaN/Inf watch names the module and step where a non-finite value first
appeared (forward and backward), gradient and activation statistics fill
their tables, and none of it changes what the model computes."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from conftest import query_json
from test_torch import run_steps, torch_python  # noqa: F401 - a fixture

# An MLP with two traps: `boom` turns its output to NaN at the step given
# by --nan-forward, `back` passes values through unchanged but sends NaN
# gradients back at the step given by --nan-backward. Steps run when told
# (`budget`), as in test_torch.py.
TRAIN = """
import sys, time
import torch
from torch import nn

torch.manual_seed(0)


def flag(name):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else -1


NAN_FORWARD, NAN_BACKWARD = flag("--nan-forward"), flag("--nan-backward")
NAN_LOSS_GRAD = flag("--nan-loss-grad")
NAN_INPUT = flag("--nan-input")
NAN_LOSS_FN = flag("--nan-loss-fn")
METRIC = "--metric" in sys.argv  # the model called again without grad, on clean data
LOSS = sys.argv[sys.argv.index("--loss") + 1] if "--loss" in sys.argv else "module"
DROPOUT = "--dropout" in sys.argv
KEYWORD = "--keyword" in sys.argv  # the model called as model(x=...)
DEVICE = "cuda" if "--cuda" in sys.argv else "cpu"  # test_torch_cuda.py
# optimizer.step(closure): SGD's one call, or LBFGS's several a step.
CLOSURE = sys.argv[sys.argv.index("--closure") + 1] if "--closure" in sys.argv else None
SPLIT = "--split" in sys.argv  # two optimizers, the body's and the head's; fc1's bias frozen
ACCUMULATE = flag("--accumulate")  # micro-batches a step, each with its backward (-1: one forward a step)
NAN_MICRO = flag("--nan-micro")  # the micro-batch the NaN is made in (-1: each)
done = 0
micro = 0


def hit(at, x=None):
    if NAN_MICRO < 0 or x is None:
        return done == at and (NAN_MICRO < 0 or micro == NAN_MICRO)
    # Under accumulation a module tells the micro-batch by its input (a
    # replay runs after the loop): a finite mark that the layers carry on.
    return done == at and bool(x.detach().abs().max() > 1e3)


class Boom(nn.Module):
    def forward(self, x):
        if hit(NAN_FORWARD, x):
            return x * float("nan")
        return x


class BadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Back(nn.Module):
    def forward(self, x):
        return BadGrad.apply(x) if hit(NAN_BACKWARD, x) else x


class BadLoss(nn.modules.loss._Loss):
    # A loss whose value is finite but whose gradient is NaN at that step.
    def forward(self, out, target):
        loss = nn.functional.mse_loss(out, target)
        return BadGrad.apply(loss) if done == NAN_LOSS_GRAD else loss


class NoisyLoss(nn.modules.loss._Loss):
    # Draws from the RNG at each call (as sampled losses do); adds 0.
    def forward(self, out, target):
        return nn.functional.mse_loss(out, target) + 0.0 * torch.rand(())


def log_target(out, target):
    # A loss function whose own code makes the NaN (a log of a negative
    # number), in the value and in the gradient it sends back.
    shift = -10.0 if done == NAN_LOSS_FN else 0.0
    return ((torch.log(target.abs() + 0.5 + shift) - out) ** 2).mean()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.2) if DROPOUT else nn.Identity()
        self.boom = Boom()
        self.fc2 = nn.Linear(32, 32)
        self.back = Back()
        self.act2 = nn.ReLU()
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.act2(self.back(self.fc2(self.boom(self.drop(self.act1(self.fc1(x))))))))


model = MLP().to(DEVICE)
criterion = {"module": nn.MSELoss(), "functional": nn.functional.mse_loss, "bad": BadLoss(), "noisy": NoisyLoss(), "log": log_target}[LOSS]
if CLOSURE == "lbfgs":
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
elif SPLIT:
    model.fc1.bias.requires_grad_(False)
    optimizer = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("head.") and p.requires_grad], lr=1e-2, momentum=0.9)
    head_optimizer = torch.optim.SGD(model.head.parameters(), lr=1e-2)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
data = torch.Generator().manual_seed(1)
losses = []


def train_step():
    global done, micro
    if ACCUMULATE > 0:
        optimizer.zero_grad()
        total = 0.0
        for micro in range(ACCUMULATE):
            x = torch.randn(8, 16, generator=data).to(DEVICE)
            target = torch.randn(8, 1, generator=data).to(DEVICE)
            if hit(NAN_INPUT):
                x[2, 5] = float("nan")
            if micro == NAN_MICRO and done in (NAN_FORWARD, NAN_BACKWARD):
                x[0, 0] = 1e6
            loss = criterion(model(x), target) / ACCUMULATE
            loss.backward()
            total = total + loss.detach()
        micro = 0
        optimizer.step()
        losses.append(total)
        done += 1
        return
    x = torch.randn(8, 16, generator=data).to(DEVICE)
    target = torch.randn(8, 1, generator=data).to(DEVICE)
    if done == NAN_INPUT:
        x[2, 5] = float("nan")
    if CLOSURE:
        def closure():
            optimizer.zero_grad()
            loss = criterion(model(x), target)
            loss.backward()
            return loss

        loss = optimizer.step(closure)
        losses.append(loss.detach().clone())
        done += 1
        return
    out = model(x=x) if KEYWORD else model(x)
    if METRIC:
        with torch.no_grad():
            model(torch.ones(8, 16, device=DEVICE))
    loss = criterion(out, target)
    optimizer.zero_grad()
    if SPLIT:
        head_optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if SPLIT:
        head_optimizer.step()
    losses.append(loss.detach().clone())
    done += 1


def save(path):
    rng = torch.cuda.get_rng_state() if DEVICE == "cuda" else None
    torch.save({"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "rng": torch.get_rng_state(), "cuda_rng": rng}, path)


if "--steps" in sys.argv:
    for _ in range(int(sys.argv[sys.argv.index("--steps") + 1])):
        train_step()
    save(sys.argv[sys.argv.index("--save") + 1])
    sys.exit(0)

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


def on(cli, pid, *args) -> str:
    result = cli(pid, "torch", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


# A loss module: the root's output goes to the watch's Python (a loss
# module may be called on it). A loss function, and the input given by
# keyword: the root stand-in keeps the step's input natively, the
# pre-hook checks the sentinels natively, and the replay is called with
# the keywords it kept (nan_arm.rs).
@pytest.mark.parametrize("call", [[], ["--keyword", "--loss", "functional"]], ids=["module-loss", "keyword-functional"])
def test_a_forward_nan_is_traced_to_its_module_and_step(torch_python, spawn, cli, call):
    target = spawn(torch_python, TRAIN, args=["--nan-forward", "4", *call])
    armed = on(cli, target.pid, "nan", "on")
    assert "nan watch: armed" in armed and "no non-finite loss or gradient seen" in armed, armed
    run_steps(cli, target, 3, 3)
    assert "no non-finite loss or gradient seen" in on(cli, target.pid, "nan")
    run_steps(cli, target, 3, 6)
    text = on(cli, target.pid, "nan")
    # Steps are numbered from 0: the fifth step is step 4.
    assert "step 4: first non-finite in forward, module boom (Boom): its output (256 non-finite)" in text, text
    assert "inputs:  min 0.0000e0 max" in text and ", 0 non-finite" in text, text
    # The loss's NaN, said as such (JSON has no NaN: it went as null, and
    # the line was left out). A loss function's value is nowhere the
    # watch's stand-ins look: it is read from the training loop's frame.
    assert "loss: nan" in text.lower(), text
    if call:
        assert "the loss was read from `loss` in train_step (" in text, text
    rows = query_json(cli, target.pid, "SELECT step, stage, module, module_type, input_nonfinite, weight_nonfinite, record FROM python.nan_events")
    assert len(rows) == 1, rows
    event = rows[0]
    assert (event["step"], event["stage"], event["module"], event["module_type"]) == (4, "forward", "boom", "Boom")
    assert event["input_nonfinite"] == 0 and event["weight_nonfinite"] is None
    # The crash-style record: the training thread's stack at the trip.
    record = json.loads(Path(event["record"]).read_text())
    assert record["source"] == "nan-watch" and record["nan_event"]["module"] == "boom"
    frames = record["exceptions"][-1]["frames"]
    assert any(f["func"] == "train_step" for f in frames), [f["func"] for f in frames]
    listed = cli("crashes", "--format", "json", env={"RANKSCOPE_RUN_DIR": str(Path(event["record"]).parent)})
    assert listed.returncode == 0, listed.stderr
    assert '"rankscope.NonFiniteValue"' in listed.stdout, listed.stdout


@pytest.mark.parametrize("loss", ["module", "functional"])
def test_a_backward_nan_is_traced_to_its_module_and_step(torch_python, spawn, cli, loss):
    # With a loss module, the search's backward starts from the loss made
    # again; with a loss function it cannot be, and starts from ones at the
    # model's output: the same module is named.
    target = spawn(torch_python, TRAIN, args=["--nan-backward", "2", "--loss", loss])
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 4, 4)
    text = on(cli, target.pid, "nan")
    assert "step 2: first non-finite in backward, module back (Back)" in text, text
    rows = query_json(cli, target.pid, "SELECT step, stage, module, loss, detail FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(2, "backward", "back")]
    start = "the loss (MSELoss, called again with the step's target)" if loss == "module" else "ones at the model's output"
    assert start in rows[0]["detail"], rows
    if loss == "module":
        assert rows[0]["loss"] > 0, "the forward was finite"
    off = on(cli, target.pid, "nan", "off")
    assert "nan watch: off" in off
    hooks = "sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())"
    assert cli(target.pid, "eval", hooks).stdout.strip() == "0"
    stand_ins = "sum('forward' in vars(m) for m in [*model.modules(), criterion] if isinstance(m, nn.Module))"
    assert cli(target.pid, "eval", stand_ins).stdout.strip() == "0"


@pytest.mark.parametrize("loss", ["module", "functional"])
def test_a_nan_input_is_named_though_the_model_is_called_again_without_grad(torch_python, spawn, cli, loss):
    # The search replays the input the loss came from, not the metric's:
    # a call without grad keeps nothing (natively with a loss function,
    # through the watch's Python with a loss module).
    target = spawn(torch_python, TRAIN, args=["--nan-input", "2", "--metric", "--loss", loss])
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 4, 4)
    rows = query_json(cli, target.pid, "SELECT step, stage, nonfinite, input_nonfinite FROM python.nan_events")
    assert [(r["step"], r["stage"], r["nonfinite"], r["input_nonfinite"]) for r in rows] == [(2, "input", 1, 1)], rows


# Modules as real models have them: one returns a dataclass, one
# `(out, (h, c))` as nn.LSTM does, and a recurrent cell runs five times a
# step. From step 3 the one named by argv[1] makes a NaN: `block` and `enc`
# in the output they nest, `cell` in its backward only (a square root's
# gradient at 0, in each of its calls).
# The tail of a target program that defines `train_step()` and `done`: as
# many steps as a test asks (`budget`, set through eval by run_steps), then
# "DONE n".
ON_REQUEST = """
budget = 0
print("READY", flush=True)
while True:
    if budget > 0:
        train_step()
        done += 1
        budget -= 1
        if budget == 0:
            print(f"DONE {done}", flush=True)
    else:
        time.sleep(0.002)
"""


NESTED = """
import dataclasses, sys, time
import torch
from torch import nn

torch.manual_seed(0)
WHICH = sys.argv[1]
done = 0


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        return Hidden(h * float("nan") if WHICH == "block" and done >= 3 else h)


class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        s = y.mean(0)
        if WHICH == "enc" and done >= 3:
            s = s * float("nan")
        return y, (s, y.std(0))


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, h):
        z = self.lin(x + h)
        if WHICH == "cell" and done >= 3:
            z = torch.sqrt(z * (z > 0).float())
        return torch.tanh(z)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.enc = Enc()
        self.cell = Cell()
        self.head = nn.Linear(8, 1)

    def forward(self, xs):
        h = torch.zeros(xs.shape[0], 8)
        for t in range(xs.shape[1]):
            y, (s, _) = self.enc(self.block(xs[:, t]).h)
            h = self.cell(y + s, h)
        if WHICH == "net" and done >= 3:
            h = torch.sqrt(h - 2)  # tanh's output is above -1: every value is NaN
        return self.head(h)


model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.MSELoss()


def train_step():
    loss = criterion(model(torch.randn(6, 5, 4)), torch.randn(6, 1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
""" + ON_REQUEST


@pytest.mark.parametrize("which, module, stage, what", [
    ("block", "block", "forward", "its output"),
    ("enc", "enc", "forward", "its output"),
    ("cell", "cell", "backward", "the gradient it sent back (its output's gradient was finite); call 5 of its 5 in the step"),
    ("net", "Net", "forward", "its own forward code, before it called head, which it handed 48 non-finite values"),
])
def test_a_nan_in_a_nested_output_or_a_module_called_again_is_named(torch_python, spawn, cli, which, module, stage, what):
    """A dataclass or `(out, (h, c))` output holds the NaN the search looks
    for; a cell called five times a step sends each call's gradient into
    the call before it, so only the call that turned a finite gradient
    non-finite names it; a module's own code that makes it between two
    children is named with its own inputs (finite), not the child's."""
    target = spawn(torch_python, NESTED, args=[which])
    on(cli, target.pid, "nan", "on")
    # The trace's backward sees a gradient reach a dataclass's tensor too.
    on(cli, target.pid, "trace", "on", "--backward")
    run_steps(cli, target, 2, 2)
    rows = query_json(cli, target.pid, "SELECT module, stage, calls FROM python.torch_trace WHERE module IN ('block', 'enc', 'cell') AND step = 1 ORDER BY module, stage")
    assert [(r["module"], r["stage"]) for r in rows] == [(m, s) for m in ["block", "cell", "enc"] for s in ["backward", "forward"]], rows
    assert all(r["calls"] == 5 for r in rows if r["stage"] == "forward"), rows
    run_steps(cli, target, 3, 5)
    rows = query_json(cli, target.pid, "SELECT step, stage, module, what, input_nonfinite FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(3, stage, module)], rows
    assert rows[0]["what"].startswith(what), rows
    if stage == "forward":
        assert rows[0]["input_nonfinite"] == 0, rows


CHECKPOINTED_ONCE = """
import time
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
done = 0


class Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if done >= 3:
            y = torch.sqrt(y * 0.0) + y  # finite forward, a NaN gradient at 0
        return torch.relu(y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.bad = Bad()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(checkpoint(self.bad, self.inp(x), use_reentrant=False))


model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step():
    loss = model(torch.randn(6, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
""" + ON_REQUEST


def test_a_backward_nan_under_a_checkpoint_names_the_module_called_once(torch_python, spawn, cli):
    # The replay's backward recomputes the checkpointed block's forward:
    # that is not a second call of the step's.
    target = spawn(torch_python, CHECKPOINTED_ONCE)
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 5, 5)
    rows = query_json(cli, target.pid, "SELECT step, stage, module, what FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(3, "backward", "bad")], rows
    assert rows[0]["what"] == "the gradient it sent back (its output's gradient was finite)", rows


GAN = """
import time
import torch
from torch import nn

torch.manual_seed(0)
netG = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
netD = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
optG = torch.optim.Adam(netG.parameters(), 2e-4)
optD = torch.optim.Adam(netD.parameters(), 2e-4)
bce = nn.BCEWithLogitsLoss()
done = 0


def train_step():
    if done == 3:
        with torch.no_grad():
            netG[2].weight[0, 0] = float("inf")  # the program's own change, between steps
    fake = netG(torch.randn(8, 4))
    lossD = bce(netD(torch.randn(8, 6) + 2), torch.ones(8, 1)) + bce(netD(fake.detach()), torch.zeros(8, 1))
    optD.zero_grad()
    lossD.backward()
    optD.step()
    lossG = bce(netD(fake), torch.ones(8, 1))
    optG.zero_grad()
    lossG.backward()
    optG.step()
""" + ON_REQUEST


SPARSE = """
import time
import torch
from torch import nn

torch.manual_seed(0)
emb = nn.Embedding(20, 4, sparse=True)
head = nn.Linear(4, 1)
optimizer = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1)
data = torch.Generator().manual_seed(1)
done = 0


def train_step():
    idx = torch.randint(0, 20, (16,), generator=data)  # indices repeat: summed
    loss = head(emb(idx)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    print("NORMS", done, emb.weight.grad.coalesce().values().norm().item(), head.weight.grad.norm().item(), flush=True)
    optimizer.step()
""" + ON_REQUEST


def test_grads_of_a_sparse_gradient_are_its_values_and_the_other_parameters_still_get_rows(torch_python, spawn, cli):
    # An Embedding(sparse=True)'s gradient is read through its values; it
    # turned the whole feature off before (torch has no aminmax for it).
    target = spawn(torch_python, SPARSE)
    on(cli, target.pid, "grads", "--every", "1")
    run_steps(cli, target, 3, 3)
    truth = {}
    for line in target.output:
        if line.startswith("NORMS"):
            _, step, sparse, dense = line.split()
            truth[int(step)] = (float(sparse), float(dense))
    rows = query_json(cli, target.pid, "SELECT step, param, norm, nonfinite FROM python.grad_stats ORDER BY step, param")
    assert [r["param"] for r in rows] == ["emb.weight", "head.bias", "head.weight"] * 3, rows
    for r in rows:
        if r["param"] != "head.bias":
            want = truth[r["step"]][0 if r["param"] == "emb.weight" else 1]
            assert r["norm"] == pytest.approx(want, rel=1e-5), (r, truth)
            assert r["nonfinite"] == 0
    assert "turned itself off" not in on(cli, target.pid, "grads")


def test_a_feature_that_turned_itself_off_says_why_and_a_look_does_not_turn_it_on(torch_python, spawn, cli):
    target = spawn(torch_python, SPARSE)
    on(cli, target.pid, "grads", "--every", "2")
    fail = cli(target.pid, "eval", "import rankscope._probe.torch.stats as s; s.GRADS.failed('the optimizer pre-hook failed: ValueError: x')")
    assert fail.returncode == 0, fail.stderr
    for _ in range(2):
        look = on(cli, target.pid, "grads")
        assert "grads: off" in look and "turned itself off after an error: the optimizer pre-hook failed: ValueError: x" in look, look
        assert "`torch grads on` turns it on again" in look, look
    assert "grads: off, after an error: the optimizer pre-hook failed" in on(cli, target.pid)
    assert "grads: on, 3 parameters, every 10 steps" in on(cli, target.pid, "grads", "on")


def test_a_nan_input_made_by_another_model_names_that_models_weights(torch_python, spawn, cli):
    # The discriminator's input is the generator's output: the generator's
    # weights, non-finite before the step, are named, not the data.
    target = spawn(torch_python, GAN)
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 5, 5)
    rows = query_json(cli, target.pid, "SELECT step, stage, module, detail FROM python.nan_events")
    assert [(r["stage"], r["module"]) for r in rows] == [("update", "netG.2")], rows
    assert "the non-finite input of netD" in rows[0]["detail"], rows


def test_a_nan_made_in_a_loss_function_is_named_as_the_loss(torch_python, spawn, cli):
    # The function is not a module: neither its value nor a way to call it
    # again is known. The model's forward, and its backward from ones at
    # its output, are finite: the stage is the loss, not the last layer.
    target = spawn(torch_python, TRAIN, args=["--nan-loss-fn", "2", "--loss", "log"])
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 4, 4)
    rows = query_json(cli, target.pid, "SELECT step, stage, module, what, detail FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(2, "loss", "the loss")], rows
    # Its value, read from the training loop's frame at the trip, tells the
    # loss itself from the gradient it sent back.
    assert rows[0]["what"] == "the loss (the model's outputs were finite)", rows
    assert "the loss was read from `loss` in train_step" in rows[0]["detail"], rows
    text = on(cli, target.pid, "nan")
    assert "step 2: first non-finite in loss" in text and "loss: nan" in text.lower(), text


def test_a_loss_that_sends_nan_back_is_named(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN, args=["--nan-loss-grad", "1", "--loss", "bad"])
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 3, 3)
    rows = query_json(cli, target.pid, "SELECT step, stage, module, what FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(1, "backward", "BadLoss")], rows
    assert rows[0]["what"] == "the gradient the loss sent back to the model's output", rows


def sci(x: float) -> str:
    """`x` as the CLI writes it (Rust's {:.4e}: 7.7096e-1)."""
    mantissa, exponent = f"{x:.4e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def reference_run(python, tmp_path, steps: int, *flags: str) -> Path:
    script = tmp_path / "reference.py"
    script.write_text(textwrap.dedent(TRAIN))
    out = tmp_path / "reference.pt"
    subprocess.run([python, str(script), *flags, "--steps", str(steps), "--save", str(out)], check=True, capture_output=True, timeout=120)
    return out


# Bitwise, NaN included (a NaN's bits come out of the same computation).
SAME_BITS = (
    "import sys, torch; a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2]); "
    "bits = lambda t: t.view(torch.int32) if t.dtype == torch.float32 else t; "
    "same = lambda x, y: torch.equal(bits(x), bits(y)); "
    "assert len(a['losses']) == len(b['losses']) == int(sys.argv[3]), 'step counts differ'; "
    "assert all(same(x, y) for x, y in zip(a['losses'], b['losses'])), 'losses differ'; "
    "assert all(same(a['params'][k], b['params'][k]) for k in a['params']), 'parameters differ'; "
    "assert torch.equal(a['rng'], b['rng']), 'the RNG stream differs'; "
    "assert (a['cuda_rng'] is None) == (b['cuda_rng'] is None) and (a['cuda_rng'] is None or torch.equal(a['cuda_rng'], b['cuda_rng'])), 'the CUDA RNG stream differs'; "
    "print('EQUAL')"
)


def assert_same_bits(python, cli, target, tmp_path, steps: int, flags, timeout=120) -> None:
    """The target's losses, parameters and RNG states after `steps` steps
    are bit for bit those of the same training run without rankscope."""
    probed = tmp_path / "probed.pt"
    assert cli(target.pid, "eval", f"save({str(probed)!r})").returncode == 0
    result = subprocess.run(
        [python, "-c", SAME_BITS, str(probed), str(reference_run(python, tmp_path, steps, *flags)), str(steps)],
        capture_output=True, text=True, timeout=timeout,
    )
    assert result.stdout.strip() == "EQUAL", result.stderr


def test_a_trip_and_its_replays_change_nothing_the_program_sees(torch_python, spawn, cli, tmp_path):
    # Dropout (the step's RNG state is kept and replayed) and a loss module
    # that draws random numbers (called again by the backward search): after
    # the trip at step 2 and both replays, the losses, the parameters and
    # the RNG state are bit for bit those of a run without rankscope.
    # (BatchNorm's running statistics: the DDP test below, which reads them
    # at each step, before the NaN reaches them.)
    flags = ["--nan-backward", "2", "--dropout", "--loss", "noisy"]
    target = spawn(torch_python, TRAIN, args=flags)
    on(cli, target.pid, "nan", "on")
    on(cli, target.pid, "trace", "on")
    run_steps(cli, target, 5, 5)
    rows = query_json(cli, target.pid, "SELECT step, stage, module, detail FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(2, "backward", "back")], rows
    assert "the loss (NoisyLoss, called again with the step's target)" in rows[0]["detail"], rows
    # The trace sampled that step too: the replays added no call to it.
    calls = query_json(cli, target.pid, "SELECT step, calls FROM python.torch_trace WHERE module = 'fc1' AND stage = 'forward' ORDER BY step")
    assert calls and all(r["calls"] == 1 for r in calls), calls
    assert_same_bits(torch_python, cli, target, tmp_path, 5, flags)


@pytest.mark.parametrize("optimizer", ["sgd", "lbfgs"])
def test_a_nan_in_a_step_given_a_closure_is_named_at_its_step_and_changes_nothing(torch_python, spawn, cli, tmp_path, optimizer):
    """`optimizer.step(closure)` runs the forward and backward inside the
    step, after its pre-hook (LBFGS calls the closure several times): the
    NaN is still named at its own step and module, before the optimizer
    applies it, and the program's losses and weights are bit for bit those
    of a run without rankscope."""
    flags = ["--nan-forward", "3", "--closure", optimizer]
    target = spawn(torch_python, TRAIN, args=flags)
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 5, 5)
    rows = query_json(cli, target.pid, "SELECT step, stage, module FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(3, "forward", "boom")], rows
    assert_same_bits(torch_python, cli, target, tmp_path, 5, flags)


@pytest.mark.parametrize("flag, micro, stage, module", [
    ("--nan-input", 0, "input", "MLP"),
    ("--nan-forward", 1, "forward", "boom"),
    ("--nan-backward", 0, "backward", "back"),
])
def test_a_nan_in_an_earlier_micro_batch_is_named_with_its_own_input(torch_python, spawn, cli, tmp_path, flag, micro, stage, module):
    """Gradient accumulation: three forwards and backwards a step, one
    optimizer step. A NaN made by an earlier micro-batch is found at the
    step and replayed with that micro-batch's input, not the last one's;
    the program runs bit for bit as without rankscope."""
    flags = [flag, "3", "--nan-micro", str(micro), "--accumulate", "3"]
    target = spawn(torch_python, TRAIN, args=flags)
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 5, 5)
    rows = query_json(cli, target.pid, "SELECT step, stage, module, detail FROM python.nan_events")
    assert [(r["step"], r["stage"], r["module"]) for r in rows] == [(3, stage, module)], rows
    assert rows[0]["detail"].startswith(f"in micro-batch {micro + 1} of 3 of the step (gradient accumulation)"), rows
    assert_same_bits(torch_python, cli, target, tmp_path, 5, flags)


PER_SAMPLE = """
import time
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(6)
done = 0


def sample_loss(params, x, y):
    return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))


def train_step():
    # Per-sample gradients (DP-SGD's way): the model runs inside vmap and
    # grad, then once without grad for the loss it logs.
    x, y = torch.randn(10, 6, generator=data), torch.randint(0, 3, (10,), generator=data)
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    for name, param in model.named_parameters():
        param.grad = per_sample[name].mean(0)
    with torch.no_grad():
        F.cross_entropy(model(x), y)
    optimizer.step()
""" + ON_REQUEST


def test_activations_of_a_model_run_inside_torch_func_transforms(torch_python, spawn, cli):
    # Inside vmap the forward hook's statistics were batched tensors, and
    # torch asserted (an internal error): the feature turned itself off.
    # Calls inside a transform are left out; the step's plain call counts.
    target = spawn(torch_python, PER_SAMPLE)
    run_steps(cli, target, 2, 2)
    assert "activations: on, 1 module" in on(cli, target.pid, "activations", "--modules", "0")
    run_steps(cli, target, 4, 6)
    status = on(cli, target.pid, "activations")
    assert "disabled" not in status and "failed" not in status, status
    rows = query_json(cli, target.pid, "SELECT step, calls, shape FROM python.activation_stats WHERE module = '0' ORDER BY step")
    assert len(rows) >= 3 and all(r["calls"] == 1 and r["shape"] == "10x12" for r in rows), rows


def test_grads_and_activations_fill_their_tables_and_change_nothing(torch_python, spawn, cli, tmp_path):
    target = spawn(torch_python, TRAIN)
    grads = on(cli, target.pid, "grads", "--every", "2")
    assert "grads: on, 6 parameters, every 2 steps, into python.grad_stats" in grads, grads
    acts = on(cli, target.pid, "activations", "--modules", "act*")
    assert "activations: on, 2 modules, every 1 step, into python.activation_stats" in acts, acts
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 6, 6)

    rows = query_json(cli, target.pid, "SELECT step, param, module, numel, norm, max_abs, nonfinite, weight_norm, update_ratio, flag FROM python.grad_stats ORDER BY step, param")
    assert sorted({r["step"] for r in rows}) == [0, 2, 4]
    assert {r["param"] for r in rows} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"}
    for r in rows:
        assert r["norm"] > 0 and 0 < r["max_abs"] <= r["norm"] and r["nonfinite"] == 0, r
        assert r["weight_norm"] > 0 and 0 < r["update_ratio"] < 1, r
        assert r["module"] == r["param"].rsplit(".", 1)[0]
    assert next(r for r in rows if r["param"] == "fc1.weight")["numel"] == 16 * 32
    # Step 0 is SGD's first: its momentum buffer is the gradient, so the
    # update is lr x the gradient, and update_ratio x weight_norm is
    # 0.01 x norm (read in place on a CPU: grad_read.rs).
    for r in rows:
        if r["step"] == 0:
            update = r["update_ratio"] * r["weight_norm"]
            assert abs(update - 0.01 * r["norm"]) <= 1e-3 * 0.01 * r["norm"], r
    # `torch grads` sums up the last sampled step: its total norm (as
    # clip_grad_norm_ takes it) and its largest norms.
    last = [r for r in rows if r["step"] == 4]
    # (Looked at with no option, it keeps its own: every 2 steps.)
    summary = on(cli, target.pid, "grads")
    assert "grads: on, 6 parameters, every 2 steps" in summary, summary
    total = sum(r["norm"] ** 2 for r in last) ** 0.5
    largest = max(last, key=lambda r: r["norm"])
    assert f"step 4: total gradient norm {sci(total)} (as the optimizer was given them, after any clipping); largest: {largest['param']} {sci(largest['norm'])}," in summary, summary
    assert "flagged: none" in summary, summary

    acts = query_json(cli, target.pid, "SELECT step, module, module_type, calls, shape, mean, std, max_abs, zero_frac, nonfinite FROM python.activation_stats ORDER BY step, module")
    # Hooked from the first step that starts after `on` (step 1) to the
    # last that ended (step 5).
    assert [(r["step"], r["module"]) for r in acts] == [(s, m) for s in range(1, 6) for m in ("act1", "act2")], acts
    for r in acts:
        assert r["module_type"] == "ReLU" and r["calls"] == 1 and r["shape"] == "8x32" and r["nonfinite"] == 0
        assert r["mean"] > 0 and r["std"] > 0 and r["max_abs"] > 0 and 0 < r["zero_frac"] < 1, r

    for feature in ("grads", "activations", "nan"):
        on(cli, target.pid, feature, "off")
    status = json.loads(cli(target.pid, "torch", "--format", "json").stdout)
    assert not status["features"]["grads"]["on"] and not status["features"]["activations"]["on"]
    assert not status["features"]["nan"]["armed"] and status["features"]["nan"]["checked_steps"] == 6
    no_hooks = (
        "import torch.optim.optimizer as o; "
        "(all(not m._forward_hooks and not m._forward_pre_hooks and 'forward' not in vars(m) for m in model.modules()), "
        "len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))"
    )
    assert cli(target.pid, "eval", no_hooks).stdout.strip() == "(True, 0, 0)"
    run_steps(cli, target, 2, 8)
    probed = tmp_path / "probed.pt"
    assert cli(target.pid, "eval", f"save({str(probed)!r})").returncode == 0
    check = (
        "import sys, torch; a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2]); "
        "assert len(a['losses']) == len(b['losses']) == 8; "
        "assert all(torch.equal(x, y) for x, y in zip(a['losses'], b['losses'])), 'losses differ'; "
        "assert all(torch.equal(a['params'][k], b['params'][k]) for k in a['params']), 'parameters differ'; "
        "print('EQUAL')"
    )
    result = subprocess.run([torch_python, "-c", check, str(probed), str(reference_run(torch_python, tmp_path, 8))], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "EQUAL", result.stderr


# A program that drops its model and builds another (a sweep, a fresh
# model for evaluation): each model, its optimizer, a parameter and the last
# batch must be freed the moment the program lets go of them, as without
# rankscope, and nothing may be left for the cyclic collector.
DROP = """
import functools, gc, json, sys, time, weakref
import torch
from torch import nn

print("READY", flush=True)
torch.manual_seed(0)
gc.disable()  # what the collector would free is not freed here: only refcounts


def refuse(optimizer, args, kwargs):
    raise RuntimeError("refused")


class Scaled(nn.Module):
    # A forward that is not a plain method: the module's bound forward
    # inside a partial, which holds the module strongly.
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(64, 1)

    def _forward(self, x, scale):
        return self.inner(x) * scale

    forward = functools.partialmethod(_forward, scale=2.0)


def train(steps, refused=0, odd=False):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), Scaled() if odd else nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    for i in range(steps):
        if i == steps - refused:
            # The last steps raise inside opt.step(), after the global
            # pre-hooks (rankscope's) and before the post-hooks.
            opt.register_step_pre_hook(refuse)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        try:
            opt.step()
        except RuntimeError:
            pass
    return [weakref.ref(model), weakref.ref(opt), weakref.ref(list(model.parameters())[-1]), weakref.ref(x)]


freed = []
for steps, refused, odd in ((12, 0, False), (7, 0, False), (9, 2, False), (8, 0, True)):
    refs = train(steps, refused, odd)
    if odd:
        # A stand-in on a forward that holds its module is in a cycle with
        # it (freed by the collector, as the program's own cycles are); but
        # nothing of the probe's may hold either from outside.
        gc.collect()
    freed.append([r() is None for r in refs])
print("RESULT " + json.dumps(freed), flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("features", ["trace,every=1", "nan", "nan,grads,trace,every=2"])
def test_a_dropped_model_is_freed_at_once_with_every_feature_on(torch_python, spawn, cli, tmp_path, features):
    script = tmp_path / "drop.py"
    script.write_text(textwrap.dedent(DROP))
    alone = subprocess.Popen([torch_python, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        want = next(line for line in alone.stdout if line.startswith("RESULT "))
    finally:
        alone.kill()
        alone.wait()
    # The premise: without rankscope everything goes at once.
    assert json.loads(want[len("RESULT ") :]) == [[True] * 4] * 4, want
    target = spawn(torch_python, DROP, env={"RANKSCOPE_TORCH": features})
    got = target.wait_for_line("RESULT")
    assert got.strip() == want.strip(), f"{features}: freed at once (model, optimizer, a parameter, the batch) {got}"
    # The features were on for both models.
    steps = query_json(cli, target.pid, "SELECT count(*) AS n FROM python.torch_steps") if "trace" in features else None
    assert steps is None or steps[0]["n"] >= 18, steps
    if "grads" in features:
        # The probe's own copies of the weights (for the update ratio) went
        # with the optimizers.
        kept = cli(target.pid, "eval", "import rankscope._probe.torch.stats as s\n"
                   "sum(r.kept_bytes for _, r in s.GRADS.readers.values()) + (s.GRADS.kept is not None)")
        assert kept.returncode == 0 and kept.stdout.strip() == "0", (kept.stdout, kept.stderr)
    if "nan" in features:
        text = on(cli, target.pid, "nan")
        checked = re.search(r"nan watch: armed \((\d+) steps checked", text)
        assert checked and int(checked.group(1)) >= 18, text


def test_bad_requests_say_what_to_do(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN)
    bad = cli(target.pid, "torch", "activations", "--modules", "nope*")
    assert bad.returncode != 0
    assert "no module matches 'nope*'" in bad.stderr and "hint:" in bad.stderr, bad.stderr
    # Refused while on: the running watch goes on as it was.
    assert cli(target.pid, "torch", "activations", "--modules", "fc*").returncode == 0
    assert cli(target.pid, "torch", "activations", "--modules", "nope*").returncode != 0
    status = cli(target.pid, "torch").stdout
    assert re.search(r"^activations: on, [1-9]\d* modules", status, re.M), status
    zero = cli(target.pid, "torch", "grads", "--every", "0")
    assert zero.returncode != 0 and "--every must be 1 or more" in zero.stderr
    # An empty glob (an unset shell variable) is not taken for every module.
    for args in (["trace", "on", "--modules", ""], ["activations", "off", "--modules", " "]):
        empty = cli(target.pid, "torch", *args)
        assert empty.returncode != 0 and "--modules is empty" in empty.stderr and "hint:" in empty.stderr, empty.stderr
    assert "trace: off" in cli(target.pid, "torch").stdout
    # No process group here: recording waits for one, and says so.
    collectives = cli(target.pid, "torch", "collectives", "on")
    assert collectives.returncode == 0, collectives.stderr
    assert "collectives: on; torch.distributed is not initialised yet" in collectives.stdout
    assert "collectives: off" in cli(target.pid, "torch", "collectives", "off").stdout


def test_grads_sums_up_every_optimizers_parameters_and_counts_only_trained_ones(torch_python, spawn, cli):
    # A GAN's or a split model's two optimizers step in one step; a frozen
    # parameter never has a gradient, and no row.
    target = spawn(torch_python, TRAIN, args=["--split"])
    grads = on(cli, target.pid, "grads", "--every", "1")
    assert "grads: on, 5 parameters, every 1 step" in grads, grads
    # (The head's optimizer, called later in the loop, marks steps from
    # the third on: the step where it takes over is numbered again.)
    run_steps(cli, target, 6, 6)
    rows = query_json(cli, target.pid, "SELECT param, norm FROM python.grad_stats WHERE step = 5 ORDER BY param")
    assert [r["param"] for r in rows] == ["fc1.weight", "fc2.bias", "fc2.weight", "head.bias", "head.weight"], rows
    summary = on(cli, target.pid, "grads")
    total = sum(r["norm"] ** 2 for r in rows) ** 0.5
    largest = max(rows, key=lambda r: r["norm"])
    assert f"step 5: total gradient norm {sci(total)} (as the optimizer was given them, after any clipping); largest: {largest['param']} {sci(largest['norm'])}," in summary, summary


def test_two_optimizers_give_each_step_one_row_a_parameter_and_one_check(torch_python, spawn, cli):
    # The head's optimizer takes over marking steps at the third step, which
    # is then numbered again: that step's rows are not written twice, and
    # the watch counts steps, not each optimizer's check of one.
    target = spawn(torch_python, TRAIN, args=["--split"])
    on(cli, target.pid, "grads", "--every", "1")
    on(cli, target.pid, "nan", "on")
    run_steps(cli, target, 8, 8)
    rows = query_json(cli, target.pid, "SELECT step, param, count(*) AS n FROM python.grad_stats GROUP BY step, param HAVING count(*) > 1")
    assert rows == [], rows
    steps = query_json(cli, target.pid, "SELECT count(DISTINCT step) AS n FROM python.grad_stats")[0]["n"]
    assert steps >= 6, steps
    text = on(cli, target.pid, "nan")
    checked = int(re.search(r"nan watch: armed \((\d+) steps checked", text).group(1))
    assert 7 <= checked <= 8, text


def test_rankscope_torch_env_arms_the_watch_and_grads_before_the_model_exists(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN, args=["--nan-forward", "3"], env={"RANKSCOPE_TORCH": "nan,grads,every=2"})
    run_steps(cli, target, 5, 5)
    text = on(cli, target.pid, "nan")
    assert "nan watch: armed (5 steps checked" in text, text
    assert "step 3: first non-finite in forward, module boom (Boom): its output" in text, text
    rows = query_json(cli, target.pid, "SELECT step, count(*) AS n, sum(nonfinite) AS bad, max(flag) AS flag FROM python.grad_stats GROUP BY step ORDER BY step")
    # Step 3's update spread the NaN into every weight: step 4's gradients are all non-finite.
    assert [(r["step"], r["n"]) for r in rows] == [(0, 6), (2, 6), (4, 6)], rows
    assert rows[1]["bad"] == 0 and rows[1]["flag"] is None
    assert rows[2]["bad"] > 0 and rows[2]["flag"] == "nonfinite", rows
    summary = on(cli, target.pid, "grads")
    assert "step 4: total gradient norm nan" in summary and "flagged: fc1.weight nonfinite (norm nan)" in summary, summary


# Armed at start, the watch knows no model until the optimizer's first step:
# a NaN in that first step (a bad initialisation, a bad first batch) was
# not located ("no forward of a model was seen"). Torch's global module
# hooks keep the first step's forward until the models are hooked, and go.
@pytest.mark.parametrize("trap", ["--nan-forward", "--nan-backward"])
def test_a_nan_in_the_first_step_is_located_when_armed_at_start(torch_python, spawn, cli, trap):
    target = spawn(torch_python, TRAIN, args=[trap, "0"], env={"RANKSCOPE_TORCH": "nan"})
    run_steps(cli, target, 2, 2)
    text = on(cli, target.pid, "nan")
    if trap == "--nan-forward":
        assert "step 0: first non-finite in forward, module boom (Boom): its output" in text, text
    else:
        assert "step 0: first non-finite in backward, module back (Back)" in text, text
    assert cli(target.pid, "eval", NO_GLOBAL_HOOKS).stdout.strip() == "(False, 0)"


# Every table of torch's global module hooks empty: `_has_any_global_hook()`
# reads the with_kwargs table, whose entry torch's own handle leaves behind
# (compiled modules then warn of hooks at every call).
NO_GLOBAL_HOOKS = "import torch.nn.modules.module as m; (bool(m._has_any_global_hook()), len(m._global_module_registration_hooks))"


INFER = """
import torch
model = torch.nn.Linear(4, 4)
with torch.no_grad():
    for _ in range(1100):
        model(torch.ones(1, 4))
print("READY", flush=True)
import time
while True:
    time.sleep(0.05)
"""


def test_the_first_step_hooks_go_from_a_program_that_does_not_train(torch_python, spawn, cli):
    target = spawn(torch_python, INFER, env={"RANKSCOPE_TORCH": "nan"})
    assert cli(target.pid, "eval", NO_GLOBAL_HOOKS).stdout.strip() == "(False, 0)"
    # What the watch does not look at, and what a loop without an
    # optimizer needs for steps, are said rather than left silent.
    nan = on(cli, target.pid, "nan")
    assert "no non-finite loss or gradient seen" in nan and "an inference loop" in nan, nan
    trace = on(cli, target.pid, "trace", "on")
    assert "note: no optimizer found" in trace and "rankscope.step()" in trace, trace


# A learning rate too large: at step 2 the loss overflows (a functional loss,
# which the watch does not see) and so do some weights' gradients, but not
# the first module's bias, the sentinel checked at most steps. A program
# that stops there left no event at all; one that goes on was told
# "forward, module 0, its output" at step 3, where the step's weights were
# already non-finite.
DIVERGE = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)
torch.set_num_threads(1)


class Net(nn.Module):
    # The first module with parameters, where the watch's sentinel is, is
    # a side branch with a loss term of its own: it stays finite while the
    # main branch diverges, so only the full check (every 8th step) or
    # the check at exit sees the divergence.
    def __init__(self):
        super().__init__()
        self.side = nn.Linear(8, 1)
        self.main = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.main(x), self.side(torch.ones(1, 8))


class Plain(nn.Module):
    # Without the side branch: the sentinel is the main branch's first weight.
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.main(x), torch.zeros(1, 1)


model = Net() if "--side" in sys.argv else Plain()
opt = torch.optim.SGD(model.parameters(), lr=5.0)
for step in range(int(sys.argv[1])):
    x = torch.randn(16, 8) * 10
    y = torch.randn(16, 1)
    opt.zero_grad()
    out, side = model(x)
    loss = F.mse_loss(out, y) + 1e-3 * side.pow(2).mean()
    loss.backward()
    opt.step()
    if not torch.isfinite(loss):
        print("NONFINITE", step, flush=True)
        if "--stop" in sys.argv:
            break
print("EXITING", flush=True)
"""


@pytest.mark.parametrize("how", ["stops", "goes-on"])
def test_a_divergence_is_named_at_its_step_where_the_sentinels_see_it_or_not(torch_python, spawn, cli, how):
    # Stopping, the program's last step is the one that diverged: the check
    # at exit finds it in the gradients it left, though the side branch's
    # sentinel never saw it. Going on, the sentinel (a weight of the branch
    # that diverged) sees it at its step.
    args = ["10", "--stop", "--side"] if how == "stops" else ["6"]
    target = spawn(torch_python, DIVERGE, args=args, env={"RANKSCOPE_TORCH": "nan"}, wait=False)
    assert target.proc.wait(timeout=120) == 0
    run_dir = target.script.parent / "run"
    result = cli("query", "--run", run_dir, "SELECT step, stage, module, detail FROM python.nan_events", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    # Where it diverges moves with the machine's arithmetic: the program says.
    first = int(next(line for line in target.proc.stdout.read().decode().splitlines() if line.startswith("NONFINITE")).split()[1])
    assert len(rows) == 1 and rows[0]["step"] == first, (first, rows)
    if how == "stops":
        # The module nearest the output whose own gradients are non-finite.
        assert rows[0]["stage"] == "backward" and rows[0]["module"] == "main.4", rows
        assert rows[0]["detail"].startswith("from the parameters' gradients (found at exit"), rows
    else:
        # Replayed, the forward was finite; the loss (a loss function's,
        # read from the loop's frame at the trip) was not: the squares of
        # the diverged outputs overflowed in the loss itself.
        rows = json.loads(cli("query", "--run", run_dir, "SELECT stage, what, CAST(loss AS VARCHAR) AS loss, detail FROM python.nan_events",
                              "--format", "json").stdout)
        assert (rows[0]["stage"], rows[0]["what"]) == ("loss", "the loss (the model's outputs were finite)"), rows
        assert rows[0]["loss"].lower() in ("inf", "nan"), rows
        assert rows[0]["detail"] == "the loss was read from `loss` in <module> (target.py:42)", rows


# A bad batch: its NaN reaches every weight's gradient, but not the
# biases' (a ReLU's backward zeroes what comes back through a NaN), nor
# the loss the program's own `.sum()` made.
BAD_BATCH = """
import sys
import torch

torch.manual_seed(0)
model = eval(sys.argv[1])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(12):
    x = torch.ones(4, 2) * (float("nan") if step == 5 else 1.0)
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
"""


@pytest.mark.parametrize("model, name", [
    ("torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))", "Sequential"),
    ("torch.nn.Linear(2, 2)", "Linear"),
])
def test_a_nan_batch_is_named_as_the_input_at_its_step(torch_python, spawn, cli, model, name):
    # The watch's sentinel was the first module's bias: the NaN went
    # through unseen and was named a step late as the optimizer's update.
    target = spawn(torch_python, BAD_BATCH, args=[model], env={"RANKSCOPE_TORCH": "nan"}, wait=False)
    assert target.proc.wait(timeout=120) == 0
    result = cli("query", "--run", target.script.parent / "run", "SELECT step, stage, module, input_nonfinite FROM python.nan_events", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"step": 5, "stage": "input", "module": name, "input_nonfinite": 8}]


# A trainer's guard skips the optimizer step whose gradient norm is not
# finite; the NaN is made outside the model, in the loss's arithmetic on
# its output (a finite forward, an infinite gradient back).
GUARDED = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print("READY", flush=True)
for step in range(8):
    x = torch.randn(16, 4)
    opt.zero_grad()
    out = model(x)
    if step == 5:
        out = torch.sqrt(out - out)
    loss = out.pow(2).mean()
    loss.backward()
    norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    if not torch.isfinite(norm):
        print(f"SKIPPED {step}", flush=True)
        continue
    opt.step()
"""


def test_a_nan_in_a_step_the_program_skipped_is_named_though_the_replay_cannot_make_it(torch_python, spawn, cli):
    # Found as the next zero_grad cleared the gradients no step used; the
    # replay of the model's forward and backward is finite, which for a
    # GradScaler's skip means no NaN at all, but with no scaler it is the
    # loss: the event was dropped, and `torch nan` saw nothing.
    target = spawn(torch_python, GUARDED, env={"RANKSCOPE_TORCH": "nan"})
    target.wait_for_line("SKIPPED 5")
    assert target.proc.wait(timeout=120) == 0
    result = cli("query", "--run", target.script.parent / "run", "SELECT step, stage, detail FROM python.nan_events", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["step"], r["stage"]) for r in rows] == [(5, "loss")], rows
    assert rows[0]["detail"].startswith("found as the program cleared gradients that no optimizer step used"), rows


# Two optimizers: the embedding's steps last, so it marks the steps and
# holds the model's sentinel; the other, for every layer after it, steps
# first. Or (--tied) one optimizer, and an output layer that shares the
# embedding's weight. The block's backward turns non-finite at step 3 (a
# square root's gradient at 0).
TWO_OPTIMIZERS = """
import sys
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(d), nn.Linear(d, d)
        self.poison = False

    def forward(self, x):
        h = self.ff(self.norm(x))
        return x + torch.tanh(torch.sqrt(h - h) if self.poison else h)


class LM(nn.Module):
    def __init__(self, vocab=30, d=16):
        super().__init__()
        self.emb, self.block, self.head = nn.Embedding(vocab, d), Block(d), nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.block(self.emb(idx)))


model = LM()
if "--tied" in sys.argv:
    model.head.weight = model.emb.weight
    layers, embedding = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.SGD([torch.zeros(1, requires_grad=True)])
else:
    layers = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("emb")], lr=1e-3)
    embedding = torch.optim.SGD(model.emb.parameters(), lr=0.1)
data = torch.Generator().manual_seed(9)
print("READY", flush=True)
for step in range(6):
    model.block.poison = step == 3
    idx = torch.randint(0, 30, (4, 6), generator=data)
    loss = F.cross_entropy(model(idx).reshape(-1, 30), idx.reshape(-1))
    layers.zero_grad()
    embedding.zero_grad()
    loss.backward()
    layers.step()
    embedding.step()
"""


@pytest.mark.parametrize("how", ["two-optimizers", "tied"])
def test_a_nan_behind_a_second_optimizer_or_a_tied_weight_is_named_at_its_module(torch_python, spawn, cli, how):
    # Two optimizers: only the embedding's held a sentinel, the layers'
    # applied the NaN first, and the watch blamed step 2's update of
    # `block.norm` (its weights were already non-finite at step 3). Tied:
    # the output layer's weight, the embedding's, summed the NaN that came
    # in through the embedding, and `head` was blamed.
    target = spawn(torch_python, TWO_OPTIMIZERS, env={"RANKSCOPE_TORCH": "nan"}, args=["--tied"] if how == "tied" else [])
    assert target.proc.wait(timeout=120) == 0
    result = cli("query", "--run", target.script.parent / "run", "SELECT step, stage, module FROM python.nan_events", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"step": 3, "stage": "backward", "module": "block"}]


# The statistics read in place on a CPU (grad_read.rs), against torch's own
# kernels on the same tensors: every float type, odd lengths, non-finite
# values, and what it leaves to torch (a strided tensor, an integer one).
IN_PLACE = """
import math, torch
from rankscope import _native

torch.manual_seed(0)
read = _native.GradRead((torch.float32, torch.float64, torch.float16, torch.bfloat16))
for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)):
    tensors = [torch.randn(n, dtype=dtype) * 3 for n in (1, 15, 16, 17, 1023, 1025, 70001)]
    norms, tops = read.norms(tensors)
    for t, norm, top in zip(tensors, norms, tops):
        want = float(torch.linalg.vector_norm(t.double()))
        assert abs(norm - want) <= tol * want, (dtype, t.numel(), norm, want)
        assert top == float(t.abs().max()) and top <= norm, (dtype, top, norm)
    before = [t.clone() for t in tensors]
    assert read.keep(tensors, 1 << 30) == read.norms(before)[0]
    for t in tensors:
        t.mul_(0.99)
    updates = read.update(tensors)
    for t, b, u in zip(tensors, before, updates):
        want = float(torch.linalg.vector_norm(b.double() - t.double()))
        assert abs(u - want) <= 1e-2 * want + 1e-30, (dtype, u, want)
    assert all(b.equal(b2) for b, b2 in zip(before, [t.clone() for t in before]))
bad = torch.ones(100)
bad[7] = float("nan")
norms, tops = read.norms([bad, torch.tensor([1.0, float("inf")])])
assert math.isnan(norms[0]) and math.isnan(tops[0]) and norms[1] == math.inf and tops[1] == math.inf
# Another tensor in the place of one kept: no update for it, the others go on.
a, b = torch.randn(10), torch.randn(10)
read.keep([a, b], 1 << 30)
assert read.update([torch.randn(10), b]) == [None, 0.0]
# Past the cap: the norms, and no copy.
assert read.keep([a, b], 79) == read.norms([a, b])[0] and read.update([a, b]) is None and read.kept_bytes == 0
read.keep([a, b], 80)
assert read.update([a, b]) == [0.0, 0.0] and read.kept_bytes == 80
assert read.norms([torch.randn(4, 4).t()]) is None and read.norms([torch.arange(5)]) is None
# Over a byte buffer at an odd offset: not aligned to float32, left to torch.
odd = torch.frombuffer(bytearray(17), dtype=torch.float32, offset=1)
assert read.norms([odd]) is None and read.norms([torch.zeros(0)]) == ([0.0], [0.0])
assert read.keep([torch.zeros(0), a], 1 << 30) == [0.0, read.norms([a])[0][0]]
read.release()
assert read.update([a, b]) is None and read.kept_bytes == 0

# Past 2^20 elements the passes run without the GIL, on detached views.
big = torch.randn(1 << 21)
norms, tops = read.norms([big])
assert abs(norms[0] / float(torch.linalg.vector_norm(big.double())) - 1) < 1e-6 and tops[0] == float(big.abs().max())
read.keep([big], 1 << 30)
big.mul_(0.5)
assert abs(read.update([big])[0] / float(torch.linalg.vector_norm(big.double())) - 1) < 1e-5
read.release()
# bfloat16 reaches 3.4e38: its squares do not overflow.
assert read.norms([torch.tensor([1e20, 1e20], dtype=torch.bfloat16)])[0][0] < float("inf")

# What a GPU (or a strided gradient) goes through: torch's norms in float32,
# so that a half gradient's norm past 65504 is not taken for infinite.
from rankscope._probe.torch import stats
half = torch.full((100000,), 300.0, dtype=torch.float16)
assert abs(float(stats._norms([half])[0]) / (300.0 * math.sqrt(100000)) - 1) < 1e-3
assert [float(v) for v in stats._norms([half, torch.zeros(0)], math.inf)] == [300.0, 0.0]
# float64 (and sparse) tensors refuse a float32 dtype: they keep their own.
mixed = [float(v) for v in stats._norms([torch.full((4,), 2.0, dtype=torch.float64), half])]
assert mixed[0] == 4.0 and abs(mixed[1] / (300.0 * math.sqrt(100000)) - 1) < 1e-3, mixed
assert float(stats._norms([torch.full((4,), 2.0, dtype=torch.float64)])[0]) == 4.0
# An activation past the copy's cap is reduced in place, to the same figures.
x = torch.randn(5000) * 3 + 1
x[:100] = 0
exact = stats._activation(x).tolist()
stats.ACTIVATION_COPY_MAX = 1000
large = stats._activation(x).tolist()
assert all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(exact, large)), (exact, large)
assert abs(large[3] - 100 / 5000) < 1e-7 and large[4] == 0
print("IN PLACE OK")
"""


def test_gradient_statistics_read_in_place_agree_with_torch(torch_python):
    result = subprocess.run([torch_python, "-c", IN_PLACE], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "IN PLACE OK", result.stderr


# The NaN watch's check read in place (finite.rs): for each tensor it reads,
# torch's own answer; None for what it leaves to torch. A plain tensor's
# metadata comes through torch's C shim where the torch has one
# (torch_abi.rs), a subclass's through Python: both ways are compared.
FINITE = """
import ctypes, torch
from rankscope import _native

check = _native.FiniteCheck((torch.float32, torch.float64, torch.float16, torch.bfloat16))
libtorch = next(line.split()[5] for line in open("/proc/self/maps") if line.rstrip().endswith("/libtorch_cpu.so"))
assert check.c_shim == hasattr(ctypes.CDLL(libtorch), "aoti_torch_is_contiguous"), check.c_shim

class Sub(torch.Tensor):
    pass

def both(t):
    answers = {check.check([t]), check.check([t.as_subclass(Sub)])}
    assert len(answers) == 1, (t.dtype, t.shape, answers)
    return answers.pop()

for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    for n in (1, 17, 1024, 4099):
        t = torch.randn(n).to(dtype)
        assert both(t) is True
        for at in (0, n // 2, n - 1):
            for bad in (float("nan"), float("inf"), float("-inf")):
                u = t.clone()
                u[at] = bad
                assert both(u) is False, (dtype, n, at, bad)
    assert both(torch.tensor(torch.finfo(dtype).max, dtype=dtype)) is True
assert both(torch.zeros(0)) is True and both(torch.randn(100)[1:]) is True
assert both(torch.tensor(float("nan"))) is False
# Left to torch: strided, integer, sparse, on the meta device, past 2^20.
assert both(torch.randn(8, 8).t()) is None and both(torch.arange(5)) is None
assert check.check([torch.randn(3, 3).to_sparse()]) is None
assert both(torch.empty(4, device="meta")) is None and both(torch.zeros(1 << 21)) is None
# A sentinel's gradient: a weight over 4,096 elements is read in its first row only.
weight = torch.nn.Parameter(torch.randn(5000, 3))
weight.grad = torch.zeros(5000, 3)
assert check.check_grads([weight], None) is True
weight.grad[1, 0] = float("nan")
assert check.check_grads([weight], None) is True
weight.grad[0, 2] = float("inf")
assert check.check_grads([weight], torch.tensor(1.0)) is False
assert check.check_grads([torch.nn.Parameter(torch.ones(2))], None) is None
assert check.check_grads([weight], torch.tensor(float("nan"))) is False
print("FINITE OK")
"""


def test_the_nan_watchs_check_read_in_place_agrees_with_torch(torch_python):
    result = subprocess.run([torch_python, "-c", FINITE], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "FINITE OK", result.stderr
    # Nothing written to the program's stderr by the shim's calls: only what
    # importing torch writes here (a torch without numpy warns of it).
    bare = subprocess.run([torch_python, "-c", "import torch"], capture_output=True, text=True, timeout=120)
    assert result.stderr == bare.stderr, result.stderr


# Two DDP ranks; rank 1's input at step 5 holds a NaN, which DDP's
# all-reduce then hands to rank 0's gradients. The model has BatchNorm
# (DDP's forward broadcasts its buffers) and, with COLLECTIVE, a module of
# its own that all-reduces in its forward: a re-run that issued either on
# one rank would hang the job.
DDP_NAN = """
import gc, os, time
import torch
import torch.distributed as dist
from torch import nn

COLLECTIVE = {collective}
dist.init_process_group("gloo")
rank = dist.get_rank()
here = os.path.dirname(os.path.abspath(__file__))


class GlobalCentre(nn.Module):
    def forward(self, x):
        total = x.detach().sum(0, keepdim=True)
        dist.all_reduce(total)
        return x - total / (x.shape[0] * dist.get_world_size())


torch.manual_seed(0)
layers = [nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()] + ([GlobalCentre()] if COLLECTIVE else [])
model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(16, 1)))
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(rank)
losses = []
for step in range(10):
    x = torch.randn(4, 8, generator=data)
    if rank == 1 and step == 5:
        x[0, 0] = float("nan")
    loss = criterion(model(x), torch.zeros(4, 1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item().hex())
    # BatchNorm's running statistics too: a replay's forward updates them
    # in place without a new version, and the program's eval mode reads them.
    norm = model.module[1]
    losses.append(float(norm.running_mean.sum() + norm.running_var.sum()).hex())
with open(os.path.join(here, "out", f"rank{{rank}}.losses"), "w") as f:
    f.write(" ".join(losses))
while os.environ.get("RANKSCOPE") and not os.path.exists(os.path.join(here, "stop")):
    time.sleep(0.05)
# The model and its gradients freed before the group goes: left to the
# interpreter's exit, torch (2.15, gloo, without rankscope too) aborted
# about one job in fifteen ("terminate called without an active exception").
del model, optimizer, loss
gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("collective", [False, True], ids=["ddp-buffers", "model-collective"])
def test_a_nan_from_one_ddp_rank_is_traced_to_it_and_the_job_goes_on_as_without_rankscope(default_python, cli, endpoint_dir, tmp_path, collective):
    import time

    from conftest import kill_tree, launch_torchrun, require_torch

    require_torch(default_python)

    def job(name, probe):
        where = tmp_path / name
        (where / "out").mkdir(parents=True)
        (where / "ddp_nan.py").write_text(DDP_NAN.format(collective=collective))
        proc = launch_torchrun(
            default_python, where / "ddp_nan.py", 2, endpoint_dir, where / "run", probe=probe,
            env={"RANKSCOPE_TORCH": "nan"} if probe else {}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        return where, proc

    def losses(where, proc):
        deadline = time.monotonic() + 90
        while len(list((where / "out").glob("rank*.losses"))) < 2:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the job did not finish its steps: a rank is stuck"
            time.sleep(0.05)
        return {p.name: p.read_text() for p in (where / "out").glob("rank*.losses")}

    where, proc = job("bare", probe=False)
    try:
        expected = losses(where, proc)
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode(errors="replace")
    finally:
        kill_tree(proc.pid)
    where, proc = job("watched", probe=True)
    try:
        assert losses(where, proc) == expected
        out = cli("cluster", "torch", "--run", where / "run", "nan")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "job: the first non-finite value began on rank 1, at step 5 (input, in DistributedDataParallel)" in out.stdout, out.stdout
        rows = json.loads(cli("cluster", "query", "--run", where / "run", "SELECT rank, step, stage, module, detail FROM python.nan_events ORDER BY rank", "--format", "json").stdout)
        assert [(r["rank"], r["step"]) for r in rows] == [(0, 5), (1, 5)], rows
        if collective:
            # Rank 0's own forward went non-finite through the model's
            # all-reduce: not re-run, named from its gradients.
            assert "at the same step: rank 0 (backward)" in out.stdout, out.stdout
            assert "not replayed" in rows[0]["detail"] and "c10d.allreduce_" in rows[0]["detail"], rows[0]
        else:
            assert "at the same step: rank 0 (all_reduce)" in out.stdout, out.stdout
            assert rows[0]["stage"] == "all_reduce" and "MSELoss" in rows[0]["detail"], rows[0]
        (where / "stop").touch()
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode(errors="replace")
        # The job is over: the same answer from its run store.
        after = cli("cluster", "torch", "--run", where / "run", "nan")
        assert after.returncode == 0, after.stdout + after.stderr
        assert "no rank of this job is running" in after.stdout, after.stdout
        assert "job: the first non-finite value began on rank 1, at step 5 (input, in DistributedDataParallel)" in after.stdout, after.stdout
        # So does `cluster query`, from every rank's files.
        read = cli("cluster", "query", "--run", where / "run", "SELECT rank, step FROM python.nan_events ORDER BY rank", "--format", "json")
        assert read.returncode == 0, read.stderr
        assert [(r["rank"], r["step"]) for r in json.loads(read.stdout)] == [(0, 5), (1, 5)], read.stdout
        assert "no rank of this job is running" in read.stderr, read.stderr
    finally:
        (where / "stop").touch()
        kill_tree(proc.pid)


# FSDP2 on two CPU ranks: every parameter and gradient is a DTensor, whose
# `data_ptr()` is not an address and whose reductions all-reduce when read.
# Rank 1's input at step 5 holds a NaN; the program's own collectives are
# counted at the end (the group's sequence number), and step 3's whole
# gradient norms written out (a collective of the program's, in both runs).
FSDP_TRAIN = """
import gc, json, os
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = dist.get_rank()
here = os.path.dirname(os.path.abspath(__file__))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(rank)
losses, norms = [], {}
for step in range(8):
    x = torch.randn(4, 8, generator=data)
    if rank == 1 and step == 5:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    if step == 3:
        norms = {name: p.grad.full_tensor().norm().item() for name, p in model.named_parameters()}
    optimizer.step()
    losses.append(loss.item().hex())
seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
with open(os.path.join(here, "out", f"rank{rank}.json"), "w") as f:
    json.dump({"losses": losses, "collectives": seq, "norms": norms}, f)
# Freed before the group goes (see DDP_NAN).
del model, optimizer, loss
gc.collect()
dist.destroy_process_group()
"""


def test_fsdp2_sharded_parameters_are_read_by_their_shards_and_no_collective_is_added(default_python, cli, endpoint_dir, tmp_path):
    import math

    from conftest import kill_tree, launch_torchrun, require_torch

    require_torch(default_python)
    if subprocess.run([default_python, "-c", "from torch.distributed.fsdp import fully_shard"], capture_output=True).returncode != 0:
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")

    def job(name, probe):
        where = tmp_path / name
        (where / "out").mkdir(parents=True)
        (where / "fsdp.py").write_text(FSDP_TRAIN)
        proc = launch_torchrun(
            default_python, where / "fsdp.py", 2, endpoint_dir, where / "run", probe=probe,
            env={"RANKSCOPE_TORCH": "trace,nan,grads,every=1"} if probe else {}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            code = proc.wait(timeout=120)
        finally:
            kill_tree(proc.pid)
        # Before the fix, the NaN watch's read in place killed the ranks (SIGSEGV).
        assert code == 0, proc.stderr.read().decode(errors="replace")
        return where, {p.name: json.loads(p.read_text()) for p in (where / "out").glob("rank*.json")}

    _, bare = job("bare", probe=False)
    where, watched = job("watched", probe=True)
    # The same losses, bit for bit, and not one collective more.
    assert watched == bare
    run = where / "run"
    rows = json.loads(cli("query", "--run", run, "SELECT rank, param, numel, norm FROM python.grad_stats WHERE step = 3", "--format", "json").stdout)
    # Each rank's row is its own shard: together they make the whole norm.
    for name, whole in bare["rank0.json"]["norms"].items():
        shards = [r for r in rows if r["param"] == name]
        assert sorted(r["rank"] for r in shards) == [0, 1], rows
        assert math.isclose(math.sqrt(sum(r["norm"] ** 2 for r in shards)), whole, rel_tol=1e-5), (name, shards, whole)
    events = json.loads(cli("query", "--run", run, "SELECT rank, step, stage, detail FROM python.nan_events ORDER BY rank", "--format", "json").stdout)
    assert [(e["rank"], e["step"]) for e in events] == [(0, 5), (1, 5)], events
    assert events[1]["stage"] == "input", events
    # Rank 0's re-run would have all-gathered the shards on one rank: refused.
    assert "not replayed" in events[0]["detail"] and "c10d." in events[0]["detail"], events
    steps = json.loads(cli("query", "--run", run, "SELECT rank, count(*) AS n FROM python.torch_trace GROUP BY rank ORDER BY rank", "--format", "json").stdout)
    assert [r["rank"] for r in steps] == [0, 1] and all(r["n"] > 0 for r in steps), steps


# The NaN watch armed at start watches the first step through torch's global
# module hooks until a model is known. A compiled model with fullgraph=True
# (dynamo traced into those hooks: Unsupported, the program died), a
# forward that raises before the first step (torch's always_call hook is
# then called without kwargs: a TypeError, a warning in stderr, which
# warnings-as-errors turned into the program's own failure), and a model
# compiled in place, which prints how many graphs dynamo made (one more,
# made when the hooks went, before `torch.compile` took them off).
FIRST_STEP_PROGRAMS = {
    "compiled-fullgraph": """
import torch
from torch import nn
torch.manual_seed(0)
model = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)), fullgraph=True)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for step in range(4):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
    loss.backward()
    optimizer.step()
    print(step, loss.item().hex())
""",
    "module-compile": """
import torch
from torch import nn
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
model.compile(backend="eager")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
    loss.backward()
    optimizer.step()
    print(step, loss.item().hex())
print("graphs", counters["stats"]["unique_graphs"])
""",
    "forward-raises-first": """
import warnings
import torch
from torch import nn
warnings.simplefilter("error")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    model(torch.randn(4, 7))  # the wrong width: the program tries, and recovers
except RuntimeError as exc:
    print("caught", type(exc).__name__)
for step in range(3):
    optimizer.zero_grad()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(step, loss.item().hex())
""",
}


@pytest.mark.parametrize("program", sorted(FIRST_STEP_PROGRAMS))
def test_the_first_step_watch_leaves_compiled_and_failing_forwards_as_they_were(torch_python, endpoint_dir, tmp_path, program):
    import os

    script = tmp_path / "program.py"
    script.write_text(FIRST_STEP_PROGRAMS[program])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}

    def run(env):
        done = subprocess.run([torch_python, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        return done.returncode, done.stdout, done.stderr

    bare = run(clean)
    assert bare[0] == 0, bare
    watched = run({**clean, "RANKSCOPE": "1", "RANKSCOPE_DIR": endpoint_dir, "RANKSCOPE_TORCH": "nan"})
    assert watched == bare


# A function compiled with fullgraph=True that calls a plain model: a
# stand-in on the model's forward was traced by dynamo, a graph break, and
# under fullgraph=True an error that ended the program. Once dynamo begins
# to compile the program's own code, stand-ins stay off plain modules: the
# program runs to the same losses, with no graph break and no graph more.
COMPILED_FUNCTION = """
import torch
from torch import nn
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_of = torch.compile(lambda x, y: nn.functional.mse_loss(model(x), y), backend="eager", fullgraph=True)
data = torch.Generator().manual_seed(1)
for step in range(12):
    optimizer.zero_grad()
    loss = loss_of(torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data))
    loss.backward()
    optimizer.step()
    print(step, loss.item().hex())
print("breaks", sum(counters["graph_break"].values()))
print("graphs", counters["stats"]["unique_graphs"])
"""


@pytest.mark.parametrize("feature", ["trace,every=2", "nan", "trace,nan"])
def test_a_compiled_function_that_calls_a_plain_model_runs_as_it_did(torch_python, endpoint_dir, tmp_path, feature):
    import os

    script = tmp_path / "program.py"
    script.write_text(COMPILED_FUNCTION)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}

    def run(env):
        done = subprocess.run([torch_python, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        return lines[:-1], int(lines[-1].split()[1]), done.stderr

    bare, bare_graphs, bare_err = run(clean)
    watched, graphs, err = run({**clean, "RANKSCOPE": "1", "RANKSCOPE_DIR": endpoint_dir, "RANKSCOPE_TORCH": feature})
    assert watched == bare and bare[-1] == "breaks 0"
    assert graphs == bare_graphs
    assert err == bare_err


COMPILED_FUNCTION_LIVE = """
import sys, time
import torch
from torch import nn
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_of = torch.compile(lambda x, y: nn.functional.mse_loss(model(x), y), backend="eager", fullgraph=True)
go = sys.argv[1]
step = 0
while True:
    optimizer.zero_grad()
    loss = loss_of(torch.randn(4, 8), torch.randn(4, 1))
    loss.backward()
    optimizer.step()
    step += 1
    if step == 3:
        print("COMPILED", flush=True)
    if step > 3 and __import__("os").path.exists(go):
        break
    time.sleep(0.005)
for _ in range(20):
    optimizer.zero_grad()
    loss_of(torch.randn(4, 8), torch.randn(4, 1)).backward()
    optimizer.step()
print("GRAPHS", counters["stats"]["unique_graphs"], flush=True)
time.sleep(60)
"""


def test_a_feature_turned_on_after_a_function_was_compiled_says_why_it_traces_no_module(torch_python, spawn, cli, tmp_path):
    # Told by dynamo's record of the code it compiled, before any stand-in
    # goes on: the compiled function is not compiled again.
    go = tmp_path / "go"
    target = spawn(torch_python, COMPILED_FUNCTION_LIVE, args=[str(go)], wait=False)
    target.wait_for_line("COMPILED")
    for request in (["trace", "on"], ["activations", "--modules", "*"]):
        refused = cli(target.pid, "torch", *request)
        assert refused.returncode != 0 and "no module can be traced" in refused.stderr, (request, refused.stderr)
        assert "torch.compile of a function" in refused.stderr
    armed = cli(target.pid, "torch", "nan", "on")
    assert armed.returncode == 0, armed.stderr
    go.touch()
    line = target.wait_for_line("GRAPHS")
    assert line.split()[1] == "1", line


# A module called three times a step on outputs of different sizes and
# scales (a shared layer), and one whose calls each add non-finite values;
# the same inputs every step, so every step's statistics are the same.
SHARED_CALLS = """
import json, time
import torch
from torch import nn
import rankscope

torch.manual_seed(0)


class Mark(nn.Module):
    def forward(self, x, k):
        x = x.clone()
        x.view(-1)[:k] = float("inf")
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.mark = Mark()

    def forward(self, a, b, c):
        outs = [self.act(self.proj(a)), self.act(b), self.act(c)]
        return outs, [self.mark(o, k) for o, k in zip(outs, (1, 2, 3))]


model = Net()
a, b, c = torch.randn(4, 4), torch.randn(2, 10) * 5, torch.randn(3, 3) - 1
with torch.no_grad():
    outs, _ = model(a, b, c)
every = torch.cat([o.flatten() for o in outs])
std, mean = torch.std_mean(every)
print("TRUTH " + json.dumps({"mean": mean.item(), "std": std.item(), "max_abs": every.abs().max().item(),
                             "zero_frac": (every == 0).float().mean().item()}), flush=True)
print("READY", flush=True)
while True:
    with torch.no_grad():
        model(a, b, c)
    rankscope.step()
    time.sleep(0.01)
"""


def test_a_module_called_several_times_a_step_has_the_statistics_of_all_its_outputs(torch_python, spawn, cli):
    target = spawn(torch_python, SHARED_CALLS, wait=False)
    truth = json.loads(target.wait_for_line("TRUTH").split(" ", 1)[1])
    target.wait_for_line("READY")
    on(cli, target.pid, "activations", "--modules", "*")
    deadline = time.monotonic() + 60
    while True:
        rows = query_json(cli, target.pid, "SELECT module, calls, mean, std, max_abs, zero_frac, nonfinite FROM python.activation_stats ORDER BY step DESC LIMIT 4")
        by = {r["module"]: r for r in rows}
        if "act" in by and "mark" in by:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    act = by["act"]
    assert act["calls"] == 3, act
    for key in ("mean", "std", "max_abs", "zero_frac"):
        assert act[key] == pytest.approx(truth[key], rel=1e-5), (key, act, truth)
    # Summed over the calls (1 + 2 + 3), not their mean.
    assert (by["mark"]["calls"], by["mark"]["nonfinite"]) == (3, 6), by["mark"]


def run_without_and_with_the_watch(python, source, endpoint_dir, tmp_path):
    """The program run to its end without rankscope, then with the NaN
    watch armed at start: each run's (exit code, stdout, stderr), and the
    second's run directory."""
    import os

    script = tmp_path / "program.py"
    script.write_text(source)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}

    def run(env):
        done = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        return done.returncode, done.stdout, done.stderr

    bare = run(clean)
    run_dir = tmp_path / "run"
    watched = run({**clean, "RANKSCOPE": "1", "RANKSCOPE_DIR": endpoint_dir, "RANKSCOPE_RUN_DIR": str(run_dir), "RANKSCOPE_TORCH": "nan"})
    return bare, watched, run_dir


def nan_events_on_disk(cli, run_dir) -> list:
    rows = cli("query", "SELECT step, stage, module, detail FROM python.nan_events", "--run", str(run_dir), "--format", "json")
    assert rows.returncode == 0, rows.stderr
    return json.loads(rows.stdout)


# A reentrant checkpoint (use_reentrant=True): autograd.grad cannot run
# through it, and called without grad it warns. Block 1's backward makes a
# NaN at step 3 (the gradient of sqrt at 0).
REENTRANT = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
STEP = 0


class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i, self.fc = i, nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.i == 1 and STEP == 3:
            h = h + torch.sqrt(h.abs() * 0.0)
        return x + h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([Block(i) for i in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


model = Net()
optimizer = torch.optim.Adam(model.parameters(), 1e-3)
x, y = torch.randn(8, 16), torch.randn(8, 1)
for STEP in range(6):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    print(STEP, loss.item().hex(), flush=True)
"""


def test_a_backward_nan_under_a_reentrant_checkpoint_is_named_and_nothing_is_printed(torch_python, endpoint_dir, tmp_path, cli):
    bare, watched, run_dir = run_without_and_with_the_watch(torch_python, REENTRANT, endpoint_dir, tmp_path)
    assert bare[0] == 0, bare
    # The replay's forward warned into stderr ("None of the inputs have
    # requires_grad=True") when it ran without grad.
    assert watched == bare
    events = nan_events_on_disk(cli, run_dir)
    # The backward cannot be replayed: the module is named from the
    # parameters' gradients (the last one, from the output, with
    # non-finite ones), rather than the search failing.
    assert [(e["step"], e["stage"], e["module"]) for e in events] == [(3, "backward", "blocks.1.fc")], events
    assert "the backward could not be replayed" in events[0]["detail"], events


# Under CPU autocast to float16, step 3's batch (scaled up) overflows the
# first layer's float16 output; in float32 nothing would overflow.
AUTOCAST = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), 1e-3)
x, y = torch.randn(64, 32), torch.randn(64, 1)
for step in range(6):
    optimizer.zero_grad()
    batch = x * 30000 if step == 3 else x
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(batch).float(), y)
    loss.backward()
    optimizer.step()
    print(step, loss.item(), flush=True)
"""


def test_a_float16_overflow_under_autocast_is_found_by_a_replay_under_it(torch_python, endpoint_dir, tmp_path, cli):
    bare, watched, run_dir = run_without_and_with_the_watch(torch_python, AUTOCAST, endpoint_dir, tmp_path)
    assert bare[0] == 0 and ("3 inf" in bare[1] or "3 nan" in bare[1]), bare  # the premise
    assert watched == bare
    events = nan_events_on_disk(cli, run_dir)
    # A replay in float32 found the outputs finite and named the loss.
    assert [(e["step"], e["stage"], e["module"]) for e in events] == [(3, "forward", "0")], events


# A GradScaler on CPU. "overflow": step 7's scale (3e38) overflows the
# scaled gradients while the loss is finite, and the scaler skips the
# optimizer, as it does now and then by design. "nan": from step 5 the
# input holds a NaN, and the scaler skips every step after it, so no
# optimizer step (where the watch checks) comes again.
SCALER = """
import sys
import torch
from torch import nn

MODE = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
data = torch.Generator().manual_seed(1)
for step in range(8):
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    if MODE == "nan" and step >= 5:
        x[0, 0] = float("nan")
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y, reduction="sum")
    scaler.scale(loss).backward()
    before = model[2].weight.detach().clone()
    scaler.step(optimizer)
    skipped = torch.equal(before, model[2].weight)
    scaler.update(3e38 if step == 6 else None)
    print(step, loss.item().hex(), "skipped" if skipped else "stepped", flush=True)
"""


@pytest.mark.parametrize("mode", ["overflow", "nan"])
def test_a_step_a_grad_scaler_skipped_is_no_event_unless_its_replay_names_an_origin(torch_python, endpoint_dir, tmp_path, cli, mode):
    if subprocess.run([torch_python, "-c", "import torch; torch.amp.GradScaler('cpu')"], capture_output=True).returncode != 0:
        pytest.skip("this torch has no GradScaler for the CPU")
    bare, watched, run_dir = run_without_and_with_the_watch(torch_python, SCALER.replace("sys.argv[1]", repr(mode)), endpoint_dir, tmp_path)
    assert bare[0] == 0, bare
    lines = bare[1].splitlines()
    assert watched == bare
    events = nan_events_on_disk(cli, run_dir)
    if mode == "overflow":
        assert lines[7].endswith("skipped") and "nan" not in lines[7] and "inf" not in lines[7], lines  # the premise
        # The exit check found the scaled gradients non-finite; replayed
        # at the real scale, the step is finite.
        assert events == [], events
    else:
        assert all(line.endswith("skipped") for line in lines[5:]), lines
        # Not "step 4, backward" (the last step whose update ran, named
        # from the gradients): the steps the scaler skipped are step 5
        # still, and its weights had not changed.
        assert [(e["step"], e["stage"]) for e in events] == [(5, "input")], events
        assert "update never ran" in events[0]["detail"], events


# Two blocks under activation checkpointing: their forward runs again
# inside the backward (all of it where reentrant; where not, up to the
# last tensor the backward needs, so only the block's Linear).
CHECKPOINTED = """
import sys, time
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

REENTRANT = sys.argv[1] == "reentrant"
torch.manual_seed(0)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=REENTRANT)


model = nn.Sequential(nn.Linear(16, 16), Checkpointed(), Checkpointed(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16), torch.randn(8, 1)
print("READY", flush=True)
while True:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    time.sleep(0.01)
"""


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_an_activation_checkpoints_recompute_is_not_counted_as_forward(torch_python, spawn, cli, how):
    target = spawn(torch_python, CHECKPOINTED, args=[how], wait=False)
    target.wait_for_line("READY")
    on(cli, target.pid, "trace", "on", "--every", "1")
    on(cli, target.pid, "activations", "--modules", "*")
    deadline = time.monotonic() + 60
    while True:
        last = query_json(cli, target.pid, "SELECT max(step) AS s FROM python.activation_stats")[0]["s"]
        if last is not None:
            trace = query_json(cli, target.pid, f"SELECT module, calls FROM python.torch_trace WHERE step = {last - 1} AND stage = 'forward'")
            stats = query_json(cli, target.pid, f"SELECT module, calls FROM python.activation_stats WHERE step = {last - 1}")
            if len(trace) == 11 and len(stats) == 11:
                break
        assert time.monotonic() < deadline, last
        time.sleep(0.2)
    # One call each, as the program makes: the recompute in the backward
    # counted as a second forward call (and its time as forward time).
    assert {r["module"]: r["calls"] for r in trace} == {r["module"]: 1 for r in trace}, trace
    assert {r["module"]: r["calls"] for r in stats} == {r["module"]: 1 for r in stats}, stats
    assert "1.block.0" in {r["module"] for r in trace}, trace


# A GradScaler skips every step from step 5 on (a NaN in each batch), so
# no optimizer step, where the watch checks, comes again; the program
# goes on. The loss by a module (kept by the watch) or a function (not).
SCALER_LIVE = """
import os, sys, time
import torch
from torch import nn


def main(how, go):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    criterion = nn.MSELoss(reduction="sum")
    data = torch.Generator().manual_seed(1)
    for step in range(12):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
        if step >= 5:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        out = model(x)
        loss = criterion(out, y) if how == "module" else nn.functional.mse_loss(out, y, reduction="sum")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(step, loss.item(), scaler.get_scale(), flush=True)
    print("READY", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)


main(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("how", ["module", "function"])
def test_a_nan_a_grad_scaler_skips_step_after_step_is_found_while_the_job_runs(torch_python, spawn, cli, tmp_path, how):
    import os

    if subprocess.run([torch_python, "-c", "import torch; torch.amp.GradScaler('cpu')"], capture_output=True).returncode != 0:
        pytest.skip("this torch has no GradScaler for the CPU")
    script = tmp_path / "scaler_live.py"
    script.write_text(SCALER_LIVE)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    bare = subprocess.run([torch_python, str(script), how, str(script)], capture_output=True, text=True, timeout=120, env=clean)
    assert bare.returncode == 0, bare.stderr
    assert "nan" in bare.stdout.splitlines()[5], bare.stdout  # the premise
    target = spawn(torch_python, SCALER_LIVE, args=[how, str(tmp_path / "go")], env={"RANKSCOPE_TORCH": "nan"}, wait=False)
    printed = [target.wait_for_line(f"{i} ") for i in range(12)]
    target.wait_for_line("READY")
    assert printed == bare.stdout.splitlines()[:12]
    shown = on(cli, target.pid, "nan")
    # While the job runs, not at its exit: the step the skipping began at
    # (the clock does not count skipped steps), and its batch's NaN.
    assert "step 5: first non-finite in input" in shown, shown
    assert "GradScaler skipped" in shown, shown
    rows = query_json(cli, target.pid, "SELECT step, stage FROM python.nan_events")
    assert [(r["step"], r["stage"]) for r in rows] == [(5, "input")], rows


# A program that skips the step itself where its loss or gradient norm is
# not finite (as large-model trainers do), so the optimizer's pre-hook,
# where the watch checks, never sees step 5. The batch of step 5 makes a
# value above 50 after the first layer; `Trap` turns it into NaN there
# ("forward": the program sees a non-finite loss and skips the backward)
# or sends NaN back from it ("backward": the gradient norm is NaN). Its
# gradients are cleared by the optimizer's or the model's `zero_grad`, at
# the top of the next step, or after the next forward ("late").
SKIPPING = """
import sys
import torch
from torch import nn

MODE, ZERO = sys.argv[1], sys.argv[2]
torch.manual_seed(0)


class Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        return g * torch.where(h > 50, float("nan"), 1.0)


class Trap(nn.Module):
    def forward(self, h):
        if MODE == "forward":
            return torch.where(h > 50, float("nan"), h)
        return Spike.apply(h)


model = nn.Sequential(nn.Linear(8, 16), Trap(), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
criterion = nn.MSELoss()
data = torch.Generator().manual_seed(1)
clear = model.zero_grad if ZERO == "model" else optimizer.zero_grad
for step in range(10):
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    if MODE != "none" and step == 5:
        x[0] = 1e4
    if ZERO != "late":
        clear()
    loss = criterion(model(x), y) if MODE == "forward" else nn.functional.mse_loss(model(x), y)
    if ZERO == "late":
        clear()
    if not torch.isfinite(loss):
        print(step, "skipped: loss", flush=True)
        continue
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    if not torch.isfinite(norm):
        print(step, "skipped: gradient norm", flush=True)
        continue
    optimizer.step()
    print(step, loss.item().hex(), flush=True)
"""


@pytest.mark.parametrize("mode,zero", [("forward", "optimizer"), ("backward", "optimizer"), ("backward", "model"),
                                       ("backward", "late"), ("none", "optimizer"), ("none", "late")])
def test_a_nan_in_a_step_the_program_skipped_itself_is_named_at_that_step(torch_python, endpoint_dir, tmp_path, cli, mode, zero):
    source = SKIPPING.replace("sys.argv[1], sys.argv[2]", f"{mode!r}, {zero!r}")
    bare, watched, run_dir = run_without_and_with_the_watch(torch_python, source, endpoint_dir, tmp_path)
    assert bare[0] == 0, bare
    lines = bare[1].splitlines()
    assert len(lines) == 10 and all("skipped" not in line for line in lines[:5] + lines[6:]), lines
    assert watched == bare
    events = nan_events_on_disk(cli, run_dir)
    if mode == "none":
        assert lines[5].split()[1] != "skipped:", lines
        assert events == [], events
        return
    assert lines[5] == f"5 skipped: {'loss' if mode == 'forward' else 'gradient norm'}", lines  # the premise
    # Step 5 (the clock counts the optimizer's steps, and five came
    # before), in the module that made it, found while the weights were
    # still the ones it ran with: no event at exit, none named from the
    # gradients.
    assert [(e["step"], e["stage"], e["module"]) for e in events] == [(5, mode, "1")], events
    assert "no optimizer step" in events[0]["detail"] or "no optimizer step used" in events[0]["detail"], events


# A healthy loop that clears its gradients after the forward (PyTorch's
# quickstart order) or in place, with an optimizer that changes the
# gradients in place (SGD's Nesterov momentum, foreach): no zero_grad
# finds gradients that no step used, so none is checked there.
ORDERS = """
import sys, time
import torch
from torch import nn

ORDER, OPT = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
if OPT == "nesterov":
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True, foreach=True)
else:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
for step in range(30):
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    if ORDER == "top":
        optimizer.zero_grad()
    elif ORDER == "top-to-none":
        optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    if ORDER == "after-forward":
        optimizer.zero_grad()
    elif ORDER == "in-place":
        model.zero_grad(set_to_none=False)
        optimizer.zero_grad(set_to_none=False)
    loss.backward()
    optimizer.step()
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("order,opt", [("top", "adam"), ("top-to-none", "adam"), ("after-forward", "adam"),
                                       ("after-forward", "nesterov"), ("in-place", "nesterov")])
def test_a_healthy_loop_has_no_gradients_checked_at_zero_grad(torch_python, spawn, cli, order, opt):
    target = spawn(torch_python, ORDERS, args=[order, opt], env={"RANKSCOPE_TORCH": "nan"}, wait=False)
    target.wait_for_line("READY")
    shown = json.loads(cli(target.pid, "torch", "--format", "json").stdout)["features"]["nan"]
    assert shown["checked_steps"] >= 25 and shown["events"] == [], shown
    assert shown["unstepped_checks"] == 0, shown
    if order != "in-place":
        # Cleared to None, told so or not, by an optimizer whose step
        # changes its gradients or not: the stand-in's inline way, past
        # the first steps (`zero_grad(set_to_none=True)` used to take the
        # long way at every step).
        assert shown["zero_grads_in_python"] <= 3, shown


# A forward that draws its own random numbers (random key dropping, with
# torch.rand in the module's code, no dropout module or rate in sight):
# when every key of a sample is dropped, softmax makes NaN. The replay
# must draw what the step drew, or it is finite and names nothing.
RANDOM_MASK = """
import json, time
import torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)
B, T, D = 8, 8, 16

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        keep = torch.rand(x.shape[0], 1, T) > 0.55
        s = (self.q(x) @ self.k(x).transpose(1, 2)).masked_fill(~keep, float("-inf"))
        return torch.softmax(s, -1) @ self.v(x)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(4, D), Attn(), nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.attn(self.emb(x))).mean(1)

model = Net()
optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
first = None
for step in range(40):
    x, y = torch.randn(B, T, 4), torch.randn(B, 1)
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    if not torch.isfinite(loss):
        first = step if first is None else first
        optimizer.zero_grad()
        continue
    optimizer.step()
print("RESULT " + json.dumps(first), flush=True)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_nan_from_a_forward_that_draws_its_own_random_numbers_is_named(torch_python, spawn, cli):
    target = spawn(torch_python, RANDOM_MASK, env={"RANKSCOPE_TORCH": "nan"}, wait=False)
    first = json.loads(target.wait_for_line("RESULT").split(" ", 1)[1])
    target.wait_for_line("READY")
    assert first is not None  # the premise: some step drops every key of a sample
    text = on(cli, target.pid, "nan")
    assert f"step {first}: first non-finite in forward, module attn (Attn): its output" in text, text


# Loops whose loss a loss function made, and whose frames hold other
# scalars with a graph beside it: the event's loss is the one the step's
# backward ran through, read from the loop's frame at the trip (or from
# the traceback's, at exit after an uncaught exception).
LOSS_IN_FRAMES = """
import sys
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
how = sys.argv[1]
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
prev_loss = None


def main():
    global prev_loss
    for step in range(12):
        x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
        out = model(x)
        bad = torch.log(out.abs() * 0).mean() if step == 7 else 0.0  # -inf at step 7, in the loss function's part
        aux_loss = 1e-3 * out.pow(2).mean()  # finite: declared first, not the loss
        if how == "total":
            ce = F.cross_entropy(out, y)
            reg = aux_loss + bad
            total = ce + reg
            opt.zero_grad()
            total.backward()
        else:
            loss = F.cross_entropy(out, y) + aux_loss + bad
            opt.zero_grad()
            loss.backward()
            if how != "goes-on" and not torch.isfinite(loss):
                if how == "exits":
                    sys.exit(3)
                raise FloatingPointError(f"loss {loss.item()} at step {step}")
            prev_loss = loss  # last step's, finite
        opt.step()


main()
"""


@pytest.mark.parametrize("how, name", [("goes-on", "loss"), ("total", "total"), ("raises", "loss"), ("exits", None)])
def test_a_loss_functions_value_is_read_from_the_loop_that_made_it(torch_python, spawn, how, name, cli):
    target = spawn(torch_python, LOSS_IN_FRAMES, args=[how], env={"RANKSCOPE_TORCH": "nan"}, wait=False)
    code = target.proc.wait(timeout=120)
    assert code == {"goes-on": 0, "total": 0, "raises": 1, "exits": 3}[how]
    run_dir = target.script.parent / "run"
    # (JSON has no NaN or infinity: the CLI writes them as text, as the
    # live tables send them.)
    result = cli("query", "--run", run_dir, "SELECT step, stage, what, loss, detail FROM python.nan_events", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    # Found at its step as the loss itself, with its value: not the finite
    # `aux_loss` or `prev_loss`, nor the `ce` that `total` holds.
    assert [(r["step"], r["stage"]) for r in rows] == [(7, "loss")], rows
    if name is None:
        # `sys.exit` left no frame to read: the gradients, non-finite with
        # no loss scaler in the program, still make the event.
        assert rows[0]["loss"] is None and "found at exit" in rows[0]["detail"], rows
        return
    assert rows[0]["what"] == "the loss (the model's outputs were finite)", rows
    assert rows[0]["loss"].lower() in ("-inf", "inf", "nan"), rows
    assert f"the loss was read from `{name}` in main (target.py:" in rows[0]["detail"], rows


COMPILED_NAMES = """
import sys
import torch
from torch import nn


class Root(nn.Module):
    def forward(self, h, bad):
        return torch.sqrt(h - bad)  # NaN where `bad` is large


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.root, self.fc2 = nn.Linear(8, 16), Root(), nn.Linear(16, 4)

    def forward(self, x, bad):
        return self.fc2(self.root(torch.relu(self.fc1(x)), bad))


torch.manual_seed(0)
model = Net()
compiled = torch.compile(model, backend="aot_eager")  # (inductor's C++ build takes minutes here)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(10):
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(compiled(x, torch.tensor(1e6 if step == 6 else -1.0)), y)
    loss.backward()
    if torch.isfinite(loss):
        opt.step()
"""


def test_a_compiled_models_modules_go_by_their_own_names(torch_python, spawn, cli):
    # Not `_orig_mod.root`, the name under torch.compile's wrapper: the
    # name the program's code gives it, in the NaN event and in the
    # gradient statistics alike.
    target = spawn(torch_python, COMPILED_NAMES, env={"RANKSCOPE_TORCH": "nan,grads"}, wait=False)
    assert target.proc.wait(timeout=240) == 0, target.proc.stderr.read().decode()[-2000:]
    run_dir = target.script.parent / "run"
    events = json.loads(cli("query", "--run", run_dir, "SELECT step, stage, module FROM python.nan_events", "--format", "json").stdout)
    assert [(e["step"], e["stage"], e["module"]) for e in events] == [(6, "forward", "root")], events
    names = json.loads(cli("query", "--run", run_dir, "SELECT DISTINCT param FROM python.grad_stats ORDER BY param", "--format", "json").stdout)
    assert [n["param"] for n in names] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], names
