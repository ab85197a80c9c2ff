"""End-to-end harness: real Python targets, the installed `rankscope` command.

Targets print READY on stdout once their state is set up; tests wait for that
line (never for time) and kill every target they started.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

READY_TIMEOUT_S = 30.0


def _interpreters() -> list[tuple[str, str | None]]:
    """(version, python path or None) for 3.11, 3.12 and 3.13.

    RANKSCOPE_TEST_PYTHONS ("3.12=/path/python:3.13=/path/python") names
    interpreters that have rankscope installed; scripts/test sets it up.
    """
    found: dict[str, str | None] = {"3.11": None, "3.12": None, "3.13": None}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here in found:
        found[here] = sys.executable
    for item in filter(None, os.environ.get("RANKSCOPE_TEST_PYTHONS", "").split(":")):
        version, _, path = item.partition("=")
        if version in found and path and Path(path).exists():
            found[version] = path
    return sorted(found.items())


INTERPRETERS = _interpreters()


@pytest.fixture(params=INTERPRETERS, ids=[v for v, _ in INTERPRETERS])
def python(request) -> str:
    version, path = request.param
    if path is None:
        pytest.skip(f"CPython {version} with rankscope installed is not available here (see scripts/test)")
    return path


@pytest.fixture
def default_python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def rankscope_bin() -> str:
    path = os.environ.get("RANKSCOPE_BIN") or shutil.which("rankscope")
    if path is None:
        candidate = Path(sys.executable).parent / "rankscope"
        path = str(candidate) if candidate.exists() else None
    if path is None:
        pytest.fail("the rankscope command is not installed: run scripts/test, or pip install . first")
    return path


@pytest.fixture
def endpoint_dir():
    # Short path: unix socket paths are limited to 108 bytes.
    path = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def line_of(source: str, marker: str) -> int:
    """Line number (1-based) of the line that carries `# @marker`."""
    for number, line in enumerate(textwrap.dedent(source).splitlines(), start=1):
        if f"# @{marker}" in line:
            return number
    raise AssertionError(f"marker @{marker} not in the target source")


class Target:
    """A running Python program, killed when the test ends."""

    def __init__(
        self,
        python: str,
        source: str,
        workdir: str,
        env: dict[str, str],
        args: list[str] | None = None,
        runner: list[str] | None = None,
        wrapper: list[str] | None = None,
    ):
        self.source = textwrap.dedent(source)
        self.script = Path(workdir) / "target.py"
        self.script.write_text(self.source)
        self.proc = subprocess.Popen(
            [*(wrapper or []), python, "-u", *(runner or []), str(self.script), *(args or [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=workdir,
            # Unbuffered: readline() then takes one line off the pipe and no
            # more, so select() in wait_for_line sees what is still unread
            # (a buffered reader could swallow two lines at once and leave
            # select() waiting for data it already holds).
            bufsize=0,
        )
        self.pid = self.proc.pid
        self.output: list[str] = []

    def wait_for_line(self, wanted: str = "READY", timeout: float = READY_TIMEOUT_S) -> str:
        """Reads the target's stdout until a line starts with `wanted`."""
        deadline = time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                line = self.proc.stdout.readline().decode(errors="replace")
                if not line:
                    err = self.proc.stderr.read().decode(errors="replace")
                    raise AssertionError(f"target exited (rc={self.proc.wait()}) before {wanted!r}:\n{err}")
                self.output.append(line)
                if line.startswith(wanted):
                    return line.strip()
        finally:
            selector.close()
        raise AssertionError(f"target did not print {wanted!r} within {timeout}s; got {self.output}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


@pytest.fixture
def spawn(endpoint_dir):
    """spawn(python, source, env=None, probe=True, runner=None) -> a READY target.
    `runner` goes between the interpreter and the script (["-m", "coverage", "run"]);
    `wrapper` before the interpreter (a command that execs what follows)."""
    started: list[Target] = []

    def _spawn(
        python: str, source: str, env: dict[str, str] | None = None, probe: bool = True, wait: bool = True, args=None, runner=None, wrapper=None
    ) -> Target:
        workdir = tempfile.mkdtemp(prefix="rs-target-", dir="/tmp")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
        full_env["RANKSCOPE_DIR"] = endpoint_dir
        # Crash records and native logs stay out of the user's ~/.local/state.
        full_env["RANKSCOPE_RUN_DIR"] = os.path.join(workdir, "run")
        if probe:
            full_env["RANKSCOPE"] = "1"
        full_env.update(env or {})
        target = Target(python, source, workdir, full_env, args, runner, wrapper)
        started.append(target)
        if wait:
            target.wait_for_line("READY")
        return target

    yield _spawn
    for target in started:
        target.kill()


@pytest.fixture
def cli(rankscope_bin, endpoint_dir, tmp_path):
    """cli(*args, input=None, timeout=60) -> CompletedProcess (text)."""

    def _cli(*args: str, input: str | None = None, timeout: float = 60, env: dict | None = None):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
        full_env["RANKSCOPE_DIR"] = endpoint_dir
        # What it starts (`demo`, `run`) records crashes here, not in ~/.local/state.
        full_env["RANKSCOPE_RUN_DIR"] = str(tmp_path / "cli-run")
        full_env.update(env or {})
        return subprocess.run(
            [rankscope_bin, *map(str, args)],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
        )

    return _cli


def query_json(cli, pid: int, sql: str) -> list[dict]:
    result = cli(pid, "query", sql, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def kill_tree(pid: int) -> None:
    """SIGKILLs `pid` and every process below it. torchrun puts its workers
    in process groups of their own, so killing the launcher's group is not
    enough: the workers would sit in a collective until gloo times out."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    order, stack = [], [pid]
    while stack:
        current = stack.pop()
        order.append(current)
        stack.extend(children.get(current, []))
    # The launcher first, so it cannot start new workers meanwhile.
    for victim in order:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def require_torch(python: str) -> None:
    if subprocess.run([python, "-c", "import torch.distributed"], capture_output=True).returncode != 0:
        pytest.skip("torch is not installed in the test environment (RANKSCOPE_TEST_TORCH=0?)")


def assert_slices_nest(events) -> None:
    """The trace event format's rule for complete ("X") events on one
    thread: two slices are apart or one holds the other, and of slices that
    start together the one that holds the other comes first in the file."""
    lanes: dict = {}
    for e in events:
        if e["ph"] == "X":
            lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    for lane, slices in lanes.items():
        assert [e["ts"] for e in slices] == sorted(e["ts"] for e in slices), f"{lane}: not in start order"
        open_ = []
        for e in slices:
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
                open_.pop()
            if open_:
                outer = open_[-1]
                assert e["ts"] + e["dur"] <= outer["ts"] + outer["dur"], f"{lane}: {e} overlaps {outer} without nesting"
            open_.append(e)


def launch_torchrun(python, script, nproc, endpoint_dir, run_dir, prefix=(), probe=True, env=None, torchrun_args=(), **popen):
    """torchrun (gloo, CPU) on `script`, with the probe on in every worker
    unless `prefix` (e.g. `rankscope run --`) turns it on itself."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    full_env.update(RANKSCOPE_DIR=str(endpoint_dir), RANKSCOPE_RUN_DIR=str(run_dir), **(env or {}))
    if probe:
        full_env["RANKSCOPE"] = "1"
    command = [*prefix, python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *torchrun_args, str(script)]
    return subprocess.Popen(command, env=full_env, cwd=Path(script).parent, **popen)


@pytest.fixture(scope="session")
def bare_venvs(tmp_path_factory):
    """python (a venv with rankscope) -> a venv of the same interpreter without it."""
    made: dict[str, str] = {}

    def _bare(python: str) -> str:
        if python not in made:
            base = subprocess.run(
                [python, "-c", "import sys; print(sys._base_executable)"], capture_output=True, text=True, check=True
            ).stdout.strip()
            venv = tmp_path_factory.mktemp("bare-venv")
            subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
            made[python] = str(venv / "bin" / "python")
        return made[python]

    return _bare


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


SPEEDSCOPE = "speedscope@1.25.0"


@pytest.fixture(scope="session")
def speedscope_schema():
    """speedscope's own JSON schema of its file format, from its npm package
    (fetched once into ~/.cache/rankscope/npm); the test skips where npm,
    the registry or jsonschema cannot be had."""
    jsonschema = pytest.importorskip("jsonschema")
    cache = os.path.join(os.path.expanduser("~"), ".cache", "rankscope", "npm", SPEEDSCOPE)
    schema = os.path.join(cache, "package", "dist", "release", "file-format-schema.json")
    if not os.path.exists(schema):
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: speedscope's schema cannot be fetched")
        os.makedirs(cache, exist_ok=True)
        packed = subprocess.run(["npm", "pack", SPEEDSCOPE, "--silent"], cwd=cache, capture_output=True, text=True, timeout=180)
        tarball = os.path.join(cache, packed.stdout.strip().splitlines()[-1]) if packed.returncode == 0 and packed.stdout.strip() else None
        if tarball is None or not os.path.exists(tarball):
            pytest.skip(f"npm pack {SPEEDSCOPE} failed: {packed.stderr.strip()[-200:]}")
        with tarfile.open(tarball) as tar:
            tar.extract("package/dist/release/file-format-schema.json", cache, filter="data")
    with open(schema) as f:
        return jsonschema.Draft7Validator(json.load(f))


DEBUGADAPTER_TESTSUPPORT = "@vscode/debugadapter-testsupport@1.68.0"


@pytest.fixture(scope="session")
def debugadapter_testsupport():
    """The node_modules folder of Microsoft's own DAP test client
    (`@vscode/debugadapter-testsupport` and the protocol types it needs),
    installed once with npm into ~/.cache/rankscope/npm; the test skips
    where node, npm or the registry cannot be had."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: Microsoft's DAP test client cannot run")
    name = DEBUGADAPTER_TESTSUPPORT.lstrip("@").replace("/", "-")
    prefix = os.path.join(os.path.expanduser("~"), ".cache", "rankscope", "npm", name)
    modules = os.path.join(prefix, "node_modules")
    entry = os.path.join(modules, "@vscode", "debugadapter-testsupport", "lib", "main.js")
    if not os.path.exists(entry):
        if shutil.which("npm") is None:
            pytest.skip(f"npm is not installed: {DEBUGADAPTER_TESTSUPPORT} cannot be fetched")
        os.makedirs(prefix, exist_ok=True)
        # Its own folder (a package.json of its own): npm leaves every other project alone.
        with open(os.path.join(prefix, "package.json"), "w") as f:
            json.dump({"name": "rankscope-test-npm", "private": True}, f)
        command = ["npm", "install", "--no-audit", "--no-fund", "--no-save", "--ignore-scripts", "--prefix", prefix, DEBUGADAPTER_TESTSUPPORT]
        try:
            installed = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {DEBUGADAPTER_TESTSUPPORT} did not finish in 300 s (no registry?)")
        if installed.returncode != 0 or not os.path.exists(entry):
            errors = [line for line in installed.stderr.splitlines() if line.startswith("npm error")] or installed.stderr.splitlines()
            pytest.skip(f"npm install {DEBUGADAPTER_TESTSUPPORT} failed (offline, or no registry?): {' / '.join(errors[:2])}")
    return modules


@pytest.fixture
def browser():
    """A headless Chromium driven by selenium (Debian's chromium and
    chromium-driver); the test skips where they are missing."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()
