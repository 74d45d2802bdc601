"""`<key>.lock`: one build of a key at a time, across processes and hosts sharing the venv dir.

An `flock` on a file opened without following symlinks and checked like every other path we
trust (`trust`). The holder writes `pid host` into it, so that a waiter can say whom it waited
for. Waits poll with a non-blocking try: bounded, and, in the async form, cancellable, so that
a request that Ray gave up on leaves no thread parked on a lock.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from ray_uv_plugin.settings import NodeSettings
from ray_uv_plugin.store import trust
from ray_uv_plugin.store.disk import NO_SPACE, disk_full

LOCK_MARGIN = 60.0  # a waiter gives up this long after the build it waits for must have ended


def build_timeout(settings: NodeSettings | None = None) -> float:
    """How long a build may hold its key's lock (`RAY_UV_PLUGIN_BUILD_TIMEOUT_S`): uv is killed
    then, a ship receiver gives up, and a waiter waits that plus `LOCK_MARGIN`."""
    return (settings or NodeSettings.read()).build_timeout_s()


class LockTimeout(TimeoutError):
    """Waited too long for another build of the same key; says for whom."""


class DiskFullError(OSError):
    """The venv dir's disk has no room for a lock file; says where and what to do."""


class BuildLock:
    def __init__(self, path: Path, what: str = "the build lock") -> None:
        self.path = path
        self.what = what  # as an error about the file names it (`.budget.lock` takes one too)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; never blocks. A disk too full to record the
        holder raises `DiskFullError`, leaving no lock file of ours behind."""
        assert self._fd is None, "already held"
        mode = 0o660 if trust.trusted_gid() is not None else 0o600
        fd, created = self._open(mode)
        try:
            if trust.check_fd(self.path, fd, self.what).st_uid == os.geteuid():
                os.fchmod(fd, mode)  # whatever the umask: the trusted group must open it too
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            # `gc` unlinks a lock file while it holds it: a lock on that inode guards nothing.
            try:
                current = os.lstat(self.path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
            if current is None or (current.st_ino, current.st_dev) != (mine.st_ino, mine.st_dev):
                os.close(fd)
                return self.try_acquire()
            self._record_holder(fd, created)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def _open(self, mode: int) -> tuple[int, bool]:
        """The lock file, opened for writing, and whether this call created it."""
        while True:  # each turn means another process created or removed it meanwhile
            try:
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
                return trust.open_no_follow(self.path, flags, mode), True
            except FileExistsError:
                pass
            except OSError as e:
                if e.errno in NO_SPACE:  # no room for even an empty file
                    raise DiskFullError(self._disk_full()) from e
                raise
            try:
                return trust.open_no_follow(self.path, os.O_RDWR), False
            except FileNotFoundError:
                continue

    def _record_holder(self, fd: int, created: bool) -> None:
        """`pid host` over the last holder's record (its blocks are reused: a full disk
        still takes it), then cut to length. A new file that gets no block is removed."""
        record = f"{os.getpid()} {socket.gethostname()}\n".encode()
        try:
            os.pwrite(fd, record, 0)
            os.ftruncate(fd, len(record))
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            if created:  # we hold it and it is our inode (checked): nobody else uses it
                os.unlink(self.path)
            raise DiskFullError(self._disk_full()) from e

    def _disk_full(self) -> str:
        return disk_full(self.path.parent, f"with no room for the build lock {self.path.name}")

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the flock

    def holder(self) -> str:
        """`pid 4242 on host-a`, as the holder wrote it, or `unknown pid`."""
        try:
            fd = trust.open_no_follow(self.path)
        except OSError:
            return "unknown pid"
        try:
            words = os.read(fd, 256).decode(errors="replace").split()
        finally:
            os.close(fd)
        if len(words) >= 2 and words[0].isdigit():
            return f"pid {words[0]} on {words[1]}"
        return "unknown pid"

    def _timeout(self, waited: float, what: str) -> LockTimeout:
        return LockTimeout(
            f"uv_project: waited {waited:.0f}s for another build of {what} ({self.holder()}, "
            f"holding {self.path}); it is still running or hung: let it finish, or stop that "
            "process and retry (a killed build leaves nothing that is used)."
        )

    async def acquire_async(self, timeout: float, what: str) -> None:
        start = time.monotonic()
        for delay in poll_delays():
            if self.try_acquire():
                return
            waited = time.monotonic() - start
            if waited >= timeout:
                raise self._timeout(waited, what)
            await asyncio.sleep(min(delay, timeout - waited))


def poll_delays() -> Iterator[float]:
    """The waits between tries of a lock or a slot held by another process: from 20 ms,
    doubling, up to half a second."""
    delay = 0.02
    while True:
        yield delay
        delay = min(delay * 2, 0.5)


def is_held(path: Path) -> bool | None:
    """Whether a process holds this lock now; None if it cannot be told (unreadable).

    Opens read-only (flock needs no write access), so a read-only user can ask too, and never
    creates a lock file.
    """
    try:
        fd = trust.open_no_follow(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return True
        return None
    finally:
        os.close(fd)
    return False


def hold_shared(path: Path) -> int:
    """Hold the build lock at `path` shared, for as long as the returned fd is open: builds and
    `gc`, which take it exclusively without waiting, then leave the key's venv alone (a sender
    reads it meanwhile). Raises BlockingIOError while one of them holds it, FileNotFoundError
    if there is no lock file or `gc` unlinked it (the venv is going), and trust's errors."""
    fd = trust.open_no_follow(path)
    try:
        trust.check_fd(path, fd, "the build lock")
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        mine = os.fstat(fd)
        current = os.lstat(path)
        if (current.st_ino, current.st_dev) != (mine.st_ino, mine.st_dev):
            raise FileNotFoundError(errno.ENOENT, "replaced while we took it", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd
