"""Where a key stands in a venv dir (`store.setup_state`), read from the venv, its lock, its
phase record and its build-slot ticket: each state from the files a build, a receive or a
failure leaves, and none from a record whose writer is gone."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from ray_uv_plugin.store import phases
from ray_uv_plugin.store.build_lock import BuildLock
from ray_uv_plugin.store.build_slots import BuildSlot
from ray_uv_plugin.store.layout import MARKER, MARKER_FORMAT, Venv
from ray_uv_plugin.store.setup_state import SetupState, read_all, read_setup

KEY = "0123456789abcdef"


def ready_venv(root: Path, key: str, built: dict | None) -> Path:
    """A venv as a build leaves it: interpreter, site-packages, then the marker."""
    venv = root / key
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib/python3.11/site-packages").mkdir(parents=True)
    meta = {"format": MARKER_FORMAT, "key": key, "site_packages": "lib/python3.11/site-packages"}
    if built is not None:
        meta["built"] = built
    (venv / MARKER).write_text(json.dumps(meta))
    return venv


@pytest.fixture
def lock(tmp_path: Path):
    held = BuildLock(Venv(tmp_path, KEY).lock)
    assert held.try_acquire()
    yield held
    held.release()


@pytest.mark.parametrize(
    ("built", "how"),
    [
        ({"how": "full"}, "built"),
        ({"how": "seeded", "seed": "x"}, "seeded"),
        ({"how": "shipped", "from": "h"}, "shipped"),
        (None, None),
    ],
)
def test_a_ready_venv_says_how_it_was_made(tmp_path: Path, built: dict | None, how: str) -> None:
    ready_venv(tmp_path, KEY, built)
    marker = tmp_path / KEY / MARKER
    before = marker.stat().st_mtime_ns
    state = read_setup(tmp_path, KEY)
    assert (state.state, state.how) == ("ready", how)
    assert marker.stat().st_mtime_ns == before  # only read: not a use for gc


def test_nothing_there_is_absent(tmp_path: Path) -> None:
    assert read_setup(tmp_path, KEY) == SetupState("absent")


def test_a_held_lock_with_its_record_is_building_in_that_phase(tmp_path: Path, lock) -> None:
    assert read_setup(tmp_path, KEY) == SetupState("building")  # no record yet
    since = time.time() - 12.5
    fields = {
        "state": "building",
        "phase": "building flash-attn==2.7.4",
        "since": since,
        "bytes": 1234,
    }
    phases.write_record(tmp_path, KEY, fields)
    state = read_setup(tmp_path, KEY, now=since + 12.5)
    assert (state.state, state.phase, state.seconds, state.bytes) == (
        "building",
        "building flash-attn==2.7.4",
        12.5,
        1234,
    )
    phases.write_record(
        tmp_path,
        KEY,
        {
            "state": "receiving",
            "phase": "ship bytes",
            "since": since,
            "bytes": 99,
            "source": "10.0.0.2",
        },
    )
    state = read_setup(tmp_path, KEY)
    assert (state.state, state.source, state.bytes) == ("receiving", "10.0.0.2", 99)


def test_a_record_whose_writer_died_is_not_building(tmp_path: Path) -> None:
    phases.write_record(tmp_path, KEY, {"state": "building", "phase": "install", "since": 0})
    assert read_setup(tmp_path, KEY) == SetupState("absent")  # the lock is free
    os.mkdir(tmp_path / KEY)  # and what the dead build left: absent, with what is there
    assert read_setup(tmp_path, KEY).state == "absent"
    assert "no marker" in (read_setup(tmp_path, KEY).cause or "")


def test_queued_only_while_its_ticket_is_held(tmp_path: Path, lock) -> None:
    slot = BuildSlot(tmp_path, limit=1)
    asyncio.run(slot.acquire_async(1.0, "x", lambda line: None))  # a build holds the slot
    waiting = BuildSlot(tmp_path, limit=1)
    waiting._enter()  # our ticket, behind it
    try:
        phases.write_record(
            tmp_path,
            KEY,
            {
                "state": "queued",
                "phase": "build-slot queue",
                "since": time.time(),
                "ticket": waiting.name,
            },
        )
        assert read_setup(tmp_path, KEY).state == "queued"
    finally:
        waiting.release()
        slot.release()
    after = read_setup(tmp_path, KEY)  # its ticket is gone: it got its slot
    assert (after.state, after.phase) == ("building", None)


def test_a_failure_stays_until_the_next_try(tmp_path: Path) -> None:
    held = BuildLock(Venv(tmp_path, KEY).lock)
    assert held.try_acquire()
    phases.write_record(
        tmp_path, KEY, {"state": "failed", "phase": "download", "cause": "no wheel for linux"}
    )
    held.release()
    state = read_setup(tmp_path, KEY)
    assert (state.state, state.phase, state.cause) == ("failed", "download", "no wheel for linux")
    assert held.try_acquire()  # a new try took the lock: building, not failed
    try:
        assert read_setup(tmp_path, KEY).state == "building"
    finally:
        held.release()


def test_a_shipped_venv_says_from_where_and_how_many_bytes(tmp_path: Path) -> None:
    ready_venv(tmp_path, KEY, {"how": "shipped", "from": "node-a", "bytes": 4096})
    assert read_setup(tmp_path, KEY) == SetupState(
        "ready", how="shipped", bytes=4096, source="node-a"
    )


def test_every_key_the_venv_dir_shows_but_the_absent(tmp_path: Path, lock) -> None:
    other = "f" * 16
    ready_venv(tmp_path, other, {"how": "full"})
    phases.write_record(tmp_path, KEY, {"state": "building", "phase": "install", "since": 0})
    (tmp_path / f"{'e' * 16}.lock").write_text("")  # a lock nobody holds: absent
    found = read_all(tmp_path)
    assert sorted(found) == [KEY, other]
    assert (found[KEY].phase, found[other].how) == ("install", "built")
    assert read_all(tmp_path / "nowhere") == {}
