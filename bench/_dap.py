"""A minimal Debug Adapter Protocol client over TCP, enough for a benchmark
to play the part of an editor: requests, their responses, events.
Standard library only.

Messages are JSON bodies behind a `Content-Length` header, as in the DAP
specification. Every read is bounded by one deadline, so a debugger that
stops answering ends the benchmark with a BenchError instead of a hang.
"""

from __future__ import annotations

import json
import socket
import time

from _common import BenchError


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
    def connect(cls, host: str, port: int, deadline: float, alive=lambda: True, name: str = "debug adapter"):
        """Connect, retrying until the adapter listens: it is a process of
        its own that opens its port some time after being started."""
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=1.0)
                return cls(sock, deadline, name)
            except OSError as e:
                if not alive():
                    raise BenchError(f"{name} exited before accepting a connection on {host}:{port}") from None
                if time.monotonic() > deadline:
                    raise BenchError(f"{name} did not accept a connection on {host}:{port}: {e}") from None
                time.sleep(0.05)

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
