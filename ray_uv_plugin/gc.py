"""Removing venvs nobody uses, without ever pulling one from under a live worker or a build,
and without ever touching what is not ours.

What may go (`inventory` classifies every entry; the rest is reported and left alone):
- a ready venv: a trusted directory whose marker names its key (the plugin wrote it);
- a dead build (no marker) or a venv with a broken marker, only if uv made it (`uv = ` in its
  `pyvenv.cfg`), the plugin made it (`<key>.lock` beside it is a trusted regular file: the
  plugin creates it before uv runs), its lock is free, and it has not changed for
  `UNFINISHED_MIN_AGE` (see there);
- trash of a gc that is gone, and lock files whose venv is gone and that nobody holds.
Untrusted entries (another user's, or writable by others) and symlinks are never touched.

`plan` is pure: from a scan and the limits, which venvs to remove and why.
`remove_venv` makes it safe against the plugin running at the same time:
  1. take the venv's build lock without waiting (held: a build is running; skip it): no
     request can build this key while we hold it;
  2. skip it if the plugin touched its marker since the scan, or a live process runs in it;
  3. rename it to `<key>.gc-<pid>`: from here on no request finds it (they wait on our lock and
     then rebuild);
  4. check the marker and `/proc` once more, for a request that found it just before the
     rename, and put it back if so;
  5. delete it (venvs are read-only: `trust.remove_tree`) and its lock file, still holding the
     lock (a waiter then sees an unlinked inode and retries on a new file).
A venv used in the last `MIN_IDLE_SECONDS` is never removed either: that covers a request that
found it but whose worker process has not started yet.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ray_uv_plugin import inventory, trust
from ray_uv_plugin.inventory import BROKEN, BUILDING, INCOMPLETE, UNTRUSTED, Other, VenvEntry
from ray_uv_plugin.lockfile import BuildLock
from ray_uv_plugin.venv_cache import MARKER, lock_path

MIN_IDLE_SECONDS = 120.0
# A build without marker is removed only once neither its dir nor its lock (whose holder writes
# its pid when a build starts) changed for an hour: twice the default build timeout
# (RAY_UV_PLUGIN_BUILD_TIMEOUT_S), for a build on another host of a shared venv dir whose file
# system does not pass flocks between hosts, or by a plugin version that locked differently.
UNFINISHED_MIN_AGE = 3600.0
DAY = 86400.0


class GcError(ValueError):
    """Bad `gc` limits; the message says what to pass instead."""


@dataclass(frozen=True)
class Decision:
    entry: VenvEntry
    reason: str


@dataclass
class GcReport:
    removed: list[Decision] = field(default_factory=list)
    kept: list[Decision] = field(default_factory=list)  # venvs we chose to keep, and why
    garbage: list[Path] = field(default_factory=list)  # trash dirs and orphan lock files
    leftovers: list[Other] = field(default_factory=list)  # garbage that must stay for now
    others: list[Other] = field(default_factory=list)  # not ours: left alone
    freed_bytes: int = 0  # what `du -s` of the venv dir drops by
    remaining_bytes: int = 0
    dry_run: bool = False


def check_limits(older_than_days: float | None, max_size_gb: float | None) -> None:
    if older_than_days is not None and older_than_days < 0:
        raise GcError(f"--older-than must be >= 0 days, got {older_than_days}.")
    if max_size_gb is not None and max_size_gb < 0:
        raise GcError(f"--max-size must be >= 0 GB, got {max_size_gb}.")


def _unfinished(e: VenvEntry, idle: float) -> tuple[bool, str]:
    """(remove?, why) for a dead build or a broken marker."""
    what = "unfinished build" if e.state == INCOMPLETE else f"broken marker: {e.note}"
    if e.not_ours:
        return False, f"{what}; not ours, left alone: {e.not_ours}"
    if idle < UNFINISHED_MIN_AGE:
        return False, f"{what}, changed {inventory.format_age(idle)}: may still be in use"
    return True, what


def plan(
    entries: Sequence[VenvEntry],
    usage: inventory.DiskUsage,
    now: float,
    older_than_days: float | None = None,
    max_size_bytes: int | None = None,
) -> tuple[list[Decision], list[Decision]]:
    """(to remove, to keep) for every entry. Dead builds of ours go once old; ready venvs go
    when unused for longer than `older_than_days`, then least recently used first while the dir
    is over `max_size_bytes`; never one in use, being built, untrusted, another user's, or used
    in the last minutes."""
    remove: list[Decision] = []
    keep: list[Decision] = []
    candidates: list[VenvEntry] = []
    me = os.geteuid()
    for e in entries:
        idle = now - e.last_used
        if e.state == UNTRUSTED:
            keep.append(Decision(e, f"untrusted, left alone: {e.note}"))
        elif e.users:
            keep.append(Decision(e, f"in use by pid {', '.join(map(str, e.users))}"))
        elif e.state == BUILDING:
            keep.append(Decision(e, e.note or "being built"))
        elif e.owner is not None and e.owner != me:
            user = inventory.user_name(e.owner)
            keep.append(Decision(e, f"owned by {user}: run gc as that user"))
        elif e.state in (INCOMPLETE, BROKEN):
            go, why = _unfinished(e, idle)
            (remove if go else keep).append(Decision(e, why))
        elif idle < MIN_IDLE_SECONDS:
            keep.append(Decision(e, f"used {inventory.format_age(idle)}"))
        elif older_than_days is not None and idle >= older_than_days * DAY:
            remove.append(Decision(e, f"unused for {idle / DAY:.1f} days"))
        else:
            candidates.append(e)
    if max_size_bytes is not None:
        removed = {d.entry.path for d in remove}
        kept = [e.path for e in entries if e.path not in removed]
        for e in sorted(candidates, key=lambda e: e.last_used):
            total = usage.size(*kept)
            if total <= max_size_bytes:
                break
            kept.remove(e.path)
            remove.append(
                Decision(e, f"least recently used while over {inventory.format_bytes(total)}")
            )
        candidates = [e for e in candidates if e.path in kept]
    for e in candidates:
        keep.append(Decision(e, f"used {inventory.format_age(now - e.last_used)}"))
    return remove, keep


def _mtime(path: Path) -> float | None:
    try:
        return os.lstat(path).st_mtime
    except FileNotFoundError:
        return None


def remove_venv(root: Path, entry: VenvEntry) -> str | None:
    """Delete one venv (see the module docstring); None if removed, else why it was kept."""
    lock = BuildLock(lock_path(root, entry.key))
    try:
        if not lock.try_acquire():
            return "being built"
    except OSError as e:
        return f"its build lock cannot be taken: {e}"
    try:
        return _remove_locked(root, entry)
    finally:
        lock.release()


def _remove_locked(root: Path, entry: VenvEntry) -> str | None:
    try:
        trust.check_dir(entry.path, "the venv")
    except FileNotFoundError:
        return "already gone"
    except trust.UntrustedPathError:
        return "changed into something untrusted during gc, left alone"
    seen = _mtime(entry.path / MARKER)
    if entry.meta is not None and seen != entry.last_used:
        return "used during gc"
    if entry.state == INCOMPLETE and seen is not None:
        return "finished building during gc"
    real = os.path.realpath(entry.path)
    if real in inventory.venv_users():
        return "in use"
    trash = root / f"{entry.key}.gc-{os.getpid()}"
    try:
        os.rename(entry.path, trash)
    except FileNotFoundError:
        return "already gone"
    except OSError as e:
        return f"cannot move it aside: {e}"
    if _mtime(trash / MARKER) != seen or real in inventory.venv_users():
        os.rename(trash, entry.path)  # nobody can have rebuilt it: we hold its lock
        return "used during gc"
    try:
        trust.remove_tree(trash)
    except OSError as e:  # the trash is garbage for the next gc, once this one is gone
        return f"removal failed: {e}"
    lock_path(root, entry.key).unlink(missing_ok=True)
    return None


def remove_garbage(root: Path, paths: Sequence[Path]) -> tuple[list[Path], list[Other]]:
    """(removed, kept and why); each is checked again just before it goes."""
    removed: list[Path] = []
    kept: list[Other] = []
    for path in paths:
        again = inventory.scan_one(root, path.name)
        if path not in again.garbage:
            kept.extend(again.leftovers + again.others)
            continue
        try:
            if path.suffix == ".lock":
                if not _remove_lock(path):
                    kept.append(Other(path, "taken by a build"))
                    continue
            else:
                trust.remove_tree(path)
        except OSError as e:
            kept.append(Other(path, f"removal failed: {e}"))
            continue
        removed.append(path)
    return removed, kept


def _remove_lock(path: Path) -> bool:
    """Unlink an orphan lock file while holding it, so that no build can start on it."""
    lock = BuildLock(path)
    if not lock.try_acquire():
        return False
    try:
        if os.path.lexists(path.with_suffix("")):
            return False  # a build made its venv meanwhile
        path.unlink(missing_ok=True)
        return True
    finally:
        lock.release()


def collect(
    root: Path,
    older_than_days: float | None = None,
    max_size_gb: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Plan and (unless `dry_run`) remove; `freed_bytes` is what `du -s root` drops by.

    Raises `VenvDirError` for a venv dir it must not clean (`inventory.check_venv_dir`) and
    `UntrustedPathError` for one the plugin would not trust."""
    check_limits(older_than_days, max_size_gb)
    report = GcReport(dry_run=dry_run)
    if not inventory.check_venv_dir(root, "gc"):
        return report
    now = time.time() if now is None else now
    inv = inventory.scan(root)
    locks = {e.path: lock_path(root, e.key) for e in inv.venvs}
    # What stays but is named like ours (e.g. a venv uv made without the plugin) may share
    # hardlinks with what goes; other things are not walked: they can be anything, and large.
    near = [o.path for o in inv.leftovers + inv.others if inventory.KEY_PREFIX.match(o.path.name)]
    usage = inventory.measure([*locks, *locks.values(), *inv.garbage, *near])
    max_bytes = None if max_size_gb is None else int(max_size_gb * 1024**3)
    remove, keep = plan(inv.venvs, usage, now, older_than_days, max_bytes)
    report.kept, report.leftovers, report.others = keep, inv.leftovers, inv.others
    if dry_run:
        report.removed, report.garbage = remove, inv.garbage
    else:
        for decision in remove:
            why_kept = remove_venv(root, decision.entry)
            if why_kept is None:
                report.removed.append(decision)
            else:
                report.kept.append(Decision(decision.entry, why_kept))
        report.garbage, failed = remove_garbage(root, inv.garbage)
        report.leftovers += failed
    gone = [p for d in report.removed for p in (d.entry.path, locks[d.entry.path])]
    kept = [p for d in report.kept for p in (d.entry.path, locks[d.entry.path])]
    stays = kept + near + [o.path for o in report.leftovers]
    report.freed_bytes = usage.freed(gone + report.garbage, stays)
    report.remaining_bytes = usage.size(*kept)
    return report
