"""What the venv dir holds: each venv's state, metadata, last use, disk usage and live users.

Read-only: `ray-uv list` shows it, `gc` decides from it. Everything here works from the file
system and `/proc` alone, so it sees venvs of every Ray session on the host, and of none. It
never follows a symlink, never creates a file, and never raises on an odd entry: the venv dir
may have been set to a directory that holds other things, so each entry is classified as a
venv of ours, a leftover of ours, or something that is not ours (which `gc` never touches).

What proves that an entry is the plugin's is `ownership`; which live processes use a venv,
`processes` (its `/proc` scan).
"""

from __future__ import annotations

import os
import pwd
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ray_uv_plugin.settings import VenvDirError
from ray_uv_plugin.store import build_slots, holds, outcomes, phases, trust
from ray_uv_plugin.store.layout import KEY_LENGTH, SHIP_INFIX, Venv
from ray_uv_plugin.store.ownership import build_record, kind, lock_form, lock_held, lstat
from ray_uv_plugin.store.processes import processes

KEY = rf"[0-9a-f]{{{KEY_LENGTH}}}"
KEY_PATTERN = re.compile(rf"^{KEY}$")
KEY_PREFIX = re.compile(rf"^{KEY}")
LOCK_PATTERN = re.compile(rf"^({KEY})\.lock$")
# `gc` renames a venv to `<key>.gc-<pid>` before deleting it: a leftover is garbage once that
# gc is gone.
TRASH_PATTERN = re.compile(rf"^({KEY})\.gc-(\d+)$")
# A venv being received from another node (`ship`) is unpacked into `<key>.ship-XXXX` under
# the key's lock: a leftover of a receiver that died is garbage once nobody holds that lock.
SHIP_PATTERN = re.compile(rf"^({KEY}){re.escape(SHIP_INFIX)}[A-Za-z0-9_]+$")
READY = "ready"  # marker written and naming its key: usable
BUILDING = "building"  # no marker, its lock is held (or cannot be checked): a build runs
INCOMPLETE = "incomplete"  # no marker, lock free, made by uv and the plugin: a dead build
BROKEN = "broken marker"  # a marker that is no JSON object of this key: never used
UNTRUSTED = "untrusted"  # owned by someone else, or writable by others: never touched


@dataclass(frozen=True)
class VenvEntry:
    key: str
    path: Path
    state: str
    meta: Mapping | None
    # Marker mtime for a ready venv (the plugin touches it on every reuse; in a trusted-group
    # venv dir, the later of it and its lock's mtime: see `_last_use`); else when its dir or
    # build lock last changed (the lock holder writes its pid when a build starts).
    last_used: float
    users: tuple[int, ...] = ()  # pids of live processes running in this venv
    note: str = ""  # what is wrong: why broken, untrusted, or why a build cannot be checked
    not_ours: str | None = None  # a broken one: why it is not provably the plugin's
    owner: int | None = None  # its uid
    frozen: bool = False  # no marker, but frozen as only a finished build leaves a venv
    # (marker mtime, lock mtime) as scanned: `gc` sees a use between its scan and its removal.
    stamps: tuple[float | None, float | None] = (None, None)

    @property
    def may_have_users(self) -> bool:
        """Whether a worker may have been handed this venv (a dead build never was)."""
        return self.state in (READY, BROKEN) or self.frozen

    @property
    def project(self) -> str:
        return str((self.meta or {}).get("project", "?"))

    @property
    def name(self) -> str:
        """The project's `[project] name`, as its build recorded it."""
        return str((self.meta or {}).get("name", "?"))

    @property
    def extras(self) -> list[str]:
        return _names((self.meta or {}).get("extras"))

    @property
    def groups(self) -> list[str]:
        return _names((self.meta or {}).get("groups"))


def _names(recorded: object) -> list[str]:
    """A marker's list of names as `list` shows it: a marker that is not what a build writes
    (another version's, one changed by hand) shows none, rather than failing the listing."""
    return [str(name) for name in recorded] if isinstance(recorded, list) else []


@dataclass(frozen=True)
class Other:
    """An entry that is not a venv: a leftover of ours, or something that is not ours."""

    path: Path
    why: str


@dataclass
class Inventory:
    venvs: list[VenvEntry] = field(default_factory=list)  # oldest use first
    garbage: list[Path] = field(default_factory=list)  # trash of a dead gc, orphan lock files
    leftovers: list[Other] = field(default_factory=list)  # ours, but must stay for now
    others: list[Other] = field(default_factory=list)  # not ours: never touched


