"""One build of a venv, under its key's lock (`ensure`): `uv sync` into `<key>`, seeded from a
ready venv where that gives bytecode, then the checks, the budget, the freeze and the marker.
A build that fails leaves nothing behind; its error says what to do."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from ray_uv_plugin.building import bytecode, seeding
from ray_uv_plugin.building.phase_events import PhaseEvents
from ray_uv_plugin.building.record import Bytecode, write_manifest, write_marker_of
from ray_uv_plugin.env import image
from ray_uv_plugin.env.cache_split import cache_split_note, uv_cache_dir
from ray_uv_plugin.env.key import VenvRequest, interpreter_tag, withheld_from_uv
from ray_uv_plugin.env.project import (
    ProjectError,
    check_ray_pin,
    check_request,
    locked_sources,
)
from ray_uv_plugin.env.uv import UvResult, UvSyncError, UvTimeout, find_uv, run_uv, sync_failure
from ray_uv_plugin.settings import BUILD_TIMEOUT_ENV, NodeSettings, boolish
from ray_uv_plugin.store import accounting, budget, freezing, manifest, tree
from ray_uv_plugin.store.disk import NO_SPACE, disk_full
from ray_uv_plugin.store.layout import Venv, installed_ray_version


def build_venv(
    request: VenvRequest,
    venv: Venv,
    logger: logging.Logger,
    timeout: float,
    events: PhaseEvents,
    settings: NodeSettings | None = None,
) -> float:
    """Build the venv (under the caller's lock), telling `events` each phase; returns uv's
    time. Leaves nothing on failure. `settings`: the node's (else this process's), for the
    budget."""
    import ray

    files, spec = request.files, request.spec
    check_request(files, spec)
    check_ray_pin(files, ray.__version__)
    if os.path.lexists(venv.path):
        freezing.remove_tree(venv.path)
    venv.remove_leftovers()  # of a receive that died
    project_fd = os.open(files.path, os.O_RDONLY | os.O_DIRECTORY)  # to tell if it is replaced
    scratch = scratch_project(request, venv.root) if spec.resolves else None
    project_dir = scratch or files.path
    command = request.sync_command(venv.path, project_dir)
    args, left, lock = list(command.args), list(command.left_out), command.lock
    logger.info("uv_project %s: building: %s %s", venv.key, find_uv(), " ".join(args))
    if withheld := withheld_from_uv(request):
        shown = ", ".join(withheld[:12]) + (
            f" and {len(withheld) - 12} more" if len(withheld) > 12 else ""
        )
        logger.info(
            "uv_project %s: the job's env_vars %s are its workers' and do not reach uv; name one "
            "in uv_project.build_env_vars to build with it (it is then part of the key)",
            venv.key,
            shown,
        )
    env = dict(command.env)
    if split := cache_split_note(env, venv.root, files.path):
        logger.warning("uv_project %s: %s.", venv.key, split)
    deadline = time.monotonic() + timeout

    def said(line: str) -> None:
        logger.info("uv: %s", line)
        events.uv_line(line)

    def sync(sync_env: Mapping[str, str]) -> UvResult:
        left = max(deadline - time.monotonic(), 1.0)
        events.enter("download")
        try:
            result = run_uv(
                args,
                sync_env,
                cwd=command.cwd,
                on_line=said,
                timeout=left,
            )
        except UvTimeout:
            raise UvSyncError(
                f"uv_project: uv sync for {files.path} ran past {timeout:.0f}s and was killed "
                f"(key {venv.key}); raise {BUILD_TIMEOUT_ENV} on the nodes for very large "
                "envs, or check the network to the package index."
            ) from None
        if result.returncode != 0:
            if "No space left on device" in result.output:
                full = disk_full(venv.root, f"while building {venv.key}")
                raise UvSyncError(f"{full}\n--- uv output ---\n{result.tail(10)}")
            error = sync_failure(files.path, result)
            if _removed(files.path, project_fd):
                raise UvSyncError(
                    f"{error}\n(The project dir {files.path} was removed while uv ran, so the "
                    "build may succeed when tried again. Ray's working_dir plugin re-unpacks a "
                    "working_dir that another raylet sharing this host's session dir unpacked.)",
                    transient=True,
                )
            raise error
        _took(logger, venv, "sync", result.seconds)
        return result

    try:
        if spec.from_image:  # made first, so that a build without isolation sees the image
            _layered_venv(venv, env, files.path, deadline)
        result, recorded, compiled, listed = _sync_and_compile(
            venv, env, sync, logger, deadline, events
        )
        if spec.from_image:  # the image's packages: seen, left out, checked (`env.image`)
            image.write_pth(venv.path, image.site_dirs())
            site_dir = venv.site_packages()
            assert site_dir is not None  # `write_pth` found it
            listed.relist([str((site_dir / accounting.IMAGE_PTH).relative_to(venv.path))])
            extras = None if spec.all_extras else spec.extras
            image.check_venv(venv.path, request.inputs.selection["image"], left, lock, extras)
        installed = installed_ray_version(venv.path)
        if installed != ray.__version__:
            raise UvSyncError(
                f"uv_project: the venv for {files.path} ({spec.describe()}) got ray "
                f"{installed or 'none'} but this node runs ray {ray.__version__}: make ray "
                f"=={ray.__version__} a dependency of the environment you ask for and run "
                "`uv lock`."
            )
        locked = (  # the lock uv installed from: the project's, or one `locked: false` made
            locked_sources(files).distributions
            if project_dir == files.path
            else accounting.locked_distributions((project_dir / "uv.lock").read_bytes())
        )
        events.enter("manifest")
        manifest_start = time.perf_counter()
        made = write_manifest(
            venv, logger, recorded, compiled, locked, listed, lambda: uv_cache_dir(env, files.path)
        )
        _took(logger, venv, "manifest", time.perf_counter() - manifest_start)
        try:  # the venv is whole but for its marker: what it adds to the venv dir is known
            budget.make_room(
                venv,
                lambda line: logger.info("uv_project %s: %s", venv.key, line),
                deadline,
                settings,
            )
        except budget.OverBudget as e:
            raise UvSyncError(str(e)) from None
        except budget.BudgetBusy as e:  # the next try may find the lock free
            raise UvSyncError(str(e), transient=True) from None
        # Its own bytecode read-only (a seed's is linked into other venvs), never uv's files.
        freeze_start = time.perf_counter()
        listed.relist([manifest.PARTS])  # its fragments' dir, frozen with the rest
        immutable = freezing.freeze(venv.path, compiled.paths - recorded.hashes.keys(), listed)
        _took(logger, venv, "freeze", time.perf_counter() - freeze_start)
        if os.geteuid() == 0 and not immutable:
            logger.warning("uv_project %s: %s.", venv.key, freezing.unfrozen_note())
        taken = compiled.taken
        built = taken.as_json() if taken else {"how": "full"}
        write_marker_of(venv, request, result.seconds, immutable, {**made, "built": built})
    except OSError as e:
        freezing.remove_tree(venv.path)
        if e.errno in NO_SPACE:
            raise UvSyncError(disk_full(venv.root, f"while building {venv.key}")) from e
        raise
    except BaseException:
        freezing.remove_tree(venv.path)
        raise
    finally:
        os.close(project_fd)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return result.seconds


def _layered_venv(venv: Venv, env: Mapping[str, str], cwd: Path, deadline: float) -> None:
    """The venv of a `from_image` request, made before `uv sync` with its `.pth` naming the
    image's site-packages (`env.image`): a package that `uv sync` builds without isolation
    (`no-build-isolation-package`) then compiles against the image's torch."""
    left = max(deadline - time.monotonic(), 1.0)
    args = ["venv", "--quiet", "--python", sys.executable, str(venv.path)]
    made = run_uv(args, dict(env), cwd, timeout=left)
    if made.returncode != 0:
        raise UvSyncError(f"uv_project: `uv venv {venv.path}` failed:\n{made.tail(10)}")
    image.write_pth(venv.path, image.site_dirs())


