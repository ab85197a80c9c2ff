"""`rankscope cluster profile`: every rank of a job sampled at once from
outside, merged into one view in which each frame names the ranks it was
seen on, and one rank set against the median of the others (`--diff`).
Each output is parsed back; the merged flame graph is rendered in headless
Chromium."""

from __future__ import annotations

import json
import re
import time
import uuid
import xml.etree.ElementTree as ET

import pytest
from conftest import assert_slices_nest

# Ranks 0, 1 and 3 run the job's loop; rank 2 runs another one.
RANK = """
import os

def matmul_like(n):
    total = 0
    for i in range(n):
        total += i * i
    return total

def train_step():
    return matmul_like(20000)

def odd_loop():
    return matmul_like(20000)

print("READY", flush=True)
step = odd_loop if os.environ["RANK"] == "2" else train_step
while True:
    step()
"""

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def job(default_python, spawn, tmp_path):
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    run = tmp_path / "run"
    targets = {
        rank: spawn(
            default_python,
            RANK,
            env={
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "4",
                "TORCHELASTIC_RUN_ID": job_id,
                "RANKSCOPE_RUN_DIR": str(run),
            },
        )
        for rank in range(4)
    }
    return run, targets


def cluster_profile(cli, run, *args):
    result = cli("cluster", "profile", "--run", run, "--duration", "1.5", *args, timeout=90)
    assert result.returncode == 0, result.stderr
    return result


def frame_titles(path) -> list[str]:
    root = ET.parse(path).getroot()
    return [t.text or "" for t in root.iter(f"{SVG}title")]


def test_the_merged_views_name_the_ranks_of_each_frame(job, cli, tmp_path, browser, speedscope_schema):
    run, targets = job
    svg = tmp_path / "job.svg"
    done = cluster_profile(cli, run, "-o", svg)
    assert re.search(r"wrote .*job\.svg \(flame graph\): \d+ samples of 4 ranks", done.stdout), done.stdout
    titles = frame_titles(svg)
    assert any(re.match(r"train_step \(target\.py:\d+\) \[3/4 ranks: 0-1,3\]", t) for t in titles), titles
    assert any(re.match(r"odd_loop \(target\.py:\d+\) \[1/4 ranks: 2\]", t) for t in titles), titles
    assert any(re.match(r"matmul_like \(target\.py:\d+\) \[", t) for t in titles), titles
    assert any(t.startswith("MainThread [4/4 ranks]") for t in titles), titles

    # A browser draws it: frames as rectangles with a width, and the title.
    browser.get(svg.as_uri())
    drawn = browser.execute_script(
        "return Array.from(document.querySelectorAll('rect')).filter(r => r.getBBox().width > 0).length"
    )
    assert drawn > 5, drawn
    assert "4 ranks" in browser.execute_script("return document.querySelector('#title').textContent")

    # Chrome/Perfetto: a process per rank, named, with its frames as slices.
    trace = tmp_path / "job.json"
    cluster_profile(cli, run, "-o", trace)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {t.pid: f"rank {r} (pid {t.pid})" for r, t in targets.items()}, names
    for rank, target in targets.items():
        slices = {e["name"].split(" (")[0] for e in events if e["ph"] == "X" and e["pid"] == target.pid}
        assert ("odd_loop" if rank == 2 else "train_step") in slices, (rank, slices)
        assert all(e["dur"] >= 0 and e["ts"] > 0 for e in events if e["ph"] == "X")
    assert_slices_nest(events)

    # speedscope: a profile per rank and thread, then every rank merged.
    scope = tmp_path / "job.speedscope.json"
    cluster_profile(cli, run, "-o", scope)
    data = json.loads(scope.read_text())
    speedscope_schema.validate(data)
    profiles = [p["name"] for p in data["profiles"]]
    assert profiles[-1] == "the job · all ranks and threads", profiles
    assert {p.split(" · ")[0] for p in profiles[:-1]} == {"rank 0", "rank 1", "rank 2", "rank 3"}, profiles
    frames = data["shared"]["frames"]
    for p in data["profiles"]:
        assert len(p["samples"]) == len(p["weights"])
        assert all(0 <= i < len(frames) for stack in p["samples"] for i in stack)

    # Folded: each rank's lines under its own prefix; the table names ranks.
    folded = tmp_path / "job.folded"
    cluster_profile(cli, run, "-o", folded)
    prefixes = {line.split(";")[0] for line in folded.read_text().splitlines()}
    assert prefixes == {"rank 0", "rank 1", "rank 2", "rank 3"}, prefixes
    table = cluster_profile(cli, run, "--top", "5").stdout
    assert table.startswith("4 ranks: "), table
    assert re.search(r"%\s+all\s+matmul_like \(target\.py\)", table), table