def check_venv_dir(root: Path, command: str) -> bool:
    """Refuse a venv dir that `list`/`gc` must not work on; False if it does not exist.

    `/`, `$HOME` and their ancestors hold the user's own files (a venv dir set to one of them
    by mistake); a venv dir of another user is theirs to clean (and we could not anyway), so
    `command` says to run it as that user. Then the trust checks the plugin makes (`trust`).
    """
    real = Path(os.path.realpath(root))
    for home in _homes():
        if real == home or real in home.parents:
            raise VenvDirError(
                f"the venv dir {root} is {'your home' if real == home else 'above your home'} "
                f"({home}), which holds your own files: set RAY_UV_PLUGIN_VENV_DIR to the "
                "directory that holds only venvs (default ~/.cache/ray-uv-plugin/venvs)."
            )
    if real == Path("/"):
        raise VenvDirError(f"the venv dir {root} is /: set RAY_UV_PLUGIN_VENV_DIR to a venv dir.")
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return False
    except PermissionError as e:
        raise VenvDirError(
            f"cannot read the venv dir {root} ({e.strerror}): run `ray-uv {command}` as the "
            "user that runs Ray."
        ) from None
    except NotADirectoryError:
        trust.resolve_root(root, must_exist=False)  # says which component is a file
        raise VenvDirError(
            f"the venv dir {root} is below a file: set RAY_UV_PLUGIN_VENV_DIR to a directory."
        ) from None
    except OSError as e:  # a symlink loop, a name too long, an I/O error
        raise VenvDirError(
            f"cannot use the venv dir {root} ({e.strerror}): set RAY_UV_PLUGIN_VENV_DIR to a "
            "directory of the user that runs Ray."
        ) from None
    gid = trust.trusted_gid()
    if st.st_uid != os.geteuid() and (gid is None or st.st_gid != gid):
        sudo = trust.user_name(st.st_uid, f"#{st.st_uid}")
        raise VenvDirError(
            f"the venv dir {root} belongs to {trust.who(st.st_uid)}, not to you, "
            f"{trust.who(os.geteuid())}: its venvs are that user's to list and remove: run "
            f"`ray-uv {command}` as that user, e.g. `sudo -u {sudo} ray-uv {command}`."
        )
    trust.check_root(root)
    return True


def _homes() -> set[Path]:
    homes = {os.environ.get("HOME", "")}
    try:
        homes.add(pwd.getpwuid(os.geteuid()).pw_dir)
    except KeyError:
        pass
    return {Path(os.path.realpath(h)) for h in homes if h}


def _marker(venv: Venv) -> tuple[dict | None, str | None, float | None]:
    """(metadata, what is wrong with the marker, its mtime); all None when there is none."""
    st = lstat(venv.marker)
    if st is None:
        return None, None, None
    if not stat.S_ISREG(st.st_mode):
        return None, f"its marker is {kind(st)}", st.st_mtime
    why = trust.why_untrusted(st, trust.trusted_gid())
    if why:
        return None, f"its marker is untrusted: {why}", st.st_mtime
    meta = venv.read_marker()
    if meta is None:
        return None, "its marker is not a JSON object", st.st_mtime
    if meta.get("key") != venv.key:
        return None, f"its marker names key {meta.get('key')!r}", st.st_mtime
    return meta, None, st.st_mtime


def _last_use(marker_mtime: float, lock: os.stat_result | None) -> float:
    """A ready venv's last use. The plugin touches the marker on every reuse; a member of a
    trusted group cannot touch another member's marker and touches the group-writable lock
    file instead, so there the later of the two counts (a build's start, which also writes
    the lock, is a use too)."""
    gid = trust.trusted_gid()
    if gid is None or lock is None or not stat.S_ISREG(lock.st_mode):
        return marker_mtime
    if trust.why_untrusted(lock, gid):
        return marker_mtime
    return max(marker_mtime, lock.st_mtime)


