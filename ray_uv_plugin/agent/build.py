"""One build of a venv, under its key's lock (`builder`): `uv sync` into `<key>`, seeded from a
ready venv where that gives bytecode, then the checks, the budget, the freeze and the marker.
A build that fails leaves nothing behind; its error says what to do."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from ray_uv_plugin.agent import bytecode, seeding
from ray_uv_plugin.agent.build_record import write_manifest, write_marker_of
from ray_uv_plugin.agent.cache_split import cache_split_note
from ray_uv_plugin.agent.project import ProjectError, check_ray_pin, check_request
from ray_uv_plugin.agent.request import VenvRequest, interpreter_tag, withheld_from_uv
from ray_uv_plugin.agent.uv import UvResult, UvSyncError, UvTimeout, find_uv, run_uv, sync_failure
from ray_uv_plugin.store import budget, freezing
from ray_uv_plugin.store.build_lock import BUILD_TIMEOUT_ENV
from ray_uv_plugin.store.layout import installed_ray_version, remove_leftovers, site_packages


def no_space(venv: Path, doing: str = "building") -> str:
    """What a full venv dir's disk says, for a build or a received venv (`ship.actors`)."""
    free = shutil.disk_usage(venv.parent).free
    return (
        f"uv_project: the disk of the venv dir {venv.parent} is full ({free / 1024**2:.0f} MiB "
        f"free) while {doing} {venv.name}: free space (`ray-uv gc --max-size ...`), or set "
        "RAY_UV_PLUGIN_VENV_DIR to a larger disk. Nothing half-built was kept."
    )


def build_venv(request: VenvRequest, venv: Path, logger: logging.Logger, timeout: float) -> float:
    """Build the venv (under the caller's lock); returns uv's time. Leaves nothing on failure."""
    import ray

    files, spec = request.files, request.spec
    check_request(files, spec)
    check_ray_pin(files, ray.__version__)
    if os.path.lexists(venv):
        freezing.remove_tree(venv)
    remove_leftovers(venv.parent, venv.name)  # of a receive that died
    project_fd = os.open(files.path, os.O_RDONLY | os.O_DIRECTORY)  # to tell if it is replaced
    scratch = scratch_project(request, venv.parent) if spec.resolves else None
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
                raise UvSyncError(f"{no_space(venv)}\n--- uv output ---\n{result.tail(10)}")
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
        result, taken = _sync_seeded(venv, env, sync, logger, deadline)
        installed = installed_ray_version(venv)
        if installed != ray.__version__:
            raise UvSyncError(
                f"uv_project: the venv for {files.path} ({spec.describe()}) got ray "
                f"{installed or 'none'} but this node runs ray {ray.__version__}: make ray "
                f"=={ray.__version__} a dependency of the environment you ask for and run "
                "`uv lock`."
            )
        listed = write_manifest(venv, logger, taken)
        try:  # the venv is whole but for its marker: what it adds to the venv dir is known
            budget.make_room(
                venv, lambda line: logger.info("uv_project %s: %s", venv.name, line), deadline
            )
        except budget.OverBudget as e:
            raise UvSyncError(str(e)) from None
        except budget.BudgetBusy as e:  # the next try may find the lock free
            raise UvSyncError(str(e), transient=True) from None
        immutable = freezing.freeze(venv)
        if os.geteuid() == 0 and not immutable:
            logger.warning("uv_project %s: %s.", venv.name, freezing.unfrozen_note())
        built = taken.as_json() if taken else {"how": "full"}
        write_marker_of(venv, request, result.seconds, immutable, {**listed, "built": built})
    except OSError as e:
        freezing.remove_tree(venv)
        if e.errno == errno.ENOSPC:
            raise UvSyncError(no_space(venv)) from e
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
    deadline: float,
) -> tuple[UvResult, seeding.Taken | None]:
    """`uv sync` into `venv`, seeded from the nearest ready venv where one may give bytecode
    (`agent.seeding`); returns uv's result (with the seconds of any second run) and what the
    seed gave (None: a full build). A seed that cannot be used gives a full build, and the log
    says why."""
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
    if taken is not None:  # compile what the seed did not give: the changed distributions
        start = time.perf_counter()
        site = site_packages(venv)
        assert site is not None  # the seed's bytecode went into it
        try:
            count = bytecode.compile_missing(site, env, max(deadline - time.monotonic(), 1.0))
        except bytecode.CompileError as e:
            logger.warning("uv_project %s: %s; uv compiles instead.", venv.name, e)
        else:
            logger.info(
                "uv_project %s: compiled the %d modules the seed did not give in %.2fs",
                venv.name,
                count,
                time.perf_counter() - start,
            )
            return first, taken
    second = sync(env)  # uv's bytecode step: what the seed did not give (or all of it)
    return replace(second, seconds=first.seconds + second.seconds), taken


def _removed(path: Path, fd: int) -> bool:
    """Whether the directory opened as `fd` was removed (or replaced) since."""
    opened = os.fstat(fd)
    try:
        return opened.st_nlink == 0 or not os.path.samestat(opened, os.stat(path))
    except FileNotFoundError:
        return True


def scratch_project(request: VenvRequest, root: Path) -> Path:
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
