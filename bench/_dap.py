"""A minimal Debug Adapter Protocol client over TCP or an adapter's
stdin/stdout, enough for a benchmark to play the part of an editor:
requests, their responses, events, the handshake that starts an attach
session. Standard library only.

Messages are JSON bodies behind a `Content-Length` header, as in the DAP
specification. Every read is bounded by one deadline, so a debugger that
stops answering ends the benchmark with a BenchError instead of a hang.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

from _common import BenchError

# What an editor says of itself; adapterID is added per adapter.
INITIALIZE = {"clientID": "rankscope-bench", "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True}

# The attach configuration of VSCode's debugpy "Remote Attach", which
# `rankscope dap` takes too.
ATTACH = {"name": "rankscope bench", "type": "debugpy", "request": "attach", "justMyCode": True}


def free_port() -> int:
    # Racy (the port could be taken before the debugger binds it), but
    # debugpy wants a number on its command line and a lost race fails loudly.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DapClient:
    def __init__(self, sock: socket.socket, deadline: float, name: str = "debug adapter"):
        self.sock = sock
        self.deadline = deadline
        self.name = name
        self.seq = 0
        self.buf = b""
        # Messages read while waiting for another one: a response may come
        # before the event the caller asks for first, or the other way round.
        self.backlog: list[dict] = []
        self.closed = False

    @classmethod
    def connect(
        cls, host: str, port: int, deadline: float, alive=lambda: True, name: str = "debug adapter", interval: float = 0.05
    ):
        """Connect, retrying every `interval` s until the adapter listens: it
        is a process of its own that opens its port some time after being
        started (a benchmark timing that start wants a short interval)."""
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=1.0)
                return cls(sock, deadline, name)
            except OSError as e:
                if not alive():
                    raise BenchError(f"{name} exited before accepting a connection on {host}:{port}") from None
                if time.monotonic() > deadline:
                    raise BenchError(f"{name} did not accept a connection on {host}:{port}: {e}") from None
                time.sleep(interval)

    @classmethod
    def spawn(cls, argv: list[str], deadline: float, env=None, stderr=None, name: str = "debug adapter"):
        """Start an adapter that speaks DAP on its stdin and stdout, as an
        editor starts `rankscope dap --stdio`; returns (client, process).

        Its stdin and stdout are one end of a socket pair rather than two
        pipes: the client's reads keep their deadline (a pipe has no receive
        timeout), and the adapter sees an ordinary stream either way."""
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(argv, stdin=theirs, stdout=theirs, stderr=stderr, env=env)
        except OSError as e:
            ours.close()
            raise BenchError(f"{name}: cannot start {argv[0]}: {e}") from None
        finally:
            theirs.close()
        return cls(ours, deadline, name), proc

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, command: str, arguments: dict | None = None) -> int:
        """Send a request; returns its seq, to match the response with."""
        self.seq += 1
        msg = {"seq": self.seq, "type": "request", "command": command}
        if arguments is not None:
            msg["arguments"] = arguments
        body = json.dumps(msg).encode()
        try:
            self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        except OSError as e:
            raise BenchError(f"{self.name}: sending {command} failed: {e}") from None
        return self.seq

    def _fill(self, what: str) -> bool:
        """Read more bytes into the buffer; False once the peer has closed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{self.name} timed out waiting for {what}")
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        except socket.timeout:
            raise BenchError(f"{self.name} timed out waiting for {what}") from None
        except OSError as e:
            # A reset after the debuggee exits is the same as a close here.
            if isinstance(e, ConnectionResetError):
                chunk = b""
            else:
                raise BenchError(f"{self.name}: reading failed: {e}") from None
        if not chunk:
            self.closed = True
            return False
        self.buf += chunk
        return True

    def read(self, what: str = "a message") -> dict | None:
        """The next message off the wire, or None once the peer has closed."""
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end >= 0:
                length = None
                for line in self.buf[:head_end].split(b"\r\n"):
                    key, _, value = line.partition(b":")
                    if key.strip().lower() == b"content-length":
                        length = int(value.strip())
                if length is None:
                    raise BenchError(f"{self.name}: message without Content-Length: {self.buf[:head_end]!r}")
                start = head_end + 4
                if len(self.buf) >= start + length:
                    body = self.buf[start : start + length]
                    self.buf = self.buf[start + length :]
                    return json.loads(body)
            if not self._fill(what):
                if self.buf:
                    raise BenchError(f"{self.name} closed in the middle of a message")
                return None

    def wait_for(self, pred, what: str) -> dict:
        """The first message, stashed or new, for which pred is true."""
        for i, msg in enumerate(self.backlog):
            if pred(msg):
                return self.backlog.pop(i)
        while True:
            msg = self.read(what)
            if msg is None:
                raise BenchError(f"{self.name} closed the connection while waiting for {what}")
            if pred(msg):
                return msg
            self.backlog.append(msg)

    def event(self, name: str) -> dict:
        return self.wait_for(lambda m: m.get("type") == "event" and m.get("event") == name, f"event {name!r}")

    def response(self, seq: int, command: str) -> dict:
        """The response to request `seq`; a failed request is a BenchError."""
        msg = self.wait_for(
            lambda m: m.get("type") == "response" and m.get("request_seq") == seq, f"the response to {command}"
        )
        if not msg.get("success"):
            raise BenchError(f"{self.name}: {command} failed: {msg.get('message')} {msg.get('body', '')}".rstrip())
        return msg

    def drain(self):
        """Yield every message, stashed then new, until the peer closes."""
        while self.backlog:
            yield self.backlog.pop(0)
        while (msg := self.read("the end of the session")) is not None:
            yield msg


