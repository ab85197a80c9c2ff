"""`rankscope PID torch`: the models found, the trace switched on and off,
and its tables queried, on a real training loop (torch on CPU)."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from conftest import kill_tree, launch_torchrun, query_json, require_torch

# A small MLP with in-place ReLUs, trained with Adam on fixed data. The
# steps run only when told (`budget` set through eval), so the test knows
# where each step boundary falls; `--steps N --save PATH` runs N steps with
# no probe and saves what the probed run saves, for the bitwise comparison.
TRAIN = """
import sys, time
LATE = "--import-late" in sys.argv
if LATE:
    print("READY", flush=True)
    while globals().get("go") is None:
        time.sleep(0.005)
import torch
from torch import nn

torch.manual_seed(0)


class Out:
    # A model output whose `loss` cannot be read (see test_a_failing_hook...).
    def __init__(self, value):
        self.value = value

    @property
    def loss(self):
        raise RuntimeError("no loss here")


class MLP(nn.Module):
    def __init__(self, odd_output=False):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.ReLU(inplace=True)
        self.head = nn.Linear(32, 1)
        self.odd_output = odd_output

    def forward(self, x):
        y = self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))
        return Out(y) if self.odd_output else y


MODEL_LATE = "--model-late" in sys.argv  # torch imported, the model made only once told
if MODEL_LATE:
    print("READY", flush=True)
    while globals().get("go") is None:
        time.sleep(0.005)
model = MLP(odd_output="--odd-output" in sys.argv)
if "--compile" in sys.argv:
    # aot_eager: dynamo and autograd's graphs as inductor gets them, without
    # its C++ build (minutes here), so the test stays quick.
    model = torch.compile(model, backend="aot_eager")
if "--compile-in-place" in sys.argv:
    model.compile(backend="aot_eager")  # the module itself, no wrapper
criterion = nn.MSELoss()
MANUAL = "--manual" in sys.argv
optimizer = None if MANUAL else (torch.optim.SGD(model.parameters(), lr=1e-2) if "--sgd" in sys.argv else torch.optim.Adam(model.parameters(), lr=1e-3))
data = torch.Generator().manual_seed(1)
losses = []
done = 0


GRAB = []  # --grab-forward: the model's forward as found at a sampled step, called from then on


def train_step():
    global done
    if "--validate" in sys.argv:
        with torch.no_grad():
            model(torch.randn(8, 16, generator=data) * 1000)  # another data set, its activations far larger
        time.sleep(0.04)  # the next batch's wait comes after the validation pass
    x = torch.randn(8, 16, generator=data)
    target = torch.randn(8, 1, generator=data)
    if "--grab-forward" in sys.argv and not GRAB and "forward" in vars(model):
        GRAB.append(model.forward)
    out = (GRAB[0] if GRAB else model)(x)
    loss = criterion(out.value if isinstance(out, Out) else out, target)
    if MANUAL:
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-2 * p.grad
        import rankscope
        rankscope.step()
    else:
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    losses.append(loss.detach().clone())
    done += 1


