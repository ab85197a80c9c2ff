"""RANKSCOPE_ON_ERROR=web: a crashed rank serves one page on loopback with
its stack, its locals and a pdb console, until the session ends (q) or stays
idle for the hold timeout.

Standard library only, single-threaded: the process is dying and runs
nothing else. Every request must carry the token printed on stderr, since
any local user can reach a loopback port and the console runs code.
"""

from __future__ import annotations

import html
import io
import json
import os
import secrets
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlsplit

from rankscope._probe import crashes

QUIT_COMMANDS = {"q", "quit", "exit"}
MAX_COMMAND = 4096


def port_for(rank: int) -> int:
    try:
        base = int(os.environ.get("RANKSCOPE_WEB_PORT", "") or 7860)
    except ValueError:
        base = 7860
    return base + rank


class _Session:
    def __init__(self, exc: BaseException, tb, token: str):
        import pdb

        self.token = token
        self.record = crashes.build_record(exc, "web")
        self.output = io.StringIO()
        self.debugger = pdb.Pdb(stdin=io.StringIO(), stdout=self.output)
        self.debugger.reset()
        self.debugger.setup(None, tb)
        self.debugger.print_stack_entry(self.debugger.stack[self.debugger.curindex])
        self.ended = False

    def run(self, command: str) -> str:
        start = self.output.tell()
        command = command.strip()
        if command.split(" ", 1)[0] in QUIT_COMMANDS:
            self.ended = True
            return "session ended; the process exits now\n"
        try:
            self.debugger.onecmd(command)
        except Exception as err:  # noqa: BLE001 - a bad command must not end the session
            self.output.write(f"*** {type(err).__name__}: {err}\n")
        self.output.seek(start)
        text = self.output.read()
        self.output.seek(0, io.SEEK_END)
        return text


def _page(session: _Session) -> str:
    rec = session.record
    last = rec["exceptions"][-1] if rec["exceptions"] else {"type": "?", "message": "", "frames": []}
    title = f"rank {rec['rank']} (pid {rec['pid']}): {last['type']}: {last['message']}"
    frames = []
    for number, frame in enumerate(last["frames"]):
        rows = "".join(
            f"<tr><td class='name'>{html.escape(loc['name'])}</td><td><code>{html.escape(loc['repr'])}</code></td></tr>"
            for loc in frame["locals"]
        )
        frames.append(
            f"<details class='frame' {'open' if number == len(last['frames']) - 1 else ''}>"
            f"<summary><b>{html.escape(frame['func'])}</b> {html.escape(frame['file'])}:{frame['lineno']}"
            f"<pre class='source'>{html.escape(frame.get('source') or '')}</pre></summary>"
            f"<table class='locals'>{rows}</table></details>"
        )
    start = html.escape(session.output.getvalue())
    token = json.dumps(session.token)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>rankscope post-mortem: {html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
.frame {{ margin: .3em 0; }} .source {{ margin: .2em 0 .2em 1.5em; color: #444; }}
.locals td {{ padding: 0 .6em; vertical-align: top; }} .name {{ font-family: monospace; }}
#output {{ background: #111; color: #ddd; padding: .6em; min-height: 8em; white-space: pre-wrap; }}
#command {{ width: 60%; font-family: monospace; }}
</style></head><body>
<h1 id="title">{html.escape(title)}</h1>
<h2>Stack (innermost last)</h2>
<div id="stack">{''.join(frames)}</div>
<h2>pdb</h2>
<pre id="output">{start}</pre>
<form id="console"><input id="command" autocomplete="off" autofocus placeholder="p x, w, u, d, l, ll, a, q">
<button type="submit">Run</button></form>
<script>
const token = {token};
const output = document.getElementById("output");
document.getElementById("console").addEventListener("submit", async (event) => {{
  event.preventDefault();
  const input = document.getElementById("command");
  const command = input.value;
  input.value = "";
  output.textContent += "(Pdb) " + command + "\\n";
  const reply = await fetch("/pdb?token=" + encodeURIComponent(token), {{method: "POST", body: command}});
  const data = await reply.json();
  output.textContent += data.output;
  if (data.ended) {{ input.disabled = true; document.body.classList.add("ended"); }}
}});
</script></body></html>"""


def serve(exc: BaseException, tb, hold: float) -> bool:
    """Serves the page until the session ends or idles past `hold`. False
    when the port cannot be had (the caller falls back to the socket)."""
    rank, pid = crashes._rank() or 0, os.getpid()
    token = secrets.token_urlsafe(24)
    session = _Session(exc, tb, token)
    last_request = [time.monotonic()]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # the target's stderr is the user's
            pass

        def _authorized(self) -> bool:
            query = parse_qs(urlsplit(self.path).query)
            given = (query.get("token") or [""])[0]
            if secrets.compare_digest(given, token):
                last_request[0] = time.monotonic()
                return True
            self._send(403, "text/plain", b"wrong or missing token: use the URL printed on the process's stderr\n")
            return False

        def _send(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's naming
            if urlsplit(self.path).path != "/":
                self._send(404, "text/plain", b"not found\n")
            elif self._authorized():
                self._send(200, "text/html; charset=utf-8", _page(session).encode())

        def do_POST(self):  # noqa: N802
            if urlsplit(self.path).path != "/pdb":
                self._send(404, "text/plain", b"not found\n")
                return
            if not self._authorized():
                return
            length = min(int(self.headers.get("Content-Length") or 0), MAX_COMMAND)
            command = self.rfile.read(length).decode("utf-8", "replace")
            output = session.run(command)
            body = json.dumps({"output": output, "ended": session.ended}).encode()
            self._send(200, "application/json", body)

    try:
        server = HTTPServer(("127.0.0.1", port_for(rank)), Handler)
    except OSError as err:
        sys.stderr.write(f"rankscope: web post-mortem on port {port_for(rank)} not possible ({err}); holding on a socket instead\n")
        return False
    with server:
        server.timeout = 1.0
        url = f"http://127.0.0.1:{server.server_address[1]}/?token={token}"
        sys.stderr.write(
            f"rankscope: rank {rank} (pid {pid}) is held for a debugger after {type(exc).__name__}: "
            f"open {url} ; it exits after {hold:g} s without a request\n"
        )
        sys.stderr.flush()
        last_request[0] = time.monotonic()
        while not session.ended and time.monotonic() < last_request[0] + hold:
            server.handle_request()
        if not session.ended:
            sys.stderr.write(f"rankscope: no debugger request within {hold:g} s; exiting\n")
    return True
