"""The venv dir's budget (`RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES`): a build makes room for its venv
before the venv is published, by removing the least recently used venvs that nothing uses.

- **What counts**: what `du -s` says the venv dir's venvs and their locks take, each inode once:
  the figure on `ray-uv list`'s `Budget:` line, and what `ray-uv gc --max-size` prunes to. uv
  hardlinks installed files from its cache, and venvs of one project share most of them, so a
  venv adds what it does not share. Apparent bytes (each venv's files summed) would count a
  shared Ray or torch once per venv and evict venvs whose removal frees nothing. The blocks of a
  file that uv's cache also holds stay allocated until the cache drops it too (`uv cache
  prune`): the budget bounds the venv dir, not the disk.
- **When**: after uv made the venv (and its manifest) and before its marker is written: the
  first moment its size, shared files counted once, is known. While uv runs the dir may hold the
  budget plus the venvs being built; a venv that does not fit is removed unpublished and never
  used.
- **What goes**: `gc`'s own plan and removal (`gc.collect` with the budget as its max size):
  least recently used first; never a venv in use by a live process, being built, being shipped,
  another user's, used in the last `gc.MIN_IDLE_SECONDS` (a request may have been handed it
  and its worker not be started yet), or that a process gc cannot see may use. The last use
  is the marker's mtime, which the warm path already touches on every reuse (one `utime`), so
  the budget costs a reuse nothing. Builds make room one at a time (a flock on the venv dir's
  `.budget.lock`), so two that finish together do not both remove for one excess. The wait for
  it counts against the build's timeout: a holder that was stopped (SIGSTOP) keeps the lock,
  and the builds behind it fail at their timeout with `BudgetBusy`, naming its pid.
- **Unset by default**: the right size depends on the disk and what else it holds, which the
  plugin cannot know, and venvs an operator built ahead (`ray-uv prepare`) should not go
  unasked. A build with a budget pays a walk of the venv dir (`du`) and a `/proc` scan.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ray_uv_plugin.settings import BUILD_TIMEOUT_ENV, VENV_DIR_MAX_BYTES_ENV, NodeSettings
from ray_uv_plugin.store import disk, gc
from ray_uv_plugin.store.build_lock import BuildLock, poll_delays
from ray_uv_plugin.store.layout import BUDGET_LOCK, Venv
from ray_uv_plugin.store.units import format_bytes

ROUNDS = 3  # collect again while a chosen venv was used meanwhile and others may go instead
_READY = disk.ReadyTrees()  # the ready venvs this process measured: walked once (`make_room`)


class OverBudget(RuntimeError):
    """The new venv does not fit the venv dir's budget and nothing more can be removed."""


def venv_dir_budget(settings: NodeSettings | None = None) -> int | None:
    """The budget in bytes (`settings`', else this process's), None if unset; a value that is
    no size raises `VenvDirError`."""
    return (settings or NodeSettings.read()).budget_bytes()


class BudgetBusy(TimeoutError):
    """Another process held the budget lock until the build's deadline: says which."""


@contextlib.contextmanager
def _one_at_a_time(root: Path, venv: str, deadline: float) -> Iterator[None]:
    """Hold the venv dir's `.budget.lock`, waiting for it until `deadline` (`time.monotonic`)
    at most: a holder that stopped (SIGSTOP) or hung keeps it, and a build that waited on it
    without a bound would run past its timeout. Held only while a build makes room: seconds."""
    lock = BuildLock(root / BUDGET_LOCK, "the budget lock")
    start = time.monotonic()
    for delay in poll_delays():
        if lock.try_acquire():
            break
        if time.monotonic() >= deadline:
            raise BudgetBusy(
                f"uv_project: waited {time.monotonic() - start:.0f}s, the rest of the build's "
                f"time ({BUILD_TIMEOUT_ENV}), for the venv dir's budget lock {lock.path}, which "
                f"{lock.holder()} holds while it makes room: it is stopped or hung. Continue "
                "(`kill -CONT`) or end that process, and retry. The new venv "
                f"{venv} was not kept."
            )
        time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
    try:
        yield
    finally:
        lock.release()


def make_room(
    venv: Venv, say: Callable[[str], None], deadline: float, settings: NodeSettings | None = None
) -> None:
    """Make the venv dir, with `venv` (built, not marked yet) in it, fit the budget (of
    `settings`, else this process's); `say` names each venv removed. Raises `OverBudget` if it
    cannot, `BudgetBusy` if another build holds the budget's lock until `deadline` (the
    build's, `time.monotonic`): the caller, who holds `venv`'s build lock, removes it."""
    limit = venv_dir_budget(settings)
    if limit is None:
        return
    root = venv.root
    with _one_at_a_time(root, venv.key, deadline):
        start = time.perf_counter()  # this build's own check and removals, not its wait
        for _round in range(ROUNDS):
            report = gc.collect(root, max_size_bytes=limit, ready=_READY)
            for d in report.removed:
                say(
                    f"removed venv {d.entry.key} ({d.entry.project}): {d.reason}, to keep the "
                    f"venv dir within its budget of {format_bytes(limit)}"
                )
            if report.remaining_bytes <= limit or not report.removed:
                break
    if report.remaining_bytes > limit:
        raise OverBudget(_over(venv, limit, report))
    say(
        f"the venv dir holds {format_bytes(report.remaining_bytes)} of its budget of "
        f"{format_bytes(limit)} (checked in {time.perf_counter() - start:.2f}s)"
    )


def _over(venv: Venv, limit: int, report: gc.GcReport) -> str:
    _, alone = disk.venv_size(venv.path)
    kept = [d for d in report.kept if d.entry.path != venv.path]
    reasons = "; ".join(f"{d.entry.key}: {d.reason}" for d in kept[:5])
    more = f"; and {len(kept) - 5} more" if len(kept) > 5 else ""
    return (
        f"uv_project: the venv dir {venv.root} would take {format_bytes(report.remaining_bytes)} "
        f"with the new venv {venv.key} ({format_bytes(alone)} on its own), over its budget "
        f"of {format_bytes(limit)} ({VENV_DIR_MAX_BYTES_ENV}), and no more venvs can be removed"
        f"{f' ({reasons}{more})' if kept else ''}. Raise {VENV_DIR_MAX_BYTES_ENV} on the nodes, "
        "remove venvs you no longer need (`ray-uv list`, `ray-uv gc`), or retry once the jobs "
        "that use them are done. The new venv was not kept."
    )
