"""`.phase-<key>`: what a build or a receive of `<key>` is doing now, for the readiness view.

Only the holder of the key's build lock (`build_lock`: a build, or a ship receiver) writes it,
whole each time (a temporary file beside it, renamed over it), so a reader sees one record or
the one before. It says which state the key is in (`queued` for a build slot, `building`,
`receiving`, or `failed` once the holder gave up), the phase and since when (the node's wall
clock), the bytes so far, where a receive comes from, and a failure's cause.

A record is believed only while its writer lives, i.e. while the key's lock is held
(`setup_state` reads both): the kernel drops the lock of a process that died, and its record
then says nothing. A `failed` record is the exception: its writer wrote it last, then let go of
the lock, and it stays until the next build or receive of the key replaces it, or `gc` removes
it (`remove_stale`: records whose writer is gone, failed ones after `FAILED_KEPT_SECONDS`).

Writing a record never fails what it records: an error (a full disk) removes the record
instead, and the view then shows the key as building without a phase.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray_uv_plugin.store import trust
from ray_uv_plugin.store.layout import KEY_LENGTH, PHASE_PREFIX, Venv
from ray_uv_plugin.store.ownership import lock_held

RECORD = re.compile(rf"^{re.escape(PHASE_PREFIX)}(?P<key>[0-9a-f]{{{KEY_LENGTH}}})(?P<tmp>\.tmp)?$")
STATES = ("queued", "building", "receiving", "failed")
FORMAT = 1
MAX_BYTES = 1 << 16
FAILED_KEPT_SECONDS = 86400.0  # a failure's cause stays readable for a day, unless replaced


def record_path(root: Path, key: str) -> Path:
    return root / f"{PHASE_PREFIX}{key}"


def is_record(name: str) -> bool:
    """Whether an entry of the venv dir is a phase record or one being written (`inventory`
    lists none: they are no venvs, and `gc` removes the stale ones)."""
    return RECORD.match(name) is not None


def write_record(root: Path, key: str, fields: Mapping[str, Any]) -> bool:
    """Replace the record of `key` with `fields` (`state`, `phase`, `since`, `bytes`,
    `source`, `cause`) and who writes it; the caller holds the key's build lock. False where it
    could not be written: then no record is left."""
    assert fields.get("state") in STATES, fields
    record = {
        "format": FORMAT,
        "key": key,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "written": time.time(),
        **fields,
    }
    path = record_path(root, key)
    tmp = path.with_name(f"{path.name}.tmp")
    mode = 0o640 if trust.trusted_gid() is not None else 0o600  # the group's readers read it
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # one a writer that died left: only the lock holder writes
        fd = trust.open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)
            json.dump(record, f)
        os.replace(tmp, path)
    except (OSError, ValueError):  # a full disk, an unwritable venv dir: say nothing, not wrong
        remove_record(root, key)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


def remove_record(root: Path, key: str) -> None:
    """Remove the record of `key` (the lock holder, once the venv is ready)."""
    with contextlib.suppress(OSError):
        os.unlink(record_path(root, key))


def read_record(root: Path, key: str) -> dict[str, Any] | None:
    """The record of `key` as written, if it is a trusted regular file of ours naming `key`
    with a known state; else None. Never raises, and says nothing of its writer's life."""
    path = record_path(root, key)
    try:
        data = trust.read_own_file(path, MAX_BYTES, "the phase record")
        record = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    if record.get("key") != key or record.get("state") not in STATES:
        return None
    return record


def writer_alive(root: Path, key: str) -> bool:
    """Whether the key's build lock is held, by the record's writer or by whoever took the
    lock after it (who then writes its own record): what cannot be told counts as held."""
    return lock_held(Venv(root, key).lock) is not False


def remove_stale(root: Path, now: float | None = None) -> int:
    """Remove the records of `root` whose writer is gone (its key's lock free), but a failed
    one younger than `FAILED_KEPT_SECONDS`, and temporary files no writer holds; how many
    went. Never one that is not a regular file of ours."""
    now = time.time() if now is None else now
    removed = 0
    try:
        with os.scandir(root) as it:
            entries = [e for e in it if e.name.startswith(PHASE_PREFIX)]
    except OSError:
        return 0
    for entry in entries:
        match = RECORD.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or trust.why_untrusted(st, trust.trusted_gid()):
            continue
        key = match["key"]
        if writer_alive(root, key):
            continue
        if not match["tmp"]:
            record = read_record(root, key)
            failed = record is not None and record["state"] == "failed"
            if failed and now - st.st_mtime < FAILED_KEPT_SECONDS:
                continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed += 1
    return removed
