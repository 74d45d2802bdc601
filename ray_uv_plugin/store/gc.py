"""Removing venvs nobody uses, without ever pulling one from under a live worker or a build,
and without ever touching what is not ours.

What may go (`inventory` classifies every entry; the rest is reported and left alone):
- a ready venv: a trusted directory whose marker names its key (the plugin wrote it);
- a dead build (no marker) or a venv with a broken marker, only if the plugin provably made
  it (`inventory`: uv's `pyvenv.cfg` and our `<key>.lock`, or a tree frozen as only a finished
  build is, e.g. what `rm -rf` by root leaves of a venv), its lock is free, and it has not
  changed for `UNFINISHED_MIN_AGE` (see there; `--all` does not wait);
- trash of a gc that is gone, lock files of the plugin's form whose venv is gone and that
  nobody holds, and the hold records of agents that died (`holds`).
Untrusted entries (another user's, or writable by others) and symlinks are never touched.

`plan` is pure: from a scan and the limits, which venvs to remove and why. A venv that a
worker may use is kept when gc cannot see every process that could run in it (`blind_spot`:
another user's processes, `/proc` missing, or gc in a PID namespace of its own, as in a
container, where the host's and other containers' processes are invisible), unless the
operator says it is unused (`assume_unused`). A venv used in the last `MIN_IDLE_SECONDS` is
never removed either: that covers a request that found it but whose worker process has not
started yet. A venv that Ray's agent holds for a live job counts as used by the agent
(`holds`): the job's workers may all be gone, and Ray starts the next in it. How a venv goes,
safe against the plugin running at the same time, is `removal`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ray_uv_plugin.store import holds, inventory, phases, trust
from ray_uv_plugin.store.disk import DiskUsage, ReadyTrees, measure
from ray_uv_plugin.store.inventory import BROKEN, BUILDING, INCOMPLETE, UNTRUSTED, Other, VenvEntry
from ray_uv_plugin.store.layout import Venv
from ray_uv_plugin.store.processes import Processes, processes
from ray_uv_plugin.store.removal import (
    garbage_blocker,
    removal_blocker,
    remove_garbage,
    remove_venv,
    take_lock,
)
from ray_uv_plugin.store.units import format_age, format_bytes

MIN_IDLE_SECONDS = 120.0
# A build without marker is removed only once neither its dir nor its lock (whose holder writes
# its pid when a build starts) changed for an hour: twice the default build timeout
# (RAY_UV_PLUGIN_BUILD_TIMEOUT_S), for a build on another host of a shared venv dir whose file
# system does not pass flocks between hosts, or by a plugin version that locked differently.
UNFINISHED_MIN_AGE = 3600.0
DAY = 86400.0
ASSUME_UNUSED_HINT = "run gc as root, or pass --assume-unused"
NO_PROC_HINT = "run gc on each Linux host that runs Ray, or pass --assume-unused"
NAMESPACE_HINT = (
    "run gc on the host, or pass --assume-unused if only processes of this container use the "
    "venv dir"
)
# The kernel's PROC_PID_INIT_INO (Linux >= 3.8): the inode of the host's PID namespace, the one
# namespace whose /proc shows every process of the machine.
INIT_PID_NAMESPACE_INODE = 0xEFFFFFFC


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


def check_limits(
    older_than_days: float | None, max_size_gb: float | None, everything: bool = False
) -> None:
    if everything and (older_than_days is not None or max_size_gb is not None):
        raise GcError(
            "--all removes every venv of ours that nothing uses, whatever its age and size: "
            "pass it alone, or --older-than/--max-size without it."
        )
    if older_than_days is not None and older_than_days < 0:
        raise GcError(f"--older-than must be >= 0 days, got {older_than_days}.")
    if max_size_gb is not None and max_size_gb < 0:
        raise GcError(f"--max-size must be >= 0 GB, got {max_size_gb}.")


def _unfinished(e: VenvEntry, idle: float, min_age: float) -> tuple[bool, str]:
    """(remove?, why) for a dead build, what is left of a venv, or a broken marker."""
    if e.state == BROKEN:
        what = f"broken marker: {e.note}"
    else:
        what = e.note or "unfinished build"
    if e.not_ours:
        return False, f"{what}; not ours, left alone: {e.not_ours}"
    if idle < min_age:
        return False, f"{what}, changed {format_age(idle)}: may still be in use"
    return True, what


def plan(
    entries: Sequence[VenvEntry],
    usage: DiskUsage,
    now: float,
    older_than_days: float | None = None,
    max_size_bytes: int | None = None,
    everything: bool = False,
    blind_spot: str | None = None,
    hint: str = ASSUME_UNUSED_HINT,
) -> tuple[list[Decision], list[Decision]]:
    """(to remove, to keep) for every entry. Dead builds of ours go once old; ready venvs go
    when unused for longer than `older_than_days`, then least recently used first while the dir
    is over `max_size_bytes`; never one in use, being built, untrusted, another user's (but for
    root), or used in the last minutes. `everything` (`--all`): every ready venv, and dead
    builds whatever their age. `blind_spot` (why gc cannot see every process that may use a
    venv): what a worker may use is kept, since it may be in use; `hint` says what to do."""
    remove: list[Decision] = []
    keep: list[Decision] = []
    candidates: list[VenvEntry] = []
    me = os.geteuid()
    if everything:
        older_than_days = 0.0
    for e in entries:
        idle = now - e.last_used
        if e.state == UNTRUSTED:
            keep.append(Decision(e, f"untrusted, left alone: {e.note}"))
        elif e.users:
            keep.append(Decision(e, f"in use by pid {', '.join(map(str, e.users))}"))
        elif e.state == BUILDING:
            keep.append(Decision(e, e.note or "being built"))
        elif e.owner is not None and e.owner != me and me != 0:
            user = trust.user_name(e.owner)
            keep.append(Decision(e, f"owned by {user}: run gc as that user"))
        elif e.state in (INCOMPLETE, BROKEN):
            go, why = _unfinished(e, idle, 0.0 if everything else UNFINISHED_MIN_AGE)
            (remove if go else keep).append(Decision(e, why))
        elif idle < MIN_IDLE_SECONDS:
            keep.append(Decision(e, f"used {format_age(idle)}"))
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
            remove.append(Decision(e, f"least recently used while over {format_bytes(total)}"))
        candidates = [e for e in candidates if e.path in kept]
    for e in candidates:
        keep.append(Decision(e, f"used {format_age(now - e.last_used)}"))
    if blind_spot is not None:
        unsure = [d for d in remove if d.entry.may_have_users]
        remove = [d for d in remove if not d.entry.may_have_users]
        keep += [
            Decision(
                d.entry,
                f"{d.reason}, but may be in use by processes this user cannot see "
                f"({blind_spot}): {hint}",
            )
            for d in unsure
        ]
    return remove, keep


def pid_namespace_blind_spot(proc: Path = Path("/proc")) -> str | None:
    """Why gc, by the PID namespace it runs in, cannot see every process of this machine, or
    None. A container has a PID namespace of its own, whose /proc lists its own processes
    only, while its venv dir may be a volume that the host or other pods (a hostPath) use too:
    only the host's namespace sees them all. What cannot be told counts as unseen."""
    try:
        inode = os.stat(proc / "self" / "ns" / "pid").st_ino
    except OSError as e:
        return f"cannot tell which PID namespace gc runs in: {proc}/self/ns/pid: {e.strerror}"
    if inode == INIT_PID_NAMESPACE_INODE:
        return None
    return (
        "gc runs in a PID namespace of its own, as in a container: the processes of the host "
        "and of other containers that share this venv dir are invisible to it"
    )


