"""`inventory` and `gc`: pure planning, du-exact sizes, /proc users, and removal under load."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_uv_plugin import gc, inventory
from ray_uv_plugin.inventory import BUILDING, INCOMPLETE, READY, VenvEntry
from ray_uv_plugin.project import load_project
from ray_uv_plugin.spec import parse_spec
from ray_uv_plugin.venv_cache import MARKER, ensure_venv, lock_path
from tests.uvproject import write_project

DAY = 86400.0
NOW = 1_000_000_000.0


def du_bytes(*paths: Path) -> int:
    """The total that real `du` prints for these paths in one invocation, in bytes."""
    out = subprocess.run(
        ["du", "-s", "-c", "-B1", *map(str, paths)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.strip().splitlines()[-1].split()[0])


# --- pure parts ------------------------------------------------------------------------------


def entry(key: str, days_idle: float, state: str = READY, users: tuple[int, ...] = ()) -> VenvEntry:
    meta = {"project": f"/p/{key}"} if state == READY else None
    return VenvEntry(key, Path(f"/v/{key}"), state, meta, NOW - days_idle * DAY, users)


def usage(sizes: dict[str, dict[int, int]]) -> inventory.DiskUsage:
    """Fake du data: venv key -> {inode: bytes}; the same inode in two venvs is a hardlink."""
    return inventory.DiskUsage(
        {Path(f"/v/{k}"): {(1, i): b for i, b in v.items()} for k, v in sizes.items()}
    )


def keys(decisions: list[gc.Decision]) -> list[str]:
    return [d.entry.key for d in decisions]


def test_plan_never_removes_used_or_building_venvs_and_always_removes_dead_builds() -> None:
    entries = [
        entry("inuse", 90, users=(41, 42)),
        entry("building", 90, state=BUILDING),
        entry("dead", 90, state=INCOMPLETE),
        entry("old", 10),
        entry("recent", 1),
        entry("justnow", 30 / DAY),  # 30 seconds ago: a worker may be starting in it
    ]
    remove, keep = gc.plan(entries, usage({}), NOW, older_than_days=0, max_size_bytes=None)
    assert keys(remove) == ["dead", "old", "recent"]
    reasons = {d.entry.key: d.reason for d in keep}
    assert reasons == {
        "inuse": "in use by pid 41, 42",
        "building": "being built",
        "justnow": "used 30s ago",
    }


def test_plan_without_limits_keeps_every_ready_venv() -> None:
    remove, keep = gc.plan([entry("a", 400), entry("b", 0.5)], usage({}), NOW)
    assert remove == [] and keys(keep) == ["a", "b"]


def test_plan_older_than() -> None:
    entries = [entry("a", 10), entry("b", 3), entry("c", 1)]
    remove, _ = gc.plan(entries, usage({}), NOW, older_than_days=2)
    assert keys(remove) == ["a", "b"]
    assert remove[0].reason == "unused for 10.0 days"


def test_plan_max_size_removes_least_recently_used_and_counts_shared_inodes_once() -> None:
    # a, b, c share inode 1 (ray, hardlinked from uv's cache): 100 bytes counted once.
    sizes = {"a": {1: 100, 2: 10}, "b": {1: 100, 3: 20}, "c": {1: 100, 4: 30}}
    entries = [entry("a", 5), entry("b", 4), entry("c", 3)]
    assert usage(sizes).size(*(e.path for e in entries)) == 160
    remove, keep = gc.plan(entries, usage(sizes), NOW, max_size_bytes=150)
    assert keys(remove) == ["a"]  # 160 -> 150: the oldest alone suffices, shared bytes stay
    assert keys(keep) == ["b", "c"]
    remove, _ = gc.plan(entries, usage(sizes), NOW, max_size_bytes=0)
    assert keys(remove) == ["a", "b", "c"]
    # In-use venvs count toward the size but are never picked.
    in_use = [entry("a", 5, users=(7,)), entry("b", 4), entry("c", 3)]
    remove, _ = gc.plan(in_use, usage(sizes), NOW, max_size_bytes=130)
    assert keys(remove) == ["b", "c"]


def test_freed_counts_only_inodes_no_kept_venv_links() -> None:
    u = usage({"a": {1: 100, 2: 10}, "b": {1: 100, 3: 20}})
    assert u.freed([Path("/v/a")], [Path("/v/b")]) == 10
    assert u.freed([Path("/v/a"), Path("/v/b")], []) == 130


def test_bad_limits_say_what_to_pass() -> None:
    with pytest.raises(gc.GcError, match="--older-than must be >= 0"):
        gc.check_limits(-1, None)
    with pytest.raises(gc.GcError, match="--max-size must be >= 0"):
        gc.check_limits(None, -2)


def test_formats() -> None:
    assert inventory.format_bytes(512) == "512B"
    assert inventory.format_bytes(3 * 1024**2 + 1024**2 // 2) == "3.5MiB"
    assert inventory.format_age(59) == "59s ago"
    assert inventory.format_age(3 * 86400 + 5) == "3d ago"


# --- file system and /proc, without uv ---------------------------------------------------------


def test_measure_matches_real_du_with_hardlinks_and_symlinks(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "sub").mkdir(parents=True)
    b.mkdir()
    (a / "big").write_bytes(os.urandom(300_000))
    (a / "sub" / "small").write_bytes(b"x" * 10)
    (a / "empty").touch()
    os.link(a / "big", a / "sub" / "big-again")  # hardlink inside a
    os.link(a / "big", b / "big-in-b")  # hardlink shared by a and b
    (b / "own").write_bytes(os.urandom(50_000))
    (b / "link").symlink_to(a / "big")
    u = inventory.measure([a, b])
    assert u.size(a) == du_bytes(a)
    assert u.size(b) == du_bytes(b)
    assert u.size(a, b) == du_bytes(a, b)
    assert u.freed([b], [a]) == du_bytes(a, b) - du_bytes(a)


def test_venv_users_sees_virtual_env_and_argv0(tmp_path: Path) -> None:
    venv = tmp_path / "0123456789abcdef"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    sleep = ["-c", "import time; time.sleep(60)"]
    by_env = subprocess.Popen(
        [sys.executable, *sleep], env={**os.environ, "VIRTUAL_ENV": str(venv)}
    )
    by_argv = subprocess.Popen(
        [str(venv / "bin" / "python"), *sleep],
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
    )
    try:
        time.sleep(0.3)
        users = inventory.venv_users()
        assert {by_env.pid, by_argv.pid} <= users[os.path.realpath(venv)]
    finally:
        by_env.kill()
        by_argv.kill()
        by_env.wait()
        by_argv.wait()
    assert os.path.realpath(venv) not in inventory.venv_users()


@pytest.fixture
def held_lock() -> Iterator[callable]:
    """Hold a file lock in another process, as a building raylet would."""
    procs: list[subprocess.Popen] = []

    def hold(path: Path) -> None:
        code = (
            "import sys, time; from filelock import FileLock\n"
            "lock = FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True)\n"
            "time.sleep(120)\n"
        )
        p = subprocess.Popen(
            [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert p.stdout.readline().strip() == "held"
        procs.append(p)

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def test_scan_states_and_leftovers(tmp_path: Path, held_lock) -> None:
    root = tmp_path
    ready, building, dead = "a" * 16, "b" * 16, "c" * 16
    for key in (ready, building, dead):
        (root / key / "bin").mkdir(parents=True)
    (root / ready / MARKER).write_text('{"project": "/p", "extras": ["x"], "groups": []}')
    lock_path(root, dead).touch()  # a lock file nobody holds: the build died
    held_lock(lock_path(root, building))
    (root / f"{'d' * 16}.gc-123").mkdir()  # an interrupted gc
    lock_path(root, "e" * 16).touch()  # lock of a venv that is gone
    (root / "not-a-venv").mkdir()
    states = {e.key: e.state for e in inventory.scan(root, users={})}
    assert states == {ready: READY, building: BUILDING, dead: INCOMPLETE}
    trash, locks = inventory.leftovers(root)
    assert [p.name for p in trash] == [f"{'d' * 16}.gc-123"]
    assert [p.name for p in locks] == [f"{'e' * 16}.lock"]
    report = gc.collect(root, older_than_days=0)
    assert keys(report.removed) == [dead]
    assert sorted(p.name for p in report.garbage) == [f"{'d' * 16}.gc-123", f"{'e' * 16}.lock"]
    assert sorted(os.listdir(root)) == sorted([ready, building, f"{building}.lock", "not-a-venv"])
    assert {d.entry.key: d.reason for d in report.kept}[building] == "being built"


# --- real venvs built by uv ------------------------------------------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(
        tmp_path_factory.mktemp("gcproj") / "p",
        extras={"six": ["six"], "ini": ["iniconfig"]},
    )


def build(project: Path, root: Path, *extras: str) -> Path:
    return ensure_venv(parse_spec({"extras": list(extras)}), load_project(project), root=root).path


def age_venv(venv: Path, days: float) -> None:
    t = time.time() - days * DAY
    os.utime(venv / MARKER, (t, t))


def test_gc_keeps_a_venv_in_use_and_frees_what_du_sees(project: Path, tmp_path: Path) -> None:
    root = tmp_path / "venvs"
    used, idle = build(project, root, "six"), build(project, root, "ini")
    age_venv(used, 30)
    age_venv(idle, 30)
    # A worker as the plugin starts it: the venv's python, VIRTUAL_ENV set.
    worker = subprocess.Popen(
        [
            str(used / "bin" / "python"),
            "-c",
            "import sys, six; print('up', flush=True); sys.stdin.readline()\n"
            "import ray; print(six.__version__, ray.__version__, flush=True)",
        ],
        env={**os.environ, "VIRTUAL_ENV": str(used)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "up"
        du_before = du_bytes(root)
        report = gc.collect(root, older_than_days=7)
        assert keys(report.removed) == [idle.name]
        assert {d.entry.key: d.reason for d in report.kept}[used.name].startswith("in use by pid")
        assert not idle.exists() and not lock_path(root, idle.name).exists()
        assert used.exists()
        assert report.freed_bytes == du_before - du_bytes(root) > 0
        # The worker goes on importing from its venv after gc.
        out, _ = worker.communicate("go\n", timeout=60)
        assert worker.returncode == 0 and len(out.split()) == 2
    finally:
        worker.kill()
        worker.wait()
    # No user left: now it goes, and du agrees again.
    du_before = du_bytes(root)
    report = gc.collect(root, older_than_days=7)
    assert keys(report.removed) == [used.name]
    assert report.freed_bytes == du_before - du_bytes(root)
    assert inventory.scan(root) == []


def test_dry_run_removes_nothing(project: Path, tmp_path: Path) -> None:
    root = tmp_path / "venvs"
    venv = build(project, root, "six")
    age_venv(venv, 30)
    report = gc.collect(root, older_than_days=1, dry_run=True)
    assert keys(report.removed) == [venv.name]
    assert report.freed_bytes == du_bytes(venv) > 0
    assert (venv / MARKER).exists()


def test_gc_does_not_touch_a_build_in_progress(project: Path, tmp_path: Path) -> None:
    """A real uv sync in another process holds the key's lock: gc keeps its dir, the build ends
    ready, and the venv works."""
    root = tmp_path / "venvs"
    code = (
        "import sys; from pathlib import Path\n"
        "from ray_uv_plugin.project import load_project\n"
        "from ray_uv_plugin.spec import parse_spec\n"
        "from ray_uv_plugin.venv_cache import ensure_venv\n"
        "o = ensure_venv(parse_spec({'extras': ['six', 'ini']}), load_project(Path(sys.argv[1])),"
        " root=Path(sys.argv[2]))\n"
        "print(o.path, o.built)\n"
    )
    builder = subprocess.Popen(
        [sys.executable, "-c", code, str(project), str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "UV_CONCURRENT_INSTALLS": "1"},
    )
    seen_building = []
    deadline = time.time() + 60
    while builder.poll() is None and time.time() < deadline:
        entries = inventory.scan(root)
        if any(e.state == BUILDING for e in entries):
            report = gc.collect(root, older_than_days=0)
            seen_building.append([d.reason for d in report.kept])
            assert report.removed == []
        time.sleep(0.05)
    out, _ = builder.communicate(timeout=120)
    assert builder.returncode == 0
    venv_path, built = out.split()
    assert built == "True"
    assert seen_building, "the build finished before gc could see it in progress"
    assert all(reasons == ["being built"] for reasons in seen_building)
    check = subprocess.run(
        [f"{venv_path}/bin/python", "-c", "import six, iniconfig"], capture_output=True
    )
    assert check.returncode == 0


def test_gc_racing_the_plugin_never_breaks_a_request(project: Path, tmp_path: Path) -> None:
    """gc --older-than 0 in a loop while another thread keeps asking for the venv: every
    request gets a venv (rebuilt when gc won), never an error, and nothing is left half-done."""
    root = tmp_path / "venvs"
    spec, files = parse_spec({"extras": ["six"]}), load_project(project)
    ensure_venv(spec, files, root=root)
    stop = threading.Event()
    errors: list[BaseException] = []
    builds = []

    def requests() -> None:
        while not stop.is_set():
            try:
                builds.append(ensure_venv(spec, files, root=root).built)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            time.sleep(random.uniform(0, 0.3))  # a busy venv is always "used just now"

    t = threading.Thread(target=requests)
    t.start()
    removed = 0
    deadline = time.time() + 10
    try:
        while time.time() < deadline:
            for e in inventory.scan(root):
                if e.state == READY:
                    age_venv(e.path, 1)
            removed += len(gc.collect(root, older_than_days=0).removed)
    finally:
        stop.set()
        t.join(timeout=120)
    assert errors == []
    assert removed >= 1 and sum(builds) >= 1  # the race did happen
    venv = ensure_venv(spec, files, root=root).path
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import six"]).returncode == 0
    assert [n for n in os.listdir(root) if ".gc-" in n] == []