def _venv(root: Path, key: str, users: Mapping[str, set[int]]) -> VenvEntry | Other | None:
    venv = Venv(root, key)
    path = venv.path
    st = lstat(path)
    if st is None:
        return None  # removed while we looked
    if not stat.S_ISDIR(st.st_mode):
        return Other(path, f"named like a venv but {kind(st)}")
    pids = tuple(sorted(users.get(os.path.realpath(path), ())))
    why = trust.why_untrusted(st, trust.trusted_gid())
    if why:
        note = f"{why} ({trust.describe(st)})"
        return VenvEntry(key, path, UNTRUSTED, None, st.st_mtime, pids, note, owner=st.st_uid)
    lock_st = lstat(venv.lock)
    meta, problem, marker_mtime = _marker(venv)
    stamps = (marker_mtime, None if lock_st is None else lock_st.st_mtime)
    if meta is not None and marker_mtime is not None:
        last = _last_use(marker_mtime, lock_st)
        return VenvEntry(key, path, READY, meta, last, pids, owner=st.st_uid, stamps=stamps)
    not_ours, lock_mtime, frozen = build_record(root, key)
    changed = max(st.st_mtime, lock_mtime)
    if problem is not None:
        return VenvEntry(
            key, path, BROKEN, None, changed, pids, problem, not_ours, st.st_uid, frozen, stamps
        )
    held = lock_held(venv.lock)
    if held is None:
        note = "its build lock cannot be checked: maybe being built"
        return VenvEntry(key, path, BUILDING, None, changed, pids, note, owner=st.st_uid)
    if held:
        return VenvEntry(key, path, BUILDING, None, changed, pids, owner=st.st_uid)
    if lstat(venv.marker) is not None:  # a build wrote it, then let go of the lock
        return _venv(root, key, users)
    if not_ours:
        return Other(path, f"named like a venv, no marker, and {not_ours}")
    note = "a built venv without its marker (partly removed by hand?)" if frozen else ""
    return VenvEntry(
        key, path, INCOMPLETE, None, changed, pids, note, None, st.st_uid, frozen, stamps
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True  # another user's process, or not a pid we can ask about: keep its trash
    return True


def _trash(root: Path, name: str, inv: Inventory) -> None:
    """`<key>.gc-<pid>` is garbage only once that gc is gone and nobody holds the key's lock:
    a gc that is still running may be putting it back. `<key>.ship-XXXX` likewise, once no
    receiver holds the key's lock."""
    path = root / name
    match = TRASH_PATTERN.match(name) or SHIP_PATTERN.match(name)
    assert match is not None
    gc_pid = int(match.group(2)) if match.re is TRASH_PATTERN else None
    st = lstat(path)
    if st is None:
        return
    what = "a gc's trash" if gc_pid is not None else "a venv being received"
    if not stat.S_ISDIR(st.st_mode):
        inv.others.append(Other(path, f"named like {what} but {kind(st)}"))
    elif why := trust.why_untrusted(st, trust.trusted_gid()):
        inv.others.append(Other(path, f"untrusted: {why} ({trust.describe(st)})"))
    elif gc_pid is not None and _pid_alive(gc_pid):
        inv.leftovers.append(Other(path, f"trash of gc pid {match.group(2)}, still running"))
    elif lock_held(Venv(root, match.group(1)).lock) is not False:
        inv.leftovers.append(Other(path, "its key's build lock is held"))
    elif st.st_uid != os.geteuid() and os.geteuid() != 0:
        inv.leftovers.append(
            Other(path, f"owned by {trust.user_name(st.st_uid)}: run gc as that user")
        )
    else:
        inv.garbage.append(path)


def _lock(root: Path, name: str, key: str, inv: Inventory) -> None:
    """`<key>.lock` is garbage when it is a trusted regular file of the plugin's form, its venv
    is gone and nobody holds it; while its venv exists it is part of it."""
    path = root / name
    st = lstat(path)
    if st is None:
        return
    if not stat.S_ISREG(st.st_mode):
        inv.others.append(Other(path, f"named like a build lock but {kind(st)}"))
    elif why := trust.why_untrusted(st, trust.trusted_gid()):
        inv.others.append(Other(path, f"untrusted: {why} ({trust.describe(st)})"))
    elif not os.path.lexists(root / key):  # else it is part of its venv
        readable, problem = lock_form(path)
        if not readable:
            inv.leftovers.append(Other(path, "a build lock this user cannot read"))
        elif problem:
            inv.others.append(
                Other(path, f"named like a build lock but not the plugin's: {problem}")
            )
        elif lock_held(path) is False:  # else a build is about to make the venv
            inv.garbage.append(path)


def scan(root: Path, users: Mapping[str, set[int]] | None = None) -> Inventory:
    """Everything under `root`, classified; `users` from `Processes.users_under` (scanned if
    None)."""
    if users is None:
        users = processes().users_under(root)
    inv = Inventory()
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return inv
    for name in names:
        _classify(root, name, users, inv)
    inv.venvs.sort(key=lambda e: e.last_used)
    return inv


def scan_one(root: Path, name: str) -> Inventory:
    """One entry of `root`, classified again (`gc` does so just before it removes garbage)."""
    inv = Inventory()
    _classify(root, name, {}, inv)
    return inv


def _classify(root: Path, name: str, users: Mapping[str, set[int]], inv: Inventory) -> None:
    if build_slots.is_queue_entry(name):
        return  # ours, and no venv: a build's ticket or the budget's lock, never garbage
    if holds.is_record(name):
        return  # ours, and no venv: its venv counts it as a use; `gc` removes the dead ones
    if phases.is_record(name):
        return  # ours, and no venv: what a build does now; `gc` removes the stale ones
    if outcomes.is_record(name):
        return  # ours, and no venv: the setups' outcomes, which the metrics exporter rotates
    if KEY_PATTERN.match(name):
        found = _venv(root, name, users)
        if isinstance(found, VenvEntry):
            inv.venvs.append(found)
        elif found is not None:
            inv.others.append(found)
    elif TRASH_PATTERN.match(name) or SHIP_PATTERN.match(name):
        _trash(root, name, inv)
    elif match := LOCK_PATTERN.match(name):
        _lock(root, name, match.group(1), inv)
    else:
        inv.others.append(Other(root / name, "not named like a venv (16 hex digits)"))


def age(entry: VenvEntry, now: float | None = None) -> float:
    return (time.time() if now is None else now) - entry.last_used
