"""The venv of a request, reused if ready, else built once under its key's lock.

Where venvs live and when one is ready is `store.layout`; this module finds a ready venv
without a subprocess (the warm path) and otherwise builds `<key>` (`steps`). Builds are bounded
(`RAY_UV_PLUGIN_BUILD_TIMEOUT_S`), run in a thread of their own so that a slow build never holds
up another key, and waits for another build of the same key are bounded and cancellable.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_uv_plugin.building import failed_builds
from ray_uv_plugin.building.phase_events import PhaseEvents
from ray_uv_plugin.building.steps import build_venv
from ray_uv_plugin.env.key import VenvRequest, make_request
from ray_uv_plugin.env.project import ProjectFiles
from ray_uv_plugin.env.spec import ParsedUvProject
from ray_uv_plugin.env.uv import UvSyncError
from ray_uv_plugin.settings import NodeSettings
from ray_uv_plugin.store import budget, outcomes, trust
from ray_uv_plugin.store.build_lock import LOCK_MARGIN, BuildLock, build_timeout
from ray_uv_plugin.store.build_slots import BuildSlot, max_builds
from ray_uv_plugin.store.layout import Venv, VenvDir, venv_root
from ray_uv_plugin.store.setup_state import made_how


@dataclass(frozen=True)
class Outcome:
    key: str
    path: Path
    built: bool
    seconds: float
    rebuilt_because: str | None = None  # a ready venv that was not whole any more
    # A reused venv's marker, as read: for its setup log line, not part of what it is.
    marker: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def venv(self) -> Venv:
        return Venv.at(self.path)


def lookup(request: VenvRequest, root: Path) -> Outcome | None:
    """The ready venv for this request, if there is one: the path every warm request takes."""
    start = time.perf_counter()
    root = trust.check_root(root)  # resolved: what we check is what workers run
    venv = VenvDir(root).venv(request.key)
    if ready := venv.check_ready():
        took = time.perf_counter() - start
        return Outcome(venv.key, venv.path, False, took, marker=ready.marker)
    return None


async def ensure_venv_async(
    request: VenvRequest,
    root: Path,
    logger: logging.Logger | None = None,
    timeout: float | None = None,
    lock_timeout: float | None = None,
    settings: NodeSettings | None = None,
) -> Outcome:
    """The ready venv for this request, built once per key across processes and hosts.

    Waiting for another build of the key happens here, on the event loop: cancelling the
    caller cancels the wait. The build runs in a thread of its own that holds the lock until
    uv is done (or killed at `timeout`), even if the caller was cancelled meanwhile. The
    node's settings are `settings` (else this process's, read once here) for the whole
    request: its timeout, build slots, budget and failed-build memo.
    """
    settings = settings or NodeSettings.read()
    logger = logger or logging.getLogger(__name__)
    timeout = build_timeout(settings) if timeout is None else timeout
    lock_timeout = timeout + LOCK_MARGIN if lock_timeout is None else lock_timeout
    start = time.perf_counter()
    key = request.key
    try:
        ready = lookup(request, root)
    except FileNotFoundError:  # no venv dir yet
        ready = None
    if ready is not None:
        outcomes.record(ready.venv.root, key, "reused")
        return ready
    root = trust.make_root(root)  # resolved: the lock, the build and the path handed out
    venv = VenvDir(root).venv(key)
    lock = BuildLock(venv.lock)

    def say(line: str) -> None:
        logger.info("uv_project %s: %s", key, line)

    if not lock.try_acquire():  # the holder's phase record says what it does meanwhile
        say(f"phase: lock wait (another build or receive of this key: {lock.holder()})")
        await lock.acquire_async(lock_timeout, request.what)
    try:
        ready = venv.check_ready()  # another process may have built it meanwhile
        why = ready.why_not
        # Ray's agent retries a failed setup: not 3 builds
        sync_inputs = "" if why is None else failed_builds.sync_inputs(request, venv.path)
        failed = None if why is None else failed_builds.recent(venv, sync_inputs, settings)
    except BaseException:
        lock.release()
        raise
    if why is None:
        lock.release()
        outcomes.record(root, key, "reused")
        return Outcome(key, venv.path, False, time.perf_counter() - start, marker=ready.marker)
    if failed is not None:
        lock.release()
        outcomes.record(root, key, "failed")
        raise failed
    if why != "absent":
        logger.info("uv_project %s: rebuilding: %s", key, why)
    events = PhaseEvents(root, key, say)
    try:  # a build, and only a build, takes one of the venv dir's slots (`build_slots`)
        slot = BuildSlot(root, max_builds(settings))
        budget.venv_dir_budget(settings)  # a bad setting fails before the build, not after

        def queued(line: str) -> None:  # its first line: the request must wait for a slot
            say(line)
            events.enter("build-slot queue", "queued", ticket=slot.name)

        waited = await slot.acquire_async(timeout, request.what, queued)  # counted in `timeout`
    except BaseException as e:
        if isinstance(e, Exception):
            events.failed(str(e))
            outcomes.record(root, key, "failed")
        else:  # cancelled
            events.clear()
        lock.release()
        raise
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()

    def settle(result: float | None, error: BaseException | None) -> None:
        if done.done():
            return  # the request was cancelled; the build's outcome is for the next one
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def build() -> None:
        result, error = None, None
        try:
            result = build_venv(request, venv, logger, timeout - waited, events, settings)
            events.clear()
            outcomes.record(root, key, made_how(venv.read_marker()) or "built")
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            error = e
            events.failed(str(e))
            outcomes.record(root, key, "failed")
            if isinstance(e, UvSyncError) and not e.transient:
                failed_builds.remember(venv, sync_inputs, str(e), settings)
        finally:
            slot.release()
            lock.release()
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=build, name=f"uv_project build {key}", daemon=True).start()
    await done
    rebuilt = None if why == "absent" else why
    return Outcome(key, venv.path, True, time.perf_counter() - start, rebuilt)


def ensure_venv(
    spec: ParsedUvProject,
    files: ProjectFiles,
    extra_env: Mapping[str, str] | None = None,
    root: Path | None = None,
    logger: logging.Logger | None = None,
    timeout: float | None = None,
    lock_timeout: float | None = None,
    settings: NodeSettings | None = None,
) -> Outcome:
    """`ensure_venv_async` for callers without an event loop (tools, tests, benchmarks)."""
    settings = settings or NodeSettings.read()
    root = root or venv_root(settings)
    request = make_request(spec, files, extra_env or {})
    return asyncio.run(ensure_venv_async(request, root, logger, timeout, lock_timeout, settings))
