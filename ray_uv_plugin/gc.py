"""Removing venvs nobody uses, without ever pulling one from under a live worker or a build.

`plan` is pure: from a scan (`inventory`) and the limits, which venvs to remove and why.
`remove_venv` makes it safe against the plugin running at the same time:
  1. take the venv's build lock with timeout 0 (held: a build is running; skip it): no request
     can build this key while we hold it;
  2. skip it if the plugin touched its marker since the scan, or a live process runs in it;
  3. rename it to `<key>.gc-<pid>`: from here on no request finds it (they wait on our lock and
     then rebuild);
  4. check the marker and `/proc` once more, for a request that found it just before the
     rename, and put it back if so;
  5. delete it and its lock file (still holding the lock: filelock waiters then see an
     unlinked inode and retry on a new file).
A venv used in the last `MIN_IDLE_SECONDS` is never removed either: that covers a request that
found it but whose worker process has not started yet.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from ray_uv_plugin import inventory
from ray_uv_plugin.inventory import BUILDING, INCOMPLETE, VenvEntry
from ray_uv_plugin.venv_cache import MARKER, lock_path

MIN_IDLE_SECONDS = 120.0
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
    freed_bytes: int = 0  # what `du -s` of the venv dir drops by
    remaining_bytes: int = 0
    dry_run: bool = False


def check_limits(older_than_days: float | None, max_size_gb: float | None) -> None:
    if older_than_days is not None and older_than_days < 0:
        raise GcError(f"--older-than must be >= 0 days, got {older_than_days}.")
    if max_size_gb is not None and max_size_gb < 0:
        raise GcError(f"--max-size must be >= 0 GB, got {max_size_gb}.")


def plan(
    entries: Sequence[VenvEntry],
    usage: inventory.DiskUsage,
    now: float,
    older_than_days: float | None = None,
    max_size_bytes: int | None = None,
) -> tuple[list[Decision], list[Decision]]:
    """(to remove, to keep) for every entry. Unfinished builds always go; ready venvs go when
    unused for longer than `older_than_days`, then least recently used first while the dir is
    over `max_size_bytes`; never one in use, being built, or used in the last minutes."""
    remove: list[Decision] = []
    keep: list[Decision] = []
    candidates: list[VenvEntry] = []
    for e in entries:
        idle = now - e.last_used
        if e.users:
            keep.append(Decision(e, f"in use by pid {', '.join(map(str, e.users))}"))
        elif e.state == BUILDING:
            keep.append(Decision(e, "being built"))
        elif e.state == INCOMPLETE:
            remove.append(Decision(e, "unfinished build"))
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
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def remove_venv(root: Path, entry: VenvEntry) -> str | None:
    """Delete one venv (see the module docstring); None if removed, else why it was kept."""
    lock = FileLock(lock_path(root, entry.key), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return "being built"
    try:
        seen = _mtime(entry.path / MARKER)
        if entry.meta is not None and seen != entry.last_used:
            return "used during gc"
        if entry.meta is None and seen is not None:
            return "finished building during gc"
        real = os.path.realpath(entry.path)
        if real in inventory.venv_users():
            return "in use"
        trash = root / f"{entry.key}.gc-{os.getpid()}"
        try:
            os.rename(entry.path, trash)
        except FileNotFoundError:
            return "already gone"
        if _mtime(trash / MARKER) != seen or real in inventory.venv_users():
            os.rename(trash, entry.path)  # nobody can have rebuilt it: we hold its lock
            return "used during gc"
        shutil.rmtree(trash)
        lock_path(root, entry.key).unlink(missing_ok=True)
        return None
    finally:
        lock.release()


def remove_garbage(paths: Sequence[Path]) -> None:
    for path in paths:
        if path.suffix == ".lock":
            lock = FileLock(path, timeout=0)
            try:
                lock.acquire()
            except Timeout:
                continue
            try:
                if not path.with_suffix("").exists():
                    path.unlink(missing_ok=True)
            finally:
                lock.release()
        else:
            shutil.rmtree(path, ignore_errors=True)


def collect(
    root: Path,
    older_than_days: float | None = None,
    max_size_gb: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Plan and (unless `dry_run`) remove; `freed_bytes` is what `du -s root` drops by."""
    check_limits(older_than_days, max_size_gb)
    now = time.time() if now is None else now
    entries = inventory.scan(root)
    trash, locks = inventory.leftovers(root)
    usage = inventory.measure([e.path for e in entries] + trash)
    max_bytes = None if max_size_gb is None else int(max_size_gb * 1024**3)
    remove, keep = plan(entries, usage, now, older_than_days, max_bytes)
    report = GcReport(kept=keep, garbage=trash + locks, dry_run=dry_run)
    if dry_run:
        report.removed = remove
    else:
        for decision in remove:
            why_kept = remove_venv(root, decision.entry)
            if why_kept is None:
                report.removed.append(decision)
            else:
                report.kept.append(Decision(decision.entry, why_kept))
        remove_garbage(report.garbage)
    gone = [d.entry.path for d in report.removed] + trash
    stays = [d.entry.path for d in report.kept]
    report.freed_bytes = usage.freed(gone, stays)
    report.remaining_bytes = usage.size(*stays)
    return report
