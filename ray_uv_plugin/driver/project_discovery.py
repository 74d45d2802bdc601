"""Where uv finds a project from a directory, as `uv run` does from the driver's: the nearest
pyproject.toml at or above it, the workspace above that which lists it, and whether uv installs
the project itself, read as the agent reads a project (`env.project`). No Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ray_uv_plugin.env.project import declared_name, read_pyproject

PLUGIN_NAME = "ray-uv-plugin"  # this package's distribution


def _pyproject(directory: Path) -> dict[str, Any] | None:
    return read_pyproject(directory / "pyproject.toml")


def _get(table: Any, *keys: str) -> Any:
    """`table[k1][k2]...`, or None where a key is missing or a level is no table (a
    pyproject.toml of a shape uv never reads: it is not taken for a project or workspace)."""
    for key in keys:
        if not isinstance(table, dict):
            return None
        table = table.get(key)
    return table


def project_name(directory: Path) -> str | None:
    """`[project] name` of the pyproject.toml in `directory`, if it has one."""
    return declared_name(_pyproject(directory))


def is_package(directory: Path) -> bool:
    """Whether uv installs this project itself: `tool.uv.package` if set, else whether it has a
    `[build-system]` (and is a `[project]` at all)."""
    data = _pyproject(directory) or {}
    if "project" not in data:
        return False
    declared = _get(data, "tool", "uv", "package")
    return declared if isinstance(declared, bool) else "build-system" in data


def plugin_groups(directory: Path) -> list[str]:
    """The dependency groups of the project in `directory` that require ray-uv-plugin itself:
    a driver's (README "Install"). The plugin runs in Ray's agent, never in a worker, and it
    brings `ray[default]`'s extras with it."""
    groups = (_pyproject(directory) or {}).get("dependency-groups") or {}
    found = []
    for name, entries in groups.items() if isinstance(groups, dict) else ():
        for entry in entries if isinstance(entries, list) else ():
            try:
                requirement = Requirement(entry) if isinstance(entry, str) else None
            except InvalidRequirement:
                continue
            if requirement is not None and canonicalize_name(requirement.name) == PLUGIN_NAME:
                found.append(name)
                break
    return found


def _workspace_members(root: Path) -> set[Path]:
    """The member directories a workspace root's `tool.uv.workspace` globs name, and itself."""
    table = _get(_pyproject(root), "tool", "uv", "workspace")
    table = table if isinstance(table, dict) else {}

    def expand(key: str) -> set[Path]:
        patterns = table.get(key)
        found = set()
        for pattern in patterns if isinstance(patterns, list) else []:
            if not isinstance(pattern, str):
                continue  # no glob: uv's error
            try:
                found |= {
                    p.resolve() for p in root.glob(pattern) if (p / "pyproject.toml").is_file()
                }
            except (TypeError, ValueError, NotImplementedError):  # no relative glob: uv's error
                continue
        return found

    return {root, *(expand("members") - expand("exclude"))}


def workspace_member(root: Path, package: str) -> Path | None:
    """The member directory of the workspace at `root` whose project is named `package`."""
    for member in _workspace_members(root):
        name = project_name(member)
        if name is not None and canonicalize_name(name) == canonicalize_name(package):
            return member
    return None


def find_project(start: Path) -> tuple[Path, Path] | None:
    """(the dir holding uv.lock, the project's own dir) as uv discovers them from `start`: the
    nearest pyproject.toml at or above it, and the workspace above that which lists it."""
    member = next((d for d in (start, *start.parents) if (d / "pyproject.toml").is_file()), None)
    if member is None:
        return None
    for directory in (member, *member.parents):
        uv_table = _get(_pyproject(directory), "tool", "uv")
        if isinstance(uv_table, dict) and "workspace" in uv_table:
            # The nearest workspace decides: its member, or a project of its own.
            root = directory if member in _workspace_members(directory) else member
            return root, member
    return member, member
