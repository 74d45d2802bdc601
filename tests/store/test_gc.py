"""`inventory` and `gc`: pure planning, du-exact sizes, /proc users, and removal under load."""

from __future__ import annotations

import json
import os
import pwd
import random
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import packaging
import pytest

from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.settings import VenvDirError
from ray_uv_plugin.store import (
    build_lock,
    disk,
    freezing,
    gc,
    inventory,
    outcomes,
    processes,
    units,
)
from ray_uv_plugin.store.inventory import BUILDING, INCOMPLETE, READY, UNTRUSTED, VenvEntry
from ray_uv_plugin.store.layout import MARKER, MARKER_FORMAT, Venv
from tests.support.uvproject import write_project

DAY = 86400.0
NOW = 1_000_000_000.0
ROOT = Path(__file__).resolve().parents[2]
DEAD_PID = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids are below it: never alive


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


def usage(sizes: dict[str, dict[int, int]]) -> disk.DiskUsage:
    """Fake du data: venv key -> {inode: bytes}; the same inode in two venvs is a hardlink."""
    return disk.DiskUsage(
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


def test_plan_all_takes_every_unused_venv_and_dead_build_whatever_its_age() -> None:
    """`--all`: ready venvs of any age and dead builds at once; never one in use, being built,
    or used in the last minutes (a worker may be starting in it)."""
    entries = [
        entry("old", 400),
        entry("recent", 0.5),
        entry("justnow", 30 / DAY),
        entry("inuse", 90, users=(7,)),
        entry("building", 90, state=BUILDING),
        entry("dead", 0, state=INCOMPLETE),  # an hour would otherwise be waited for
    ]
    remove, keep = gc.plan(entries, usage({}), NOW, everything=True)
    assert keys(remove) == ["old", "recent", "dead"]
    assert keys(keep) == ["justnow", "inuse", "building"]
    with pytest.raises(gc.GcError, match="--all removes every venv of ours that nothing uses"):
        gc.check_limits(14, None, everything=True)


def test_plan_keeps_what_a_worker_may_use_where_this_user_cannot_see_every_process() -> None:
    """A blind spot (another user's processes, no /proc): ready venvs and what is left of one
    stay, with what to do; a dead build, which no worker was ever given, still goes."""
    note = "a built venv without its marker"
    remains = VenvEntry(
        "remains", Path("/r"), INCOMPLETE, None, NOW - 9 * DAY, (), note, frozen=True
    )
    entries = [entry("old", 30), remains, entry("dead", 1, state=INCOMPLETE)]
    remove, keep = gc.plan(
        entries, usage({}), NOW, older_than_days=7, blind_spot="3 processes of root"
    )
    assert keys(remove) == ["dead"]
    assert {d.entry.key: d.reason for d in keep} == {
        "old": "unused for 30.0 days, but may be in use by processes this user cannot see (3 "
        "processes of root): run gc as root, or pass --assume-unused",
        "remains": "a built venv without its marker, but may be in use by processes this user "
        "cannot see (3 processes of root): run gc as root, or pass --assume-unused",
    }
    no_proc = processes.processes(Path("/nonexistent/proc"))
    assert no_proc.blind_spot(Path("/")) == "/proc cannot be listed"
    assert processes.processes().blind_spot(Path("/")) is None  # root sees what can be seen


def test_formats() -> None:
    assert units.format_bytes(512) == "512B"
    assert units.format_bytes(3 * 1024**2 + 1024**2 // 2) == "3.5MiB"
    assert units.format_age(59) == "59s ago"
    assert units.format_age(3 * 86400 + 5) == "3d ago"


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
    u = disk.measure([a, b])
    assert u.size(a) == du_bytes(a)
    assert u.size(b) == du_bytes(b)
    assert u.size(a, b) == du_bytes(a, b)
    assert u.freed([b], [a]) == du_bytes(a, b) - du_bytes(a)


def test_venv_users_sees_the_plugins_variable_virtual_env_and_argv0(tmp_path: Path) -> None:
    venv = tmp_path / "0123456789abcdef"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    sleep = ["-c", "import time; time.sleep(60)"]
    plain = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "RAY_UV_PLUGIN_VENV")}
    # A Ray worker as the plugin starts it now: argv[0] `ray::Name`, RAY_UV_PLUGIN_VENV set.
    by_plugin = subprocess.Popen(
        ["ray::Worker", "60"],
        executable=shutil.which("sleep"),
        env={**plain, "RAY_UV_PLUGIN_VENV": str(venv)},
    )
    by_env = subprocess.Popen([sys.executable, *sleep], env={**plain, "VIRTUAL_ENV": str(venv)})
    by_argv = subprocess.Popen([str(venv / "bin" / "python"), *sleep], env=plain)
    procs = [by_plugin, by_env, by_argv]
    try:
        time.sleep(0.3)
        users = processes.venv_users()
        assert {p.pid for p in procs} <= users[os.path.realpath(venv)]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert os.path.realpath(venv) not in processes.venv_users()


