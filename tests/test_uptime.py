"""`list` and `cluster list` show how long the process has run, not its
probe: a probe injected (or started) late must not make a process look new."""

import json
import os
import re
import subprocess
import uuid

from test_hosts import on_host, two_hosts  # noqa: F401 - the fixture

AGES_FIRST = """
import time
started = time.monotonic()
while time.monotonic() - started < 3:  # the process runs 3 s before anyone looks
    time.sleep(0.05)
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""

STARTS_PROBE_LATE = """
import time
started = time.monotonic()
while time.monotonic() - started < 3:
    time.sleep(0.05)
import rankscope
rankscope.start()
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def seconds(text: str) -> int:
    """`list`'s human durations: 5s, 2m05s, 1h02m."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert match and text, text
    h, m, s = (int(g or 0) for g in match.groups())
    return h * 3600 + m * 60 + s


def test_list_shows_the_age_of_an_injected_process(python, spawn, cli):
    target = spawn(python, AGES_FIRST, probe=False)
    injected = cli("inject", target.pid, timeout=60)
    assert injected.returncode == 0, injected.stderr
    [row] = [line.split() for line in cli("list").stdout.splitlines() if line.split()[:1] == [str(target.pid)]]
    assert seconds(row[3]) >= 3, row
    [entry] = [e for e in json.loads(cli("list", "--format", "json").stdout) if e["pid"] == target.pid]
    assert entry["uptime_s"] >= 3
    assert entry["probe_uptime_s"] < entry["uptime_s"] - 2
    [info] = json.loads(cli(target.pid, "query", "SELECT uptime_s FROM process.info", "--format", "json").stdout)
    assert info["uptime_s"] >= 3


def test_cluster_list_shows_each_ranks_process_age(default_python, spawn, cli, tmp_path):
    run = tmp_path / "run"
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": job_id, "RANKSCOPE_RUN_DIR": str(run)}
        spawn(default_python, STARTS_PROBE_LATE, env=env, probe=False)
    listing = cli("cluster", "list", "--run", run)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1"]
    assert all(r[4] == "running" and seconds(r[5]) >= 3 for r in rows), listing.stdout


def test_a_rank_on_another_host_is_aged_from_its_probes_metadata(two_hosts, default_python, spawn, rankscope_bin, endpoint_dir, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    for rank, host in enumerate(("host-a", "host-b")):
        netns, address = two_hosts[host]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": job_id,
            "RANKSCOPE_RUN_DIR": str(run),
            "RANKSCOPE_LISTEN": f"{address}:0",
        }
        spawn(default_python, STARTS_PROBE_LATE, env=env, probe=False, wrapper=on_host(netns, host))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
    full_env["RANKSCOPE_DIR"] = endpoint_dir
    listing = subprocess.run(
        [*on_host(two_hosts["host-a"][0], "host-a"), rankscope_bin, "cluster", "list", "--run", str(run)],
        capture_output=True, text=True, env=full_env, timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line.split() for line in listing.stdout.splitlines()[2:]}
    # Rank 1 lives on host-b: its age comes from what its probe read in its /proc at start.
    assert rows["1"][2] == "host-b" and rows["1"][4] == "running"
    assert seconds(rows["0"][5]) >= 3 and seconds(rows["1"][5]) >= 3, listing.stdout
