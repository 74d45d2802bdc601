"""What venvs take on disk, walked once per inode: uv hardlinks installed files from its cache,
and venvs of the same project share most of them, so a file counts once, as `du` counts it.

Never follows a symlink and never raises on an entry that vanished or that we cannot read:
it is counted as far as we can see (the venv dir may be changing while we walk it).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

Inode = tuple[int, int]  # (st_dev, st_ino)


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


def measure(paths: Iterable[Path]) -> DiskUsage:
    usage = DiskUsage()
    for path in paths:
        usage.inodes[path] = {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in walk(path)}
    return usage