@pytest.fixture
def held_lock() -> Iterator[Callable[[Path], None]]:
    """Hold a build lock in another process, as a building raylet would."""
    procs: list[subprocess.Popen] = []

    def hold(path: Path) -> None:
        code = (
            "import sys, time; from pathlib import Path\n"
            "from ray_uv_plugin.store.build_lock import BuildLock\n"
            "lock = BuildLock(Path(sys.argv[1])); assert lock.try_acquire()\n"
            "print('held', flush=True); time.sleep(120)\n"
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


def made_by_plugin(root: Path, key: str, marker: dict | None = None, hours: float = 2) -> Path:
    """What the plugin leaves, without uv: `<key>/pyvenv.cfg` as uv writes it, `<key>.lock`
    holding its last holder's pid, a marker naming the key if `marker`; unchanged for `hours`."""
    venv = root / key
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nuv = 0.13.9\nversion_info = 3.11.7\n")
    Venv(root, key).lock.write_text("4242 node-a\n")
    touched = [venv, Venv(root, key).lock]
    if marker is not None:
        Venv.at(venv).write_marker({"format": MARKER_FORMAT, "key": key, **marker})
        touched.append(venv / MARKER)
    t = time.time() - hours * 3600
    for path in touched:
        os.utime(path, (t, t))
    return venv


def test_scan_states_and_leftovers(tmp_path: Path, held_lock) -> None:
    root = tmp_path
    ready, building, dead, fresh = "a" * 16, "b" * 16, "c" * 16, "f" * 16
    made_by_plugin(root, ready, {"project": "/p", "extras": ["x"], "groups": []}, hours=0)
    made_by_plugin(root, building)
    held_lock(Venv(root, building).lock)
    made_by_plugin(root, dead)  # no marker, lock free, unchanged for 2 hours: the build died
    made_by_plugin(root, fresh, hours=0)  # the same, but just now
    trash = f"{'d' * 16}.gc-{DEAD_PID}"
    (root / trash).mkdir()  # an interrupted gc
    Venv(root, "e" * 16).lock.touch()  # lock of a venv that is gone
    (root / "not-a-venv").mkdir()
    inv = inventory.scan(root, users={})
    states = {e.key: e.state for e in inv.venvs}
    assert states == {ready: READY, building: BUILDING, dead: INCOMPLETE, fresh: INCOMPLETE}
    assert [p.name for p in inv.garbage] == [trash, f"{'e' * 16}.lock"]
    assert [o.path.name for o in inv.others] == ["not-a-venv"]
    report = gc.collect(root, older_than_days=0)
    assert keys(report.removed) == [dead]
    assert sorted(p.name for p in report.garbage) == [trash, f"{'e' * 16}.lock"]
    reasons = {d.entry.key: d.reason for d in report.kept}
    assert reasons[building] == "being built"
    assert reasons[fresh] == "unfinished build, changed 0s ago: may still be in use"
    assert reasons[ready] == "used 0s ago"
    assert sorted(os.listdir(root)) == sorted(
        [ready, f"{ready}.lock", building, f"{building}.lock", fresh, f"{fresh}.lock", "not-a-venv"]
    )


def test_a_build_that_ends_while_scanned_is_ready_not_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin writes the marker, then lets go of the lock: a scan that found no marker and
    then a free lock looks at the marker again instead of calling the venv a dead build."""
    key = "a" * 16
    venv = made_by_plugin(tmp_path, key)

    def build_ends(path: Path) -> bool:
        Venv.at(venv).write_marker({"format": MARKER_FORMAT, "key": key, "project": "/p"})
        return False

    monkeypatch.setattr(build_lock, "is_held", build_ends)
    assert [(e.key, e.state) for e in inventory.scan(tmp_path, users={}).venvs] == [(key, READY)]


def freeze_like_a_build(venv: Path) -> None:
    """Directories below the top one read-only, as `freezing.freeze` leaves them (without the
    immutable flag, which `rm -rf` by root then stops at)."""
    for dirpath, _dirnames, _filenames in os.walk(venv, topdown=False):
        if dirpath != str(venv):
            os.chmod(dirpath, 0o555)


def test_a_frozen_tree_without_marker_or_lock_is_ours_and_anything_less_is_not(
    tmp_path: Path,
) -> None:
    """What proves a key-named dir is ours once its marker, lock and pyvenv.cfg are gone: a
    `lib/` and every directory below the top read-only, of one owner (`inventory`)."""
    remains, writable, flat = "a" * 16, "b" * 16, "c" * 16
    for key in (remains, writable):
        (tmp_path / key / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
        (tmp_path / key / "bin").mkdir()
        freeze_like_a_build(tmp_path / key)
    (tmp_path / writable / "lib" / "python3.11").chmod(0o755)  # one writable dir is enough
    (tmp_path / flat).mkdir()  # no lib/: nothing to tell it from somebody's data
    (tmp_path / flat / "notes.txt").write_text("mine")
    inv = inventory.scan(tmp_path, users={})
    assert [(e.key, e.state, e.frozen, e.note) for e in inv.venvs] == [
        (remains, INCOMPLETE, True, "a built venv without its marker (partly removed by hand?)")
    ]
    assert sorted(o.path.name for o in inv.others) == [writable, flat]
    report = gc.collect(tmp_path, everything=True)
    assert keys(report.removed) == [remains]
    assert sorted(os.listdir(tmp_path)) == [writable, flat]


def test_gc_keeps_a_venv_that_a_ship_sender_is_reading(tmp_path: Path) -> None:
    """A ship sender holds the key's lock shared while it packs the venv: gc's exclusive try
    fails, and it says why."""
    venv = made_by_plugin(tmp_path, "a" * 16, {"project": "/p"}, hours=999)
    code = (
        "import fcntl, sys, time\n"
        "f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH); print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    sender = subprocess.Popen(
        [sys.executable, "-c", code, str(Venv(tmp_path, venv.name).lock)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout.readline().strip() == "held"
        for dry_run in (True, False):
            report = gc.collect(tmp_path, older_than_days=0, dry_run=dry_run)
            assert report.removed == []
            assert [d.reason for d in report.kept] == ["in use (being sent to another node)"]
    finally:
        sender.kill()
        sender.wait()
    assert venv.exists()


def test_gc_leaves_lock_files_that_are_not_the_plugins_alone(tmp_path: Path) -> None:
    """Named like a build lock, but somebody's file: other content, or a hard link of a file
    elsewhere. gc neither removes nor truncates it, nor the venv beside it; a lock of the
    plugin's form (`pid host`, or empty) whose venv is gone still goes."""
    notes = tmp_path / "0123456789abcdef.lock"
    notes.write_text("my notes, not a lock\n")
    precious = tmp_path / "precious.txt"
    precious.write_text("precious data\n")
    venv = made_by_plugin(tmp_path, "a" * 16, {"project": "/p"}, hours=999)
    Venv(tmp_path, venv.name).lock.unlink()
    os.link(precious, Venv(tmp_path, venv.name).lock)
    orphans = [Venv(tmp_path, "b" * 16).lock, Venv(tmp_path, "c" * 16).lock]
    orphans[0].write_text("4242 node-a\n")
    orphans[1].touch()
    for dry_run in (True, False):
        report = gc.collect(tmp_path, older_than_days=0, dry_run=dry_run)
        assert report.removed == [] and report.garbage == orphans
        assert {o.path.name: o.why for o in report.others} == {
            notes.name: "named like a build lock but not the plugin's: it holds something else "
            "than the `pid host` a build writes",
            "precious.txt": "not named like a venv (16 hex digits)",
        }
        assert [d.reason for d in report.kept] == [
            f"{venv.name}.lock is not the plugin's build lock (it has 2 hard links): left alone"
        ]
    assert notes.read_text() == "my notes, not a lock\n"
    assert precious.read_text() == "precious data\n" and venv.exists()
    assert not any(p.exists() for p in orphans)


def snapshot(*dirs: Path) -> dict[str, object]:
    """Every path under `dirs` with its type, owner, mode and content (or link target)."""
    seen: dict[str, object] = {}
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(d):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    content: object = os.readlink(path)
                elif stat.S_ISREG(st.st_mode):
                    content = Path(path).read_bytes()
                else:
                    content = None
                seen[path] = (st.st_mode, st.st_uid, content)
    return seen


def test_gc_leaves_what_is_not_ours_alone(tmp_path: Path) -> None:
    """A venv dir set by mistake to a dir of other things: gc removes nothing that is not
    provably a venv of the plugin, follows no symlink, and says why it left each thing."""
    root, outside = tmp_path / "venvs", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "experiment.csv").write_text("run,loss\n1,0.3\n")
    data = root / "0123456789abcdef"  # named like a key: no pyvenv.cfg, no lock
    data.mkdir()
    (data / "results.txt").write_text("keep me")
    victim = made_by_plugin(outside, "1" * 16)  # looks like ours, but outside the venv dir
    (root / ("1" * 16)).symlink_to(victim)
    (outside / "precious.txt").write_text("keep me too")
    (root / f"{'2' * 16}.lock").symlink_to(outside / "precious.txt")
    (root / f"{'3' * 16}.gc-{DEAD_PID}").symlink_to(victim)
    made_by_plugin(root, "4" * 16)
    Venv(root, "4" * 16).lock.unlink()  # made by uv, but not by the plugin
    made_by_plugin(root, "5" * 16)
    (root / ("5" * 16) / "pyvenv.cfg").write_text("home = /usr/bin\n")  # not by uv
    writable = made_by_plugin(root, "6" * 16, {"project": "/p"}, hours=999)
    writable.chmod(0o777)  # anybody could have put anything in it
    (root / f"{'9' * 16}.lock").mkdir()
    os.mkfifo(root / f"{'a' * 16}.lock")  # opening a FIFO would block: never opened
    (root / ("b" * 16)).mkdir()
    os.mkfifo(root / f"{'b' * 16}.lock")
    made_by_plugin(root, "c" * 16)
    (root / ("c" * 16) / "pyvenv.cfg").unlink()
    os.mkfifo(root / ("c" * 16) / "pyvenv.cfg")
    foreign = None
    if os.geteuid() == 0:
        foreign = made_by_plugin(root, "7" * 16, {"project": "/p"}, hours=999)
        for path in (foreign, foreign / MARKER, Venv(root, foreign.name).lock):
            os.chown(path, 65534, 65534, follow_symlinks=False)
        (root / f"{'8' * 16}.lock").touch()
        os.chown(root / f"{'8' * 16}.lock", 65534, 65534)
    for path in (data, root / "experiment.csv"):
        os.utime(path, (0, 0))  # ages old enough for anything
    before = snapshot(root, outside)
    report = gc.collect(root, older_than_days=0)
    assert report.removed == [] and report.garbage == []
    assert snapshot(root, outside) == before
    others = {o.path.name: o.why for o in report.others}
    assert others["experiment.csv"] == "not named like a venv (16 hex digits)"
    assert others[data.name] == (
        "named like a venv, no marker, and no build lock 0123456789abcdef.lock of the plugin "
        "beside it"
    )
    assert others["1" * 16] == "named like a venv but a symlink (never followed)"
    assert others[f"{'2' * 16}.lock"] == "named like a build lock but a symlink (never followed)"
    assert others[f"{'3' * 16}.gc-{DEAD_PID}"] == (
        "named like a gc's trash but a symlink (never followed)"
    )
    assert others["4" * 16].endswith(f"no build lock {'4' * 16}.lock of the plugin beside it")
    assert others["5" * 16].endswith("it has no pyvenv.cfg written by uv")
    assert others[f"{'9' * 16}.lock"] == "named like a build lock but a directory"
    assert others[f"{'a' * 16}.lock"] == "named like a build lock but not a regular file"
    assert others["b" * 16].endswith(f"{'b' * 16}.lock is not a regular file")
    assert others["c" * 16].endswith("it has no pyvenv.cfg written by uv")
    kept = {d.entry.key: d.reason for d in report.kept}
    assert kept["6" * 16].startswith("untrusted, left alone: others can write it (owner ")
    if foreign is not None:
        assert kept["7" * 16].startswith(
            "untrusted, left alone: it is owned by another user (owner nobody (uid 65534)"
        )
        assert others[f"{'8' * 16}.lock"].startswith("untrusted: it is owned by another user")
    assert all(e.state == UNTRUSTED for e in inventory.scan(root).venvs)


