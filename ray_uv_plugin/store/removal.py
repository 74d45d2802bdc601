"""Removing one venv, or a leftover, for `gc`: never from under a live worker or a build.

`removal_blocker` checks what the removal needs (ownership, a sticky venv dir, immutable
directories when not root, a readable lock of the plugin's form) in a dry run as well, so that
a dry run promises only what the real run can do.
`remove_venv` makes it safe against the plugin running at the same time:
  1. take the venv's build lock without waiting (held: a build is running, or a ship sender
     packs the venv, which holds it shared; skip it): no request can build this key while we
     hold it. gc writes nothing into it (its mtime is part of the last-use record);
  2. skip it if the plugin touched its marker or lock since the scan, or a live process runs
     in it;
  3. rename it to `<key>.gc-<pid>`: from here on no request finds it (they wait on our lock and
     then rebuild);
  4. check the marker, the lock and `/proc` once more, for a request that found it just before
     the rename, and put it back if so;
  5. delete it (venvs are read-only: `freezing.remove_tree`) and its lock file, still holding the
     lock (a waiter then sees an unlinked inode and retries on a new file).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from ray_uv_plugin.store import freezing, inventory, trust
from ray_uv_plugin.store.inventory import INCOMPLETE, Other, VenvEntry
from ray_uv_plugin.store.layout import MARKER, Venv
from ray_uv_plugin.store.ownership import lock_form_problem, lstat
from ray_uv_plugin.store.processes import processes

# chattr +i / +a: nobody, root included, may rename or remove such an entry, or one inside
# such a directory, until root clears the flag (`freezing.thaw` does, for directories, as root).
_FS_IOC_GETFLAGS, _IMMUTABLE_OR_APPEND = 0x80086601, 0x10 | 0x20


def _mtime(path: Path) -> float | None:
    st = lstat(path)
    return None if st is None else st.st_mtime


def chattr_flags(path: Path) -> int:
    """The chattr flags of a file or directory (0 where they cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf, True)
        return int.from_bytes(buf, "little")
    except OSError:
        return 0
    finally:
        os.close(fd)


