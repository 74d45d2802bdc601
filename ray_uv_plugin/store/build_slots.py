"""At most N builds at once per venv dir, in order of arrival, across the processes, Ray
sessions and hosts that share it: requests over the limit queue, they are not refused.

A build of a new venv (never a reuse: the warm path takes no ticket) first takes a ticket, an
empty file `<venv dir>/.build-<ns since the epoch>-<pid>-<random>`, and holds an exclusive
`flock` on it for as long as it waits and builds, then removes it: an idle venv dir holds
none. The first N living tickets in name order may build; the others wait, polling from the
event loop, so that the wait is bounded (the caller counts it against the build's timeout) and
ends with the request when Ray cancels it. Why a queue of tickets rather than N slot files to
grab: a slot that frees goes to the oldest waiter, not to whichever poller comes first, so no
request starves behind later ones.

- The kernel drops the flock of a process that died: a ticket whose lock is free is a
  leftover, and whoever sees it removes it, so a dead waiter never blocks the queue. A ticket
  appears under its name only once locked (made as `.build-new-...`, locked, then renamed), so
  a living one is never taken for dead.
- Names sort by wall-clock time: the order of arrival on a host; across the hosts of a shared
  venv dir, up to their clocks' skew.
- Each process applies its own limit (the node setting): give every raylet that shares a venv
  dir the same value. On a venv dir shared by several hosts, the limit is theirs together.

The default is the cores this process may use (`usable_cores`): a `uv sync` already runs its
downloads and links in parallel and compiles bytecode on every core, so more syncs than cores
only share the same cores (each slower, all holding their memory and temporary files at once),
while fewer leave cores idle while a build waits on the network. benchmarks/build_limits.py
measures it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ray_uv_plugin.settings import BUILD_TIMEOUT_ENV, MAX_BUILDS_ENV, NodeSettings
from ray_uv_plugin.store import trust
from ray_uv_plugin.store.build_lock import DiskFullError, poll_delays
from ray_uv_plugin.store.disk import NO_SPACE, disk_full
from ray_uv_plugin.store.layout import BUDGET_LOCK, BUILD_TICKET_PREFIX

_NAME = r"\d{20}-\d+-[0-9a-f]{8}"
TICKET = re.compile(rf"^{re.escape(BUILD_TICKET_PREFIX)}{_NAME}$")
NEW_PREFIX = f"{BUILD_TICKET_PREFIX}new-"  # a ticket being made: not counted; removed once old
NEW_TICKET = re.compile(rf"^{re.escape(NEW_PREFIX)}{_NAME}$")
STALE_NEW_SECONDS = 60.0
REPORT_EVERY = 10.0  # at most one "still waiting" line per this many seconds


class SlotTimeout(TimeoutError):
    """Waited a build's whole time for a build slot; says how many run and what to do."""


def usable_cores(affinity: int, cpu_max: str | None) -> int:
    """The cores a build may use: the CPUs this process may run on (`affinity`), capped by a
    cgroup v2 CPU quota (`cpu.max`: `200000 100000` is 2 cores, `max 100000` none), as a
    container's (a pod sees the host's cores but gets its quota)."""
    cores = affinity
    parts = (cpu_max or "").split()
    if len(parts) == 2 and parts[0] != "max":
        try:
            quota, period = int(parts[0]), int(parts[1])
        except ValueError:
            quota = period = 0
        if quota > 0 and period > 0:
            cores = min(cores, math.ceil(quota / period))
    return max(1, cores)


