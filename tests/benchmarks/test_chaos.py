"""The chaos harness (`benchmarks.chaos`): its plan is the seed's alone (the invariants and the
blame: test_chaos_invariants.py). A short real run (a round of 9 faults on the 3-node namespace
cluster, 3 of them at least hitting a target) is `slow`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import netns, node_disks
from benchmarks.chaos_faults import KINDS, cold_starts, plan

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_is_the_seeds_alone() -> None:
    first = [plan(7, r, len(KINDS), 40.0, 3) for r in range(5)]
    assert first == [plan(7, r, len(KINDS), 40.0, 3) for r in range(5)]
    assert first != [plan(8, r, len(KINDS), 40.0, 3) for r in range(5)]
    for faults in first:  # every kind once a round; never a SIGKILLed raylet or agent on the head
        assert sorted(f.kind for f in faults) == sorted(KINDS)
        assert all(
            f.node != 0 for f in faults if f.kind in ("agent", "raylet") and f.action == "kill"
        )
        assert [f.offset_s for f in faults] == sorted(f.offset_s for f in faults)


def test_every_sync_and_ship_fault_has_its_target_start_at_its_moment() -> None:
    """A sync or a ship lasts seconds: the round starts fresh builds (or a `prepare`) when such
    a fault comes due, so that it finds one (the seed-1 run, without them: 21 of 30 sync faults
    and 31 of 60 ship faults found none)."""
    ships = ("ship_sender", "ship_receiver")
    for r in range(5):
        faults = plan(2, r, 2 * len(KINDS), 40.0, 3)
        syncs = [(f.offset_s, "cold") for f in faults if f.kind == "uv_sync"]
        shipping = [(f.offset_s, "cold_ship") for f in faults if f.kind in ships]
        assert len(syncs) == 2 and len(shipping) == 4  # each kind twice a round
        assert cold_starts(faults) == sorted(syncs + shipping)
        assert cold_starts(faults) == cold_starts(plan(2, r, 2 * len(KINDS), 40.0, 3))
    others = [f for f in plan(2, 0, 18, 40.0, 3) if f.kind not in ("uv_sync", *ships)]
    assert cold_starts(others) == []


@pytest.mark.slow
def test_a_short_chaos_run_injects_faults_checks_every_round_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    why_not = netns.unavailable() or node_disks.unavailable()  # here: a mkfs, not at collection
    if why_not:
        pytest.skip(f"no namespaces or loop mounts: {why_not}")
    out = tmp_path / "chaos.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--seed", "3", "--faults", "3",
         "--per-round", "9", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    summary = lines[-1]
    assert summary["type"] == "summary", done.stderr[-3000:]
    assert summary["faults_injected"] >= 3
    faults = [x for x in lines if x["type"] == "fault"]
    assert all(set(f["invariants_held"]) == set(summary["invariants"]) for f in faults)
    mine = f"{netns.PREFIX}{lines[0]['network']}-"
    assert not [ns for ns in netns.namespaces() if ns.startswith(mine)]  # its namespaces are gone
    assert (
        "ruvship-chaos-" not in subprocess.run(["findmnt"], capture_output=True, text=True).stdout
    )
