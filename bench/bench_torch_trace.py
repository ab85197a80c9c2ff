"""What `rankscope PID torch trace on` costs a training step.

A small model trains in a target, on a CPU with one torch thread: the
MLP (Linear+ReLU layers, Adam, batch 64, about 1.6 ms a step here: the
worst case for a cost per step) or, with --model gpt, a small GPT
(pre-norm blocks of causal attention and a 4x MLP, d=128, 4 layers,
context 64, batch 8, Adam). It trains with the probe on. Rounds alternate between no trace,
`trace on --every 1`, `--every 20`, and `--every 1 --backward`, each set
through the installed CLI (`rankscope PID torch trace on|off`), and time
--steps steps each. Each round is timed twice: by the wall clock and by the
training thread's own CPU time (`time.thread_time`), which leaves out the
time the thread spent waiting for a core: on a shared 2-core machine that
wait is most of the noise, and the hooks run on this thread, so their cost
is all in it. A mode's figure is the median over rounds of its paired
ratio against no trace in the same round; the best rounds' ratio is
printed beside it.

Targets (from the issue): forward only, <= 3 % at --every 1 and <= 0.5 % at
--every 20; --backward: reported.

    .venv/bin/python bench/bench_torch_trace.py [--model mlp|gpt] [--width W] [--layers 4] [--device cpu|cuda] [--rounds 40] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import random

from _common import ask, base_env, machine, overhead_table, private_dir, probe_cli, run_main, start_target, stop_target, tool

TARGET = r"""
import json, sys, time
import torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
width, layers, kind, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

class Block(nn.Module):
    # A pre-norm GPT block: causal self-attention, then a 4x MLP.
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, context):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

if kind == "gpt":
    vocab, context, batch = 256, 64, 8
    model = GPT(vocab, width, layers, 4, context)
    data = torch.randint(0, vocab, (batch, context + 1))
    x, y = data[:, :-1], data[:, 1:]
    loss_of = lambda out: nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))
else:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 1))
    x, y = torch.randn(64, width), torch.randn(64, 1)
    loss_of = lambda out: nn.functional.mse_loss(out, y)
model = model.to(device)
x, y = x.to(device), y.to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
# CUDA runs ahead of the CPU: a round is timed from an idle device to an idle one.
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

def step():
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(model(x))
    loss.backward()
    optimizer.step()

for _ in range(50):
    step()
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    sync()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        step()
    sync()
    print(json.dumps([(time.perf_counter() - t0) / n, (time.thread_time() - c0) / n]), flush=True)
"""

MODES = {
    "no trace": None,
    "--every 1": ["--every", "1"],
    "--every 20": ["--every", "20"],
    "--every 1 --backward": ["--every", "1", "--backward"],
}


def add_model_args(ap) -> None:
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    ap.add_argument("--width", type=int, default=None, help="MLP width (256) or GPT d_model (128)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains (cuda: on GPU 0)")


def target_args(args) -> tuple:
    if args.width is None:
        args.width = 128 if args.model == "gpt" else 256
    return (str(args.width), str(args.layers), args.model, args.device)


def describe_model(args) -> str:
    if args.model == "gpt":
        return f"GPT: {args.layers} blocks, d={args.width}, 4 heads, context 64, batch 8, vocab 256, Adam, {_where(args)}"
    return f"MLP: {args.layers} x Linear({args.width}, {args.width}) + ReLU, batch 64, Adam, {_where(args)}"


def judged_by(args) -> str:
    # A GPU step ends in a wait for the device, which spins the thread: its
    # CPU time then counts the device's work.
    return "wall" if args.device == "cuda" else "thread CPU"


def _where(args) -> str:
    return "CUDA (rounds timed to a synchronize)" if args.device == "cuda" else "CPU, 1 thread"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    rankscope = tool("rankscope")
    endpoint = private_dir("rs-bench-torch-")
    env = base_env(RANKSCOPE="1", RANKSCOPE_DIR=endpoint, RANKSCOPE_RUN_DIR=os.path.join(endpoint, "run"), OMP_NUM_THREADS="1")
    proc, _ = start_target(TARGET, env, target_args(args))
    cli = probe_cli(rankscope, [proc.pid], base_env(RANKSCOPE_DIR=endpoint))

    def measure(n):
        return ask(proc, n)

    times: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    try:
        order = list(MODES.items())
        for round_no in range(args.rounds):
            # A fresh order each round: a mode never always follows the same one.
            random.Random(round_no).shuffle(order)
            for mode, flags in order:
                cli("torch", "trace", "off")
                # Every mode makes the same two requests (each walks gc.get_objects()).
                cli("torch", "trace", "on", *flags) if flags is not None else cli("torch")
                measure(25)  # warm up; the hooks go on at the first boundary
                times[mode].append(measure(args.steps))
        cli("torch", "trace", "off")
    finally:
        stop_target(proc)

    print(f"machine: {machine()}")
    print(f"{describe_model(args)}; "
          f"{args.rounds} rounds x {args.steps} steps per mode, alternating")
    overhead_table(times, "no trace", {"--every 1": 3.0, "--every 20": 0.5}, judge=judged_by(args))
    return 0


if __name__ == "__main__":
    run_main(main)
