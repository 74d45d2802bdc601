"""Venvs on disk, one per key: found without a subprocess, built once under a file lock.

Layout under the venv dir (`RAY_UV_PLUGIN_VENV_DIR`):
    <key>/                 the venv, made by `uv sync` with UV_PROJECT_ENVIRONMENT=<key>
    <key>/.ray-uv-ready    JSON metadata, written last: only a venv with it is ever used
    <key>.lock             the build lock (filelock), held while uv runs
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ray_uv_plugin.key import venv_key
from ray_uv_plugin.project import ProjectFiles, check_ray_pin, check_request
from ray_uv_plugin.spec import UvProjectSpec
from ray_uv_plugin.uv import UvSyncError, explain_failure, find_uv, run_uv

VENV_DIR_ENV = "RAY_UV_PLUGIN_VENV_DIR"
MARKER = ".ray-uv-ready"
DEFAULT_VENV_DIR = Path("~/.cache/ray-uv-plugin/venvs")


def venv_root() -> Path:
    return Path(os.environ.get(VENV_DIR_ENV) or DEFAULT_VENV_DIR).expanduser()


def lock_path(root: Path, key: str) -> Path:
    return root / f"{key}.lock"


@dataclass(frozen=True)
class Outcome:
    key: str
    path: Path
    built: bool
    seconds: float

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def find_ready(root: Path, key: str) -> Path | None:
    """The ready venv for `key`, touched as used; costs a stat and a utime, no subprocess."""
    path = root / key
    try:
        os.utime(path / MARKER)
    except FileNotFoundError:
        return None
    except PermissionError:
        pass  # a read-only shared venv dir: usable, its last use just goes unrecorded
    return path


def ensure_venv(
    spec: UvProjectSpec,
    files: ProjectFiles,
    extra_env: Mapping[str, str] | None = None,
    root: Path | None = None,
    logger: logging.Logger | None = None,
) -> Outcome:
    """Return the ready venv for this request, building it once per key across processes."""
    logger = logger or logging.getLogger(__name__)
    root = root or venv_root()
    start = time.perf_counter()
    ready = lookup(spec, files, root)
    if ready is not None:
        return ready
    root.mkdir(parents=True, exist_ok=True)
    key = venv_key(spec, files)
    with FileLock(lock_path(root, key)):
        if find_ready(root, key) is None:  # else another process built it while we waited
            _build(spec, files, root / key, extra_env or {}, logger)
            return Outcome(key, root / key, True, time.perf_counter() - start)
    return Outcome(key, root / key, False, time.perf_counter() - start)


def lookup(spec: UvProjectSpec, files: ProjectFiles, root: Path) -> Outcome | None:
    """The ready venv for this request, if there is one: the path every warm request takes."""
    start = time.perf_counter()
    key = venv_key(spec, files)
    path = find_ready(root, key)
    return None if path is None else Outcome(key, path, False, time.perf_counter() - start)


def sync_env(venv: Path, extra_env: Mapping[str, str]) -> dict[str, str]:
    """The node's environment, the runtime_env's env_vars over it, pointed at the venv."""
    # The node's own venv and lock mode must not leak into this sync.
    dropped = ("VIRTUAL_ENV", "UV_LOCKED", "UV_FROZEN")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update({k: os.path.expandvars(v) for k, v in extra_env.items()})
    env["UV_PROJECT_ENVIRONMENT"] = str(venv)
    env.setdefault("UV_PYTHON_DOWNLOADS", "never")
    return env


def _build(
    spec: UvProjectSpec,
    files: ProjectFiles,
    venv: Path,
    extra_env: Mapping[str, str],
    logger: logging.Logger,
) -> None:
    import ray

    check_request(files, spec)
    check_ray_pin(files, ray.__version__)
    if venv.exists():
        logger.info("uv_project %s: removing an unfinished build", venv.name)
        shutil.rmtree(venv)
    args = ["sync", "--project", str(files.path), *spec.sync_args(), "--python", sys.executable]
    logger.info("uv_project %s: building: %s %s", venv.name, find_uv(), " ".join(args))
    try:
        result = run_uv(
            args,
            sync_env(venv, extra_env),
            cwd=files.path,
            on_line=lambda line: logger.info("uv: %s", line),
        )
        if result.returncode != 0:
            raise UvSyncError(explain_failure(files.path, result))
        installed = installed_ray_version(venv)
        if installed != ray.__version__:
            raise UvSyncError(
                f"uv_project: the venv for {files.path} ({spec.describe()}) got ray "
                f"{installed or 'none'} but this node runs ray {ray.__version__}: make ray "
                f"=={ray.__version__} a dependency of the environment you ask for and run "
                "`uv lock`."
            )
        _write_marker(venv, spec, files, result.seconds)
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise


def installed_ray_version(venv: Path) -> str | None:
    for dist_info in venv.glob("lib/python*/site-packages/ray-*.dist-info"):
        return dist_info.name[len("ray-") : -len(".dist-info")]
    return None


def _write_marker(venv: Path, spec: UvProjectSpec, files: ProjectFiles, seconds: float) -> None:
    import ray

    meta = {
        "key": venv.name,
        "project": str(files.path),
        "extras": ["*"] if spec.all_extras else list(spec.extras),
        "groups": list(spec.groups),
        "ray": ray.__version__,
        "python": sys.version.split()[0],
        "built_at": time.time(),
        "build_seconds": round(seconds, 3),
    }
    tmp = venv / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, venv / MARKER)


def read_marker(venv: Path) -> dict | None:
    try:
        return json.loads((venv / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
