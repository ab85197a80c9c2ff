"""A scripted Debug Adapter Protocol client for the tests: the editor's part,
over the adapter's stdin/stdout or a TCP connection.

Every message the adapter sends is checked against the DAP JSON schema
(debugpy's wheel ships Microsoft's `debugProtocol.json`) as it arrives: a
response against `<Command>Response`, an event against `<Event>Event`.
Every wait is bounded, so an adapter that stops answering fails the test
instead of hanging it.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time

DEFAULT_TIMEOUT_S = 20.0


def load_schema():
    """A validator per DAP definition, or None where debugpy or jsonschema is missing."""
    try:
        import debugpy
        import jsonschema
    except ImportError:
        return None
    path = os.path.join(
        os.path.dirname(debugpy.__file__), "_vendored", "pydevd", "_pydevd_bundle", "_debug_adapter", "debugProtocol.json"
    )
    with open(path) as f:
        protocol = json.load(f)
    definitions = protocol["definitions"]

    def validator(name: str):
        if name not in definitions:
            return None
        return jsonschema.Draft4Validator({"$ref": f"#/definitions/{name}", "definitions": definitions})

    return validator


class DapError(AssertionError):
    pass


class DapClient:
    def __init__(self, read, write, close, schema=None, name: str = "adapter"):
        self._read = read
        self._write = write
        self._close = close
        self.schema = schema
        self.name = name
        self.seq = 0
        self.messages: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self.responses: dict[int, dict] = {}
        self.invalid: list[str] = []
        self.all: list[dict] = []
        self._validators: dict = {}
        self._cond = threading.Condition()
        self.eof = False
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    # -- transport ---------------------------------------------------------------

    def _read_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self._read(n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    def _pump(self) -> None:
        try:
            while True:
                header = b""
                while not header.endswith(b"\r\n\r\n"):
                    byte = self._read(1)
                    if not byte:
                        raise EOFError
                    header += byte
                length = None
                for line in header.decode("ascii").split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                if length is None:
                    self.invalid.append(f"a message without Content-Length: {header!r}")
                    continue
                message = json.loads(self._read_exact(length))
                self._check(message)
                with self._cond:
                    self.all.append(message)
                    if message.get("type") == "response":
                        self.responses[message["request_seq"]] = message
                    elif message.get("type") == "event":
                        self.events.append(message)
                    self._cond.notify_all()
        except (EOFError, OSError, ValueError):
            pass
        finally:
            with self._cond:
                self.eof = True
                self._cond.notify_all()

    def _check(self, message: dict) -> None:
        if self.schema is None:
            return
        kind = message.get("type")
        if kind == "response":
            name = message.get("command", "")
            definition = name[:1].upper() + name[1:] + "Response" if message.get("success") else "ErrorResponse"
        elif kind == "event":
            name = message.get("event", "")
            definition = name[:1].upper() + name[1:] + "Event"
        else:
            self.invalid.append(f"a message of type {kind!r}: {message}")
            return
        validator = self._validators.get(definition)
        if validator is None:
            validator = self.schema(definition) or self.schema("Response" if kind == "response" else "Event")
            self._validators[definition] = validator
        for error in validator.iter_errors(message):
            self.invalid.append(f"{definition}: {error.message} in {json.dumps(message)[:400]}")

    # -- requests and events -----------------------------------------------------

    def send(self, command: str, arguments: dict | None = None) -> int:
        self.seq += 1
        message = {"seq": self.seq, "type": "request", "command": command}
        if arguments is not None:
            message["arguments"] = arguments
        body = json.dumps(message).encode()
        self._write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def response(self, seq: int, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while seq not in self.responses:
                left = deadline - time.monotonic()
                if left <= 0 or self.eof:
                    raise DapError(f"no response from the {self.name} to request {seq} (eof={self.eof})")
                self._cond.wait(left)
            return self.responses[seq]

    def request(self, command: str, arguments: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S, ok: bool = True) -> dict:
        reply = self.response(self.send(command, arguments), timeout)
        if ok and not reply.get("success"):
            raise DapError(f"{command} failed: {reply.get('message')}")
        return reply

    def event(self, name: str, match=lambda body: True, timeout: float = DEFAULT_TIMEOUT_S, after: int = 0) -> dict:
        """The first event `name` (from index `after` on) whose body matches."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events[after:]:
                    if event.get("event") == name and match(event.get("body", {})):
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or self.eof:
                    seen = [e.get("event") for e in self.events]
                    raise DapError(f"no {name!r} event from the {self.name} (eof={self.eof}); saw {seen}")
                self._cond.wait(left)

    def mark(self) -> int:
        """Where the events list ends now: `event(..., after=mark)` waits for a new one."""
        with self._cond:
            return len(self.events)

    def stopped(self, after: int, reason: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
        return self.event("stopped", lambda b: reason is None or b.get("reason") == reason, timeout, after)["body"]

    def top(self, thread: int, levels: int = 1) -> list[dict]:
        reply = self.request("stackTrace", {"threadId": thread, "startFrame": 0, "levels": levels})
        return reply["body"]["stackFrames"]

    def wait_eof(self, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.eof and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            return self.eof

    def close(self) -> None:
        self._close()
