"""Which venvs Ray's runtime-env agents hold for live jobs: records that `gc` and the budget
count as uses, beside the live processes that run in a venv (`processes`).

Ray's agent keeps each runtime_env it set up for as long as a job or a worker refers to it,
and hands that job's later workers the context it kept, without asking the plugin again. A job
whose workers on a node are all gone (killed, or idle and ended) thus starts its next worker in
the venv it was handed, and until then no process runs in it and nothing touches its marker.
So the plugin holds a venv while Ray does: when it hands Ray a venv for a runtime_env it makes
a record `.held-<key>-<pid>-<random>` in the venv dir and keeps an exclusive `flock` on it,
until Ray says that no job or worker refers to that runtime_env any more (`Hold.release`).

- The kernel drops the flock of a process that died: a record whose lock is free is that of
  an agent that died without releasing it (with its raylet). It holds nothing, and `gc`
  removes it (`remove_dead`).
- A record appears under its name only once locked (made as `.held-new-...`, locked, then
  renamed), so a living one is never taken for dead.
- What cannot be told (a record this user may not open) holds its venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import time
from pathlib import Path

from ray_uv_plugin.store import trust
from ray_uv_plugin.store.build_slots import flock_held
from ray_uv_plugin.store.layout import HELD_PREFIX, KEY_LENGTH

_NAME = rf"(?P<key>[0-9a-f]{{{KEY_LENGTH}}})-(?P<pid>\d+)-[0-9a-f]{{8}}"
RECORD = re.compile(rf"^{re.escape(HELD_PREFIX)}{_NAME}$")
NEW_PREFIX = f"{HELD_PREFIX}new-"  # a record being made: holds nothing; removed once old
NEW_RECORD = re.compile(rf"^{re.escape(NEW_PREFIX)}{_NAME}$")
STALE_NEW_SECONDS = 60.0


def is_record(name: str) -> bool:
    """Whether an entry of the venv dir is a hold's record (`inventory` lists none: they are
    no venvs, and `gc` removes the dead ones)."""
    return bool(RECORD.match(name) or NEW_RECORD.match(name))


class Hold:
    """The plugin's record that Ray's agent holds the venv `<root>/<key>` for a live job;
    `release` once Ray no longer does."""

    def __init__(self, root: Path, key: str) -> None:
        self.key = key
        unique = f"{key}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path, new = root / f"{HELD_PREFIX}{unique}", root / f"{NEW_PREFIX}{unique}"
        mode = 0o640 if trust.trusted_gid() is not None else 0o600  # the group's gc reads it
        fd = trust.open_no_follow(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # whatever the umask
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new file nobody else has: at once
            os.rename(new, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(new)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):  # names are never reused: it is ours or gone
            os.unlink(self.path)
        os.close(fd)


def _records(root: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(root) as it:
            return [e for e in it if e.name.startswith(HELD_PREFIX)]
    except OSError:  # gone, or not ours to read: `gc` says why elsewhere
        return []


def _regular(entry: os.DirEntry) -> os.stat_result | None:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def holders(root: Path) -> dict[str, set[int]]:
    """Real path of a venv of `root` -> pids of the live agents that hold it for a job."""
    found: dict[str, set[int]] = {}
    for entry in _records(root):
        match = RECORD.match(entry.name)
        if match and _regular(entry) and flock_held(Path(entry.path), clean=False):
            venv = os.path.realpath(root / match["key"])
            found.setdefault(venv, set()).add(int(match["pid"]))
    return found


def remove_dead(root: Path) -> int:
    """Remove the records of `root` whose agent died, and old half-made ones; how many went."""
    removed = 0
    now = time.time()
    for entry in _records(root):
        st = _regular(entry)
        if st is None:
            continue
        dead = RECORD.match(entry.name) or (
            NEW_RECORD.match(entry.name) and now - st.st_mtime > STALE_NEW_SECONDS
        )
        if dead and not flock_held(Path(entry.path), clean=True):
            removed += not os.path.lexists(entry.path)
    return removed
