"""The sample program behind `rankscope demo`: a tiny training loop with a
background loader thread, so there is something worth looking at."""

import os
import queue
import threading
import time

import rankscope

model_cfg = {"layers": 4, "hidden": 256, "lr": 3e-4, "optimizer": "adamw"}
step_zero = 0
os.environ.setdefault("DEMO_API_TOKEN", "s3cr3t-never-shown")
os.environ.setdefault("DEMO_DATASET", "tiny-shakespeare")
batches: "queue.Queue[list[float]]" = queue.Queue(maxsize=4)


def load_batches(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        batch = [float(i % 7) for i in range(n, n + 32)]
        try:
            batches.put(batch, timeout=0.1)
        except queue.Full:
            continue
        n += 32


def forward(batch, weights):
    activations = [x * w for x, w in zip(batch, weights)]
    return sum(activations) / len(activations)


def train_step(step, weights):
    batch = batches.get()
    loss = forward(batch, weights)
    time.sleep(0.05)  # the "GPU" is busy
    return loss


def train(stop: threading.Event) -> None:
    weights = [0.5] * 32
    step = 0
    announced = False
    while not stop.is_set():
        loss = train_step(step, weights)
        step += 1
        if not announced:
            print("READY", flush=True)
            announced = True


def main() -> None:
    rankscope.start()  # already started by RANKSCOPE=1; this is a no-op then
    stop = threading.Event()
    loader = threading.Thread(target=load_batches, args=(stop,), name="data-loader", daemon=True)
    loader.start()
    try:
        train(stop)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()


if __name__ == "__main__":
    main()
