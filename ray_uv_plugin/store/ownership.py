"""What proves that an entry of the venv dir is the plugin's, so that `gc` may remove it.

A key-named directory without a (valid) marker is ours, in a venv dir that
the trust rules already make private to this user (or the trusted group): uv's `pyvenv.cfg`
in it and the plugin's `<key>.lock` beside it, or, once those are gone (`rm -rf` by root
deletes them and stops at the directories `freezing.freeze` made immutable), the state that only
`freezing.freeze` leaves: a `lib/` and no directory below the top one with a write bit, all of
one owner. Nothing else writes there, and nobody makes a whole tree read-only by accident.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ray_uv_plugin.store import build_lock, trust
from ray_uv_plugin.store.layout import Venv

# What `build_lock.BuildLock` writes into a lock it takes: `pid host`; a lock file may also be
# empty (its maker died before writing). Anything else is somebody else's file.
LOCK_CONTENT = re.compile(rb"\A(\d+ \S+\n)?\Z")
MAX_LOCK_BYTES = 512


def lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (never followed)"
    return "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"


def _made_by_uv(venv: Path) -> bool:
    """Whether `<venv>/pyvenv.cfg` is a regular file with the `uv = ` line uv writes. Its mode
    is not checked: a dead build was never frozen, so its files have the builder's umask."""
    st = lstat(venv / "pyvenv.cfg")
    if st is None or not stat.S_ISREG(st.st_mode):
        return False  # and never opened: a FIFO would block
    try:
        fd = trust.open_no_follow(venv / "pyvenv.cfg")
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        text = os.read(fd, 1 << 16).decode("utf-8", errors="replace")
    except OSError:
        return False
    finally:
        os.close(fd)
    return any(re.match(r"uv\s*=", line.strip()) for line in text.splitlines())


def lock_held(lock: Path) -> bool | None:
    """`build_lock.is_held`, asked only of a regular file (opening a FIFO would block): a lock
    that is anything else is no build lock of the plugin, which never makes one."""
    st = lstat(lock)
    if st is None or not stat.S_ISREG(st.st_mode):
        return False
    return build_lock.is_held(lock)


def lock_form_problem(fd: int) -> str | None:
    """Why the open file `fd`, named like a build lock, is no lock the plugin made, or None.

    `BuildLock` writes `pid host` into a lock it takes; a lock the user keeps under that name
    (or a hard link to one of its files) must not be truncated or removed as if it were ours.
    """
    st = os.fstat(fd)
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} hard links"
    if st.st_size > MAX_LOCK_BYTES:
        return f"it holds {st.st_size} bytes"
    if not LOCK_CONTENT.match(os.pread(fd, MAX_LOCK_BYTES + 1, 0)):
        return "it holds something else than the `pid host` a build writes"
    return None


def lock_form(lock: Path) -> tuple[bool, str | None]:
    """(whether this user could read `lock`, and if so why it is no lock of the plugin's or
    None). Opened only if it is a regular file: opening a FIFO would block."""
    st = lstat(lock)
    if st is None or not stat.S_ISREG(st.st_mode):
        return True, None  # gone, or refused by the caller's own checks
    try:
        fd = trust.open_no_follow(lock)
    except OSError:
        return False, None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True, "it is not a regular file"
        return True, lock_form_problem(fd)
    except OSError:
        return False, None
    finally:
        os.close(fd)


def _frozen_as_built(venv: Path) -> bool:
    """Whether `venv` is as `freezing.freeze` leaves a built venv (see the module docstring): a
    `lib/`, and no directory below the top one with a write bit, all of one owner."""
    try:
        owner = os.lstat(venv).st_uid
        lib = os.lstat(venv / "lib")
    except OSError:
        return False
    if not stat.S_ISDIR(lib.st_mode):
        return False
    stack = [str(venv)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if st.st_mode & 0o222 or st.st_uid != owner:
                        return False
                    stack.append(entry.path)
        except OSError:
            return False  # what we cannot read proves nothing
    return True


def build_record(root: Path, key: str) -> tuple[str | None, float, bool]:
    """(why `<key>` is not provably the plugin's, or None; mtime of its lock file, or 0;
    whether it is frozen as a finished build).

    Proof is uv's `pyvenv.cfg` in it and our `<key>.lock` beside it (the plugin creates the
    lock before uv runs), or a tree frozen as only a finished build is (`_frozen_as_built`): a
    directory merely named like a key is somebody else's.
    """
    lock = Venv(root, key).lock
    st = lstat(lock)
    if st is None:
        if _frozen_as_built(root / key):
            return None, 0.0, True
        return f"no build lock {lock.name} of the plugin beside it", 0.0, False
    if not stat.S_ISREG(st.st_mode):
        return f"{lock.name} is {kind(st)}", 0.0, False
    why = trust.why_untrusted(st, trust.trusted_gid())
    if why:
        return f"{lock.name} is untrusted: {why}", 0.0, False
    _readable, problem = lock_form(lock)  # what this user cannot read, `lock_held` reports
    if problem:
        return f"{lock.name} is not the plugin's: {problem}", 0.0, False
    if _frozen_as_built(root / key):
        return None, st.st_mtime, True
    if not _made_by_uv(root / key):
        return "it has no pyvenv.cfg written by uv", st.st_mtime, False
    return None, st.st_mtime, False
