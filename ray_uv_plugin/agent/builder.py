"""The builder: the venv of a request, reused if ready, else built once under its key's lock.

Where venvs live and when one is ready is `store.layout`; this module finds a ready venv
without a subprocess (the warm path) and otherwise runs `uv sync` into `<key>`. Builds are bounded
(`RAY_UV_PLUGIN_BUILD_TIMEOUT_S`), run in a thread of their own so that a slow build never holds
up another key, and waits for another build of the same key are bounded and cancellable.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ray_uv_plugin.agent import failed_builds, seeding
from ray_uv_plugin.agent.project import (
    ProjectError,
    ProjectFiles,
    check_ray_pin,
    check_request,
    project_name,
)
from ray_uv_plugin.agent.request import (
    VenvRequest,
    interpreter_tag,
    make_request,
    withheld_from_uv,
)
from ray_uv_plugin.agent.spec import ParsedUvProject
from ray_uv_plugin.agent.uv import (
    UvResult,
    UvSyncError,
    UvTimeout,
    find_uv,
    run_uv,
    sync_failure,
)
from ray_uv_plugin.store import budget, freezing, manifest, trust
from ray_uv_plugin.store.build_lock import BUILD_TIMEOUT_ENV, LOCK_MARGIN, BuildLock, build_timeout
from ray_uv_plugin.store.build_slots import BuildSlot
from ray_uv_plugin.store.layout import (
    MARKER_FORMAT,
    check_ready,
    installed_ray_version,
    lock_path,
    remove_leftovers,
    site_packages,
    venv_root,
    write_marker,
)


@dataclass(frozen=True)
class Outcome:
    key: str
    path: Path
    built: bool
    seconds: float
    rebuilt_because: str | None = None  # a ready venv that was not whole any more

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def lookup(request: VenvRequest, root: Path) -> Outcome | None:
    """The ready venv for this request, if there is one: the path every warm request takes."""
    start = time.perf_counter()
    root = trust.check_root(root)  # resolved: what we check is what workers run
    if check_ready(root, request.key) is None:
        return Outcome(request.key, root / request.key, False, time.perf_counter() - start)
    return None


async def ensure_venv_async(
    request: VenvRequest,
    root: Path,
    logger: logging.Logger | None = None,
    timeout: float | None = None,
    lock_timeout: float | None = None,
) -> Outcome:
    """The ready venv for this request, built once per key across processes and hosts.

    Waiting for another build of the key happens here, on the event loop: cancelling the
    caller cancels the wait. The build runs in a thread of its own that holds the lock until
    uv is done (or killed at `timeout`), even if the caller was cancelled meanwhile.
    """
    logger = logger or logging.getLogger(__name__)
    timeout = build_timeout() if timeout is None else timeout
    lock_timeout = timeout + LOCK_MARGIN if lock_timeout is None else lock_timeout
    start = time.perf_counter()
    key = request.key
    try:
        ready = lookup(request, root)
    except FileNotFoundError:  # no venv dir yet
        ready = None
    if ready is not None:
        return ready
    root = trust.make_root(root)  # resolved: the lock, the build and the path handed out
    lock = BuildLock(lock_path(root, key))
    await lock.acquire_async(lock_timeout, request.what)
    try:
        why = check_ready(root, key)  # another process may have built it while we waited
        # Ray's agent retries a failed setup: not 3 builds
        sync_inputs = failed_builds.sync_inputs(request)
        failed = None if why is None else failed_builds.recent(root / key, sync_inputs)
    except BaseException:
        lock.release()
        raise
    if why is None:
        lock.release()
        return Outcome(key, root / key, False, time.perf_counter() - start)
    if failed is not None:
        lock.release()
        raise UvSyncError(failed)
    if why != "absent":
        logger.info("uv_project %s: rebuilding: %s", key, why)
    try:  # a build, and only a build, takes one of the venv dir's slots (`build_slots`)
        slot = BuildSlot(root)
        budget.venv_dir_budget()  # a bad setting fails before the build, not after
        waited = await slot.acquire_async(  # counted against `timeout`
            timeout, request.what, lambda line: logger.info("uv_project %s: %s", key, line)
        )
    except BaseException:
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
            result = _build(request, root / key, logger, timeout - waited)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            error = e
            if isinstance(e, UvSyncError) and not e.transient:
                failed_builds.remember(root / key, sync_inputs, str(e))
        finally:
            slot.release()
            lock.release()
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=build, name=f"uv_project build {key}", daemon=True).start()
    await done
    rebuilt = None if why == "absent" else why
    return Outcome(key, root / key, True, time.perf_counter() - start, rebuilt)


def ensure_venv(
    spec: ParsedUvProject,
    files: ProjectFiles,
    extra_env: Mapping[str, str] | None = None,
    root: Path | None = None,
    logger: logging.Logger | None = None,
    timeout: float | None = None,
    lock_timeout: float | None = None,
) -> Outcome:
    """`ensure_venv_async` for callers without an event loop (tools, tests, benchmarks)."""
    root = root or venv_root()
    request = make_request(spec, files, extra_env or {})
    return asyncio.run(ensure_venv_async(request, root, logger, timeout, lock_timeout))


def _no_space(venv: Path) -> str:
    free = shutil.disk_usage(venv.parent).free
    return (
        f"uv_project: the disk of the venv dir {venv.parent} is full ({free / 1024**2:.0f} MiB "
        f"free) while building {venv.name}: free space (`ray-uv gc --max-size ...`), or set "
        "RAY_UV_PLUGIN_VENV_DIR to a larger disk. Nothing half-built was kept."
    )


def _device(path: Path) -> int | None:
    """`st_dev` of `path`, or of its nearest existing ancestor (where uv would create it)."""
    for candidate in (path, *path.parents):
        try:
            return os.stat(candidate).st_dev
        except OSError:
            continue
    return None


def cache_split_note(uv_env: Mapping[str, str], venv_dir: Path, cwd: Path) -> str | None:
    """Why uv will copy every file into a venv of `venv_dir` instead of hardlinking it from its
    cache (the two are on different file systems), with the fix; None if it will not.

    One `uv cache dir` (a few ms, in uv's environment and the project's dir, where a uv.toml
    may set `cache-dir`) and two stats: asked per build, never per reuse."""
    no_cache = uv_env.get("UV_NO_CACHE", "").lower() in ("1", "true", "yes", "on")
    if no_cache or uv_env.get("UV_LINK_MODE") == "copy":  # copies whatever the volumes
        return None
    try:
        out = subprocess.run(
            [find_uv(), "cache", "dir"],
            env=dict(uv_env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # the build itself says what is wrong with uv
    cache = Path(out)
    cache_device, venv_device = _device(cache), _device(venv_dir)
    if not out or cache_device is None or cache_device == venv_device:
        return None
    return (
        f"the uv cache {cache} and the venv dir {venv_dir} are on different file systems, so "
        "uv copies every file into the venv instead of hardlinking it from the cache: builds "
        "take longer and each venv takes its full size on disk again. Put both on one volume: "
        f"set UV_CACHE_DIR to a directory on the venv dir's file system (e.g. "
        f"{venv_dir.parent / 'uv-cache'}) in the environment of `ray start` on every node"
    )


def _build(request: VenvRequest, venv: Path, logger: logging.Logger, timeout: float) -> float:
    """Build the venv (under the caller's lock); returns uv's time. Leaves nothing on failure."""
    import ray

    files, spec = request.files, request.spec
    check_request(files, spec)
    check_ray_pin(files, ray.__version__)
    if os.path.lexists(venv):
        freezing.remove_tree(venv)
    remove_leftovers(venv.parent, venv.name)  # of a receive that died
    project_fd = os.open(files.path, os.O_RDONLY | os.O_DIRECTORY)  # to tell if it is replaced
    scratch = _scratch_project(request, venv.parent) if spec.resolves else None
    project_dir = scratch or files.path
    args = ["sync", "--project", str(project_dir), *spec.sync_args(), "--python", sys.executable]
    for name in request.sources.copied_names:  # uv caches their builds by mtime
        args += ["--refresh-package", name]
    logger.info("uv_project %s: building: %s %s", venv.name, find_uv(), " ".join(args))
    if withheld := withheld_from_uv(request):
        shown = ", ".join(withheld[:12]) + (
            f" and {len(withheld) - 12} more" if len(withheld) > 12 else ""
        )
        logger.info(
            "uv_project %s: the job's env_vars %s are its workers' and do not reach uv; name one "
            "in uv_project.build_env_vars to build with it (it is then part of the key)",
            venv.name,
            shown,
        )
    env = {**request.uv_env, "UV_PROJECT_ENVIRONMENT": str(venv)}
    if split := cache_split_note(env, venv.parent, files.path):
        logger.warning("uv_project %s: %s.", venv.name, split)
    deadline = time.monotonic() + timeout

    def sync(sync_env: Mapping[str, str]) -> UvResult:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            result = run_uv(
                args,
                sync_env,
                cwd=files.path,
                on_line=lambda s: logger.info("uv: %s", s),
                timeout=left,
            )
        except UvTimeout:
            raise UvSyncError(
                f"uv_project: uv sync for {files.path} ran past {timeout:.0f}s and was killed "
                f"(key {venv.name}); raise {BUILD_TIMEOUT_ENV} on the nodes for very large "
                "envs, or check the network to the package index."
            ) from None
        if result.returncode != 0:
            if "No space left on device" in result.output:
                raise UvSyncError(f"{_no_space(venv)}\n--- uv output ---\n{result.tail(10)}")
            error = sync_failure(files.path, result)
            if _removed(files.path, project_fd):
                raise UvSyncError(
                    f"{error}\n(The project dir {files.path} was removed while uv ran, so the "
                    "build may succeed when tried again. Ray's working_dir plugin re-unpacks a "
                    "working_dir that another raylet sharing this host's session dir unpacked.)",
                    transient=True,
                )
            raise error
        return result

    try:
        result, taken = _sync_seeded(venv, env, sync, logger)
        installed = installed_ray_version(venv)
        if installed != ray.__version__:
            raise UvSyncError(
                f"uv_project: the venv for {files.path} ({spec.describe()}) got ray "
                f"{installed or 'none'} but this node runs ray {ray.__version__}: make ray "
                f"=={ray.__version__} a dependency of the environment you ask for and run "
                "`uv lock`."
            )
        listed = _write_manifest(venv, logger, taken.known if taken else None)
        try:  # the venv is whole but for its marker: what it adds to the venv dir is known
            budget.make_room(venv, lambda line: logger.info("uv_project %s: %s", venv.name, line))
        except budget.OverBudget as e:
            raise UvSyncError(str(e)) from None
        immutable = freezing.freeze(venv)
        if os.geteuid() == 0 and not immutable:
            logger.warning("uv_project %s: %s.", venv.name, freezing.unfrozen_note())
        built = taken.as_json() if taken else {"how": "full"}
        _write_marker(venv, request, result.seconds, immutable, {**listed, "built": built})
    except OSError as e:
        freezing.remove_tree(venv)
        if e.errno == errno.ENOSPC:
            raise UvSyncError(_no_space(venv)) from e
        raise
    except BaseException:
        freezing.remove_tree(venv)
        raise
    finally:
        os.close(project_fd)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return result.seconds


def _sync_seeded(
    venv: Path,
    env: Mapping[str, str],
    sync: Callable[[Mapping[str, str]], UvResult],
    logger: logging.Logger,
) -> tuple[UvResult, seeding.Taken | None]:
    """`uv sync` into `venv`, seeded from the nearest ready venv where one may give bytecode
    (`agent.seeding`); returns uv's result (both runs' seconds) and what the seed gave (None:
    a full build). A seed that cannot be used gives a full build, and the log says why."""
    compiles = env.get("UV_COMPILE_BYTECODE", "").lower() in ("1", "true", "yes", "on")
    interpreter = interpreter_tag()
    if not compiles or not seeding.has_candidates(venv.parent, venv.name, interpreter):
        return sync(env), None
    first = sync({**env, "UV_COMPILE_BYTECODE": "0"})
    start = time.perf_counter()
    taken = None
    try:
        seed = seeding.choose(venv.parent, venv, interpreter)
        if seed is not None:
            taken = seeding.take_bytecode(seed, venv)
            logger.info(
                "uv_project %s: seeded from %s: the bytecode of %d distributions (%d files, "
                "%.0f MB) in %.2fs",
                venv.name,
                taken.seed,
                taken.distributions,
                taken.files,
                taken.bytes / 1e6,
                time.perf_counter() - start,
            )
    except Exception as e:
        if not seeding.untrusted_seed(e):
            raise
        logger.warning("uv_project %s: %s; a full build instead.", venv.name, e)
        freezing.remove_tree(venv)
        taken = None
    second = sync(env)  # uv's bytecode step: what the seed did not give (or all of it)
    return replace(second, seconds=first.seconds + second.seconds), taken


def _removed(path: Path, fd: int) -> bool:
    """Whether the directory opened as `fd` was removed (or replaced) since."""
    opened = os.fstat(fd)
    try:
        return opened.st_nlink == 0 or not os.path.samestat(opened, os.stat(path))
    except FileNotFoundError:
        return True


def _scratch_project(request: VenvRequest, root: Path) -> Path:
    """`locked: false` lets uv re-lock; it does so in a private copy of the project's metadata,
    never in the project (a job's working_dir or a shared dir that other jobs read).

    The copy lives in the venv dir, whose ancestors are trusted: uv looks for config files in
    the directories above a project, and anyone may write `/tmp/uv.toml`."""
    files = request.files
    if request.points_into_project:
        raise ProjectError(
            f"uv_project: locked: false would re-lock {files.path}, whose lock has path or "
            "editable sources (or install_project is set) that only resolve in place, and the "
            "plugin never rewrites a project's uv.lock: run `uv lock` and use the default "
            "locked: true, or frozen: true to use the lock as it is."
        )
    scratch = Path(tempfile.mkdtemp(prefix=f"{request.key}.locked-false-", dir=root))
    (scratch / "pyproject.toml").write_bytes(files.pyproject)
    (scratch / "uv.lock").write_bytes(files.lock)
    for config in request.config_files:  # a uv.toml, beside the project or above it
        if config.path.name == "uv.toml":
            shutil.copyfile(config.path, scratch / "uv.toml")
    return scratch


def _site_packages(venv: Path) -> str:
    site = site_packages(venv)
    if site is None:
        raise UvSyncError(f"uv_project: uv made {venv} without a site-packages dir.")
    return str(site.relative_to(venv))


def _write_manifest(
    venv: Path,
    logger: logging.Logger,
    known: Mapping[str, tuple[int, manifest.Entry]] | None = None,
) -> dict[str, Any]:
    """The venv's manifest (`store.manifest`), before it is frozen; returns what the marker
    records of it: its sha256, and the files that differ from their distribution's RECORD.
    Such a file was changed in uv's cache (through another venv's hardlink to it), or its
    wheel's RECORD is wrong (some are): the venv is used here, with a warning, and never sent
    to another node (`ship.archive.Packer`), which builds its own."""
    start = time.perf_counter()
    files = manifest.scan(venv, known)  # a seed's bytecode was read as it was linked
    listed: dict[str, Any] = {}
    mismatches = manifest.records(venv, files)
    if mismatches:
        files_named = ", ".join(mismatches[:5]) + (", ..." if len(mismatches) > 5 else "")
        logger.warning(
            f"uv_project {venv.name}: {len(mismatches)} installed files differ from their "
            f"distribution's RECORD: {files_named}. A file changed in uv's cache (through a "
            "hardlink to it) reaches every venv made from it: `uv cache clean <package>` and "
            "rebuild; a wheel whose RECORD is wrong is the wheel's fault. The venv is used "
            "here, and never sent to other nodes."
        )
        listed[manifest.NOT_AS_RECORDED] = {"count": len(mismatches), "first": mismatches[:5]}
    listed["manifest"] = manifest.write(venv, files)
    size = sum(entry.size for entry in files.values())
    logger.info(
        "uv_project %s: manifest of %d entries (%.0f MB) in %.2fs",
        venv.name,
        len(files),
        size / 1e6,
        time.perf_counter() - start,
    )
    return listed


def _write_marker(
    venv: Path, request: VenvRequest, seconds: float, immutable: bool, listed: Mapping[str, Any]
) -> None:
    import ray

    spec = request.spec
    write_marker(
        venv,
        {
            "format": MARKER_FORMAT,
            "key": venv.name,
            "name": project_name(request.files),
            "project": str(request.files.path),
            "extras": ["*"] if spec.all_extras else list(spec.extras),
            "groups": list(spec.groups),
            "ray": ray.__version__,
            "python": sys.version.split()[0],
            "site_packages": _site_packages(venv),
            "built_at": time.time(),
            "build_seconds": round(seconds, 3),
            "immutable": immutable,  # chattr +i below the top dir (root only), else modes alone
            "inputs": request.inputs.as_json(),
            **listed,  # the manifest's sha256, files not as their RECORD says: `_write_manifest`
        },
    )