def test_gc_refuses_a_venv_dir_of_slash_or_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    made_by_plugin(home, "0123456789abcdef")  # what an old gc would take for a dead build
    monkeypatch.setenv("HOME", str(home))
    before = snapshot(tmp_path)
    with pytest.raises(VenvDirError, match=rf"the venv dir {home} is your home \({home}\)"):
        gc.collect(home, older_than_days=0)
    with pytest.raises(VenvDirError, match=f"the venv dir {tmp_path} is above your home"):
        gc.collect(tmp_path, older_than_days=0)
    with pytest.raises(VenvDirError, match="the venv dir / is above your home"):
        gc.collect(Path("/"), older_than_days=0, dry_run=True)
    with pytest.raises(VenvDirError, match="is your home"):  # the account's, whatever HOME says
        gc.collect(Path(pwd.getpwuid(os.geteuid()).pw_dir), older_than_days=0, dry_run=True)
    with pytest.raises(VenvDirError, match="is your home"):
        inventory.check_venv_dir(home / ".." / "home", "list")
    assert snapshot(tmp_path) == before


def test_gc_refuses_a_venv_dir_of_another_user(tmp_path: Path) -> None:
    """The venv dir's owner is not the invoker (here: root running gc on nobody's dir)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    theirs = tmp_path / "theirs"
    made_by_plugin(theirs, "a" * 16, {"project": "/p"}, hours=999)
    os.chown(theirs, 65534, 65534)
    before = snapshot(theirs)
    with pytest.raises(VenvDirError) as e:
        gc.collect(theirs, older_than_days=0)
    assert str(e.value) == (
        f"the venv dir {theirs} belongs to nobody (uid 65534), not to you, root (uid 0): its "
        "venvs are that user's to list and remove: run `ray-uv gc` as that user, e.g. "
        "`sudo -u nobody ray-uv gc`."
    )
    with pytest.raises(VenvDirError, match="`sudo -u nobody ray-uv list`"):
        inventory.check_venv_dir(theirs, "list")
    assert snapshot(theirs) == before


def test_trash_is_garbage_only_once_its_gc_is_gone(tmp_path: Path, held_lock) -> None:
    """Another gc may be putting its trash back: trash goes only when that gc's pid is dead and
    nobody holds the key's lock."""
    root = tmp_path
    live = subprocess.Popen(["sleep", "60"])
    try:
        running = root / f"{'a' * 16}.gc-{live.pid}"
        locked = root / f"{'b' * 16}.gc-{DEAD_PID}"
        dead = root / f"{'c' * 16}.gc-{DEAD_PID}"
        for trash in (running, locked, dead):
            (trash / "lib" / "site").mkdir(parents=True)
            (trash / "lib" / "site" / "mod.py").write_text("x = 1\n")
            (trash / "lib" / "site").chmod(0o555)  # venvs are read-only once built
            (trash / "lib").chmod(0o555)
        held_lock(Venv(root, "b" * 16).lock)
        report = gc.collect(root)
        assert report.garbage == [dead]
        assert {o.path: o.why for o in report.leftovers} == {
            running: f"trash of gc pid {live.pid}, still running",
            locked: "its key's build lock is held",
        }
        assert sorted(os.listdir(root)) == sorted([running.name, locked.name, f"{'b' * 16}.lock"])
    finally:
        live.kill()
        live.wait()


