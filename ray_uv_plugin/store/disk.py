"""What venvs take on disk, walked once per inode: uv hardlinks installed files from its cache,
and venvs of the same project share most of them, so a file counts once, as `du` counts it.

Never follows a symlink and never raises on an entry that vanished or that we cannot read:
it is counted as far as we can see (the venv dir may be changing while we walk it).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ray_uv_plugin.settings import VENV_DIR_ENV
from ray_uv_plugin.store.layout import MARKER

Inode = tuple[int, int]  # (st_dev, st_ino)
# A write that found no room: no free block, or this user's disk quota used up.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(root: Path, what: str) -> str:
    """What a write under the venv dir `root` that failed with one of `NO_SPACE` says: `what`
    found no room (`while building <key>`, `with no room for the build lock <key>.lock`)."""
    free = shutil.disk_usage(root).free
    return (
        f"uv_project: the disk of the venv dir {root} is full ({free / 1024**2:.0f} MiB free, "
        f"or your disk quota is used up) {what}: free space (`ray-uv gc --max-size ...`), or "
        f"set {VENV_DIR_ENV} to a larger disk. Nothing half-built was kept."
    )


def walk(path: Path) -> Iterator[os.stat_result]:
    """The lstat of `path` and of everything below it."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    yield st
    stack = [str(path)] if stat.S_ISDIR(st.st_mode) else []
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    yield st
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
        except OSError:  # gone, or unreadable to us: counted as far as we can see
            continue


def venv_size(venv: Path) -> tuple[int, int]:
    """(bytes the venv's files hold, counting each inode once; bytes on disk, as `du` says)."""
    seen: set[Inode] = set()
    size = blocks = 0
    for st in walk(venv):
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        size += st.st_size if stat.S_ISREG(st.st_mode) else 0
        blocks += st.st_blocks * 512
    return size, blocks


@dataclass
class DiskUsage:
    """Bytes on disk per inode under each measured dir, so that hardlinks count once.

    `du -s DIR...` counts each inode once per invocation, at `st_blocks * 512` bytes,
    directories and symlinks included; so do these sums.
    """

    inodes: dict[Path, dict[Inode, int]] = field(default_factory=dict)

    def size(self, *paths: Path) -> int:
        """What `du -s -B1 PATHS...` would print as the total."""
        seen: dict[Inode, int] = {}
        for path in paths:
            seen.update(self.inodes.get(path, {}))
        return sum(seen.values())

    def freed(self, removed: Iterable[Path], kept: Iterable[Path]) -> int:
        """How much `du -s` of the whole venv dir drops when `removed` go and `kept` stay:
        inodes that a kept venv also links are still counted there."""
        still = set()
        for path in kept:
            still.update(self.inodes.get(path, {}))
        gone: dict[Inode, int] = {}
        for path in removed:
            gone.update(self.inodes.get(path, {}))
        return sum(size for inode, size in gone.items() if inode not in still)


def _walk_inodes(path: Path) -> dict[Inode, int]:
    return {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in walk(path)}


def _ready_stamp(path: Path) -> tuple[int, ...] | None:
    """What tells a ready venv apart from any other tree at `path`: its top dir's identity and
    last change, and its marker's inode; None unless it is a read-only dir with a marker (a
    venv is made read-only when its marker is written, and nothing changes it after)."""
    try:
        top, marker = os.lstat(path), os.lstat(path / MARKER)
    except OSError:
        return None
    if not stat.S_ISDIR(top.st_mode) or top.st_mode & 0o222:
        return None
    return top.st_dev, top.st_ino, top.st_ctime_ns, marker.st_ino


@dataclass
class ReadyTrees:
    """The inodes of ready venvs, walked once per process: `budget` measures the whole venv dir
    before each build, and walking every venv each time made a burst of builds quadratic.

    A ready venv is read-only and nothing of the plugin changes it; a rebuild, a receive or a
    removal gives a new top dir (another inode or ctime), which is walked again. What root
    changes inside a venv by hand (modes do not stop root) is not seen until then: the sizes
    are for a budget, never for deciding what is safe to remove. Kept compact (arrays, ~24
    bytes a file), and only for the venvs of the latest `measure`."""

    seen: dict[Path, tuple[tuple[int, ...], array, array, array]] = field(default_factory=dict)

    def inodes(self, path: Path) -> dict[Inode, int]:
        stamp = _ready_stamp(path)
        cached = self.seen.get(path)
        if stamp is not None and cached is not None and cached[0] == stamp:
            return dict(zip(zip(cached[1], cached[2], strict=True), cached[3], strict=True))
        inodes = _walk_inodes(path)
        if stamp is not None and _ready_stamp(path) == stamp:  # unchanged while walked
            devs, inos = array("Q", (d for d, _ in inodes)), array("Q", (i for _, i in inodes))
            self.seen[path] = (stamp, devs, inos, array("Q", inodes.values()))
        return inodes

    def keep_only(self, paths: Iterable[Path]) -> None:
        keep = set(paths)
        for path in [p for p in self.seen if p not in keep]:
            del self.seen[path]


def measure(paths: Iterable[Path], ready: ReadyTrees | None = None) -> DiskUsage:
    """The inodes under each path; with `ready`, ready venvs measured before are not walked."""
    usage = DiskUsage()
    for path in paths:
        usage.inodes[path] = ready.inodes(path) if ready else _walk_inodes(path)
    if ready is not None:
        ready.keep_only(usage.inodes)
    return usage
