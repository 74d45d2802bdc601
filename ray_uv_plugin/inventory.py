"""What the venv dir holds: each venv's state, metadata, last use, disk usage and live users.

Read-only: `ray-uv list` shows it, `gc` decides from it. Everything here works from the file
system and `/proc` alone, so it sees venvs of every Ray session on the host, and of none.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from ray_uv_plugin.request import KEY_LENGTH
from ray_uv_plugin.venv_cache import MARKER, lock_path, read_marker

KEY_PATTERN = re.compile(rf"^[0-9a-f]{{{KEY_LENGTH}}}$")
# `gc` renames a venv to `<key>.gc-<pid>` before deleting it: a leftover is garbage.
TRASH_PATTERN = re.compile(rf"^[0-9a-f]{{{KEY_LENGTH}}}\.gc-\d+$")

READY = "ready"  # marker written: usable
BUILDING = "building"  # its lock is held: uv is (or a waiter is about to be) building it
INCOMPLETE = "incomplete"  # no marker and nobody holds the lock: a failed or killed build


@dataclass(frozen=True)
class VenvEntry:
    key: str
    path: Path
    state: str
    meta: Mapping | None
    last_used: float  # marker mtime (the plugin touches it on every reuse), else the dir's
    users: tuple[int, ...] = ()  # pids of live processes running in this venv

    @property
    def project(self) -> str:
        return str((self.meta or {}).get("project", "?"))

    @property
    def extras(self) -> list[str]:
        return list((self.meta or {}).get("extras", []))

    @property
    def groups(self) -> list[str]:
        return list((self.meta or {}).get("groups", []))


def lock_is_held(lock: Path) -> bool:
    """Whether some process holds this build lock now (a try with timeout 0, released at once)."""
    if not lock.exists():
        return False  # never create lock files for venvs nobody builds
    try:
        FileLock(lock, timeout=0).acquire().lock.release()
    except Timeout:
        return True
    return False


def _proc_entries(proc: Path) -> Iterable[tuple[int, Path]]:
    try:
        names = os.listdir(proc)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name), proc / name


def venv_users(proc: Path = Path("/proc")) -> dict[str, set[int]]:
    """Real path of a venv -> pids of the live processes that run in it.

    A process runs in a venv if its environment says `VIRTUAL_ENV=<venv>` (the plugin sets it
    for every worker) or its argv[0] is `<venv>/bin/python...` (Ray starts workers with the
    venv's interpreter). Processes we may not read are skipped: run `gc` as the user that runs
    Ray (or root) so that none are.
    """
    users: dict[str, set[int]] = {}
    for pid, pdir in _proc_entries(proc):
        venvs: set[str] = set()
        try:
            for item in (pdir / "environ").read_bytes().split(b"\0"):
                if item.startswith(b"VIRTUAL_ENV="):
                    venvs.add(os.fsdecode(item[len(b"VIRTUAL_ENV=") :]))
            argv0 = os.fsdecode((pdir / "cmdline").read_bytes().split(b"\0")[0])
        except OSError:
            continue
        exe = Path(argv0)
        if exe.name.startswith("python") and exe.parent.name == "bin":
            venvs.add(str(exe.parent.parent))  # not resolved: bin/python links out of the venv
        for venv in venvs:
            if venv:
                users.setdefault(os.path.realpath(venv), set()).add(pid)
    return users


def scan(root: Path, users: Mapping[str, set[int]] | None = None) -> list[VenvEntry]:
    """The venvs under `root`, oldest use first; `users` from `venv_users()` (scanned if None)."""
    if users is None:
        users = venv_users()
    entries = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    for name in names:
        path = root / name
        if not KEY_PATTERN.match(name) or not path.is_dir() or path.is_symlink():
            continue
        meta = read_marker(path)
        try:
            last_used = (path / MARKER).stat().st_mtime if meta else path.stat().st_mtime
        except FileNotFoundError:  # removed or finished while we looked
            continue
        if meta is not None:
            state = READY
        else:
            state = BUILDING if lock_is_held(lock_path(root, name)) else INCOMPLETE
        pids = tuple(sorted(users.get(os.path.realpath(path), ())))
        entries.append(VenvEntry(name, path, state, meta, last_used, pids))
    entries.sort(key=lambda e: e.last_used)
    return entries


def leftovers(root: Path) -> tuple[list[Path], list[Path]]:
    """Garbage that is no venv: trash dirs of an interrupted `gc`, and lock files whose venv is
    gone and whose lock nobody holds."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return [], []
    trash = [root / n for n in sorted(names) if TRASH_PATTERN.match(n)]
    locks = []
    for name in sorted(names):
        key = name.removesuffix(".lock")
        if name.endswith(".lock") and KEY_PATTERN.match(key) and not (root / key).exists():
            if not lock_is_held(root / name):
                locks.append(root / name)
    return trash, locks


@dataclass
class DiskUsage:
    """Bytes per inode under each measured dir, so that hardlinks count once, as `du` does.

    uv hardlinks installed files from its cache, and venvs of the same project share most of
    them. `du -s DIR...` counts each inode once per invocation, at `st_blocks * 512` bytes,
    directories and symlinks included; so do these sums.
    """

    inodes: dict[Path, dict[tuple[int, int], int]] = field(default_factory=dict)

    def size(self, *paths: Path) -> int:
        """What `du -s -B1 PATHS...` would print as the total."""
        seen: dict[tuple[int, int], int] = {}
        for path in paths:
            seen.update(self.inodes.get(path, {}))
        return sum(seen.values())

    def freed(self, removed: Iterable[Path], kept: Iterable[Path]) -> int:
        """How much `du -s` of the whole venv dir drops when `removed` go and `kept` stay:
        inodes that a kept venv also links are still counted there."""
        still = set()
        for path in kept:
            still.update(self.inodes.get(path, {}))
        gone: dict[tuple[int, int], int] = {}
        for path in removed:
            gone.update(self.inodes.get(path, {}))
        return sum(size for inode, size in gone.items() if inode not in still)


def _walk(path: Path, into: dict[tuple[int, int], int]) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    into[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    stack = [str(path)] if path.is_dir() and not path.is_symlink() else []
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    into[(st.st_dev, st.st_ino)] = st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except (FileNotFoundError, NotADirectoryError):
            continue


def measure(paths: Iterable[Path]) -> DiskUsage:
    usage = DiskUsage()
    for path in paths:
        usage.inodes[path] = {}
        _walk(path, usage.inodes[path])
    return usage


def format_bytes(n: float) -> str:
    """`412.0MiB`, the way uv prints sizes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_age(seconds_ago: float) -> str:
    """`12s ago`, `5m ago`, `3h ago`, `4d ago`."""
    s = max(0.0, seconds_ago)
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if s < limit:
            return f"{int(s // div)}{unit} ago"
    return f"{int(s // 86400)}d ago"


def age(entry: VenvEntry, now: float | None = None) -> float:
    return (time.time() if now is None else now) - entry.last_used