def test_a_dead_receivers_unpack_dir_is_garbage_once_its_lock_is_free(
    tmp_path: Path, held_lock
) -> None:
    """`<key>.ship-XXXX`: a venv being received from another node (`ship`), under its key's
    lock; what a receiver that died left is removed by gc, a running receive is not."""
    root = tmp_path
    receiving = root / f"{'a' * 16}.ship-k2j4_x"
    dead = root / f"{'b' * 16}.ship-9qz1ab"
    for tree in (receiving, dead):
        (tree / "bin").mkdir(parents=True)
        (tree / "bin").chmod(0o555)
    held_lock(Venv(root, "a" * 16).lock)
    report = gc.collect(root)
    assert report.garbage == [dead]
    assert {o.path: o.why for o in report.leftovers} == {receiving: "its key's build lock is held"}
    assert sorted(os.listdir(root)) == sorted([receiving.name, f"{'a' * 16}.lock"])


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
    # A worker as the plugin starts it: the venv's python, RAY_UV_PLUGIN_VENV set.
    worker = subprocess.Popen(
        [
            str(used / "bin" / "python"),
            "-c",
            "import sys, six; print('up', flush=True); sys.stdin.readline()\n"
            "import ray; print(six.__version__, ray.__version__, flush=True)",
        ],
        env={**os.environ, "RAY_UV_PLUGIN_VENV": str(used)},
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
        assert not idle.exists() and not Venv(root, idle.name).lock.exists()
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
    assert inventory.scan(root).venvs == []


def test_dry_run_removes_nothing(project: Path, tmp_path: Path) -> None:
    root = tmp_path / "venvs"
    venv = build(project, root, "six")
    age_venv(venv, 30)
    report = gc.collect(root, older_than_days=1, dry_run=True)
    assert keys(report.removed) == [venv.name]
    assert report.freed_bytes == du_bytes(venv, Venv(root, venv.name).lock) > 0
    assert (venv / MARKER).exists()


def test_gc_does_not_touch_a_build_in_progress(project: Path, tmp_path: Path) -> None:
    """A real uv sync in another process holds the key's lock: gc keeps its dir, the build ends
    ready, and the venv works."""
    root = tmp_path / "venvs"
    code = (
        "import sys; from pathlib import Path\n"
        "from ray_uv_plugin.env.project import load_project\n"
        "from ray_uv_plugin.env.spec import parse_spec\n"
        "from ray_uv_plugin.building.ensure import ensure_venv\n"
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
        entries = inventory.scan(root).venvs
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
    # Each gc saw it being built, or (the build ended between the two scans) just made.
    assert ["being built"] in seen_building, seen_building
    assert all(r in (["being built"], ["used 0s ago"]) for r in seen_building), seen_building
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
    start = time.time()  # 10 s of racing, longer on a loaded machine until gc won once
    try:
        while time.time() < start + 10 or (removed == 0 and time.time() < start + 120):
            for e in inventory.scan(root).venvs:
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


def kill_build(venv: Path, hours: float = 0) -> None:
    """Make a built venv look like a build killed before its marker, `hours` ago: never
    frozen, so its directories are writable."""
    freezing.thaw(venv)
    (venv / MARKER).unlink(missing_ok=True)
    t = time.time() - hours * 3600
    for path in (venv, Venv(venv.parent, venv.name).lock):
        if path.exists():
            os.utime(path, (t, t))


def test_a_dead_build_goes_only_once_old_and_only_if_the_plugin_made_it(
    project: Path, tmp_path: Path
) -> None:
    root = tmp_path / "venvs"
    dead, orphan = build(project, root, "six"), build(project, root, "ini")
    kill_build(dead)
    kill_build(orphan)
    Venv(root, orphan.name).lock.unlink()  # made by uv, but nothing says the plugin made it
    report = gc.collect(root)
    assert report.removed == []
    assert {d.entry.key: d.reason for d in report.kept} == {
        dead.name: "unfinished build, changed 0s ago: may still be in use"
    }
    assert [o.path for o in report.others] == [orphan]
    kill_build(dead, hours=2)  # no marker, lock free, unchanged for longer than a build runs
    os.utime(orphan, (0, 0))
    du_before = du_bytes(root)
    report = gc.collect(root)
    assert [(d.entry.key, d.reason) for d in report.removed] == [(dead.name, "unfinished build")]
    assert not dead.exists() and not Venv(root, dead.name).lock.exists()
    assert report.freed_bytes == du_before - du_bytes(root) > 0
    assert (orphan / "pyvenv.cfg").exists() and [o.path for o in report.others] == [orphan]


RAY_UV = str(Path(sys.executable).parent / "ray-uv")  # what `uv run ray-uv` runs


def test_gc_all_removes_what_rm_rf_by_root_leaves_of_a_venv(project: Path, tmp_path: Path) -> None:
    """A venv built by root is immutable below its top dir: `rm -rf` by hand deletes its lock,
    marker and top-level files and stops there. gc knows what is left as ours (frozen as only a
    build leaves a tree) and `ray-uv gc --all` removes it, then nothing is left."""
    if os.geteuid() != 0:
        pytest.skip("only a venv built by root is made immutable")
    root = tmp_path / "venvs"
    venv = build(project, root, "six")
    if not json.loads((venv / MARKER).read_text())["immutable"]:
        pytest.skip("this file system has no immutable flag")
    by_hand = subprocess.run(["rm", "-rf", str(venv), str(Venv(root, venv.name).lock)])
    assert by_hand.returncode != 0 and venv.exists()
    assert not (venv / MARKER).exists() and not Venv(root, venv.name).lock.exists()
    report = gc.collect(root)  # without --all, as any dead build: after an hour
    assert report.removed == [] and report.others == []
    assert [d.reason for d in report.kept] == [
        "a built venv without its marker (partly removed by hand?), changed 0s ago: may still "
        "be in use"
    ]
    env = {**os.environ, "RAY_UV_PLUGIN_VENV_DIR": str(root)}
    dry = subprocess.run(
        [RAY_UV, "gc", "--all", "--dry-run"], env=env, capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(
        f"Would remove {venv.name}: a built venv without its marker (partly removed by hand?)\n"
    )
    out = subprocess.run([RAY_UV, "gc", "--all"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        f"Removed {venv.name}: a built venv without its marker (partly removed by hand?)\n"
    )
    assert os.listdir(root) == [outcomes.OUTCOMES]  # the setups' count stays


# --- a second Unix user ----------------------------------------------------------------------


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """A directory every user can traverse (tmp_path is root's alone), with a copy of the code
    a second user runs: ray_uv_plugin and its one dependency that list and gc import."""
    base = Path(tempfile.mkdtemp(prefix="ray-uv-user-", dir="/tmp"))
    try:
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / "ray_uv_plugin", base / "lib" / "ray_uv_plugin", ignore=ignore)
        shutil.copytree(Path(packaging.__file__).parent, base / "lib" / "packaging", ignore=ignore)
        for dirpath, _dirnames, filenames in os.walk(base):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o644)
        yield base
    finally:
        shutil.rmtree(base)


CLI = "import sys; from ray_uv_plugin.ops.cli import main; sys.exit(main(sys.argv[1:]))"


def as_user(
    user: tuple[str, int, int], base: Path, env: dict[str, str], *args: str, code: str = CLI
):
    """`ray-uv args` (or Python `code` with `args`) run as `user` (conftest's `other_user`), with
    a Python it can run (root's may be under /root, which only root may enter)."""
    if not shutil.which("runuser"):
        pytest.skip("needs runuser to run a command as another user")
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        command = [
            "runuser", "-u", user[0], "--", "/usr/bin/env", "-i", "PATH=/usr/bin:/bin",
            f"HOME={base}", f"PYTHONPATH={base / 'lib'}", "PYTHONDONTWRITEBYTECODE=1",
            *(f"{k}={v}" for k, v in env.items()), python, "-c",
        ]  # fmt: skip
        probe = "import sys; assert sys.version_info >= (3, 11)"
        if subprocess.run([*command, probe], cwd=base, capture_output=True).returncode == 0:
            return subprocess.run(
                [*command, code, *args], cwd=base, capture_output=True, text=True, timeout=120
            )
    pytest.skip(f"no Python >= 3.11 that {user[0]} may run")


def chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


def test_another_user_cannot_gc_roots_venv_dir(other_user, user_dir: Path) -> None:
    """Another user runs `ray-uv gc`/`list` on root's venv dir: a clear refusal that names the
    owner, no traceback, nothing removed."""
    root = user_dir / "venvs"
    made_by_plugin(root, "a" * 16, {"project": "/p"}, hours=999)
    made_by_plugin(root, "b" * 16)  # a dead build
    root.chmod(0o755)
    before = snapshot(root)
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
    for command in (["gc", "--older-than", "0"], ["list", "--json"]):
        out = as_user(other_user, user_dir, env, *command)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        assert out.stderr == (
            f"error: the venv dir {root} belongs to root (uid 0), not to you, {other_user[0]} "
            f"(uid {other_user[1]}): its venvs are that user's to list and remove: run "
            f"`ray-uv {command[0]}` as that user, e.g. `sudo -u root ray-uv {command[0]}`.\n"
        )
    assert snapshot(root) == before


def test_a_read_only_member_of_the_trusted_group_lists_without_crashing(
    other_user, user_dir: Path
) -> None:
    """A venv dir shared with a trusted group that the user may read but not write (lock files
    it cannot open): `list` reports, `gc` keeps what it cannot check or does not own."""
    root = user_dir / "shared"
    made_by_plugin(root, "a" * 16, {"project": "/p"}, hours=999)
    made_by_plugin(root, "b" * 16)  # no marker, and a lock the user cannot open
    gid = other_user[2]
    chown_tree(root, 0, gid)
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o2750)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o640)
    for key in ("a" * 16, "b" * 16):
        Venv(root, key).lock.chmod(0o600)
    before = snapshot(root)
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root), "RAY_UV_PLUGIN_TRUSTED_GROUP": str(gid)}
    out = as_user(other_user, user_dir, env, "list", "--json")
    assert out.returncode == 0, out.stderr
    states = {v["key"]: (v["state"], v["note"]) for v in json.loads(out.stdout)["venvs"]}
    assert states == {
        "a" * 16: ("ready", None),
        "b" * 16: ("building", "its build lock cannot be checked: maybe being built"),
    }
    out = as_user(other_user, user_dir, env, "gc", "--older-than", "0")
    assert out.returncode == 0, out.stderr
    assert f"Kept {'a' * 16} (/p): owned by root: run gc as that user" in out.stdout
    assert f"Kept {'b' * 16}: its build lock cannot be checked: maybe being built" in out.stdout
    assert snapshot(root) == before


