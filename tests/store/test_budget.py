"""The venv dir keeps a budget: a build that would pass it removes the least recently
used venvs that nothing uses, with gc's removal, and names them; when nothing can go the build
fails clearly and keeps nothing; `ray-uv list` shows what the budget holds. Real uv, no Ray."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from benchmarks.log_lines import Lines, capturing_logger
from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvSyncError
from ray_uv_plugin.settings import (
    MAX_BUILDS_ENV,
    UV_ENV_VAR,
    VENV_DIR_ENV,
    VENV_DIR_MAX_BYTES_ENV,
    VenvDirError,
    parse_size,
)
from ray_uv_plugin.store import budget, disk
from ray_uv_plugin.store.freezing import remove_tree
from ray_uv_plugin.store.layout import BUDGET_LOCK, MARKER, MARKER_FORMAT, Venv
from ray_uv_plugin.store.trust import UntrustedPathError
from ray_uv_plugin.store.units import format_bytes
from tests.store.test_build_slots import hold_slot, kill
from tests.support.uvproject import CountingUv, left_in, project_variants, write_project

GIB = 1024**3

# --- pure parts ------------------------------------------------------------------------------


def test_sizes_take_the_units_du_prints() -> None:
    assert parse_size("50G") == parse_size("50GiB") == parse_size("50 gb") == 50 * GIB
    assert parse_size("1.5T") == int(1.5 * 1024**4)
    assert parse_size("500M") == 500 * 1024**2 and parse_size("64k") == 64 * 1024
    assert parse_size("1048576") == parse_size("1048576B") == 1024**2
    for bad in ("", "G", "-1G", "0", "0.1", "ten G", "5X", "1e9"):
        assert parse_size(bad) is None, bad


def test_the_budget_is_unset_by_default_and_a_bad_one_says_what_to_set(monkeypatch) -> None:
    monkeypatch.delenv(VENV_DIR_MAX_BYTES_ENV, raising=False)
    assert budget.venv_dir_budget() is None
    monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, "20G")
    assert budget.venv_dir_budget() == 20 * GIB
    monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, "lots")
    with pytest.raises(VenvDirError, match=r"'lots' is no size: .* e\.g\. 50G; unset it"):
        budget.venv_dir_budget()


# --- real uv ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("budget") / "base", ["six"])


@pytest.fixture
def counting_uv(tmp_path, monkeypatch) -> CountingUv:
    uv = CountingUv(tmp_path / "uv")
    monkeypatch.setenv(UV_ENV_VAR, str(uv.path))
    monkeypatch.setenv("UV_COMPILE_BYTECODE", "0")  # small, fast venvs
    monkeypatch.delenv(VENV_DIR_MAX_BYTES_ENV, raising=False)
    return uv


def build(project: Path, root: Path, logger: logging.Logger | None = None) -> Path:
    return ensure_venv(parse_spec({}), load_project(project), root=root, logger=logger).path


def held(root: Path) -> int:
    """What the budget counts: the venvs and their locks, each inode once (`du -s` of them)."""
    venvs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    paths = venvs + [Venv(root, v.name).lock for v in venvs]
    return disk.measure(paths).size(*paths)


def age(venv: Path, hours: float) -> None:
    t = time.time() - hours * 3600
    os.utime(venv / MARKER, (t, t))


def logger_with_lines() -> tuple[logging.Logger, Lines]:
    return capturing_logger("test-budget")


def test_a_build_over_the_budget_removes_the_least_recently_used_venv(
    base_project, tmp_path, counting_uv, monkeypatch
):
    root = tmp_path / "venvs"
    oldest, older, new = project_variants(base_project, tmp_path, 3)
    a, b = build(oldest, root), build(older, root)
    age(a, 2)
    age(b, 1)
    two = held(root)
    # What one more venv adds: its own files and dirs (the rest are hardlinks already counted).
    own = two - disk.measure([a, Venv(root, a.name).lock]).size(a, Venv(root, a.name).lock)
    limit = two + own // 2  # room for two venvs, not three
    monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, str(limit))
    logger, lines = logger_with_lines()
    c = build(new, root, logger)
    assert not a.exists() and not Venv(root, a.name).lock.exists()
    assert b.exists() and (c / MARKER).exists()
    assert held(root) <= limit
    (removed,) = lines.having("removed venv")
    assert removed.startswith(f"uv_project {c.name}: removed venv {a.name} ({oldest}): ")
    assert "least recently used while over " in removed
    assert removed.endswith(f"to keep the venv dir within its budget of {format_bytes(limit)}")


def test_a_venv_in_use_or_just_used_stays_and_the_build_that_needs_its_room_fails(
    base_project, tmp_path, counting_uv, monkeypatch
):
    root = tmp_path / "venvs"
    used, recent, new = project_variants(base_project, tmp_path, 3)
    a = build(used, root)
    age(a, 2)
    b = build(recent, root)  # used seconds ago: a worker may be starting in it
    # A worker as the plugin starts it: the venv's python, RAY_UV_PLUGIN_VENV set.
    worker = subprocess.Popen(
        [str(a / "bin" / "python"), "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        env={**os.environ, "RAY_UV_PLUGIN_VENV": str(a)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "up\n"
        monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, str(held(root) + 4096))
        with pytest.raises(UvSyncError) as info:
            build(new, root)
    finally:
        worker.kill()
        worker.wait()
    message = str(info.value)
    assert "over its budget of" in message and "no more venvs can be removed" in message
    assert f"{a.name}: in use by pid {worker.pid}" in message
    assert f"{b.name}: used " in message
    assert f"Raise {VENV_DIR_MAX_BYTES_ENV} on the nodes" in message
    assert message.endswith("The new venv was not kept.")
    assert a.exists() and b.exists()
    c = make_request(parse_spec({}), load_project(new), {}).key
    left = sorted(name for name in left_in(root) if name != BUDGET_LOCK)
    assert left == sorted([a.name, f"{a.name}.lock", b.name, f"{b.name}.lock", f"{c}.lock"])
    assert counting_uv.syncs() == 3


def test_a_budget_that_is_no_size_fails_before_the_build(
    base_project, tmp_path, counting_uv, monkeypatch
):
    monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, "ten gigs")
    (project,) = project_variants(base_project, tmp_path, 1)
    with pytest.raises(VenvDirError, match=f"{VENV_DIR_MAX_BYTES_ENV}='ten gigs' is no size"):
        build(project, tmp_path / "venvs")
    assert counting_uv.syncs() == 0


def ray_uv_list(root: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    env = {**os.environ, VENV_DIR_ENV: str(root), **settings}
    return subprocess.run(
        ["ray-uv", "list", *args], env=env, capture_output=True, text=True, check=True
    )


def test_list_shows_what_the_budget_holds_and_the_builds(
    base_project, tmp_path, counting_uv, monkeypatch
):
    root = tmp_path / "venvs"
    (project,) = project_variants(base_project, tmp_path, 1)
    build(project, root)
    size = held(root)
    out = ray_uv_list(root, **{VENV_DIR_MAX_BYTES_ENV: "1G", MAX_BUILDS_ENV: "1"}).stdout
    share = f"{size / GIB:.0%}"
    assert f"Budget: {format_bytes(size)} of 1.0GiB ({share}, {VENV_DIR_MAX_BYTES_ENV})" in out
    assert f"Builds: 0 running, 0 waiting (at most 1 at once, {MAX_BUILDS_ENV})" in out
    assert "not ours" not in out  # the budget's lock is the plugin's
    assert f"Budget: none ({VENV_DIR_MAX_BYTES_ENV} unset)" in ray_uv_list(root).stdout
    holders = [hold_slot(root, limit=1), hold_slot(root, limit=2)]  # one builds, one waits
    try:
        listed = json.loads(ray_uv_list(root, "--json", **{MAX_BUILDS_ENV: "1"}).stdout)
    finally:
        for holder in holders:
            kill(holder)
    assert listed["budget_bytes"] is None and listed["budget_held_bytes"] == size
    assert (listed["builds_running"], listed["builds_waiting"], listed["max_builds"]) == (1, 1, 1)
    listed = json.loads(ray_uv_list(root, "--json", **{VENV_DIR_MAX_BYTES_ENV: "2M"}).stdout)
    assert listed["budget_bytes"] == 2 * 1024**2 and listed["builds_running"] == 0


def test_ready_venvs_are_walked_once_and_again_once_replaced(tmp_path, monkeypatch) -> None:
    """The budget measures the venv dir before every build: a ready venv (read-only, marked)
    is walked the first time only, a venv that is not ready every time, and a ready venv that
    was replaced (a new dir at its path) again; the sizes are those of a fresh walk."""
    walked: list[str] = []
    walk = disk._walk_inodes
    monkeypatch.setattr(disk, "_walk_inodes", lambda p: walked.append(p.name) or walk(p))

    def venv(name: str, files: int, ready: bool) -> Path:
        path = tmp_path / name
        (path / "lib").mkdir(parents=True)
        for i in range(files):
            (path / "lib" / f"m{i}.py").write_bytes(bytes(5000))
        if ready:
            Venv.at(path).write_marker({"format": MARKER_FORMAT, "key": name})  # read-only, as ours
        return path

    ready, building = venv("ready", 3, True), venv("building", 2, False)
    trees = disk.ReadyTrees()
    for _ in range(3):
        cached = disk.measure([ready, building], trees)
        assert cached.inodes == disk.measure([ready, building]).inodes
    assert walked.count("ready") == 1 + 3 and walked.count("building") == 3 + 3  # + fresh walks
    walked.clear()
    ready.chmod(0o755)
    remove_tree(ready)
    ready = venv("ready", 4, True)  # rebuilt: another tree at the same path
    assert disk.measure([ready], trees).inodes == disk.measure([ready]).inodes
    assert walked.count("ready") == 2
    assert list(trees.seen) == [ready]  # only what the latest call measured is kept


def test_a_venv_dir_over_its_budget_by_its_lock_files_alone_makes_room(
    base_project, tmp_path, counting_uv, monkeypatch
):
    """The budget counts the venvs' lock files too (4 KiB each, as `du` does): a dir whose
    venvs fit but whose venvs and locks do not is over, and the oldest venv goes; it was
    kept, and the build failed, while gc's plan counted the venvs alone."""
    root = tmp_path / "venvs"
    old, new = project_variants(base_project, tmp_path, 2)
    a = build(old, root)
    age(a, 2)
    b = build(new, root)
    venvs_alone = disk.measure([a, b]).size(a, b)
    assert held(root) > venvs_alone
    monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, str(venvs_alone))  # fits without the locks
    logger, lines = logger_with_lines()
    remove_tree(b)  # what a build makes again, then has to make room for
    c = build(new, root, logger)
    assert c == b and not a.exists() and held(root) <= venvs_alone
    assert len(lines.having("removed venv")) == 1