def _sync_and_compile(
    venv: Venv,
    env: Mapping[str, str],
    sync: Callable[[Mapping[str, str]], UvResult],
    logger: logging.Logger,
    deadline: float,
    events: PhaseEvents,
) -> tuple[UvResult, accounting.Recorded, Bytecode, tree.Tree]:
    """`uv sync` into `venv` without bytecode, the bytecode of the nearest ready venv where one
    may give it (`building.seeding`), then the modules still without bytecode compiled
    (`building.bytecode`): so the build knows every `.pyc` it made. Returns uv's result (with the
    seconds of any second run), the distributions' RECORDs, the bytecode's record, and the
    venv's entries (`store.tree`: listed once, for the manifest and the freeze). A seed that
    cannot be used gives a full build, and the log says why."""
    compiles = bool(boolish(env.get("UV_COMPILE_BYTECODE")))  # as uv reads it
    no_bytecode = {**env, "UV_COMPILE_BYTECODE": "0"}
    result = sync(no_bytecode)
    if not compiles:
        recorded = accounting.read_records(venv.path)  # uv wrote each as it installed
        return result, recorded, Bytecode("none", frozenset()), tree.collect(venv.path)
    events.enter("bytecode")
    start = time.perf_counter()
    seed = None
    if seeding.has_candidates(venv, interpreter_tag()):
        seed = _choose(venv, logger)  # and its dirs made while the venv is listed
    chosen = time.perf_counter() - start
    start = time.perf_counter()
    try:
        listed = tree.collect(venv.path)
    finally:  # every thread done before anything else touches the venv
        if seed is not None:
            seed[1].made()
    listing = time.perf_counter() - start
    _took(logger, venv, "listing", listing)
    taken = None
    if seed is not None:
        start = time.perf_counter()
        taken = _take(venv, *seed, listed, logger)
        _took(logger, venv, "seeding", chosen + time.perf_counter() - start)
        if taken is None:  # an untrusted seed: from the start
            second = sync(no_bytecode)
            result = replace(second, seconds=result.seconds + second.seconds)
            listed = tree.collect(venv.path)
    # uv wrote each RECORD as it installed; compiling adds none
    recorded = accounting.read_records(venv.path)
    site = venv.site_packages()
    if site is None:
        raise UvSyncError(f"uv_project: uv made {venv.path} without a site-packages dir.")
    start = time.perf_counter()
    shipped = {f"{venv.path}/{path}" for path in recorded.hashes if path.endswith(".pyc")}
    sources = list(bytecode.missing(listed, site, shipped))  # `shipped`: as uv's step does
    top = len(str(venv.path)) + 1
    written = {bytecode.compiled_path(source)[top:] for source in sources}
    paths = set(written)
    if taken is not None:
        paths.update(taken.known)
    try:
        bytecode.compile_sources(site, sources, env, max(deadline - time.monotonic(), 1.0))
        _took(logger, venv, "compile", time.perf_counter() - start)
    except bytecode.CompileError as e:
        logger.warning("uv_project %s: %s; uv compiles instead.", venv.key, e)
        if taken is not None:  # uv's step may write anywhere: every part is listed anew
            taken.listings.clear()
        second = sync(env)  # uv's bytecode step: the same sources, and the venv's `.pth` files
        listed = tree.collect(venv.path)
        if taken is not None:
            seeding.remove_empty(listed, taken)
        return (
            replace(second, seconds=result.seconds + second.seconds),
            recorded,
            Bytecode("uv", frozenset(paths), taken),
            listed,
        )
    listed.relist({path.rpartition("/")[0] for path in written})  # the `__pycache__` dirs
    if taken is not None:  # a part the compile step wrote into is not the one seeding listed
        prefix = f"{site.relative_to(venv.path)}/"
        for path in written:
            taken.listings.pop(manifest.part_of(path, prefix), None)
        seeding.remove_empty(listed, taken)
    logger.info(
        "uv_project %s: compiled the %d modules %s in %.2fs (the venv's %d entries listed in "
        "%.2fs)",
        venv.key,
        len(sources),
        "the seed did not give" if taken is not None else "of the venv",
        time.perf_counter() - start,
        len(listed.entries),
        listing,
    )
    return result, recorded, Bytecode("plugin", frozenset(paths), taken), listed


