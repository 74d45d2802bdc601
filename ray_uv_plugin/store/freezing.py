"""A built venv made read-only (and immutable, as root), and undone to remove it.

Read-only directories, and the plugin's own files read-only (`freeze`), stop a worker that
changes a venv by accident, not root: a plugin run by root also sets chattr +i on the venv's
directories where the file system and the process's capabilities allow it. Every removal of
a venv (gc, a failed or replaced build, a receive that failed) goes through `remove_tree`,
which undoes both first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import sys
from collections.abc import Collection
from pathlib import Path

from ray_uv_plugin.store import tree

_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _set_immutable(directory: str, on: bool) -> bool:
    """chattr +i / -i on a directory: nobody, root included, can add, rename or remove an
    entry in it. Only root may set it, and not every file system has it (False then)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf, True)
        flags = int.from_bytes(buf, sys.byteorder)
        wanted = flags | _FS_IMMUTABLE_FL if on else flags & ~_FS_IMMUTABLE_FL
        if wanted != flags:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, wanted.to_bytes(4, sys.byteorder))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def freeze(venv: Path, own: Collection[str] = (), listed: tree.Tree | None = None) -> bool:
    """After a build: nobody but its owner may change anything, and its directories are
    read-only, so that a worker cannot add, replace or remove a file by accident. The top dir
    is left to the caller, which writes the marker into it first.

    Mode bits do not stop root, so a plugin run by root also makes every directory below the
    top one immutable (chattr +i) where the file system allows it; returns whether it did.
    (The top dir stays mutable for root: `gc` renames it before it deletes it.)
    uv's files keep their owner's write bit: uv hardlinks them from its cache, and a mode is per
    inode, so a chmod here would change the cache's file (and every venv's made from it). The
    plugin's own files, `own` (paths relative to `venv`: the bytecode a build compiled or a seed
    gave, every file a receiver wrote), lose every write bit: a seed's `.pyc` is hardlinked into
    the venvs seeded from it, and a write in place to it in one venv would change them all.
    (A manifest's mode, `manifest.file_mode`, has the owner's write bit whatever the file's.)
    `listed`: the venv's entries as its build listed them (`store.tree`), else listed now; the
    plugin's own top-level files written since are made without group or other write bits.
    """
    immutable = os.geteuid() == 0
    if listed is None:
        listed = tree.collect(venv)
    entries = list(listed.entries.items())
    for rel, st in entries:
        if stat.S_ISREG(st.st_mode):
            drop = 0o222 if rel in own else 0o022
            if st.st_mode & drop:
                os.chmod(listed.path(rel), stat.S_IMODE(st.st_mode) & ~drop)
    for rel, st in reversed(entries):  # a dir after what it holds
        if stat.S_ISDIR(st.st_mode):
            os.chmod(listed.path(rel), stat.S_IMODE(st.st_mode) & ~0o222)
            immutable = immutable and _set_immutable(listed.path(rel), True)
    return immutable


CAP_LINUX_IMMUTABLE = 9  # its bit in `CapEff:` of /proc/self/status


def can_change_immutable() -> bool:
    """Whether this process may set or clear chattr +i: root with CAP_LINUX_IMMUTABLE in its
    effective set, which container runtimes drop by default."""
    if os.geteuid() != 0:
        return False
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_LINUX_IMMUTABLE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def unfrozen_note() -> str:
    """What a venv that `freeze` could not make immutable (as root) still has, and the fix."""
    why = (
        "the file system of the venv dir has no immutable flag"
        if can_change_immutable()
        else "this process lacks CAP_LINUX_IMMUTABLE (containers drop it by default)"
    )
    return (
        f"not made immutable (chattr +i): {why}. What protects it still: read-only directories "
        "and files (against accidents, not against root), a venv dir only this user (or the "
        "trusted group) may write, and the check on every use (marker naming its key, "
        "interpreter and site-packages present), which rebuilds a venv that fails it. For "
        "chattr +i, grant the Ray container CAP_LINUX_IMMUTABLE "
        "(securityContext.capabilities.add)"
    )


def thaw(path: Path) -> None:
    """Undo `freeze` on a tree (never following symlinks), so that it can be removed."""
    for dirpath, _dirnames, _filenames in os.walk(path):
        if os.geteuid() == 0:
            _set_immutable(dirpath, False)
        try:
            os.chmod(dirpath, stat.S_IMODE(os.lstat(dirpath).st_mode) | stat.S_IRWXU)
        except FileNotFoundError:
            continue


def remove_tree(path: Path) -> None:
    """Remove a venv (frozen or half-built), never following a symlink out of it."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    thaw(path)
    shutil.rmtree(path)