def test_diff_names_what_one_rank_does_that_the_others_do_not(job, cli, tmp_path):
    run, _ = job
    folded = tmp_path / "diff.folded"
    done = cluster_profile(cli, run, "--diff", "2", "-o", folded)
    assert "rank 2 against the median of the others" in done.stdout, done.stdout
    before_after = {}
    for line in folded.read_text().splitlines():
        stack, before, after = line.rsplit(" ", 2)
        before_after[stack] = (int(before), int(after))
    odd = [v for k, v in before_after.items() if "odd_loop" in k]
    usual = [v for k, v in before_after.items() if "train_step" in k]
    assert odd and all(before == 0 and after > 0 for before, after in odd), before_after
    assert usual and all(before > 0 and after == 0 for before, after in usual), before_after

    table = cluster_profile(cli, run, "--diff", "2", "--no-lines").stdout
    rows = table.splitlines()
    assert rows[0] == "rank 2 against the median of 3 other ranks (share of samples with the function on the stack)", table
    assert re.match(r"\s+\d+\.\d% \s+0\.0% \s+\+\d+\.\d%  odd_loop \(target\.py\)$", rows[2]), table
    assert re.match(r"\s+0\.0% \s+\d+\.\d% \s+-\d+\.\d%  train_step \(target\.py\)$", rows[-1]), table

    svg = tmp_path / "diff.svg"
    cluster_profile(cli, run, "--diff", "2", "-o", svg)
    assert any("odd_loop" in t for t in frame_titles(svg))

    # Each rank's profiles are kept in the job's run store: the odd rank
    # shows in SQL too, after the ranks are gone as well as now.
    sql = "SELECT rank, sum(CASE WHEN stack LIKE '%odd_loop%' THEN samples ELSE 0 END) AS odd, sum(samples) AS n FROM python.profile GROUP BY rank ORDER BY rank"
    result = cli("query", "--run", run, sql, "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3], rows
    assert all((r["odd"] > 0) == (r["rank"] == 2) and r["n"] > 0 for r in rows), rows
    # The live ranks answer from their run stores with their last profile
    # (the run store keeps the three this test took).
    live = cli("cluster", "query", "--run", run, sql, "--format", "json")
    assert live.returncode == 0 and "did not answer" not in live.stderr, live.stderr
    last = sql.replace("GROUP BY rank ORDER", "WHERE ts IN (SELECT max(ts) FROM python.profile GROUP BY rank) GROUP BY rank ORDER")
    kept_last = json.loads(cli("query", "--run", run, last, "--format", "json").stdout)
    assert json.loads(live.stdout) == kept_last, (live.stdout, kept_last)
    assert all(mine["n"] < every["n"] for mine, every in zip(kept_last, rows)), (kept_last, rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--diff", "7"], "--diff 7: that rank is not among those profiled here"),
        (["--diff", "2", "-o", "x.json"], "error: --diff writes .svg, .folded or .txt"),
        (["-o", "missing/x.svg"], "there is no folder missing"),
    ],
)
def test_bad_arguments_are_refused_before_sampling(job, cli, tmp_path, args, message):
    """GIVEN a long duration, WHEN an argument cannot work, THEN it is
    refused at once, not after every rank was sampled for nothing."""
    run, _ = job
    started = time.monotonic()
    result = cli("cluster", "profile", "--run", run, "--duration", "60", *args, timeout=30)
    assert time.monotonic() - started < 20
    assert result.returncode != 0
    assert message in result.stderr and "hint:" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--diff", "7"], "--diff 7: that rank is not among those profiled here"),
        (["--diff", "2", "--ranks", "2"], "--diff needs at least two ranks"),
        (["--diff", "2", "-o", "x.json"], "error: --diff writes .svg, .folded or .txt"),
        (["--ranks", "9"], "rank 9 is not in job"),
        (["-o", "x.png"], "cannot tell the format of x.png"),
    ],
)
def test_bad_arguments_get_one_line_and_a_hint(job, cli, tmp_path, args, message):
    run, _ = job
    result = cli("cluster", "profile", "--run", run, "--duration", "0.3", *args, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "hint:" in result.stderr, result.stderr


def test_inside_has_each_rank_sample_itself(job, cli, tmp_path):
    run, _ = job
    done = cluster_profile(cli, run, "--inside", "--diff", "2", "--no-lines")
    assert "ranks 0-3 are sampled by their own probes (--inside)" in done.stderr, done.stderr
    rows = done.stdout.splitlines()
    assert re.match(r"\s+\d+\.\d% \s+0\.0% \s+\+\d+\.\d%  odd_loop \(target\.py\)$", rows[2]), done.stdout
    # Each probe kept its own profile in the run store (once, not again by the CLI).
    result = cli("query", "--run", run, "SELECT rank, count(DISTINCT ts) AS profiles FROM python.profile GROUP BY rank ORDER BY rank", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"rank": r, "profiles": 1} for r in range(4)], result.stdout