def _tree_blocker(tree: Path) -> str | None:
    """What keeps this process from deleting `tree`: `freezing.remove_tree` makes each directory
    writable first, which needs its owner or root, and cannot clear chattr flags without
    CAP_LINUX_IMMUTABLE (root in a container usually lacks it)."""
    me = os.geteuid()
    stack = [tree]
    while stack:
        directory = stack.pop()
        st = lstat(directory)
        if st is None:
            continue
        if st.st_uid != me and me != 0:
            return (
                f"{directory} belongs to {trust.user_name(st.st_uid)}, whose directories "
                "only they or root may make writable to empty them: run gc as root"
            )
        if chattr_flags(directory) & _IMMUTABLE_OR_APPEND:
            if me != 0:
                return (
                    f"{directory} is immutable (chattr +i), which only root can undo: run gc "
                    "as root"
                )
            return (
                f"{directory} is immutable (chattr +i) and this process lacks "
                "CAP_LINUX_IMMUTABLE (as in a container), which undoing it needs: run gc where "
                "root has it, e.g. on the host"
            )
        try:
            with os.scandir(directory) as it:
                stack += [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
        except OSError as e:
            return f"this user cannot read {directory}: {e.strerror}"
    return None


def removal_blocker(root: Path, path: Path, lock: Path | None = None) -> str | None:
    """Why this user could not remove `path` (a venv, trash, or lock file) and the lock file
    `lock` beside it, or None: what the removal needs, checked before anything is touched (in
    a dry run too). Renaming and unlinking need write access to the venv dir, the entry's
    ownership if the venv dir is sticky, and no chattr flag on the entry."""
    me = os.geteuid()
    try:
        root_st = os.lstat(root)
    except OSError as e:
        return f"cannot check the venv dir: {e.strerror}"
    if not os.access(root, os.W_OK | os.X_OK):
        return f"this user may not rename or delete entries of the venv dir {root}"
    sticky = root_st.st_mode & stat.S_ISVTX and me not in (0, root_st.st_uid)
    for entry in (path, lock):
        st = None if entry is None else lstat(entry)
        if entry is None or st is None:
            continue
        if sticky and st.st_uid != me:
            return (
                f"{entry.name} belongs to {trust.user_name(st.st_uid)} and the venv dir is "
                "sticky (only an entry's owner may remove it): run gc as that user or as root"
            )
        opens_safely = stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)  # no device, FIFO
        if opens_safely and chattr_flags(entry) & _IMMUTABLE_OR_APPEND:
            return f"{entry.name} is immutable or append-only: clear it with `chattr -i -a {entry}`"
    st = lstat(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return None
    if me != 0 or not freezing.can_change_immutable():
        return _tree_blocker(path)
    return None


def take_lock(path: Path, create: bool) -> tuple[int | None, str | None]:
    """(an fd holding an exclusive flock on the key's lock file, None) or (None, why not).
    Without `create`, a missing lock file is (None, None).

    Unlike `build_lock.BuildLock`, this writes nothing: in a trusted-group venv dir the lock's
    mtime is part of the venv's last-use record, and a file that is not the plugin's lock is
    neither truncated nor removed. A lock held shared is a ship sender packing the venv."""
    mode = 0o660 if trust.trusted_gid() is not None else 0o600
    try:
        fd = trust.open_no_follow(path, os.O_RDONLY | (os.O_CREAT if create else 0), mode)
    except FileNotFoundError:
        return None, None
    except trust.UntrustedPathError as e:
        return None, f"its build lock is untrusted: {e}"
    except OSError as e:
        return None, f"this user cannot open its build lock {path.name}: {e.strerror}"
    try:
        why = _lock_open_file(path, fd, mode)
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        return None, why
    return fd, None


def _lock_open_file(path: Path, fd: int, mode: int) -> str | None:
    """Check and flock the lock file open as `fd`; None once held, else why not."""
    try:
        st = trust.check_fd(path, fd, "the build lock")
        if st.st_uid == os.geteuid():
            os.fchmod(fd, mode)  # one we made: the trusted group must open it too
        problem = lock_form_problem(fd)
        if problem:
            return f"{path.name} is not the plugin's build lock ({problem}): left alone"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return "being built"
            return "in use (being sent to another node)"
        if not os.path.samestat(os.fstat(fd), os.lstat(path)):
            return "its build lock was replaced during gc"
    except FileNotFoundError:
        return "its build lock was removed during gc"
    except trust.UntrustedPathError as e:
        return f"its build lock is untrusted: {e}"
    except OSError as e:
        return f"its build lock cannot be taken: {e}"
    return None


def remove_venv(root: Path, entry: VenvEntry) -> str | None:
    """Delete one venv (see the module docstring); None if removed, else why it was kept."""
    lock = Venv(root, entry.key).lock
    fd, why = take_lock(lock, create=True)
    if fd is None:
        return why
    try:
        # The lock's mtime as scanned; a lock file we just made has that of its making.
        lock_mtime = entry.stamps[1] if entry.stamps[1] is not None else os.fstat(fd).st_mtime
        return _remove_locked(root, entry, fd, lock_mtime)
    finally:
        os.close(fd)


def _used_since_scan(entry: VenvEntry, venv: Path, lock: Path, lock_mtime: float) -> str | None:
    marker = _mtime(venv / MARKER)
    if entry.state == INCOMPLETE and marker is not None and entry.stamps[0] is None:
        return "finished building during gc"
    if marker != entry.stamps[0] or _mtime(lock) != lock_mtime:
        return "used during gc"
    return None


def _remove_locked(root: Path, entry: VenvEntry, fd: int, lock_mtime: float) -> str | None:
    lock = Venv(root, entry.key).lock
    try:
        trust.check_dir(entry.path, "the venv")
    except FileNotFoundError:
        return "already gone"
    except trust.UntrustedPathError:
        return "changed into something untrusted during gc, left alone"
    why = _used_since_scan(entry, entry.path, lock, lock_mtime)
    if why:
        return why
    real = os.path.realpath(entry.path)
    if real in processes().users_under(root):
        return "in use"
    trash = root / f"{entry.key}.gc-{os.getpid()}"
    try:
        os.rename(entry.path, trash)
    except FileNotFoundError:
        return "already gone"
    except OSError as e:
        return f"cannot move it aside: {e}"
    why = _used_since_scan(entry, trash, lock, lock_mtime)
    if why or real in processes().users_under(root):
        os.rename(trash, entry.path)  # nobody can have rebuilt it: we hold its lock
        return why or "in use"
    try:
        freezing.remove_tree(trash)
    except OSError as e:  # the trash is garbage for the next gc, once this one is gone
        return f"removal failed: {e}"
    _unlink_held(lock, fd)
    return None


def _unlink_held(lock: Path, fd: int) -> None:
    """Unlink the lock file we hold by `fd`, if its name still refers to it."""
    with contextlib.suppress(OSError):  # the venv is gone; a lock left is the next gc's garbage
        if os.path.samestat(os.fstat(fd), os.lstat(lock)):
            os.unlink(lock)


def garbage_blocker(root: Path, path: Path) -> str | None:
    """Why this user could not remove a piece of garbage (`removal_blocker`; and a lock file
    must be one it can take), or None."""
    why = removal_blocker(root, path)
    if why is None and path.suffix == ".lock":
        fd, why = take_lock(path, create=False)
        if fd is not None:
            os.close(fd)
    return why


def remove_garbage(root: Path, paths: Sequence[Path]) -> tuple[list[Path], list[Other]]:
    """(removed, kept and why); each is checked again just before it goes."""
    removed: list[Path] = []
    kept: list[Other] = []
    for path in paths:
        again = inventory.scan_one(root, path.name)
        if path not in again.garbage:
            kept.extend(again.leftovers + again.others)
            continue
        why = removal_blocker(root, path)
        try:
            if why is None and path.suffix == ".lock":
                why = _remove_lock(path)
            elif why is None:
                freezing.remove_tree(path)
        except OSError as e:
            why = f"removal failed: {e}"
        if why is None:
            removed.append(path)
        else:
            kept.append(Other(path, why))
    return removed, kept


def _remove_lock(path: Path) -> str | None:
    """Unlink an orphan lock file while holding it, so that no build can start on it; None if
    removed, else why not."""
    fd, why = take_lock(path, create=False)
    if fd is None:
        return why or "already gone"
    try:
        if os.path.lexists(path.with_suffix("")):
            return "a build made its venv meanwhile"
        os.unlink(path)
        return None
    finally:
        os.close(fd)
