"""RANKSCOPE_ON_ERROR=web: the crashed rank's page, driven in a real headless
Chromium (Debian's chromium and chromium-driver, through selenium)."""

import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from test_crashes import CRASH
from test_postmortem import start_crashing, wait_for_stderr

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_web_page_shows_the_stack_and_runs_pdb(default_python, endpoint_dir, tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    proc, script = start_crashing(
        default_python, tmp_path, endpoint_dir, RANKSCOPE_ON_ERROR="web", RANKSCOPE_WEB_PORT=str(port), RANKSCOPE_HOLD_TIMEOUT="60"
    )
    try:
        line = wait_for_stderr(proc, "is held for a debugger")
        url = line.split("open ")[1].split(" ;")[0]
        assert url.startswith(f"http://127.0.0.1:{port}/?token=")

        # Without the token: refused.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/")
        assert refused.value.code == 403

        browser.get(url)
        assert "KeyError" in browser.find_element(By.ID, "title").text
        stack = browser.find_element(By.ID, "stack").text
        assert "load" in stack and "main" in stack and str(script) in stack
        assert "Checkpoint(step=41)" in stack and "4096" in stack  # the crash frame is open, with its locals
        output = browser.find_element(By.ID, "output")
        assert "-> return table[path]" in output.text

        command = browser.find_element(By.ID, "command")
        command.send_keys("p path\n")
        WebDriverWait(browser, 10).until(lambda d: "'missing.pt'" in output.text)
        command.send_keys("u\n")
        WebDriverWait(browser, 10).until(lambda d: "main()" in output.text)
        command.send_keys("p paths\n")
        WebDriverWait(browser, 10).until(lambda d: "['missing.pt']" in output.text)
        command.send_keys("q\n")
        WebDriverWait(browser, 10).until(lambda d: "session ended" in output.text)

        assert proc.wait(timeout=30) == 1
        assert "KeyError: 'missing.pt'" in proc.stderr.read()
    finally:
        proc.kill()


def test_a_busy_port_falls_back_to_the_socket(default_python, endpoint_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc, _ = start_crashing(
            default_python, tmp_path, endpoint_dir, RANKSCOPE_ON_ERROR="web", RANKSCOPE_WEB_PORT=str(port), RANKSCOPE_HOLD_TIMEOUT="0.5"
        )
        try:
            assert proc.wait(timeout=30) == 1
            err = proc.stderr.read()
            assert "holding on a socket instead" in err and "nc -U" in err
        finally:
            proc.kill()
