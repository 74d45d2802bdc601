"""Whether a build of the lock builds anything from source on this node.

A wheel comes by the URL and hash that uv.lock records: whatever proxy, CA or index answers, the
venv holds those bytes or the build fails. A build from source does not: its build requirements
resolve from the indexes uv is given, and its build backend or a build hook may download what it
likes through the proxy it is given. So where the lock builds anything from source, the
settings of `uv_env.SOURCE_FETCH_VARS` are keyed (`key.make_request`), and with wheels only
they are not, which keeps those keys as they were.

From source means: a `git` source; a `directory` or `editable` one (the project itself only
with `install_project`); a `path` or `url` source that is no wheel; a registry package with an
sdist and no wheel this interpreter can install; and every package where the config or the
environment says `no-binary`. A package with an sdist and only wheels of other platforms counts
too, though its markers may leave it out here: keying more only splits venvs.

The lock is parsed once per content and asked only where a `SOURCE_FETCH_VARS` setting is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from ray_uv_plugin.env.project import ConfigFile, LockMemo, ProjectFiles, lock_packages
from ray_uv_plugin.env.uv_cache import read_regular

NO_BINARY_VARS = ("UV_NO_BINARY", "UV_NO_BINARY_PACKAGE")


@cache
def _supported() -> frozenset[str]:
    """The wheel tags this interpreter installs (`py3-none-any`, `cp312-cp312-manylinux...`)."""
    return frozenset(str(tag) for tag in sys_tags())


def _installs_a_wheel(package: dict) -> bool:
    for wheel in package.get("wheels") or ():
        if not isinstance(wheel, dict):
            continue
        where = wheel.get("url") or wheel.get("path") or wheel.get("filename") or ""
        try:
            tags = parse_wheel_filename(str(where).rsplit("/", 1)[-1])[3]
        except InvalidWheelFilename:
            continue
        if any(str(tag) in _supported() for tag in tags):
            return True
    return False


def _from_source(package: dict) -> tuple[bool, bool]:
    """(whether `package` is built from source, whether it is the project itself)."""
    source = package.get("source")
    if not isinstance(source, dict):
        return False, False
    if "virtual" in source:
        return False, False
    if "git" in source or "directory" in source:
        return True, False
    if "editable" in source:
        return source["editable"] != ".", source["editable"] == "."
    if "registry" in source and "sdist" not in package:
        return False, False  # wheels alone: one of them, or no install at all
    if str(source.get("path", "")).endswith(".whl"):
        return False, False
    return not _installs_a_wheel(package), False


def _lock_builds(files: ProjectFiles) -> tuple[bool, bool]:
    """(whether a dependency of the lock is built from source, whether the project is)."""
    found = [_from_source(package) for package in lock_packages(files)]
    return any(built for built, _ in found), any(itself for _, itself in found)


_builds = LockMemo(_lock_builds)  # parsed once per lock content


def builds_from_source(
    files: ProjectFiles,
    configs: tuple[ConfigFile, ...],
    uv_env: Mapping[str, str],
    install_project: bool,
) -> bool:
    """Whether `uv sync` of this lock in `uv_env` builds a package from source here (`configs`:
    `project.config_files`, where a `no-binary` may be set, as in pyproject.toml and the file of
    `UV_CONFIG_FILE`)."""
    if any(uv_env.get(name) for name in NO_BINARY_VARS):
        return True
    texts = [files.pyproject, *(read_regular(c.path) for c in configs)]
    if uv_env.get("UV_CONFIG_FILE"):
        texts.append(read_regular(uv_env["UV_CONFIG_FILE"]))
    if any(b"no-binary" in text or b"\\u" in text.lower() for text in texts):
        return True
    dependency, project = _builds(files)
    return dependency or (project and install_project)