def _choose(venv: Venv, logger: logging.Logger) -> tuple[seeding.Seed, seeding.CacheDirs] | None:
    """The nearest ready venv that may give `venv` bytecode (`seeding`), and its dirs, being
    made; None where there is none, or it cannot be used (the log says why)."""
    site = venv.site_packages()
    if site is None:
        return None
    try:
        seed = seeding.choose(venv, interpreter_tag(), seeding.record_digests(site))
        if seed is None:
            return None
        return seed, seeding.CacheDirs(seed, venv.path)
    except Exception as e:
        if not seeding.untrusted_seed(e):
            raise
        logger.warning("uv_project %s: %s; a full build instead.", venv.key, e)
        return None


def _take(
    venv: Venv,
    seed: seeding.Seed,
    dirs: seeding.CacheDirs,
    listed: tree.Tree,
    logger: logging.Logger,
) -> seeding.Taken | None:
    """The seed's bytecode linked into `venv` (`seeding`), and listed into `listed`; None where
    the seed cannot be used (the log says why): `venv` was then removed, to be synced anew."""
    start = time.perf_counter()
    try:
        taken = seeding.take_bytecode(seed, venv.path, listed, dirs)
    except Exception as e:
        if not seeding.untrusted_seed(e):
            raise
        logger.warning("uv_project %s: %s; a full build instead.", venv.key, e)
        freezing.remove_tree(venv.path)
        return None
    logger.info(
        "uv_project %s: seeded from %s: the bytecode of %d distributions (%d files, %.0f MB) "
        "in %.2fs",
        venv.key,
        taken.seed,
        taken.distributions,
        taken.files,
        taken.bytes / 1e6,
        time.perf_counter() - start,
    )
    return taken


def _took(logger: logging.Logger, venv: Venv, step: str, seconds: float) -> None:
    """One step of a build with its seconds, a line of the setup log each (sync, seeding,
    compile, manifest, freeze): where a build's time went (`benchmarks.edit_run` reads them)."""
    logger.info("uv_project %s: step %s took %.2fs", venv.key, step, seconds)


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
