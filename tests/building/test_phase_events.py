"""A build's phases as they happen (`building.phase_events`): uv's lines read into phases, one log
line per phase at most once a second, and the key's phase record that the readiness view reads
(`store.setup_state`), through real builds by real uv of a source package that takes its time."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.log_lines import capturing_logger
from ray_uv_plugin.building import phase_events
from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.building.phase_events import PhaseEvents
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvSyncError, find_uv
from ray_uv_plugin.settings import MAX_BUILDS_ENV
from ray_uv_plugin.store import outcomes, phases
from ray_uv_plugin.store.build_lock import BuildLock
from ray_uv_plugin.store.build_slots import BuildSlot
from ray_uv_plugin.store.layout import Venv
from ray_uv_plugin.store.setup_state import SetupState, read_setup
from ray_uv_plugin.store.units import format_bytes
from tests.support.slow_build import write_slow_package
from tests.support.uvproject import write_project

KEY = "0123456789abcdef"

# --- pure: uv's lines, the log's pace, the record --------------------------------------------


def test_uvs_lines_give_the_phases_and_the_bytes(tmp_path: Path) -> None:
    said: list[str] = []
    events = PhaseEvents(tmp_path, KEY, said.append)
    events.enter("download")
    for line in [
        "Resolved 3 packages in 1ms",
        "Downloading numpy (15.9MiB)",
        "   Building flash-attn==2.7.4",
        "   Building pyyaml==6.0.2",
    ]:
        events.uv_line(line)
    record = phases.read_record(tmp_path, KEY)
    assert record["phase"] == "building flash-attn==2.7.4, pyyaml==6.0.2"
    events.uv_line("      Built pyyaml==6.0.2")
    assert phases.read_record(tmp_path, KEY)["phase"] == "building flash-attn==2.7.4"
    events.uv_line(" Downloaded numpy")
    assert events.bytes == int(15.9 * 2**20)
    events.uv_line("      Built flash-attn==2.7.4")
    assert phases.read_record(tmp_path, KEY)["phase"] == "download"
    events.uv_line("Prepared 3 packages in 2.1s")
    record = phases.read_record(tmp_path, KEY)
    assert (record["state"], record["phase"], record["bytes"]) == (
        "building",
        "install",
        int(15.9 * 2**20),
    )
    assert said == [
        "phase: download",
        "phase: building flash-attn==2.7.4",
        "phase: building flash-attn==2.7.4, pyyaml==6.0.2",
        # back in building flash-attn, the bytes, then download: each said within the second
        "phase: install",
    ]


def test_a_phase_is_said_at_most_once_a_second(tmp_path: Path, monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(phase_events.time, "monotonic", lambda: clock[0])
    said: list[str] = []
    events = PhaseEvents(tmp_path, KEY, said.append)
    events.enter("download")
    for _ in range(3):  # uv going in and out of a build within the second
        events.uv_line("Building a==1")
        events.uv_line("Built a==1")
    assert said == ["phase: download", "phase: building a==1"]
    clock[0] += 1.0
    events.uv_line("Building a==1")
    assert said[-1] == "phase: building a==1" and len(said) == 3
    for _ in range(50):
        events.add_bytes(1000)  # a receive's chunks: the record has them, the log waits
    assert len(said) == 3 and phases.read_record(tmp_path, KEY)["bytes"] is None
    clock[0] += 1.0
    events.add_bytes(1000)
    assert said[-1] == f"phase: building a==1: {format_bytes(51000)} so far"
    assert phases.read_record(tmp_path, KEY)["bytes"] == 51000


def test_failed_keeps_the_cause_and_clear_leaves_nothing(tmp_path: Path) -> None:
    events = PhaseEvents(tmp_path, KEY)
    events.enter("download")
    events.failed("x" * 5000)
    record = phases.read_record(tmp_path, KEY)
    assert (record["state"], record["phase"]) == ("failed", "download")
    assert len(record["cause"]) == phase_events.CAUSE_CHARS
    events.clear()
    assert phases.read_record(tmp_path, KEY) is None


# --- real builds ------------------------------------------------------------------------------


def slow_project(tmp_path: Path, seconds: float, fail: bool = False) -> Path:
    name = f"slow{time.monotonic_ns()}"
    write_slow_package(tmp_path / name, name, seconds, fail)
    project = write_project(tmp_path / "proj", [name], name=f"p{time.monotonic_ns()}", lock=False)
    with (project / "pyproject.toml").open("a") as f:
        f.write(f'\n[tool.uv.sources]\n{name} = {{ path = "../{name}" }}\n')
    subprocess.run([find_uv(), "lock", "--project", str(project), "--quiet"], check=True)
    return project


def key_of(project: Path) -> str:
    return make_request(parse_spec({}), load_project(project), {}).key


class Watching:
    """`read_setup` of one key every 0.1 s while a build runs: each state seen, with when."""

    def __init__(self, root: Path, key: str) -> None:
        self.root, self.key = root, key
        self.seen: list[tuple[float, SetupState]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.root.exists():
                self.seen.append((time.monotonic(), read_setup(self.root, self.key)))
            time.sleep(0.1)

    def stop(self) -> list[SetupState]:
        self._stop.set()
        self._thread.join()
        return [s for _, s in self.seen]


def test_a_long_source_build_shows_its_package_and_time_live(tmp_path: Path) -> None:
    project = slow_project(tmp_path, seconds=4.0)
    root = tmp_path / "venvs"
    key = key_of(project)
    logger, lines = capturing_logger("phases")
    watch = Watching(root, key)
    start = time.monotonic()
    ensure_venv(parse_spec({}), load_project(project), root=root, logger=logger)
    seen = watch.stop()
    building = [(when, s) for when, s in watch.seen if (s.phase or "").startswith("building slow")]
    assert building, seen
    assert max(s.seconds for _, s in building) >= 3.0  # its time in the phase, growing
    assert all(s.state == "building" for _, s in building)
    assert read_setup(root, key) == SetupState("ready", how="built")
    said = [line.split(": ", 1)[1] for line in lines.having("phase: ")]
    assert said[0] == "phase: download" and said[-1] == "phase: manifest", said
    assert any(line.startswith("phase: building slow") for line in said), said
    assert "phase: install" in said
    assert phases.read_record(root, key) is None  # ready: the record went
    # each setup's outcome, for the node's metrics (`store.outcomes`): this build, then a reuse
    ensure_venv(parse_spec({}), load_project(project), root=root)
    assert outcomes.read_from(root, 0)[0] == Counter({(key, "built"): 1, (key, "reused"): 1})
    assert time.monotonic() - start >= 4.0


def test_a_failed_build_leaves_its_cause_for_the_view(tmp_path: Path) -> None:
    project = slow_project(tmp_path, seconds=0.0, fail=True)
    root = tmp_path / "venvs"
    with pytest.raises(UvSyncError):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    state = read_setup(root, key_of(project))
    assert state.state == "failed" and state.phase.startswith("building slow")
    assert "never builds" in state.cause
    assert outcomes.read_from(root, 0)[0] == Counter({(key_of(project), "failed"): 1})


def test_a_build_waiting_for_a_slot_is_queued_and_one_waiting_for_the_lock_says_so(
    tmp_path: Path, monkeypatch
) -> None:
    project = write_project(tmp_path / "proj", ["six"], name=f"q{time.monotonic_ns()}")
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    key = key_of(project)
    monkeypatch.setenv(MAX_BUILDS_ENV, "1")
    other = BuildSlot(root, limit=1)  # another key's build holds the one slot
    asyncio.run(other.acquire_async(1.0, "other", lambda line: None))
    logger, lines = capturing_logger("queued")
    build = threading.Thread(
        target=ensure_venv,
        args=(parse_spec({}), load_project(project)),
        kwargs={"root": root, "logger": logger},
    )
    build.start()
    try:
        deadline = time.monotonic() + 20
        while read_setup(root, key).state != "queued" and time.monotonic() < deadline:
            time.sleep(0.1)
        state = read_setup(root, key)
        assert (state.state, state.phase) == ("queued", "build-slot queue")
    finally:
        other.release()
        build.join(300)
    assert read_setup(root, key) == SetupState("ready", how="built")
    assert lines.having("phase: build-slot queue")

    # the lock held by someone else: the request says whom it waits for, and waits
    second = write_project(tmp_path / "proj2", ["six"], name=f"r{time.monotonic_ns()}")
    key2 = key_of(second)
    held = BuildLock(Venv(root, key2).lock)
    assert held.try_acquire()
    logger, lines = capturing_logger("lockwait")
    build = threading.Thread(
        target=ensure_venv,
        args=(parse_spec({}), load_project(second)),
        kwargs={"root": root, "logger": logger},
    )
    build.start()
    try:
        deadline = time.monotonic() + 20
        while not lines.having("phase: lock wait") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lines.having("phase: lock wait (another build or receive of this key: pid ")
        assert read_setup(root, key2) == SetupState("building")  # the holder wrote no record
    finally:
        held.release()
        build.join(300)
    assert read_setup(root, key2).state == "ready"