HOLD_BUDGET_LOCK = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from ray_uv_plugin.store.build_lock import BuildLock
    assert BuildLock(Path(sys.argv[1])).try_acquire()
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    """
)


def stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


def test_a_stopped_holder_of_the_budget_lock_fails_the_build_at_its_timeout(
    base_project, tmp_path, counting_uv, monkeypatch
):
    """Another build stopped (SIGSTOP) while it makes room holds `.budget.lock`. The wait for
    it counts against the build's timeout (before: a blocking flock, past any deadline), and
    the error names the holder; nothing of the new venv is kept."""
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_BUDGET_LOCK, str(root / BUDGET_LOCK)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    # Bounds the test on a plugin that waits without end: the holder dies after 60 s.
    ending = threading.Timer(60, kill, [holder])
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        while not stopped(holder.pid):
            time.sleep(0.05)
        monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, "100G")
        (project,) = project_variants(base_project, tmp_path, 1)
        ending.start()
        start = time.monotonic()
        with pytest.raises(UvSyncError) as info:
            ensure_venv(parse_spec({}), load_project(project), root=root, timeout=8)
        assert time.monotonic() - start < 30
    finally:
        ending.cancel()
        kill(holder)
    message = str(info.value)
    assert f"for the venv dir's budget lock {root / BUDGET_LOCK}, which pid {holder.pid}" in message
    assert "stopped or hung" in message and "kill -CONT" in message
    key = make_request(parse_spec({}), load_project(project), {}).key
    assert message.endswith(f"The new venv {key} was not kept.")
    assert not (root / key).exists() and counting_uv.syncs() == 1


def test_a_budget_lock_that_is_no_file_is_refused_by_its_name(tmp_path, monkeypatch) -> None:
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    os.mkfifo(root / BUDGET_LOCK)
    monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, "1G")
    with pytest.raises(UntrustedPathError, match="the budget lock"):
        budget.make_room(Venv(root, "0123456789abcdef"), print, time.monotonic() + 5)