def save(path):
    torch.save({"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}, path)


if "--steps" in sys.argv:
    for _ in range(int(sys.argv[sys.argv.index("--steps") + 1])):
        train_step()
    save(sys.argv[sys.argv.index("--save") + 1])
    sys.exit(0)

budget = globals().get("budget", 0)  # set with `go` by the import-late test
if not LATE and not MODEL_LATE:
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

NO_HOOKS = (
    "import torch.optim.optimizer as o; "
    "(all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks and 'forward' not in vars(m) "
    "for m in model.modules()), "
    "len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks), "
    "sum(hasattr(c.zero_grad, '_rankscope_zero_grad_watched') for c in (o.Optimizer, torch.nn.Module)))"
)


@pytest.fixture
def torch_python(python):
    require_torch(python)
    return python


def run_steps(cli, target, n: int, total: int) -> None:
    result = cli(target.pid, "eval", f"budget = {n}")
    assert result.returncode == 0, result.stderr
    target.wait_for_line(f"DONE {total}")


def torch_json(cli, pid, *args) -> dict:
    result = cli(pid, "torch", *args, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def reference_run(python, tmp_path, steps: int, *flags: str) -> Path:
    """The same training with no probe at all."""
    script = tmp_path / "reference.py"
    script.write_text(textwrap.dedent(TRAIN))
    out = tmp_path / "reference.pt"
    subprocess.run([python, str(script), *flags, "--steps", str(steps), "--save", str(out)], check=True, capture_output=True, timeout=120)
    return out


def assert_bitwise_equal(python, a: Path, b: Path) -> None:
    check = (
        "import sys, torch; a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2]); "
        "assert len(a['losses']) == len(b['losses']) > 0; "
        "assert all(torch.equal(x, y) for x, y in zip(a['losses'], b['losses'])), 'losses differ'; "
        "assert a['params'].keys() == b['params'].keys(); "
        "assert all(torch.equal(a['params'][k], b['params'][k]) for k in a['params']), 'parameters differ'; "
        "print('EQUAL')"
    )
    result = subprocess.run([python, "-c", check, str(a), str(b)], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "EQUAL", result.stderr


def test_torch_lists_the_model_and_optimizer(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN)
    run_steps(cli, target, 3, 3)
    text = cli(target.pid, "torch")
    assert text.returncode == 0, text.stderr
    assert "model MLP: 5 submodules, 1,633 parameters (1,633 trainable), float32 on cpu, training" in text.stdout
    assert "fc1" in text.stdout and "Linear" in text.stdout
    assert "optimizer 0 (optimizer): Adam, 1 param group" in text.stdout  # named by its variable
    assert "lr=0.001" in text.stdout
    assert "step 3 (from optimizer state)" in text.stdout
    assert "loss modules: MSELoss" in text.stdout
    assert "trace: off" in text.stdout
    status = torch_json(cli, target.pid)
    # Roots only: the loss module and the submodules are not models.
    assert [m["name"] for m in status["models"]] == ["MLP"]
    assert status["models"][0]["parameters"] == 16 * 32 + 32 + 32 * 32 + 32 + 32 + 1
    assert status["optimizers"][0]["param_groups"][0]["hyperparameters"]["betas"] == [0.9, 0.999]


NESTED = """
import time
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.embed = nn.Embedding(10, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.extra = nn.ModuleList([Block(d), Block(2 * d)])
        self.head = nn.Linear(d, 10)


net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def test_torch_shows_the_module_tree_with_alike_siblings_as_one_line(torch_python, spawn, cli):
    target = spawn(torch_python, NESTED)
    text = cli(target.pid, "torch")
    assert text.returncode == 0, text.stderr
    block = 8 * 24 + 24 + 8 * 32 + 32 + 32 * 8 + 8
    lines = [line.rstrip() for line in text.stdout.splitlines()]

    def row(name):
        found = [line for line in lines if line.split()[:1] == [name]]
        assert len(found) == 1, (name, text.stdout)
        return found[0]

    assert row("embed").split()[1:] == ["Embedding", "80", "parameters"]
    assert row("blocks").split()[1:] == ["ModuleList", f"{4 * block:,}", "parameters"]
    # Four alike blocks are one line, and what is under them is named as
    # --modules globs name it.
    assert row("blocks.0-3").split()[1:] == ["Block", "x4", f"{block:,}", "parameters", "each"]
    assert row("blocks.*.attn").split()[1:] == ["Linear", "216", "parameters"]
    assert row("blocks.*.mlp").startswith("      blocks.*.mlp  "), text.stdout  # indented by its depth
    # Blocks of different sizes stay apart.
    assert row("extra.0").split()[1] == "Block" and row("extra.1").split()[1] == "Block"
    tree = torch_json(cli, target.pid)["models"][0]["tree"]
    assert tree["left_out"] == 0 and tree["max_depth"] == 3
    depth3 = [r["name"] for r in tree["rows"] if r["depth"] == 3]
    assert depth3[:2] == ["blocks.*.attn", "blocks.*.mlp"], tree
    assert not any(r["depth"] > 3 for r in tree["rows"]), tree
    # A glob that matches nothing: the first names it was matched against, and how many more.
    for feature in (["trace", "on"], ["activations"]):
        bad = cli(target.pid, "torch", *feature, "--modules", "block.*")
        assert bad.returncode != 0
        assert "error: no module matches 'block.*'; modules: Net, embed, blocks, blocks.0, blocks.0.attn," in bad.stderr, bad.stderr
        assert "extra.0.mlp.0" not in bad.stderr and " and 29 more\n" in bad.stderr, bad.stderr


SCRIPTED_CHILD = """
import time
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        # jit keeps the eager Sequential alive, sharing its parameters.
        self.js = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.js(self.a(x)))


net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_scripted_childs_eager_original_is_not_a_second_model(torch_python, spawn, cli):
    target = spawn(torch_python, SCRIPTED_CHILD)
    status = torch_json(cli, target.pid)
    assert [m["name"] for m in status["models"]] == ["Net"], status["models"]
    rows = [r["name"] for r in status["models"][0]["tree"]["rows"]]
    assert "a" in rows and "head" in rows and not any(name.startswith("net.") for name in rows), rows


TIED_APART = """
import time
import torch
from torch import nn

emb = nn.Embedding(10, 4)
head = nn.Linear(4, 10)
emb.weight = head.weight  # tied, though neither is part of the other
optimizer = torch.optim.SGD([*emb.parameters(), head.bias], lr=0.1)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def test_two_models_made_apart_that_share_weights_are_both_models(torch_python, spawn, cli):
    target = spawn(torch_python, TIED_APART)
    status = torch_json(cli, target.pid)
    assert sorted(m["name"] for m in status["models"]) == ["emb", "head"], status["models"]


def test_trace_every_2_then_off_leaves_the_model_as_without_rankscope(torch_python, spawn, cli, tmp_path):
    target = spawn(torch_python, TRAIN)
    on = cli(target.pid, "torch", "trace", "on", "--every", "2")
    assert on.returncode == 0, on.stderr
    assert "trace on: 6 modules, every 2 steps" in on.stdout
    run_steps(cli, target, 5, 5)
    # Step 5 is in progress and not sampled: the modules are untouched (no
    # hook, no stand-in for forward), only the optimizer's step hooks are in.
    assert cli(target.pid, "eval", NO_HOOKS).stdout.strip() == "(True, 1, 1, 2)"
    run_steps(cli, target, 1, 6)
    timed = "sum('forward' in vars(m) for m in model.modules()), sum(len(m._forward_hooks) for m in model.modules())"
    assert cli(target.pid, "eval", timed).stdout.strip() == "(6, 0)"  # step 6: a stand-in on each of 6 modules, no hook
    # What the program may do with its model at a sampled step sees the
    # model as it is: a deep copy runs its own weights, untimed; pickling
    # and signature inspection see the module's own forward.
    copies = (
        "import copy, pickle, inspect; c = copy.deepcopy(model); p = pickle.loads(pickle.dumps(model)); "
        "probe = torch.randn(2, 16); "
        "[c.fc1.weight.data.zero_(), c.fc1.bias.data.zero_()]; "
        "(torch.equal(c(probe), c.head(c.act2(c.fc2(torch.zeros(2, 32))))), "
        "torch.equal(p(probe), p.head(p.act2(p.fc2(p.act1(p.fc1(probe)))))), "
        "str(inspect.signature(model.forward)), model.fc1.forward.__self__ is model.fc1)"
    )
    assert cli(target.pid, "eval", copies).stdout.strip() == "(True, True, '(x)', True)"

    rows = query_json(
        cli,
        target.pid,
        "SELECT module, stage, count(*) AS n, min(step) AS first, max(step) AS last, avg(duration_ms) AS ms "
        "FROM python.torch_trace GROUP BY module, stage ORDER BY module",
    )
    assert {r["module"] for r in rows} == {"MLP", "fc1", "act1", "fc2", "act2", "head"}
    for r in rows:
        # Steps 2 and 4 ended while traced; step 6 is still in progress.
        assert (r["stage"], r["n"], r["first"], r["last"]) == ("forward", 2, 2, 4), r
        assert r["ms"] > 0
    steps = query_json(cli, target.pid, "SELECT DISTINCT step FROM python.torch_trace ORDER BY step")
    assert [r["step"] for r in steps] == [2, 4]
    depth = query_json(cli, target.pid, "SELECT module, depth, module_type, rank FROM python.torch_trace WHERE module IN ('MLP', 'fc1')")
    assert {(r["module"], r["depth"], r["module_type"]) for r in depth} == {("MLP", 0, "MLP"), ("fc1", 1, "Linear")}

    per_step = query_json(cli, target.pid, "SELECT * FROM python.torch_steps ORDER BY step")
    assert [r["step"] for r in per_step] == [1, 2, 3, 4, 5]
    for r in per_step:
        assert r["step_ms"] > 0 and r["optimizer_ms"] > 0
        assert r["sampled"] == (r["step"] % 2 == 0)
        if r["sampled"]:
            assert r["forward_ms"] > 0 and r["dataloader_wait_ms"] >= 0
            assert r["samples"] == 8 and r["samples_per_s"] > 0
            assert r["loss"] is not None and r["loss"] > 0
            assert r["backward_ms"] is None  # no --backward
        else:
            assert r["forward_ms"] is None and r["loss"] is None
    # Filters reach the probe, and the engine still applies them.
    later = query_json(cli, target.pid, "SELECT count(*) AS n FROM python.torch_trace WHERE step > 2")
    assert later == [{"n": 6}]

    off = cli(target.pid, "torch", "trace", "off")
    assert off.returncode == 0, off.stderr
    assert "trace off" in off.stdout
    assert cli(target.pid, "eval", NO_HOOKS).stdout.strip() == "(True, 0, 0, 0)"
    run_steps(cli, target, 4, 10)
    # No more rows once off.
    assert query_json(cli, target.pid, "SELECT max(step) AS s FROM python.torch_steps") == [{"s": 5}]
    probed = tmp_path / "probed.pt"
    assert cli(target.pid, "eval", f"save({str(probed)!r})").returncode == 0
    assert_bitwise_equal(torch_python, probed, reference_run(torch_python, tmp_path, 10))


def test_backward_through_in_place_relu(torch_python, spawn, cli, tmp_path):
    target = spawn(torch_python, TRAIN)
    on = cli(target.pid, "torch", "trace", "on", "--backward", "--modules", "*")
    assert on.returncode == 0, on.stderr
    run_steps(cli, target, 4, 4)
    rows = query_json(
        cli, target.pid, "SELECT module, stage, count(*) AS n, min(duration_ms) AS ms FROM python.torch_trace GROUP BY module, stage"
    )
    seen = {(r["module"], r["stage"]): r for r in rows}
    for module in ("MLP", "fc1", "act1", "fc2", "act2", "head"):
        for stage in ("forward", "backward"):
            assert seen[(module, stage)]["n"] == 3, (module, stage, rows)  # steps 1, 2, 3
            assert seen[(module, stage)]["ms"] >= 0
    steps = query_json(cli, target.pid, "SELECT step, backward_ms, forward_ms FROM python.torch_steps ORDER BY step")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["backward_ms"] > 0 and r["forward_ms"] > 0 for r in steps)
    assert cli(target.pid, "torch", "trace", "off").returncode == 0
    assert cli(target.pid, "eval", NO_HOOKS).stdout.strip() == "(True, 0, 0, 0)"
    run_steps(cli, target, 2, 6)
    probed = tmp_path / "probed.pt"
    assert cli(target.pid, "eval", f"save({str(probed)!r})").returncode == 0
    assert_bitwise_equal(torch_python, probed, reference_run(torch_python, tmp_path, 6))


def test_the_trace_is_queried_live_then_from_the_run_store_after_sigkill(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN)
    assert cli(target.pid, "torch", "trace", "on").returncode == 0
    run_steps(cli, target, 6, 6)
    sql = "SELECT step, count(*) AS n, sum(duration_ms) > 0 AS timed FROM python.torch_trace GROUP BY step ORDER BY step"
    live = query_json(cli, target.pid, sql)
    assert [r["step"] for r in live] == [1, 2, 3, 4, 5] and all(r["n"] == 6 and r["timed"] for r in live), live
    # GPU time and the allocator's deltas are CUDA's; on a CPU they are null, not zero.
    cuda_only = query_json(cli, target.pid, "SELECT count(gpu_ms) AS g, count(alloc_delta_mb) AS a, count(peak_delta_mb) AS p, count(*) AS n FROM python.torch_trace")
    assert cuda_only == [{"g": 0, "a": 0, "p": 0, "n": 30}], cuda_only
    status = torch_json(cli, target.pid)
    run_dir = target.script.parent / "run"
    assert status["trace"]["store"]["spill"]["dir"] == str(run_dir / "tables"), status["trace"]["store"]
    # The store's thread writes within a second of the rows coming in.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spilled = torch_json(cli, target.pid)["trace"]["store"]["spill"]["rows"]
        if spilled.get("torch_trace", 0) >= 30 and spilled.get("torch_steps", 0) >= 5:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"not spilled: {spilled}")
    kill_tree(target.pid)  # SIGKILL: no exit handler runs
    target.proc.wait(timeout=30)

    offline = cli("query", "--run", run_dir, sql, "--format", "json")
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout) == live
    who = cli("query", "--run", run_dir, "SELECT DISTINCT pid, host FROM python.torch_steps", "--format", "json")
    assert who.returncode == 0, who.stderr
    assert [r["pid"] for r in json.loads(who.stdout)] == [target.pid]
    # The files are plain Arrow IPC streams: any Arrow reader opens them.
    files = sorted((run_dir / "tables" / "torch_trace").glob("*.arrows"))
    assert files and all(f.name.endswith(f"-{target.pid}-0.arrows") for f in files), files


def test_rows_reach_the_run_store_at_a_clean_exit(torch_python, spawn, cli):
    exits = TRAIN.replace("            print(f\"DONE {done}\", flush=True)", "            print(f\"DONE {done}\", flush=True)\n            if done >= 3:\n                sys.exit(0)")
    assert exits != TRAIN
    # The store's thread would write only after a minute: what reaches the
    # disk is the exit's own flush.
    target = spawn(torch_python, exits, env={"RANKSCOPE_TORCH": "trace", "RANKSCOPE_STORE_FLUSH_S": "60"})
    run_steps(cli, target, 3, 3)
    assert target.proc.wait(timeout=60) == 0
    run_dir = target.script.parent / "run"
    result = cli("query", "--run", run_dir, "SELECT max(step) AS last FROM python.torch_steps", "--format", "json")
    assert result.returncode == 0, result.stderr
    # The last step's row came in just before exit: the exit flush wrote it.
    assert json.loads(result.stdout) == [{"last": 2}]


@pytest.mark.parametrize("how", ["--compile", "--compile-in-place"])
def test_a_compiled_model_is_timed_at_its_boundary_and_never_recompiled(torch_python, spawn, cli, tmp_path, how):
    target = spawn(torch_python, TRAIN, args=[how])
    run_steps(cli, target, 2, 2)  # compiled, forward and backward
    graphs = "from torch._dynamo.utils import counters; (counters['stats']['unique_graphs'], counters['frames']['total'])"
    before = cli(target.pid, "eval", graphs).stdout.strip()
    on = cli(target.pid, "torch", "trace", "on", "--backward")
    assert on.returncode == 0, on.stderr
    # The wrapper torch.compile returned (or the module compiled in place),
    # and nothing inside it.
    assert "trace on: 1 modules" in on.stdout, on.stdout
    run_steps(cli, target, 3, 5)
    rows = query_json(cli, target.pid, "SELECT DISTINCT module, module_type, stage FROM python.torch_trace ORDER BY stage")
    kind = "OptimizedModule" if how == "--compile" else "MLP"
    assert rows == [
        {"module": "MLP", "module_type": kind, "stage": "backward"},
        {"module": "MLP", "module_type": kind, "stage": "forward"},
    ], rows
    assert cli(target.pid, "torch", "trace", "off").returncode == 0
    run_steps(cli, target, 2, 7)
    assert cli(target.pid, "eval", graphs).stdout.strip() == before, "the trace made dynamo compile again"
    # Activation statistics the same way: the boundary only (a hook on fc1
    # inside the compiled region recompiled the model).
    inside = cli(target.pid, "torch", "activations", "--modules", "fc*")
    assert inside.returncode != 0 and "watched at its boundary only" in inside.stderr, inside.stderr
    assert cli(target.pid, "torch", "activations", "--modules", "*").returncode == 0
    run_steps(cli, target, 2, 9)
    assert cli(target.pid, "torch", "activations", "off").returncode == 0
    watched = query_json(cli, target.pid, "SELECT DISTINCT module FROM python.activation_stats")
    assert watched == [{"module": "MLP"}], watched
    run_steps(cli, target, 1, 10)
    assert cli(target.pid, "eval", graphs).stdout.strip() == before, "activations made dynamo compile again"
    probed = tmp_path / "probed.pt"
    assert cli(target.pid, "eval", f"save({str(probed)!r})").returncode == 0
    assert_bitwise_equal(torch_python, probed, reference_run(torch_python, tmp_path, 10, how))


def test_module_glob_and_a_bad_glob(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN)
    bad = cli(target.pid, "torch", "trace", "on", "--modules", "encoder.*")
    assert bad.returncode != 0
    assert "no module matches 'encoder.*'" in bad.stderr and "hint:" in bad.stderr
    # The names the glob was matched against, not the root alone.
    assert "modules: MLP, fc1, act1, fc2, act2, head\n" in bad.stderr, bad.stderr
    assert cli(target.pid, "torch", "trace", "on", "--modules", "fc*").returncode == 0
    run_steps(cli, target, 3, 3)
    rows = query_json(cli, target.pid, "SELECT DISTINCT module FROM python.torch_trace ORDER BY module")
    assert [r["module"] for r in rows] == ["fc1", "fc2"]
    # A request refused leaves the running trace as it was.
    assert cli(target.pid, "torch", "trace", "on", "--every", "3", "--modules", "encoder.*").returncode != 0
    status = cli(target.pid, "torch").stdout
    assert "trace: on, every 1 step, modules 'fc*', forward" in status, status
    # The model itself is still hooked for the step's figures.
    steps = query_json(cli, target.pid, "SELECT forward_ms FROM python.torch_steps WHERE sampled")
    assert steps and all(r["forward_ms"] > 0 for r in steps)


def test_steps_between_samples_each_get_their_row(torch_python, spawn, cli):
    # --every 4: steps 1, 2, 5, 6, 9, 10 end by the short way (nothing on
    # but the step clock); 3 attaches the stand-ins by the long way, which
    # hands them to the short way; 7 and 11 put the same stand-ins on again
    # by the short way, and 8 and 12 end there, rows and all.
    target = spawn(torch_python, TRAIN)
    assert cli(target.pid, "torch", "trace", "on", "--every", "4").returncode == 0
    run_steps(cli, target, 8, 8)
    timed = "sum('forward' in vars(m) for m in model.modules()), sum(len(m._forward_hooks) for m in model.modules())"
    assert cli(target.pid, "eval", timed).stdout.strip() == "(6, 0)"  # step 8, put on by the short way
    run_steps(cli, target, 5, 13)
    assert cli(target.pid, "eval", NO_HOOKS).stdout.strip() == "(True, 1, 1, 2)"
    per_step = query_json(
        cli,
        target.pid,
        "SELECT step, sampled, step_ms, optimizer_ms, forward_ms, dataloader_wait_ms, loss, samples, samples_per_s "
        "FROM python.torch_steps ORDER BY step",
    )
    assert [r["step"] for r in per_step] == list(range(1, 13)), per_step
    # The loss in a sampled step's row is the program's own, to the bit
    # (step N is the program's N+1th: the trace came on during its first).
    losses = cli(target.pid, "eval", "[float(l) for l in losses]")
    program_losses = eval(losses.stdout.strip())  # a list of floats, from repr
    for r in per_step:
        assert r["step_ms"] > 0 and r["optimizer_ms"] > 0, r
        assert r["sampled"] == (r["step"] % 4 == 0), r
        if r["sampled"]:
            assert r["forward_ms"] > 0 and r["dataloader_wait_ms"] >= 0, r
            assert r["samples"] == 8 and r["samples_per_s"] > 0, r
            assert r["loss"] == program_losses[r["step"]], (r, program_losses)
        else:
            assert r["forward_ms"] is None and r["loss"] is None and r["samples"] is None, r
    traced = query_json(
        cli, target.pid, "SELECT step, count(*) AS modules, min(calls) AS lo, max(calls) AS hi, min(duration_ms) AS ms FROM python.torch_trace GROUP BY step ORDER BY step"
    )
    assert [(r["step"], r["modules"], r["lo"], r["hi"]) for r in traced] == [(4, 6, 1, 1), (8, 6, 1, 1), (12, 6, 1, 1)], traced
    assert all(r["ms"] > 0 for r in traced), traced
    assert torch_json(cli, target.pid)["trace"]["sampled_steps"] == 3
    # Off from the short way: no hook is left, and no more rows come.
    assert cli(target.pid, "torch", "trace", "off").returncode == 0
    run_steps(cli, target, 2, 15)
    assert cli(target.pid, "eval", NO_HOOKS).stdout.strip() == "(True, 0, 0, 0)"
    assert query_json(cli, target.pid, "SELECT max(step) AS s FROM python.torch_steps") == [{"s": 12}]


def test_a_root_forward_the_program_keeps_calling_counts_in_its_sampled_steps_only(torch_python, spawn, cli):
    # The program takes the model's forward while the trace's stand-in is
    # on it and calls it at every step after: each sampled step's row
    # still counts that step's samples and wait alone.
    target = spawn(torch_python, TRAIN, args=["--grab-forward"])
    assert cli(target.pid, "torch", "trace", "on", "--every", "4").returncode == 0
    run_steps(cli, target, 13, 13)
    assert cli(target.pid, "eval", "type(GRAB[0]).__name__").stdout.strip() == "'StandIn'"
    rows = query_json(cli, target.pid, "SELECT step, samples, dataloader_wait_ms, forward_ms, step_ms FROM python.torch_steps WHERE sampled ORDER BY step")
    assert [(r["step"], r["samples"]) for r in rows] == [(4, 8), (8, 8), (12, 8)], rows
    for r in rows:
        assert 0 <= r["dataloader_wait_ms"] <= r["step_ms"], r


def test_a_validation_pass_before_the_forward_is_no_part_of_the_wait_or_the_activations(torch_python, spawn, cli):
    # Each step runs the model without grad on another data set, waits
    # 40 ms for its batch, then trains: the step's data-loader wait is the
    # time outside its forwards (not the few microseconds before the
    # validation pass), and its activation statistics are the training
    # call's (not a mean with the validation call's, 1000 times larger).
    target = spawn(torch_python, TRAIN, args=["--validate"])
    assert cli(target.pid, "torch", "trace", "on").returncode == 0
    assert cli(target.pid, "torch", "activations", "--modules", "fc1").returncode == 0
    run_steps(cli, target, 6, 6)
    rows = query_json(cli, target.pid, "SELECT step, dataloader_wait_ms, forward_ms, step_ms FROM python.torch_steps WHERE sampled ORDER BY step")
    assert len(rows) >= 4, rows
    for r in rows:
        assert 35 <= r["dataloader_wait_ms"] <= r["step_ms"] - r["forward_ms"], r
    acts = query_json(cli, target.pid, "SELECT step, calls, max_abs FROM python.activation_stats WHERE module = 'fc1' ORDER BY step")
    assert len(acts) >= 4, acts
    assert all(a["calls"] == 1 and a["max_abs"] < 50 for a in acts), acts


ROOT_CHAIN = "(lambda f: (type(f).__name__, type(getattr(f, '__wrapped__', None)).__name__))(vars(model).get('forward'))"
IN_CHILDREN = "sum('forward' in vars(m) for m in model.children())"


def test_the_nan_watch_armed_and_disarmed_while_the_short_way_has_stand_ins_on(torch_python, spawn, cli):
    # The trace's stand-ins, put on and taken off by the short way, meet
    # the NaN watch's on the model's root: armed at a sampled step, the
    # watch's goes on top of the trace's; the short way then takes the
    # trace's out from under it, and the long way takes over while the
    # watch is armed.
    target = spawn(torch_python, TRAIN)
    assert cli(target.pid, "torch", "trace", "on", "--every", "4").returncode == 0
    run_steps(cli, target, 8, 8)
    assert cli(target.pid, "eval", ROOT_CHAIN).stdout.strip() == "('StandIn', 'method')"
    assert cli(target.pid, "torch", "nan", "on").returncode == 0
    assert cli(target.pid, "eval", ROOT_CHAIN).stdout.strip() == "('StandIn', 'StandIn')"
    run_steps(cli, target, 1, 9)
    assert cli(target.pid, "eval", ROOT_CHAIN).stdout.strip() == "('StandIn', 'method')"  # the watch's alone
    assert cli(target.pid, "eval", IN_CHILDREN).stdout.strip() == "0"
    run_steps(cli, target, 3, 12)
    assert cli(target.pid, "eval", ROOT_CHAIN).stdout.strip() == "('StandIn', 'StandIn')"
    assert cli(target.pid, "eval", IN_CHILDREN).stdout.strip() == "5"
    assert cli(target.pid, "torch", "nan", "off").returncode == 0
    run_steps(cli, target, 5, 17)
    traced = query_json(cli, target.pid, "SELECT step, count(*) AS modules FROM python.torch_trace GROUP BY step ORDER BY step")
    assert [(r["step"], r["modules"]) for r in traced] == [(4, 6), (8, 6), (12, 6), (16, 6)], traced
    assert cli(target.pid, "torch", "trace", "off").returncode == 0
    run_steps(cli, target, 2, 19)
    assert cli(target.pid, "eval", NO_HOOKS).stdout.strip() == "(True, 0, 0, 0)"
    # The trace off while the watch keeps the step clock: its hooks stay,
    # and nothing says they come off.
    assert cli(target.pid, "torch", "nan", "on").returncode == 0
    assert cli(target.pid, "torch", "trace", "on").returncode == 0
    run_steps(cli, target, 1, 20)
    off = cli(target.pid, "torch", "trace", "off")
    status = cli(target.pid, "torch").stdout
    assert "come off" not in off.stdout + status and "nan watch: armed" in status, (off.stdout, status)


def test_the_probes_own_work_at_a_boundary_is_in_no_steps_time(torch_python, spawn, cli):
    """GIVEN step boundaries where the probe's own work takes 80 ms (made
    slow here on purpose, as finding a large model's modules at the first
    one is), WHEN the steps' rows are read, THEN no step's time holds it:
    the next step starts when the program has its thread back."""
    # One thread of torch's: after a sleep its pool's workers are woken
    # again, which on a busy machine took tens of ms of the steps after.
    target = spawn(torch_python, TRAIN, env={"OMP_NUM_THREADS": "1"})
    slow = ("import time, rankscope._probe.torch.trace as t\n"
            "_long = t.Tracer._boundary\n"
            "def _slow(self, *args):\n    _long(self, *args)\n    time.sleep(0.08)\n"
            "t.Tracer._boundary = _slow")
    assert cli(target.pid, "eval", slow).returncode == 0
    assert cli(target.pid, "torch", "trace", "on", "--every", "2").returncode == 0
    run_steps(cli, target, 8, 8)
    rows = query_json(cli, target.pid, "SELECT step, step_ms, dataloader_wait_ms FROM python.torch_steps ORDER BY step")
    assert len(rows) >= 6, rows
    assert all(r["step_ms"] < 60 for r in rows), rows
    assert all(r["dataloader_wait_ms"] is None or r["dataloader_wait_ms"] < 60 for r in rows), rows


def test_rankscope_step_marks_steps_without_an_optimizer(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN, args=["--manual"])
    status = torch_json(cli, target.pid)
    assert [m["name"] for m in status["models"]] == ["MLP"] and status["optimizers"] == []
    assert cli(target.pid, "torch", "trace", "on", "--every", "3").returncode == 0
    run_steps(cli, target, 7, 7)
    steps = query_json(cli, target.pid, "SELECT DISTINCT step FROM python.torch_trace ORDER BY step")
    assert [r["step"] for r in steps] == [3, 6]
    text = cli(target.pid, "torch").stdout
    assert "step 7 (from rankscope.step())" in text
    assert cli(target.pid, "torch", "trace", "off").returncode == 0
    assert cli(target.pid, "eval", "import rankscope; rankscope._step_hook is None").stdout.strip() == "True"


def test_a_failing_hook_turns_the_trace_off_and_the_program_goes_on(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN, args=["--odd-output"])
    assert cli(target.pid, "torch", "trace", "on").returncode == 0
    run_steps(cli, target, 4, 4)
    text = cli(target.pid, "torch").stdout
    assert "trace: off" in text
    assert "turned itself off after an error (1 in all): the trace's end of MLP failed: RuntimeError: no loss here" in text
    assert cli(target.pid, "eval", NO_HOOKS).stdout.strip() == "(True, 0, 0, 0)"
    run_steps(cli, target, 2, 6)
    assert target.alive()


def test_rankscope_torch_env_turns_the_trace_on_once_torch_is_imported(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN, args=["--import-late"], env={"RANKSCOPE_TORCH": "trace,every=2"})
    # Nothing was imported for the trace.
    assert cli(target.pid, "eval", "import sys; 'torch' in sys.modules").stdout.strip() == "False"
    assert cli(target.pid, "eval", "go = 1; budget = 5").returncode == 0
    target.wait_for_line("DONE 5")
    status = torch_json(cli, target.pid)
    assert status["trace"]["on"] and status["trace"]["every"] == 2
    steps = query_json(cli, target.pid, "SELECT DISTINCT step FROM python.torch_trace ORDER BY step")
    assert [r["step"] for r in steps] == [2, 4]
    # On before the program's first step: no step was in progress, so step
    # 0 has its row (unsampled: no model was known when it began).
    per_step = query_json(cli, target.pid, "SELECT step, sampled, step_ms, optimizer_ms FROM python.torch_steps ORDER BY step")
    assert [(r["step"], r["sampled"]) for r in per_step] == [(0, False), (1, False), (2, True), (3, False), (4, True)], per_step
    assert per_step[0]["step_ms"] is None and per_step[0]["optimizer_ms"] > 0, per_step


def test_rankscope_torch_env_grads_every_1_names_every_parameter_from_the_first_step(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN, env={"RANKSCOPE_TORCH": "grads,every=1"})
    # Before any step: the model is there, and counted.
    assert "grads: on, 6 parameters, every 1 step," in cli(target.pid, "torch", "grads").stdout
    run_steps(cli, target, 3, 3)
    rows = query_json(cli, target.pid, "SELECT step, param, module FROM python.grad_stats ORDER BY step, param")
    names = [("fc1.bias", "fc1"), ("fc1.weight", "fc1"), ("fc2.bias", "fc2"), ("fc2.weight", "fc2"), ("head.bias", "head"), ("head.weight", "head")]
    assert [(r["step"], r["param"], r["module"]) for r in rows] == [(step, *name) for step in (0, 1, 2) for name in names], rows


def test_activations_before_the_model_exists_wait_for_it(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN, args=["--model-late"])
    on = cli(target.pid, "torch", "activations", "--modules", "fc*")
    assert on.returncode == 0, on.stderr
    assert "activations: on, 0 modules" in on.stdout and "note: no model found yet" in on.stdout, on.stdout
    assert cli(target.pid, "eval", "go = 1; budget = 4").returncode == 0
    target.wait_for_line("DONE 4")
    # Found at the clock's first boundary: the steps from there on are watched.
    rows = query_json(cli, target.pid, "SELECT step, module FROM python.activation_stats ORDER BY step, module")
    assert [(r["step"], r["module"]) for r in rows] == [(s, m) for s in (1, 2, 3) for m in ("fc1", "fc2")], rows
    text = cli(target.pid, "torch", "activations").stdout
    assert "activations: on, 2 modules" in text and "note:" not in text, text
    # A glob that the model, once found, does not match: off, saying why.
    late = spawn(torch_python, TRAIN, args=["--model-late"])
    assert cli(late.pid, "torch", "activations", "--modules", "encoder.*").returncode == 0
    assert cli(late.pid, "eval", "go = 1; budget = 2").returncode == 0
    late.wait_for_line("DONE 2")
    activations = torch_json(cli, late.pid)["features"]["activations"]
    assert not activations["on"], activations
    assert activations["disabled"] == "no module matches 'encoder.*'; modules: MLP, fc1, act1, fc2, act2, head", activations


def test_trace_on_names_its_first_sampled_step_and_counts_its_modules_alike(torch_python, spawn, cli):
    target = spawn(torch_python, TRAIN)
    run_steps(cli, target, 7, 7)
    # The clock never ran: the step in progress is the optimizer's count.
    on = cli(target.pid, "torch", "trace", "on", "--modules", "fc*", "--every", "5")
    assert on.returncode == 0, on.stderr
    assert "trace on: 2 modules, every 5 steps (first sampled step: 10);" in on.stdout, on.stdout
    assert "counted from here" not in on.stdout, on.stdout  # Adam's own count
    run_steps(cli, target, 3, 10)  # step 10 in progress, sampled
    assert "; 2 modules timed now;" in cli(target.pid, "torch").stdout
    assert "trace off: 2 modules as they were" in cli(target.pid, "torch", "trace", "off").stdout
    # The clock ran for `grads` and stopped: what it counted then is stale.
    assert cli(target.pid, "torch", "grads").returncode == 0
    run_steps(cli, target, 3, 13)
    assert cli(target.pid, "torch", "grads", "off").returncode == 0
    run_steps(cli, target, 9, 22)
    on = cli(target.pid, "torch", "trace", "on", "--modules", "fc*", "--every", "5")
    assert "trace on: 2 modules, every 5 steps (first sampled step: 25);" in on.stdout, on.stdout
    run_steps(cli, target, 4, 26)
    sampled = query_json(cli, target.pid, "SELECT step FROM python.torch_steps WHERE sampled AND step > 10 ORDER BY step")
    assert [r["step"] for r in sampled] == [25], sampled
    # Between sampled steps, off counts the same modules.
    assert "trace off: 2 modules as they were" in cli(target.pid, "torch", "trace", "off").stdout
    # SGD keeps no count: the numbers start from the clock's, and `trace on` says so.
    sgd = spawn(torch_python, TRAIN, args=["--sgd"])
    run_steps(cli, sgd, 7, 7)
    on = cli(sgd.pid, "torch", "trace", "on", "--every", "5")
    assert "trace on: 6 modules, every 5 steps (first sampled step: 5);" in on.stdout, on.stdout
    assert "note: steps are counted from here, as the probe found no count" in on.stdout, on.stdout
    run_steps(cli, sgd, 2, 9)
    assert torch_json(cli, sgd.pid)["trace"]["numbered"] == "clock"


def test_without_torch_imported(python, spawn, cli):
    target = spawn(python, "import time\nprint('READY', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    result = cli(target.pid, "torch")
    assert result.returncode != 0
    assert "error: torch is not imported in this process" in result.stderr
    assert "hint:" in result.stderr
    result = cli(target.pid, "torch", "trace", "on")
    assert result.returncode != 0 and "torch is not imported" in result.stderr
    assert query_json(cli, target.pid, "SELECT count(*) AS n FROM python.torch_trace") == [{"n": 0}]
    assert query_json(cli, target.pid, "SELECT * FROM python.torch_steps") == []
    assert query_json(cli, target.pid, "SELECT * FROM python.flight_recorder") == []
    assert cli(target.pid, "eval", "import sys; 'torch' in sys.modules").stdout.strip() == "False"


DDP_TRAIN = """
import os, sys, time
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(10):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    dist.all_reduce(loss.detach().clone())  # a logging all_reduce, from Python
    optimizer.step()
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "done", f"rank{rank}.done"), "w").close()
while True:
    time.sleep(0.1)