def test_a_user_removes_its_own_read_only_venvs(other_user, user_dir: Path) -> None:
    """Built venvs are read-only (no write bits on their dirs): a user who is not root can
    still remove its own, and the trash of its own gc that died midway."""
    root = user_dir / "mine"
    venv = made_by_plugin(root, "a" * 16, {"project": "/p"}, hours=999)
    trash = root / f"{'b' * 16}.gc-{DEAD_PID}"
    for top in (venv, trash):
        (top / "lib" / "site").mkdir(parents=True)
        (top / "lib" / "site" / "mod.py").write_text("x = 1\n")
    chown_tree(root, other_user[1], other_user[2])
    for top in (venv, trash):
        for sub in (top / "lib" / "site", top / "lib", top):
            sub.chmod(0o555)
    os.utime(venv / MARKER, (0, 0))
    root.chmod(0o700)
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
    out = as_user(other_user, user_dir, env, "gc", "--older-than", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Removed {venv.name} (/p): unused for" in out.stdout
    assert f"Removed leftover {trash.name}" in out.stdout
    assert os.listdir(root) == []


def shared_venv_dir(base: Path, gid: int, mode: int = 0o2770) -> Path:
    """A venv dir of root shared with the trusted group `gid`, as `trust.make_root` makes one
    (`mode` 0o3770: sticky as well, so that members may remove only their own entries)."""
    root = base / "shared"
    root.mkdir()
    os.chown(root, 0, gid)
    root.chmod(mode)
    return root


def member_venv(root: Path, key: str, owner: tuple[int, int], days_idle: float) -> Path:
    """A ready venv as `freezing.freeze` and `write_marker` leave it for the plugin's checks (a
    site-packages dir, a bin/python), group-readable, marker and lock unused for `days_idle`."""
    venv = made_by_plugin(root, key, {"project": "/p", "site_packages": "lib/site-packages"})
    (venv / "lib" / "site-packages").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to("/bin/sh")
    chown_tree(venv, *owner)
    os.chown(Venv(root, key).lock, *owner)
    Venv(root, key).lock.chmod(0o660)
    t = time.time() - days_idle * DAY
    for path in (venv / MARKER, Venv(root, key).lock):
        os.utime(path, (t, t))
    return venv


def test_a_members_reuse_of_roots_venv_is_a_use_that_gc_sees(
    other_user, user_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a trusted-group venv dir a member may not touch root's marker; its reuse refreshes
    the group-writable lock file instead, and gc counts the later of the two."""
    gid = other_user[2]
    root = shared_venv_dir(user_dir, gid)
    venv = member_venv(root, "a" * 16, (0, gid), days_idle=30)
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root), "RAY_UV_PLUGIN_TRUSTED_GROUP": str(gid)}
    reuse = (
        "import sys; from pathlib import Path; from ray_uv_plugin.store.layout import Venv\n"
        "print(bool(Venv(Path(sys.argv[1]), sys.argv[2]).check_ready()))"
    )
    out = as_user(other_user, user_dir, env, str(root), venv.name, code=reuse)
    assert out.stdout == "True\n", out.stderr  # ready, and used
    assert time.time() - os.lstat(venv / MARKER).st_mtime > 29 * DAY  # root's: not touched
    monkeypatch.setenv("RAY_UV_PLUGIN_TRUSTED_GROUP", str(gid))
    (ready,) = inventory.scan(root, users={}).venvs
    assert time.time() - ready.last_used < 60
    report = gc.collect(root, older_than_days=1)
    assert report.removed == [] and venv.exists()
    # Used seconds ago (gc's clock reads a moment after this test's: the count may differ).
    assert [d.entry.path for d in report.kept] == [venv]
    assert all(re.fullmatch(r"used \d+s ago", d.reason) for d in report.kept), report.kept


def test_a_member_keeps_a_venv_that_a_process_of_root_runs_in(
    other_user, user_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member cannot read root's /proc entries: its gc keeps a venv that a worker may use,
    says why and what to do, and removes it only when told `--assume-unused`."""
    gid = other_user[2]
    root = shared_venv_dir(user_dir, gid)
    venv = member_venv(root, "a" * 16, other_user[1:], days_idle=30)
    worker = subprocess.Popen(["sleep", "120"], env={**os.environ, "RAY_UV_PLUGIN_VENV": str(venv)})
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root), "RAY_UV_PLUGIN_TRUSTED_GROUP": str(gid)}
    try:
        for dry_run in ([], ["--dry-run"]):
            out = as_user(other_user, user_dir, env, "gc", "--older-than", "0", *dry_run)
            assert out.returncode == 0, out.stderr
            assert re.search(
                rf"^Kept {venv.name} \(/p\): unused for 30.0 days, but may be in use by "
                r"processes this user cannot see \(\d+ process(es)? of root\): run gc as root, "
                r"or pass --assume-unused$",
                out.stdout,
                re.MULTILINE,
            ), out.stdout
        assert venv.exists()
        monkeypatch.setenv("RAY_UV_PLUGIN_TRUSTED_GROUP", str(gid))
        as_root = gc.collect(root, older_than_days=0, dry_run=True)  # root sees it
        assert [d.reason for d in as_root.kept] == [f"in use by pid {worker.pid}"]
    finally:
        worker.kill()
        worker.wait()
    # Root, who sees every process, may remove a member's venv (the advice above).
    assert keys(gc.collect(root, older_than_days=0, dry_run=True).removed) == [venv.name]
    out = as_user(other_user, user_dir, env, "gc", "--older-than", "0", "--assume-unused")
    assert f"Removed {venv.name} (/p): unused for 30.0 days" in out.stdout, out.stdout + out.stderr
    assert not venv.exists()


