"""The chaos harness (`benchmarks.chaos`): its plan is the seed's alone, and each invariant check
reports what breaks it (a damaged venv, a worker in a venv without a marker, a leftover, a lock
held past its bound). A short real run (a round of 9 faults on the 3-node namespace cluster,
3 of them at least hitting a target) is `slow`."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import netns, node_disks
from benchmarks.chaos_faults import KINDS, cold_starts, plan
from benchmarks.chaos_invariants import locks, ran_in_ready, unexpected_entries, whole
from ray_uv_plugin.store import manifest
from ray_uv_plugin.store.freezing import thaw
from ray_uv_plugin.store.layout import write_marker

ROOT = Path(__file__).resolve().parents[2]
KEY = "0123456789abcdef"


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


def ready_venv(root: Path, key: str = KEY) -> Path:
    """A venv dir entry as a build leaves it: files, a manifest, a marker naming both."""
    venv = root / key
    (venv / "bin").mkdir(parents=True)
    (venv / "lib/python3.11/site-packages").mkdir(parents=True)
    (venv / "lib/python3.11/site-packages/mod.py").write_text("x = 1\n")
    (venv / "bin/python").symlink_to(sys.executable)
    sha = manifest.write(venv, manifest.scan(venv))
    write_marker(venv, {"format": 1, "key": key, "manifest": sha,
                        "site_packages": "lib/python3.11/site-packages"})  # fmt: skip
    return venv


def test_whole_reports_a_ready_venv_changed_after_its_build(tmp_path: Path) -> None:
    venv = ready_venv(tmp_path)
    assert whole([tmp_path], set()) == []
    thaw(venv)
    (venv / "lib/python3.11/site-packages/mod.py").write_text("x = 2\n")
    found = whole([tmp_path], set())
    assert len(found) == 1 and "mod.py" in found[0] and "not whole" in found[0]


def test_ran_in_ready_reports_a_worker_whose_venv_had_no_ready_marker(tmp_path: Path) -> None:
    prefix = str(tmp_path / KEY)
    good = {"pid": 1, "prefix": prefix, "marker": {"format": 1, "key": KEY}}
    assert ran_in_ready([good], [tmp_path]) == []
    bad = [
        {**good, "marker": "unreadable: FileNotFoundError()"},
        {**good, "marker": {"format": 1, "key": KEY, "not_whole": "drifted"}},
        {**good, "prefix": "/usr"},
    ]
    assert len(ran_in_ready(bad, [tmp_path])) == 3


def test_leftovers_reports_what_is_no_venv_lock_or_ticket(tmp_path: Path) -> None:
    ready_venv(tmp_path)
    (tmp_path / f"{KEY}.lock").write_text("1 host\n")
    assert unexpected_entries(tmp_path) == []
    (tmp_path / f"{KEY}.ship-abc123").mkdir()
    (tmp_path / "fedcba9876543210").mkdir()  # a build that died: no marker, its lock free
    found = unexpected_entries(tmp_path)
    assert len(found) == 2 and any(".ship-abc123" in f for f in found)


def test_locks_reports_one_held_past_its_bound(tmp_path: Path) -> None:
    lock = tmp_path / f"{KEY}.lock"
    lock.write_text(f"{os.getpid()} host\n")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert locks([tmp_path], bound_s=240) == []  # just taken
        os.utime(lock, (time.time() - 1000, time.time() - 1000))
        found = locks([tmp_path], bound_s=240)
        assert len(found) == 1 and "held" in found[0] and str(os.getpid()) in found[0]
    finally:
        os.close(fd)
    assert locks([tmp_path], bound_s=240) == []  # let go: nobody holds it


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