"""


def test_every_rank_samples_the_same_steps_and_cluster_query_sees_them(default_python, cli, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "ddp.py"
    script.write_text(DDP_TRAIN)
    done = tmp_path / "done"
    done.mkdir()
    proc = launch_torchrun(
        default_python, script, 2, endpoint_dir, tmp_path / "run", env={"RANKSCOPE_TORCH": "trace,every=3"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(done.glob("rank*.done"))) < 2:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the ranks did not finish their steps"
            time.sleep(0.05)
        run = str(tmp_path / "run")
        result = cli("cluster", "query", "--run", run, "SELECT rank, step FROM python.torch_trace GROUP BY rank, step ORDER BY rank, step", "--format", "json")
        assert result.returncode == 0, result.stderr
        rows = json.loads(result.stdout)
        assert [(r["rank"], r["step"]) for r in rows] == [(0, 3), (0, 6), (0, 9), (1, 3), (1, 6), (1, 9)]
        modules = cli("cluster", "query", "--run", run, "SELECT DISTINCT module FROM python.torch_trace ORDER BY module", "--format", "csv")
        assert modules.stdout.split() == ["module", "DistributedDataParallel", "module", "module.0", "module.1", "module.2"]
        steps = cli("cluster", "query", "--run", run, "SELECT rank, count(*) AS n FROM python.torch_steps GROUP BY rank ORDER BY rank", "--format", "csv")
        # Ten steps each: the trace came on as the program imported torch,
        # so step 0 (before the clock's first boundary) has its row too.
        assert steps.stdout.split() == ["rank,n", "0,10", "1,10"]
        # The query for the slow rank, as written there.
        slow = cli("cluster", "query", "--run", run, "SELECT rank, avg(step_ms) FROM python.torch_steps GROUP BY rank ORDER BY 2 DESC", "--format", "json")
        assert slow.returncode == 0, slow.stderr
        assert sorted(r["rank"] for r in json.loads(slow.stdout)) == [0, 1] and all(v > 0 for r in json.loads(slow.stdout) for k, v in r.items() if k != "rank"), slow.stdout
        # Each collective carries the step it was called in (the clock
        # started as the program imported torch: the first is step 0).
        collectives = cli("cluster", "query", "--run", run, "SELECT rank, count(*) AS n, min(step) AS first, max(step) AS last, count(DISTINCT step) AS steps FROM python.collectives WHERE op = 'all_reduce' GROUP BY rank ORDER BY rank", "--format", "csv")
        assert collectives.stdout.split() == ["rank,n,first,last,steps", "0,10,0,9,10", "1,10,0,9,10"], collectives.stdout

        status = cli("cluster", "torch", "--run", run)
        assert status.returncode == 0, status.stderr
        assert status.stdout.count("trace: on, every 3 steps") == 2, status.stdout
        assert "== rank 0" in status.stdout and "== rank 1" in status.stdout
        off = cli("cluster", "torch", "--run", run, "trace", "off", "--ranks", "1")
        assert off.returncode == 0, off.stderr
        assert "== rank 1" in off.stdout and "== rank 0" not in off.stdout and "trace off" in off.stdout, off.stdout
        both = json.loads(cli("cluster", "torch", "--run", run, "--format", "json").stdout)
        assert [(r["rank"], r["torch"]["trace"]["on"]) for r in both] == [(0, True), (1, False)]
        # What SIGKILL would lose is the last second's rows: wait for the
        # store's thread to write them.
        deadline = time.monotonic() + 30
        while any(r["torch"]["trace"]["store"]["spill"]["rows"].get("torch_steps", 0) < 9 for r in both):
            assert time.monotonic() < deadline, both
            time.sleep(0.2)
            both = json.loads(cli("cluster", "torch", "--run", run, "--format", "json").stdout)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    # The job is gone: its ranks' rows are still in the run store.
    after = cli("query", "--run", tmp_path / "run", "SELECT rank, count(*) AS n FROM python.torch_steps GROUP BY rank ORDER BY rank", "--format", "csv")
    assert after.returncode == 0, after.stderr
    assert after.stdout.split() == ["rank,n", "0,10", "1,10"]


def wait_for_files(proc, folder, pattern, count, deadline, what, ready=lambda: True):
    """Until `count` files match `pattern` in `folder` (and `ready()`): the
    ranks of a torchrun job are up. The job must not end meanwhile."""
    while len(list(folder.glob(pattern))) < count or not ready():
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


# SGD keeps no count of its steps: each rank's clock counts from where it
# started. Every rank feeds the step's own number in, so that the same
# step has the same loss on every rank.
DDP_SGD_UNTIL_STOPPED = """
import os, time
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
here = os.path.dirname(os.path.abspath(__file__))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
target = torch.zeros(4, 1)
i = 0
open(os.path.join(here, f"rank{rank}.ready"), "w").close()
while not os.path.exists(os.path.join(here, "stop")):
    loss = criterion(model(torch.full((4, 8), 0.01 * i)), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    i += 1
    time.sleep(0.02)
"""


def test_cluster_trace_on_numbers_steps_alike_on_ranks_whose_clocks_started_apart(default_python, cli, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "ddp_sgd.py"
    script.write_text(DDP_SGD_UNTIL_STOPPED)
    proc = launch_torchrun(default_python, script, 2, endpoint_dir, tmp_path / "run", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = str(tmp_path / "run")

    def rank_status():
        result = cli("cluster", "torch", "--run", run, "--format", "json")
        return {r["rank"]: r.get("torch") for r in json.loads(result.stdout)} if result.returncode == 0 else {}

    try:
        deadline = time.monotonic() + 120
        wait_for_files(proc, tmp_path, "rank*.ready", 2, deadline, "the ranks did not start", lambda: len(rank_status()) == 2)
        # Rank 0's clock starts now, rank 1's only with the trace, steps later.
        first = cli("cluster", "torch", "--run", run, "--ranks", "0", "grads", "on", "--every", "1000")
        assert first.returncode == 0, first.stdout + first.stderr
        while (rank_status()[0] or {}).get("step") is None or rank_status()[0]["step"] < 8:
            assert time.monotonic() < deadline, rank_status()
            time.sleep(0.05)
        on = cli("cluster", "torch", "--run", run, "trace", "on", "--every", "4")
        assert on.returncode == 0, on.stdout + on.stderr
        assert "steps: numbered alike on 2 ranks" in on.stdout and "moved: rank 1 +" in on.stdout, on.stdout
        sql = "SELECT rank, step, loss FROM python.torch_steps WHERE sampled ORDER BY rank, step"
        while True:
            rows = json.loads(cli("cluster", "query", "--run", run, sql, "--format", "json").stdout)
            by_rank = {rank: {r["step"]: r["loss"] for r in rows if r["rank"] == rank} for rank in (0, 1)}
            if all(len(steps) >= 4 for steps in by_rank.values()):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.1)
        shared = sorted(set(by_rank[0]) & set(by_rank[1]))
        assert len(shared) >= 3, by_rank
        assert all(step % 4 == 0 for steps in by_rank.values() for step in steps), by_rank
        # The same step number is the same step: its loss is the same.
        assert [by_rank[0][s] for s in shared] == [by_rank[1][s] for s in shared], by_rank
        assert len({by_rank[0][s] for s in shared}) == len(shared), by_rank
    finally:
        (tmp_path / "stop").touch()
        kill_tree(proc.pid)
        proc.wait()


# A DataLoader whose workers multiprocessing starts by spawn: each worker
# (and the resource tracker) inherits its rank's RANK, WORLD_SIZE and
# TORCHELASTIC_RUN_ID, and registered as a rank of the job.
DDP_SPAWN_LOADER = """
import os, time
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

HERE = os.path.dirname(os.path.abspath(__file__))


class Numbers(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((8,), float(i)), torch.zeros(1)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(HERE, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = DataLoader(Numbers(), batch_size=4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True)
    while not os.path.exists(os.path.join(HERE, "stop")):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(0.01)
    dist.destroy_process_group()
"""


def test_dataloader_workers_started_by_spawn_are_not_ranks_of_the_job(default_python, cli, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "loader.py"
    script.write_text(DDP_SPAWN_LOADER)
    proc = launch_torchrun(default_python, script, 2, endpoint_dir, tmp_path / "run", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = str(tmp_path / "run")
    try:
        deadline = time.monotonic() + 120
        wait_for_files(proc, tmp_path, "rank*.pid", 2, deadline, "the ranks did not start")
        pids = {int(p.name[4]): int(p.read_text()) for p in tmp_path.glob("rank*.pid")}
        # The workers are up once a step has run on each rank.
        while True:
            status = cli("cluster", "torch", "--run", run, "--format", "json")
            answers = json.loads(status.stdout) if status.stdout.strip() else []
            if status.returncode == 0 and len(answers) == 2 and all((a["torch"].get("step") or 0) > 0 or a["torch"]["optimizers"] for a in answers):
                break
            assert time.monotonic() < deadline, status.stdout + status.stderr
            time.sleep(0.2)
        listed = json.loads(cli("cluster", "list", "--run", run, "--format", "json").stdout)
        assert sorted((r["rank"], r["pid"]) for r in listed) == sorted(pids.items()), listed
        on = cli("cluster", "torch", "--run", run, "trace", "on")
        assert on.returncode == 0, on.stdout + on.stderr
        assert all(f"== rank {rank} (pid {pid})" in on.stdout for rank, pid in pids.items()), on.stdout
    finally:
        (tmp_path / "stop").touch()
        try:
            proc.wait(timeout=60)
        finally:
            kill_tree(proc.pid)
    crashes = cli("crashes", "--run", run)
    assert "vanished" not in crashes.stdout + crashes.stderr, crashes.stdout


def test_cluster_trace_on_in_a_job_of_one_rank_says_nothing_of_numbering(default_python, cli, endpoint_dir, tmp_path):
    require_torch(default_python)
    script = tmp_path / "ddp_sgd.py"
    script.write_text(DDP_SGD_UNTIL_STOPPED)
    proc = launch_torchrun(default_python, script, 1, endpoint_dir, tmp_path / "run", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = str(tmp_path / "run")
    try:
        deadline = time.monotonic() + 120
        wait_for_files(proc, tmp_path, "rank*.ready", 1, deadline, "the rank did not start",
                       lambda: cli("cluster", "list", "--run", run).returncode == 0)
        on = cli("cluster", "torch", "--run", run, "trace", "on", "--every", "2")
        assert on.returncode == 0, on.stdout + on.stderr
        assert "steps:" not in on.stdout and "== rank 0" in on.stdout, on.stdout
    finally:
        (tmp_path / "stop").touch()
        kill_tree(proc.pid)
        proc.wait()


# A module that hands its input on as its output (nn.Identity, a drop
# path turned off, as in timm's blocks): the gradient reaches its input
# when it reaches its output, so its backward takes no time of its own.
PASS_THROUGH = """
import torch
from torch import nn

torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
        self.drop_path = nn.Identity()
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.drop_path(self.body(x)))

model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(8):
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("READY", flush=True)
import time
time.sleep(600)
"""


def test_a_pass_through_module_has_no_backward_time_of_its_own(torch_python, spawn, cli):
    target = spawn(torch_python, PASS_THROUGH, env={"RANKSCOPE_TORCH": "trace,backward"})
    rows = query_json(
        cli, target.pid, "SELECT module, sum(duration_ms) AS ms, count(*) AS n FROM python.torch_trace WHERE stage = 'backward' GROUP BY module"
    )
    ms = {r["module"]: r["ms"] for r in rows}
    assert {"body", "drop_path", "head"} <= set(ms), rows
    # It was charged with the rest of the pass: the body's whole backward.
    assert ms["drop_path"] < 0.05 * ms["body"], rows