def _cgroup_cpu_max() -> str | None:
    """This process's cgroup v2 `cpu.max`, if it has one (a parent's quota is not read)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            try:
                return (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "cpu.max").read_text()
            except OSError:
                return None
    return None


def default_max_builds() -> int:
    return usable_cores(len(os.sched_getaffinity(0)), _cgroup_cpu_max())


def max_builds(settings: NodeSettings | None = None) -> int:
    """Builds at once per venv dir (`RAY_UV_PLUGIN_MAX_BUILDS` of `settings`, else of this
    process; unset: `default_max_builds`)."""
    return (settings or NodeSettings.read()).max_builds_at_once(default_max_builds)


@dataclass(frozen=True)
class Standing:
    """Where a ticket stands: `ahead` living tickets before it, `limit` builds at once."""

    ahead: int
    limit: int

    @property
    def may_build(self) -> bool:
        return self.ahead < self.limit

    @property
    def place(self) -> int:
        """1: the next to build once a slot frees."""
        return self.ahead - self.limit + 1

    def describe(self) -> str:
        return f"{min(self.ahead, self.limit)} of {self.limit} in use; place {self.place} in queue"


def is_queue_entry(name: str) -> bool:
    """Whether an entry of the venv dir is a build's ticket or the budget's lock (`inventory`
    lists neither: they are no venvs, and what is left of them cleans itself up)."""
    return bool(TICKET.match(name) or NEW_TICKET.match(name)) or name == BUDGET_LOCK


def flock_held(path: Path, clean: bool) -> bool:
    """Whether a live process holds a flock on this ticket (or a hold's record: `holds`); if
    not (its process died) and `clean`, remove it. What cannot be told (another member's file
    we may not open) counts as held."""
    try:
        fd = trust.open_no_follow(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True  # held (EWOULDBLOCK), or cannot be told
        if clean:  # nobody holds it: its holder died
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.lstat(path)):
                    os.unlink(path)
        return False
    finally:
        os.close(fd)


def living_tickets(root: Path, before: str | None = None, clean: bool = False) -> int:
    """How many tickets in the venv dir `root` (sorting before `before`, if given) a process
    holds; with `clean`, the dead ones and old half-made ones are removed on the way."""
    try:
        with os.scandir(root) as it:
            entries = sorted(
                (e for e in it if e.name.startswith(BUILD_TICKET_PREFIX)), key=lambda e: e.name
            )
    except FileNotFoundError:
        return 0
    living = 0
    now = time.time()
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if TICKET.match(entry.name):
            if before is None or entry.name < before:
                living += flock_held(Path(entry.path), clean)
        elif NEW_TICKET.match(entry.name) and clean and now - st.st_mtime > STALE_NEW_SECONDS:
            flock_held(Path(entry.path), clean)
    return living


class BuildSlot:
    """One build's place among the venv dir's builds: `acquire_async`, then `release` once the
    build is over (from any thread)."""

    def __init__(self, root: Path, limit: int | None = None) -> None:
        self.root = root
        self.limit = max_builds() if limit is None else limit
        self.name: str | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _enter(self) -> None:
        unique = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
        name, new = f"{BUILD_TICKET_PREFIX}{unique}", self.root / f"{NEW_PREFIX}{unique}"
        mode = 0o660 if trust.trusted_gid() is not None else 0o600
        try:
            fd = trust.open_no_follow(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        except OSError as e:
            if e.errno in NO_SPACE:
                why = disk_full(self.root, f"with no room for a build ticket {new.name}")
                raise DiskFullError(why) from e
            raise
        try:
            os.fchmod(fd, mode)  # whatever the umask: the trusted group must open it too
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new file nobody else has: at once
            os.rename(new, self.root / name)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(new)
            raise
        self._fd, self.name = fd, name

    def standing(self) -> Standing:
        assert self.name is not None, "no ticket"
        ahead = living_tickets(self.root, before=self.name, clean=True)
        return Standing(ahead, self.limit)

    async def acquire_async(self, timeout: float, what: str, say: Callable[[str], None]) -> float:
        """Wait for a slot, at most `timeout` seconds; returns the seconds waited. `say` gets
        a line when the request must wait, when its place moves (at most every
        `REPORT_EVERY` s), and when it gets its slot. Cancelled or failed: leaves no ticket."""
        start = time.monotonic()
        self._enter()
        try:
            reported: tuple[float, int] | None = None  # (waited, place) at the last line
            for delay in poll_delays():
                standing = self.standing()
                waited = time.monotonic() - start
                if standing.may_build:
                    if reported is not None:
                        say(f"got a build slot in {waited:.2f}s")
                    return waited
                if waited >= timeout:
                    raise self._timeout(waited, what, standing)
                if reported is None:
                    say(f"waiting for a build slot ({standing.describe()})")
                    reported = (waited, standing.place)
                elif standing.place < reported[1] and waited - reported[0] >= REPORT_EVERY:
                    say(f"waiting for a build slot ({standing.describe()}; {waited:.2f}s so far)")
                    reported = (waited, standing.place)
                await asyncio.sleep(min(delay, timeout - waited))
        except BaseException:
            self.release()
            raise
        raise AssertionError("unreachable")

    def _timeout(self, waited: float, what: str, standing: Standing) -> SlotTimeout:
        return SlotTimeout(
            f"uv_project: waited {waited:.0f}s for a build slot for {what}, its whole build "
            f"time ({BUILD_TIMEOUT_ENV}): {standing.limit} builds at once run in the venv dir "
            f"{self.root} ({MAX_BUILDS_ENV}) and it was place {standing.place} in the queue. "
            f"Build envs ahead with `ray-uv prepare`, or raise {MAX_BUILDS_ENV} or "
            f"{BUILD_TIMEOUT_ENV} on the nodes. Nothing was built."
        )

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        assert self.name is not None
        with contextlib.suppress(OSError):  # names are never reused: it is ours or gone
            os.unlink(self.root / self.name)
        os.close(fd)
