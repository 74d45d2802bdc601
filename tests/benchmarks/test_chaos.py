"""The chaos harness (`benchmarks.chaos`) run for real (its plan and faults:
test_chaos_faults.py; the invariants and the blame: test_chaos_invariants.py). A short real
run (a round of faults on the 3-node namespace cluster, 3 of them at least meeting their
operation) is `slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import netns, node_disks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_chaos_run_injects_faults_checks_every_round_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    why_not = netns.unavailable() or node_disks.unavailable()  # here: a mkfs, not at collection
    if why_not:
        pytest.skip(f"no namespaces or loop mounts: {why_not}")
    out = tmp_path / "chaos.jsonl"
    # One round, every kind twice, its seed the day's (UTC): each CI run meets another plan, and
    # the printed line reruns it. Its violations are printed, not yet failed on. `cache_write`'s
    # put-back no longer makes `whole` report venvs built meanwhile (such a build now fails: its
    # files differ from their RECORD); a clean round on CI's host is yet to be seen.
    seed = os.environ.get("RAY_UV_CHAOS_SEED") or time.strftime("%Y%m%d", time.gmtime())
    print(f"chaos seed {seed}: uv run python -m benchmarks.chaos --seed {seed} --rounds 1")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--seed", seed, "--rounds", "1",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    summary = lines[-1]
    assert summary["type"] == "summary", done.stderr[-3000:]
    print("chaos violations:", json.dumps(summary.get("violations", []))[:3000])
    assert summary["faults_met"] >= 3 and summary["faults_sent"] >= summary["faults_met"]
    faults = [x for x in lines if x["type"] == "fault"]
    assert all(set(f["invariants_held"]) == set(summary["invariants"]) for f in faults)
    mine = f"{netns.PREFIX}{lines[0]['network']}-"
    assert not [ns for ns in netns.namespaces() if ns.startswith(mine)]  # its namespaces are gone
    assert (
        "ruvship-chaos-" not in subprocess.run(["findmnt"], capture_output=True, text=True).stdout
    )
