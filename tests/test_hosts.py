"""One job across two machines, reached from one CLI. The machines are two
network namespaces on this one, each with a host name of its own (a UTS
namespace) and one end of a veth pair; the run directory is shared, as it
is on a cluster's shared filesystem. Skipped where namespaces cannot be
made (not root, no `ip`/`unshare`)."""

import json
import os
import shutil
import subprocess
import uuid

import pytest

from conftest import line_of

# The light ranks of the cluster tests: rank 2 in the data loader, the others waiting.
from test_cluster import RANK  # noqa: E402



def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """{name: (netns, address)} for host-a and host-b, joined by a veth pair."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("network namespaces need root, `ip` and `unshare`")
    tag = uuid.uuid4().hex[:6]
    a, b = f"rsa{tag}", f"rsb{tag}"
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    steps = [
        ("netns", "add", a),
        ("netns", "add", b),
        ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
        ("link", "set", f"va{tag}", "netns", a),
        ("link", "set", f"vb{tag}", "netns", b),
        ("-n", a, "addr", "add", f"{subnet}.1/24", "dev", f"va{tag}"),
        ("-n", b, "addr", "add", f"{subnet}.2/24", "dev", f"vb{tag}"),
        ("-n", a, "link", "set", f"va{tag}", "up"),
        ("-n", b, "link", "set", f"vb{tag}", "up"),
        ("-n", a, "link", "set", "lo", "up"),
        ("-n", b, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"this machine does not allow network namespaces here (ip {' '.join(step)}: {done.stderr.strip()})")
        yield {"host-a": (a, f"{subnet}.1"), "host-b": (b, f"{subnet}.2")}
    finally:
        _ip("netns", "del", a)
        _ip("netns", "del", b)


def on_host(netns: str, host: str) -> list[str]:
    """A command prefix that runs what follows inside `netns`, named `host`."""
    return ["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$0" "$@"']


def test_one_job_across_two_hosts_from_one_cli(two_hosts, default_python, spawn, rankscope_bin, endpoint_dir, tmp_path):
    run = tmp_path / "run"
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    targets = {}
    for rank, host in enumerate(("host-a", "host-b")):
        netns, address = two_hosts[host]
        targets[rank] = spawn(
            default_python,
            RANK,
            env={
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": job_id,
                "RANKSCOPE_RUN_DIR": str(run),
                # TCP is off unless asked for: each rank listens on its host's address.
                "RANKSCOPE_LISTEN": f"{address}:0",
            },
            wrapper=on_host(netns, host),
        )

    def cli_on(host, *args, env=None):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE")}
        full_env.update(RANKSCOPE_DIR=endpoint_dir, **(env or {}))
        netns, _ = two_hosts[host]
        return subprocess.run([*on_host(netns, host), rankscope_bin, *map(str, args)], capture_output=True, text=True, env=full_env, timeout=60)

    # From host-a: rank 0 is local (unix socket), rank 1 is on host-b (TCP, token from the shared registry).
    listing = cli_on("host-a", "cluster", "list", "--run", run)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[2:]}
    assert "host-a" in rows["0"] and " running " in rows["0"]
    assert "host-b" in rows["1"] and " running " in rows["1"]
    bt = cli_on("host-a", "cluster", "bt", "--run", run)
    assert bt.returncode == 0, bt.stderr
    assert f"ranks 0-1 (2): wait_for_peers (target.py:{line_of(RANK, 'peers')})" in bt.stdout
    ev = cli_on("host-a", "cluster", "eval", "--run", run, "import socket; (RANK_VALUE, socket.gethostname())")
    assert ev.stdout.splitlines() == [
        f"== rank 0 (pid {targets[0].pid})", "(0, 'host-a')",
        f"== rank 1 (pid {targets[1].pid})", "(1, 'host-b')",
    ], ev.stderr
    q = cli_on("host-a", "cluster", "query", "--run", run, "SELECT rank, host, count(*) AS n FROM python.threads GROUP BY rank, host ORDER BY rank", "--format", "json")
    assert [(r["rank"], r["host"]) for r in json.loads(q.stdout)] == [(0, "host-a"), (1, "host-b")], q.stderr

    # By address, without the run directory: host-a asks rank 1 on host-b for the job.
    [entry] = (run / "ranks").glob(f"rank1-pid{targets[1].pid}.json")
    registered = json.loads(entry.read_text())
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    address = registered["tcp"].removeprefix("tcp://")
    by_address = cli_on("host-a", "--job", address, "cluster", "bt", env={"RANKSCOPE_TOKEN": registered["token"], "RANKSCOPE_RUN_DIR": str(tmp_path / "elsewhere")})
    assert by_address.returncode == 0, by_address.stderr
    assert f"job {job_id}: 2 ranks answered" in by_address.stdout
    no_token = cli_on("host-a", "cluster", "--job", address, "bt")
    assert no_token.returncode == 1 and "needs that rank's token in RANKSCOPE_TOKEN" in no_token.stderr
    wrong = cli_on("host-a", "cluster", "--job", address, "bt", env={"RANKSCOPE_TOKEN": "nope"})
    assert wrong.returncode == 1 and "401" in wrong.stderr

    # A profile of the whole job from host-a: rank 0 read from outside here,
    # rank 1 sampled by its own probe on host-b, which answers with its fold.
    out = tmp_path / "job.folded"
    prof = cli_on("host-a", "cluster", "profile", "--run", run, "--duration", "1", "--rate", "50", "-o", out)
    assert prof.returncode == 0, prof.stderr
    assert "ranks 1 (on host-b) are sampled by their own probes" in prof.stderr, prof.stderr
    assert "of 2 ranks" in prof.stdout, prof.stdout
    lines = out.read_text().splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"rank {rank};")]
        assert any("wait_for_peers" in line for line in mine), (rank, lines)
        # About a second at 50 a second, of the main thread (idle in a sleep).
        assert 20 <= sum(int(line.rsplit(" ", 1)[1]) for line in mine) <= 80, (rank, mine)
    # Each kept in the shared run store: rank 1 by its own probe on host-b.
    kept = cli_on("host-a", "query", "--run", run, "SELECT rank, sum(samples) AS n FROM python.profile GROUP BY rank ORDER BY rank", "--format", "json")
    assert kept.returncode == 0, kept.stderr
    assert [r["rank"] for r in json.loads(kept.stdout)] == [0, 1], kept.stdout

    # A rank whose host cannot be reached is named, and the others still answer.
    targets[1].kill()
    _ip("netns", "del", two_hosts["host-b"][0])
    bt = cli_on("host-a", "cluster", "bt", "--run", run, "--timeout", "1")
    assert bt.returncode == 0, bt.stderr
    assert "rank 1: no stacks (unreachable:" in bt.stdout and "rank  0 (1): wait_for_peers" in bt.stdout