def blind_spot(procs: Processes, root: Path) -> tuple[str, str] | None:
    """(why gc cannot see every process that may use a venv of `root`, what to do), or None."""
    if procs.proc is None:
        return "/proc cannot be listed", NO_PROC_HINT
    why = pid_namespace_blind_spot(procs.proc)
    if why is not None:
        return why, NAMESPACE_HINT
    why = procs.blind_spot(root)
    return None if why is None else (why, ASSUME_UNUSED_HINT)


def collect(
    root: Path,
    older_than_days: float | None = None,
    max_size_gb: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
    everything: bool = False,
    assume_unused: bool = False,
    max_size_bytes: int | None = None,
    ready: ReadyTrees | None = None,
) -> GcReport:
    """Plan and (unless `dry_run`) remove; `freed_bytes` is what `du -s root` drops by.
    `everything` is `ray-uv gc --all`; `assume_unused` is `--assume-unused` (`plan`);
    `max_size_bytes` is `max_size_gb` to the byte (a build's venv dir budget: `budget`);
    `ready`: the ready venvs measured by earlier calls of this process (`disk.ReadyTrees`).

    Raises `VenvDirError` for a venv dir it must not clean (`inventory.check_venv_dir`) and
    `UntrustedPathError` for one the plugin would not trust."""
    check_limits(older_than_days, max_size_gb, everything)
    report = GcReport(dry_run=dry_run)
    if not inventory.check_venv_dir(root, "gc"):
        return report
    now = time.time() if now is None else now
    procs = processes()
    inv = inventory.scan(root, procs.users_under(root))
    unseen = None if assume_unused else blind_spot(procs, root)
    locks = {e.path: Venv(root, e.key).lock for e in inv.venvs}
    # What stays but is named like ours (e.g. a venv uv made without the plugin) may share
    # hardlinks with what goes; other things are not walked: they can be anything, and large.
    near = [o.path for o in inv.leftovers + inv.others if inventory.KEY_PREFIX.match(o.path.name)]
    usage = measure([*locks, *locks.values(), *inv.garbage, *near], ready)
    for venv, lock in locks.items():  # a venv's lock goes with it: the plan counts both
        usage.inodes[venv] = {**usage.inodes[venv], **usage.inodes.get(lock, {})}
    max_bytes = None if max_size_gb is None else int(max_size_gb * 1024**3)
    max_bytes = max_size_bytes if max_size_bytes is not None else max_bytes
    why_unseen, hint = unseen or (None, ASSUME_UNUSED_HINT)
    remove, keep = plan(
        inv.venvs, usage, now, older_than_days, max_bytes, everything, why_unseen, hint
    )
    report.kept, report.leftovers, report.others = keep, inv.leftovers, inv.others
    for decision in remove:
        entry = decision.entry
        why_kept = removal_blocker(root, entry.path, locks[entry.path])
        if why_kept is None and dry_run:
            fd, why_kept = take_lock(locks[entry.path], create=False)
            if fd is not None:
                os.close(fd)
        elif why_kept is None:
            why_kept = remove_venv(root, entry)
        if why_kept is None:
            report.removed.append(decision)
        else:
            report.kept.append(Decision(entry, why_kept))
    if dry_run:
        for path in inv.garbage:
            why = garbage_blocker(root, path)
            if why is None:
                report.garbage.append(path)
            else:
                report.leftovers.append(Other(path, why))
    else:
        report.garbage, failed = remove_garbage(root, inv.garbage)
        report.leftovers += failed
        holds.remove_dead(root)  # records of agents that died: they hold nothing
        phases.remove_stale(root)  # phase records whose writer is gone
    gone = [p for d in report.removed for p in (d.entry.path, locks[d.entry.path])]
    kept = [p for d in report.kept for p in (d.entry.path, locks[d.entry.path])]
    stays = kept + near + [o.path for o in report.leftovers]
    report.freed_bytes = usage.freed(gone + report.garbage, stays)
    report.remaining_bytes = usage.size(*kept)
    return report
