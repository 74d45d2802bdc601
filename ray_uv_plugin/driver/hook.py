"""Ray's runtime_env hook for drivers started with `uv run`: the job's workers get the node's
cached venv of the driver's project and selection, not one `uv run` each.

Ray calls `RAY_RUNTIME_ENV_HOOK` on the job's runtime_env in `ray.init`, but runs its own
`uv run` hook instead while `RAY_ENABLE_UV_RUN_RUNTIME_ENV` is on (the default since Ray 2.47),
so the setup (`ray-uv plugin-config --shell`, `ray_uv_plugin.setup_driver()`) names this hook
and turns Ray's off. Ray's own hook still runs inside ours: it keeps its `working_dir` default,
its checks that the project is inside the working_dir, and the job for every command line that
a `uv_project` value cannot express. Imports of Ray stay inside the hook: the setup runs before
every `ray start` and must not pay for them.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ray_uv_plugin.driver.uv_run import keeps_rays_uv_run, read_uv_run
from ray_uv_plugin.env.spec import FIELD
from ray_uv_plugin.settings import OWN_CHOICE_FIELDS, PREVIOUS_HOOK_ENV
from ray_uv_plugin.store import trust

logger = logging.getLogger(__name__)

HOOK_ENV = "RAY_RUNTIME_ENV_HOOK"
THIS_HOOK = "ray_uv_plugin.driver_hook.hook"
# The same hook for `ray-uv plugin-config --shell`, from a directory of its own on PYTHONPATH:
# there it must import in every driver of the node, also a `uv run` project's venv without us.
PORTABLE_HOOK = "ray_uv_plugin_hook.hook"
HOOK_PATH = Path(__file__).resolve().parents[1] / "hook_path"
OUR_HOOKS = (THIS_HOOK, PORTABLE_HOOK)
# Ray's own `uv run` hook: on while this is unset or true, and then it replaces ours.
RAY_UV_HOOK_ENV = "RAY_ENABLE_UV_RUN_RUNTIME_ENV"
RAY_UV_HOOK = "ray._private.runtime_env.uv_runtime_env_hook.hook"
# A job runtime_env with one of these chose its workers' Python itself: Ray's behaviour stays.
_OWN_CHOICE = (FIELD, *OWN_CHOICE_FIELDS)


def check_hook_dir(path: Path = HOOK_PATH) -> None:
    """Refuse to hand out `path` for PYTHONPATH where anyone but this user or root could change
    what is imported from it (`trust.untrusted_import_dir`): there it comes ahead of the standard
    library in every Python of the shell, so a `json.py` planted there runs as whoever imports
    `json`. The same for what the hook imports: in a Python without the plugin it loads the
    package `path` belongs to (its parent: `__init__.py` and every module below), so that
    package and everything in it is checked too, `path` among them. Raises
    `trust.UntrustedPathError` saying what to do."""
    package = path.parent
    found = trust.untrusted_import_dir(package)
    if found is None:
        return
    where, st, why = found
    fix = (
        "install ray-uv-plugin where only you or root can write (a venv or `uv tool install` "
        "of your own, or as root) and run it from there"
    )
    subject = "" if where == path else f"{where}: "
    writable = why in (trust.OTHERS_WRITE, trust.GROUP_WRITE)  # else: another install helps
    if writable and (where == package or package in where.parents):
        fix = f"`chmod -R go-w {shlex.quote(str(package))}` if those are your files, or {fix}"
    elif writable:
        quoted = shlex.quote(str(where))
        fix = f"`chmod go-w {quoted}` (or `chmod +t {quoted}`, sticky as /tmp), or {fix}"
    raise trust.UntrustedPathError(
        f"refusing the driver hook's directory {path} for PYTHONPATH: {subject}{why} "
        f"({trust.describe(st)}); every Python started from this shell would import from it "
        f"ahead of the standard library, and the hook there runs the package {package}, so "
        f"whoever can change either runs code as you: {fix}."
    )


def hook_settings(environ: Mapping[str, str], portable: bool) -> dict[str, str]:
    """The env vars that make drivers use this hook instead of Ray's `uv run` one. `portable`:
    for a shell whose drivers may run in other Pythons (`ray start`, `uv run`): by PYTHONPATH,
    whose directory must be trusted as the venv dir is (`check_hook_dir`); else for this
    process, which has imported us."""
    settings = {HOOK_ENV: PORTABLE_HOOK if portable else THIS_HOOK, RAY_UV_HOOK_ENV: "0"}
    if portable:
        check_hook_dir()
        paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(HOOK_PATH) not in paths:
            settings["PYTHONPATH"] = os.pathsep.join([str(HOOK_PATH), *paths])
    previous = environ.get(HOOK_ENV, "").strip()
    # Ray's `uv run` hook set as the hook (how Ray before 2.47 turned it on) is what ours
    # replaces; calling it first would leave its `uv run` interpreter in every job.
    if previous and previous not in (*OUR_HOOKS, RAY_UV_HOOK):
        settings[PREVIOUS_HOOK_ENV] = previous
    return settings


def _uv_run_cmdline() -> list[str] | None:
    """The command line of the nearest ancestor process that is `uv run`, as Ray finds it (a
    driver may be a child of a child of `uv run`)."""
    import ray  # noqa: F401 - Ray vendors psutil (`ray/thirdparty_files`) and puts it on sys.path

    psutil = importlib.import_module("psutil")  # so: after Ray

    for parent in psutil.Process().parents():
        try:
            cmdline = parent.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if len(cmdline) > 1 and os.path.basename(cmdline[0]) == "uv" and cmdline[1] == "run":
            return cmdline
    return None


def _load(path: str) -> Callable[[Any], Any]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _relative_project(project: Path, working_dir: str) -> str | None:
    """`project` as the workers' nodes see it: relative to the working_dir (".": the
    working_dir itself), or None where it is not inside it. A working_dir URI (Ray Jobs' upload)
    is the driver's current directory, unpacked."""
    base = Path(working_dir) if "://" not in working_dir else Path.cwd()
    try:
        return str(project.relative_to(base.resolve()))
    except ValueError:
        return None


def hook(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """Ray's `RAY_RUNTIME_ENV_HOOK`: under `uv run`, the job's `uv_project` default. It also
    arms the check, run once `ray.init()` has connected, that this Ray loads the plugin."""
    from ray_uv_plugin.registration import watch

    watch()
    previous = os.environ.get(PREVIOUS_HOOK_ENV)
    if previous and previous not in (*OUR_HOOKS, RAY_UV_HOOK):
        runtime_env = _load(previous)(runtime_env)
    runtime_env = dict(runtime_env or {})
    cmdline = _uv_run_cmdline()
    if cmdline is None:
        return runtime_env
    from ray._private.runtime_env import uv_runtime_env_hook

    # Raises, as without us, for `pip`/`uv` and for a project outside the working_dir.
    ray_env = uv_runtime_env_hook.hook(runtime_env)
    if any(field in runtime_env for field in _OWN_CHOICE):
        return ray_env
    driver = read_uv_run(cmdline, Path.cwd(), os.environ, platform.python_version())
    if driver.warning is not None:
        logger.warning(driver.warning)
        return ray_env
    assert driver.value is not None and driver.project is not None
    # Ray before 2.47 looks only at the driver's parent and sets no working_dir otherwise.
    working_dir = ray_env.setdefault("working_dir", os.getcwd())
    project = _relative_project(driver.project, working_dir)
    if project is None:
        why = f"the project {driver.project} is outside the working_dir {working_dir}"
        logger.warning(keeps_rays_uv_run(why + ", which is all that workers get"))
        return ray_env
    value = {k: v for k, v in driver.value.items() if k != "project"}
    if project != ".":
        value["project"] = project
    ray_env.pop("py_executable", None)
    ray_env[FIELD] = {**value, "job_default": True}
    return ray_env