def handshake(dap: DapClient, adapter_id: str, attach: dict, configure=None) -> dict[str, float]:
    """Start an attach session as an editor does: initialize, attach, and
    between the `initialized` event and configurationDone the configuration
    (`configure(dap)`, breakpoints). Returns when (time.monotonic()) each
    step was answered, by name.

    debugpy answers attach only after configurationDone, rankscope at once:
    either order is read, and a refused attach fails here rather than as a
    wait for an `initialized` that will not come."""
    marks = {}
    dap.response(dap.send("initialize", dict(INITIALIZE, adapterID=adapter_id)), "initialize")
    marks["initialize"] = time.monotonic()
    attach_seq = dap.send("attach", attach)
    first = dap.wait_for(
        lambda m: (m.get("type") == "event" and m.get("event") == "initialized")
        or (m.get("type") == "response" and m.get("request_seq") == attach_seq and not m.get("success")),
        "event 'initialized'",
    )
    if first.get("type") == "response":
        raise BenchError(f"{dap.name}: attach failed: {first.get('message')} {first.get('body', '')}".rstrip())
    marks["initialized"] = time.monotonic()
    if configure is not None:
        configure(dap)
    dap.response(dap.send("configurationDone"), "configurationDone")
    marks["configurationDone"] = time.monotonic()
    dap.response(attach_seq, "attach")
    marks["attach"] = time.monotonic()
    return marks


def disconnect(dap: DapClient, proc, timeout: float) -> float:
    """End a `--stdio` adapter's session with `disconnect` and wait for the
    adapter to exit, as it should once its only editor has left. Returns the
    seconds from the request to the exit; one that lingers is a BenchError
    (the caller still kills it)."""
    t0 = time.monotonic()
    dap.deadline = t0 + timeout
    dap.response(dap.send("disconnect"), "disconnect")
    try:
        proc.wait(timeout=max(0.1, dap.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise BenchError(f"{dap.name} still ran {timeout:.0f} s after its session's disconnect") from None
    if proc.returncode != 0:
        raise BenchError(f"{dap.name} exited {proc.returncode} after disconnect")
    return time.monotonic() - t0