def test_a_dry_run_promises_only_what_the_real_run_does(other_user, user_dir: Path) -> None:
    """A member's gc in a sticky trusted-group venv dir: root's lock files may not be removed
    by the member, nor an immutable tree by anyone but root. The dry run says so, as the real
    run then does, and the real run removes exactly what the dry run promised."""
    uid, gid = other_user[1:]
    root = shared_venv_dir(user_dir, gid, mode=0o3770)
    roots_lock = member_venv(root, "a" * 16, (uid, gid), days_idle=30)
    os.chown(Venv(root, roots_lock.name).lock, 0, gid)
    immutable = member_venv(root, "b" * 16, (uid, gid), days_idle=30)
    mine = member_venv(root, "c" * 16, (uid, gid), days_idle=30)
    orphans = {Venv(root, "d" * 16).lock: (0, gid), Venv(root, "e" * 16).lock: (uid, gid)}
    for orphan, owner in orphans.items():
        orphan.write_text("4242 node-a\n")
        os.chown(orphan, *owner)
        orphan.chmod(0o660)
    if subprocess.run(["chattr", "+i", str(immutable / "lib")], capture_output=True).returncode:
        pytest.skip("this file system has no immutable flag")
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root), "RAY_UV_PLUGIN_TRUSTED_GROUP": str(gid)}
    args = ["gc", "--older-than", "0", "--assume-unused"]
    try:
        dry = as_user(other_user, user_dir, env, *args, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        real = as_user(other_user, user_dir, env, *args)
        assert real.returncode == 0, real.stderr
    finally:
        subprocess.run(["chattr", "-i", str(immutable / "lib")], check=True)
    promised = dry.stdout.replace("Would remove ", "Removed ").replace("Would free ", "Freed ")
    assert real.stdout == promised
    sticky = (
        "and the venv dir is sticky (only an entry's owner may remove it): run gc as that "
        "user or as root"
    )
    assert real.stdout.splitlines()[:5] == [
        f"Removed {mine.name} (/p): unused for 30.0 days",
        f"Kept {roots_lock.name} (/p): {roots_lock.name}.lock belongs to root {sticky}",
        f"Kept {immutable.name} (/p): {immutable / 'lib'} is immutable (chattr +i), which only "
        "root can undo: run gc as root",
        f"Removed leftover {'e' * 16}.lock",
        f"Kept leftover {'d' * 16}.lock: {'d' * 16}.lock belongs to root {sticky}",
    ]
    assert sorted(os.listdir(root)) == sorted(
        [
            roots_lock.name,
            f"{roots_lock.name}.lock",
            immutable.name,
            f"{immutable.name}.lock",
            f"{'d' * 16}.lock",
        ]
    )
