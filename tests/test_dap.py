"""`rankscope dap`: an editor's debugger on a live process, driven by a
scripted DAP client the way VSCode drives debugpy, on every Python version.
Every message the adapter sends is checked against the DAP JSON schema."""

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import line_of
from dap_client import DapClient, load_schema

LOOP = """
import time

def work(step):
    x = step * 2  # @x
    y = x + 1  # @y
    return y

def helper(n):
    total = 0  # @helper
    for k in range(n):
        total += k  # @acc
    return total

def train():
    step = 0
    while True:
        step += 1
        r = work(step)  # @call
        s = helper(3)  # @helper_call
        if step % 50 == 0:
            print("tick", step, flush=True)
        time.sleep(0.002)

print("READY", flush=True)
train()
"""

SCHEMA = load_schema()


@pytest.fixture
def schema():
    if SCHEMA is None:
        pytest.skip("debugpy (for the DAP schema) or jsonschema is not installed; scripts/test installs them")
    return SCHEMA


class Adapter:
    """`rankscope dap --stdio` as a child process, and a client on its pipes."""

    def __init__(self, rankscope_bin, endpoint_dir, pid, schema, *extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
        env["RANKSCOPE_DIR"] = endpoint_dir
        self.proc = subprocess.Popen(
            [rankscope_bin, "dap", "--stdio", "--pid", str(pid), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self.client = DapClient(self.proc.stdout.read, self._write, self.proc.stdin.close, schema)

    def _write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def adapters(rankscope_bin, endpoint_dir):
    started = []

    def start(pid, schema, *extra):
        adapter = Adapter(rankscope_bin, endpoint_dir, pid, schema, *extra)
        started.append(adapter)
        return adapter

    yield start
    for adapter in started:
        adapter.stop()


def attach(client, just_my_code=True):
    init = client.request("initialize", {"clientID": "pytest", "adapterID": "rankscope", "linesStartAt1": True, "columnsStartAt1": True, "pathFormat": "path"})
    caps = init["body"]
    client.request("attach", {"type": "debugpy", "request": "attach", "connect": {"host": "127.0.0.1", "port": 5678}, "justMyCode": just_my_code})
    client.event("initialized")
    return caps


# What a debug session may change while attached, and must give back.
HOOKS = (
    "import sys, threading; "
    "(sys.gettrace(), [sys.monitoring.get_tool(i) for i in range(6)] if hasattr(sys, 'monitoring') else None, "
    "sys.excepthook, threading.excepthook)"
)


def hooks(cli, pid) -> str:
    result = cli(pid, "eval", HOOKS)
    assert result.returncode == 0, result.stderr
    return result.stdout


def ticks_after(target, seen: int, timeout: float = 20) -> int:
    """Waits for a `tick N` line with N past `seen`: the loop runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = target.wait_for_line("tick", timeout=max(0.1, deadline - time.monotonic()))
        n = int(line.split()[1])
        if n > seen:
            return n
    raise AssertionError("the loop did not go on")


def local(client, frame_id, name):
    scopes = client.request("scopes", {"frameId": frame_id})["body"]["scopes"]
    ref = next(s["variablesReference"] for s in scopes if s["name"] == "Locals")
    variables = client.request("variables", {"variablesReference": ref})["body"]["variables"]
    return ref, {v["name"]: v for v in variables}.get(name)


def test_a_whole_editor_session_on_a_running_loop(python, spawn, adapters, schema, cli):
    target = spawn(python, LOOP)
    before = hooks(cli, target.pid)
    path = str(target.script)
    lines = {m: line_of(LOOP, m) for m in ("x", "y", "helper", "acc", "call", "helper_call")}
    client = adapters(target.pid, schema).client

    caps = attach(client)
    assert caps["supportsConfigurationDoneRequest"] and caps["supportsConditionalBreakpoints"]
    assert caps["supportsLogPoints"] and caps["supportsSetVariable"] and caps["supportsDataBreakpoints"]
    filters = {f["filter"] for f in caps["exceptionBreakpointFilters"]}
    assert "uncaught" in filters

    # A conditional breakpoint in the running loop.
    mark = client.mark()
    set_bp = client.request("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": lines["x"], "condition": "step % 7 == 0"}]})
    assert [b["verified"] for b in set_bp["body"]["breakpoints"]] == [True]
    client.request("setExceptionBreakpoints", {"filters": []})
    client.request("configurationDone")
    stop = client.stopped(mark, "breakpoint")
    thread = stop["threadId"]
    assert stop["allThreadsStopped"] is False

    threads = client.request("threads")["body"]["threads"]
    assert any(t["id"] == thread and t["name"] == "MainThread" for t in threads)

    # The stack, paged.
    trace = client.request("stackTrace", {"threadId": thread, "startFrame": 0, "levels": 1})["body"]
    assert trace["totalFrames"] >= 3
    (top,) = trace["stackFrames"]
    assert (top["name"], top["line"], top["source"]["path"]) == ("work", lines["x"], path)
    (second,) = client.request("stackTrace", {"threadId": thread, "startFrame": 1, "levels": 1})["body"]["stackFrames"]
    assert (second["name"], second["line"]) == ("train", lines["call"])

    # Scopes, variables, evaluate in the frame (watch and console).
    ref, step = local(client, top["id"], "step")
    assert int(step["value"]) % 7 == 0
    value = client.request("evaluate", {"expression": "step * 10", "frameId": top["id"], "context": "watch"})["body"]
    assert value["result"] == str(int(step["value"]) * 10)
    mark = client.mark()
    client.request("evaluate", {"expression": "print('from the editor', step)", "frameId": top["id"], "context": "repl"})
    out = client.event("output", lambda b: "from the editor" in b["output"], after=mark)
    assert out["body"]["output"].strip() == f"from the editor {step['value']}"
    # The Debug Console completes names in the frame, and attributes.
    labels = [t["label"] for t in client.request("completions", {"text": "ste", "column": 4, "frameId": top["id"]})["body"]["targets"]]
    assert "step" in labels and all(label.startswith("ste") for label in labels), labels
    (sleep,) = [t for t in client.request("completions", {"text": "x = time.sle", "column": 13, "frameId": second["id"]})["body"]["targets"] if t["label"] == "sleep"]
    assert (sleep["start"], sleep["length"]) == (10, 3)
    # The Modules and Loaded Scripts views: the program's script is the user's, the library's is not; no rankscope.
    modules = client.request("modules", {})["body"]
    by_name = {m["name"]: m for m in modules["modules"]}
    assert modules["totalModules"] == len(modules["modules"]) and not any(n.startswith("rankscope") for n in by_name)
    assert by_name["__main__"]["path"] == path and by_name["__main__"]["isUserCode"] is True, by_name["__main__"]
    assert by_name["os"]["isUserCode"] is False
    sources = [s["path"] for s in client.request("loadedSources")["body"]["sources"]]
    assert path in sources and len(sources) == len(set(sources))
    failed = client.request("evaluate", {"expression": "no_such_name", "frameId": top["id"], "context": "watch"}, ok=False)
    assert not failed["success"] and "NameError" in failed["message"]

    # A Watch entry edited: setExpression assigns and answers with the new value.
    edited = client.request("setExpression", {"expression": "step", "value": "step + 2000", "frameId": top["id"]})["body"]
    assert edited["value"] == str(int(step["value"]) + 2000)
    assert client.request("evaluate", {"expression": "step", "frameId": top["id"], "context": "watch"})["body"]["result"] == edited["value"]
    refused = client.request("setExpression", {"expression": "len(x)", "value": "1", "frameId": top["id"]}, ok=False)
    assert not refused["success"] and "name, an attribute or a subscript" in refused["message"]

    # setVariable writes into the running functions (fast locals on 3.11 and
    # 3.12 too): work's own `step`, and the loop's in the frame below.
    changed = client.request("setVariable", {"variablesReference": ref, "name": "step", "value": "1000"})
    assert changed["body"]["value"] == "1000"
    loop_ref, loop_step = local(client, second["id"], "step")
    assert loop_step["value"] == step["value"]
    client.request("setVariable", {"variablesReference": loop_ref, "name": "step", "value": "1000"})

    # Step over: the next line, with the new value.
    mark = client.mark()
    client.request("next", {"threadId": thread})
    client.stopped(mark, "step")
    (top,) = client.top(thread)
    assert top["line"] == lines["y"]
    assert client.request("evaluate", {"expression": "x", "frameId": top["id"], "context": "watch"})["body"]["result"] == "2000"

    # Step out: back in the caller, past the call.
    mark = client.mark()
    client.request("stepOut", {"threadId": thread})
    client.stopped(mark, "step")
    (top,) = client.top(thread)
    assert (top["name"], top["line"]) == ("train", lines["helper_call"])

    # Step in: into helper's first line.
    mark = client.mark()
    client.request("stepIn", {"threadId": thread})
    client.stopped(mark, "step")
    (top,) = client.top(thread)
    assert (top["name"], top["line"]) == ("helper", lines["helper"])

    # Continue: the loop's next pass with step 1001 (1001 % 7 == 0) stops
    # again, so the value set from the editor is the program's now.
    mark = client.mark()
    resumed = client.request("continue", {"threadId": thread})
    assert resumed["body"].get("allThreadsContinued") is False
    client.stopped(mark, "breakpoint")
    (top,) = client.top(thread)
    assert local(client, top["id"], "step")[1]["value"] == "1001"

    # A logpoint never stops: its message is an output event.
    set_bp = client.request("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": lines["acc"], "logMessage": "total={total} k={k}", "hitCondition": "%3"}]})
    assert set_bp["body"]["breakpoints"][0]["verified"]
    mark = client.mark()
    client.request("continue", {"threadId": thread})
    logged = client.event("output", lambda b: b["output"].startswith("total="), after=mark)
    assert logged["body"]["output"] == "total=1 k=2\n"
    assert not [e for e in client.events[mark:] if e["event"] == "stopped"]

    # A data breakpoint: stop in helper, then break when `total` changes.
    mark = client.mark()
    client.request("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": lines["helper"]}]})
    client.stopped(mark, "breakpoint")
    (top,) = client.top(thread)
    ref, _ = local(client, top["id"], "total")
    info = client.request("dataBreakpointInfo", {"variablesReference": ref, "name": "total"})["body"]
    assert info["dataId"]
    client.request("setBreakpoints", {"source": {"path": path}, "breakpoints": []})
    data = client.request("setDataBreakpoints", {"breakpoints": [{"dataId": info["dataId"], "accessType": "write"}]})
    assert data["body"]["breakpoints"][0]["verified"]
    mark = client.mark()
    client.request("continue", {"threadId": thread})
    stop = client.stopped(mark, "data breakpoint")
    assert "total" in stop.get("description", "") + stop.get("text", "")
    client.request("setDataBreakpoints", {"breakpoints": []})

    # Pause a running thread.
    client.request("continue", {"threadId": thread})
    mark = client.mark()
    client.request("pause", {"threadId": thread})
    client.stopped(mark, "pause")
    # At the next line it runs: in the loop, or still in helper where the
    # data breakpoint stopped it (a pause can overtake the continue).
    assert client.top(thread)[0]["name"] in ("train", "helper")

    # Disconnect: breakpoints gone, the thread runs, the target lives.
    client.request("disconnect", {"terminateDebuggee": True})
    assert client.wait_eof()
    assert target.alive()
    ticks_after(target, 1001)
    listed = cli(target.pid, "break", "list", "--format", "json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    # No trace function, sys.monitoring tool or excepthook of ours is left.
    assert hooks(cli, target.pid) == before
    assert not client.invalid, client.invalid


def test_a_slow_console_expression_does_not_hold_up_a_pause(python, spawn, adapters, schema):
    """GIVEN an editor whose Debug Console runs an expression that takes
    seconds, WHEN it pauses the running thread meanwhile, THEN the thread
    stops and the pause is answered before the expression's result."""
    target = spawn(python, LOOP)
    client = adapters(target.pid, schema).client
    attach(client)
    client.request("configurationDone")
    (main,) = [t["id"] for t in client.request("threads")["body"]["threads"] if t["name"] == "MainThread"]
    slow = client.send("evaluate", {"expression": "__import__('time').sleep(3) or 'slept'", "context": "repl"})
    mark = client.mark()
    started = time.monotonic()
    client.request("pause", {"threadId": main}, timeout=2.5)
    client.stopped(mark, "pause", timeout=2.5)
    assert time.monotonic() - started < 2.5
    answer = client.response(slow, timeout=20)
    assert answer["success"] and answer["body"]["result"] == "'slept'", answer
    client.request("continue", {"threadId": main})
    client.request("disconnect", {})
    assert client.wait_eof()
    ticks_after(target, 0)
    assert not client.invalid, client.invalid


def test_a_client_that_goes_away_leaves_no_thread_stopped(default_python, spawn, adapters, schema):
    target = spawn(default_python, LOOP)
    adapter = adapters(target.pid, schema)
    client = adapter.client
    attach(client)
    mark = client.mark()
    client.request("setBreakpoints", {"source": {"path": str(target.script)}, "breakpoints": [{"line": line_of(LOOP, "x")}]})
    client.request("configurationDone")
    client.stopped(mark, "breakpoint")
    # The editor's end of the pipe closes without a disconnect.
    client.close()
    assert adapter.proc.wait(timeout=20) == 0
    ticks_after(target, 0)


def test_an_adapter_killed_while_a_thread_is_stopped_lets_it_go(default_python, spawn, adapters, schema):
    target = spawn(default_python, LOOP)
    adapter = adapters(target.pid, schema, "--lease", "2")
    client = adapter.client
    attach(client)
    mark = client.mark()
    client.request("setBreakpoints", {"source": {"path": str(target.script)}, "breakpoints": [{"line": line_of(LOOP, "x")}]})
    client.request("configurationDone")
    client.stopped(mark, "breakpoint")
    adapter.proc.send_signal(signal.SIGKILL)
    adapter.proc.wait()
    # The probe's lease lapses: the breakpoint goes and the loop goes on.
    ticks_after(target, 0, timeout=30)


def test_uncaught_and_raised_exceptions_stop_the_thread(python, spawn, adapters, schema, cli):
    source = """
import threading, time

def fail(n):
    value = n * 3
    raise ValueError(f"bad value {value}")  # @raise

def worker():
    while not go.is_set():
        time.sleep(0.01)
    try:
        fail(1)  # @caught
    except ValueError:
        pass
    fail(2)

go = threading.Event()
threading.Thread(target=worker, name="worker").start()
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""
    target = spawn(python, source)
    before = hooks(cli, target.pid)
    client = adapters(target.pid, schema).client
    caps = attach(client)
    filters = {f["filter"] for f in caps["exceptionBreakpointFilters"]}
    wanted = ["uncaught"] + (["raised"] if "raised" in filters else [])
    reply = client.request("setExceptionBreakpoints", {"filters": wanted})
    assert all(b["verified"] for b in reply["body"]["breakpoints"])
    client.request("configurationDone")
    mark = client.mark()
    client.request("evaluate", {"expression": "go.set()", "context": "repl"})
    assert caps["supportsExceptionInfoRequest"]
    if "raised" in wanted:
        stop = client.stopped(mark, "exception")
        assert "bad value 3" in stop["text"]
        info = client.request("exceptionInfo", {"threadId": stop["threadId"]})["body"]
        assert (info["exceptionId"], info["breakMode"], info["description"]) == ("ValueError", "always", "bad value 3")
        (top,) = client.top(stop["threadId"])
        assert (top["name"], top["line"]) == ("fail", line_of(source, "raise"))
        mark = client.mark()
        client.request("continue", {"threadId": stop["threadId"]})
    stop = client.stopped(mark, "exception")
    if "raised" in wanted:  # the second raise first, then the same one uncaught
        assert "bad value 6" in stop["text"]
        mark = client.mark()
        client.request("continue", {"threadId": stop["threadId"]})
        stop = client.stopped(mark, "exception")
    assert stop["description"].startswith("uncaught") and "bad value 6" in stop["text"]
    # The editor's exception widget: the type, the message and the traceback.
    info = client.request("exceptionInfo", {"threadId": stop["threadId"]})["body"]
    assert (info["exceptionId"], info["breakMode"], info["description"]) == ("ValueError", "unhandled", "bad value 6")
    assert info["details"]["typeName"] == "ValueError"
    trace = info["details"]["stackTrace"]
    assert trace.startswith("Traceback") and "fail(2)" in trace and trace.rstrip().endswith("ValueError: bad value 6"), trace
    frames = client.top(stop["threadId"], levels=5)
    assert frames[0]["name"] == "fail" and frames[0]["line"] == line_of(source, "raise")
    ref, value = local(client, frames[0]["id"], "value")
    assert value["value"] == "6"
    client.request("disconnect", {})
    assert client.wait_eof()
    assert not client.invalid, client.invalid
    # The worker thread went on into the program's own excepthook and ended.
    deadline = time.monotonic() + 20
    alive = "import threading; any(t.name == 'worker' for t in threading.enumerate())"
    while cli(target.pid, "eval", alive).stdout.strip() != "False":
        assert time.monotonic() < deadline, "the worker thread never ended"
        time.sleep(0.05)
    assert hooks(cli, target.pid) == before
    assert target.alive()


def test_bad_input_is_one_line_and_a_non_zero_exit(cli, default_python, spawn):
    missing = cli("dap", "--stdio", "--pid", "999999")
    assert missing.returncode != 0 and "999999" in missing.stderr
    target = spawn(default_python, LOOP)
    open_to_all = cli("dap", "--listen", "0.0.0.0:0", "--pid", target.pid, timeout=20)
    assert open_to_all.returncode != 0 and "token" in open_to_all.stderr.lower()
    neither = cli("dap", "--pid", target.pid)
    assert neither.returncode != 0


def test_listen_serves_one_editor_after_another_over_tcp(default_python, spawn, rankscope_bin, endpoint_dir, schema):
    target = spawn(default_python, LOOP)
    with socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    env["RANKSCOPE_DIR"] = endpoint_dir
    adapter = subprocess.Popen([rankscope_bin, "dap", "--listen", str(port), "--pid", str(target.pid)], stderr=subprocess.PIPE, env=env)
    try:
        for _ in range(2):
            deadline = time.monotonic() + 20
            while True:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                    break
                except OSError:
                    assert adapter.poll() is None, adapter.stderr.read().decode()
                    assert time.monotonic() < deadline, "the adapter did not listen"
                    time.sleep(0.05)
            sock.settimeout(20)
            client = DapClient(sock.recv, sock.sendall, lambda: sock.shutdown(socket.SHUT_RDWR), schema)
            attach(client)
            client.request("configurationDone")
            names = [t["name"] for t in client.request("threads")["body"]["threads"]]
            assert "MainThread" in names
            client.request("disconnect", {})
            assert client.wait_eof()
            sock.close()
            assert not client.invalid, client.invalid
        assert adapter.poll() is None
    finally:
        adapter.kill()
        adapter.wait()


TENSORS = """
import time
import torch

def step(model, batch):
    out = model(batch)
    loss = out.pow(2).mean()  # @loss
    return loss

model = torch.nn.Linear(4, 2)
batch = torch.ones(8, 4)
print("READY", flush=True)
while True:
    step(model, batch)
    time.sleep(0.005)
"""


def test_tensors_show_shape_dtype_device_and_statistics(python, spawn, adapters, schema):
    from conftest import require_torch

    require_torch(python)
    target = spawn(python, TENSORS)
    client = adapters(target.pid, schema).client
    attach(client)
    mark = client.mark()
    client.request("setBreakpoints", {"source": {"path": str(target.script)}, "breakpoints": [{"line": line_of(TENSORS, "loss")}]})
    client.request("configurationDone")
    thread = client.stopped(mark, "breakpoint")["threadId"]
    (top,) = client.top(thread)
    _, out = local(client, top["id"], "out")
    assert out["type"] == "torch.Tensor"
    assert "shape=[8, 2]" in out["value"] and "dtype=torch.float32" in out["value"] and "device=cpu" in out["value"]
    assert "mean=" in out["value"]  # CPU statistics, from the data, not .item() of a device value
    children = client.request("variables", {"variablesReference": out["variablesReference"]})["body"]["variables"]
    fields = {v["name"]: v["value"] for v in children}
    assert fields["shape"] == "torch.Size([8, 2])" and fields["dtype"] == "torch.float32" and fields["device"] == "device(type='cpu')"
    assert fields["requires_grad"] == "True" and "grad" not in fields  # a non-leaf's .grad would warn into the program
    # The model's weights, from its attributes.
    weight = client.request("evaluate", {"expression": "model.weight", "frameId": top["id"], "context": "hover"})["body"]
    assert weight["result"].startswith("Parameter(shape=[2, 4]")
    # A hover runs no call.
    refused = client.request("evaluate", {"expression": "model(batch)", "frameId": top["id"], "context": "hover"}, ok=False)
    assert not refused["success"]
    client.request("disconnect", {})
    assert client.wait_eof()
    assert not client.invalid, client.invalid
