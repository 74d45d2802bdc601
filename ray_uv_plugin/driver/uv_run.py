"""A driver's `uv run` command line, read as a `uv_project` value. No Ray.

`uv run --extra vllm python train.py` synced the driver's project with that selection; the same
selection as a job-level `uv_project` gives every worker that environment from the node's venv
cache, instead of one `uv run` per worker. Only what a `uv sync` of the lock can express maps:
any other option that may shape the environment leaves the job to Ray's own per-worker
`uv run`, and the result says which option and why.

The options, and reading a command line into them, are `uv_run_options`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.driver.project_discovery import (
    find_project,
    is_package,
    plugin_groups,
    project_name,
    workspace_member,
)
from ray_uv_plugin.driver.uv_run_options import (
    NAMING,
    SELECTING,
    UNMAPPABLE,
    UvRunParseError,
    env_options,
    split_options,
)
from ray_uv_plugin.env.fields import FIELDS, Field, uv_options
from ray_uv_plugin.env.spec import parse_spec

# --- the result ------------------------------------------------------------------------------


@dataclass(frozen=True)
class UvRunDriver:
    """A `uv run` driver read: the job's `uv_project` value (its `project` absolute), or the
    one option, with why, that leaves the job to Ray's own per-worker `uv run`."""

    value: dict[str, Any] | None
    project: Path | None  # the directory holding uv.lock (a workspace's root)
    unmappable: tuple[str, str] | None  # (option as given, why)

    @property
    def warning(self) -> str | None:
        """The one line a driver logs when its job keeps Ray's per-worker `uv run`."""
        if self.unmappable is None:
            return None
        option, why = self.unmappable
        return keeps_rays_uv_run(f"`uv run {option}` {why}")


def keeps_rays_uv_run(why: str) -> str:
    """The one warning line of a `uv run` driver whose job keeps Ray's per-worker `uv run`."""
    return (
        "ray-uv-plugin: this job's workers keep Ray's own per-worker `uv run`, not the node's "
        f"cached venv: {why}."
    )


def _refused(option: str, why: str) -> UvRunDriver:
    return UvRunDriver(None, None, (option, why))


def _shown(name: str, value: str | None) -> str:
    return name if value is None else f"{name} {value}"


_PYTHON_VERSION = re.compile(r"(?:c?python)?[-@]?(\d+(?:\.\d+){0,2})", re.IGNORECASE)


def _python_is_the_drivers(request: str, driver_version: str) -> bool:
    """Whether `--python <request>` names the driver's own interpreter version (which Ray
    requires the nodes to run): a plain version such as 3.11 or cpython@3.11.7 whose parts
    are the driver's."""
    match = _PYTHON_VERSION.fullmatch(request.strip())
    if not match:
        return False
    asked = match.group(1).split(".")
    return driver_version.split(".")[: len(asked)] == asked


# `uv run`'s aliases of options that set a field.
_ALIASES = {"--no-dev": ("--no-group", "dev"), "--only-dev": ("--only-group", "dev")}


class _Selection:
    """The selection that a sequence of options builds, as uv reads them (later wins): the
    fields they set (`chosen`), each list with every name given. uv's options that set a field
    (`--extra X` -> extras, `--no-locked` -> locked: False) are the table's (`uv_options`)."""

    def __init__(self, table: tuple[Field, ...] = FIELDS) -> None:
        self.table = table
        self.options = uv_options(table)
        self.chosen: dict[str, Any] = {f.name: [] for f in table if f.is_list}
        self.no_sync = False

    def apply(self, name: str, value: str | None) -> None:
        name, value = _ALIASES.get(name, (name, value))
        if name == "--no-sync":  # uv: implies --frozen, whatever --no-frozen says
            self.no_sync = True
        elif name in self.options:
            f, flag_value = self.options[name]
            if f.is_list:
                if value is not None:
                    self.chosen[f.name].append(value)
            else:
                self.chosen[f.name] = value if flag_value is None else flag_value

    def value(self, install_project: bool, package: str | None) -> dict[str, Any]:
        """The `uv_project` value, defaults left out but `locked`. Without --locked or
        --frozen, `uv run` has just locked the project on the driver: the workers' sync checks
        the lock is still current (`locked`, whatever `--no-locked` said)."""
        frozen = bool(self.chosen.get("frozen")) or self.no_sync
        chosen = {
            **self.chosen,
            "frozen": frozen,
            "locked": not frozen,
            "install_project": install_project,
            "package": package,
        }
        return {
            f.name: chosen[f.name]
            for f in self.table
            if f.kind != "path" and chosen.get(f.name) not in (None, False, [])
        }


def read_uv_run(
    argv: Sequence[str],
    cwd: Path,
    environ: Mapping[str, str],
    driver_python: str,
) -> UvRunDriver:
    """Read the `uv run` command line `argv` of a driver that runs in `cwd` with `environ`
    (uv already changed into `--directory`) on Python `driver_python` (e.g. "3.11.7")."""
    try:
        options, _command = split_options(argv)
    except UvRunParseError as e:
        return _refused(
            e.option, f"cannot be read ({e}), so what it does to the environment is unknown"
        )
    selection = _Selection()
    chosen: list[str] = []  # the selecting options, as given: what a refusal names
    for name, value in [*env_options(environ), *options]:
        if name in UNMAPPABLE:
            return _refused(_shown(name, value), UNMAPPABLE[name][1])
        if name in NAMING and value is not None and not value.strip():
            return _refused(_shown(name, repr(value)), "names no extra, group or package")
        if name == "--python" and value is not None:
            if not _python_is_the_drivers(value, driver_python):
                return _refused(
                    _shown(name, value),
                    f"asks for another interpreter than the driver's Python {driver_python}, "
                    "from which the nodes build their venvs",
                )
            continue
        selection.apply(name, value)
        if name in SELECTING and name not in ("--project", "--python"):
            chosen.append(_shown(name, value))
    picked = selection.chosen
    start = cwd / picked["project"] if picked.get("project") else cwd
    layout = find_project(start.resolve())
    if layout is None:
        return _refused(
            _shown("--project", picked["project"]) if picked.get("project") else "(no project)",
            f"found no pyproject.toml at or above {start}, so there is no uv.lock to sync",
        )
    root, member = layout
    package = picked.get("package")
    target = member
    if package is not None:
        target = workspace_member(root, package)
        if target is None:
            return _refused(f"--package {package}", f"names no member of the workspace {root}")
    elif member != root:
        package = project_name(member)
    # The groups that hold ray-uv-plugin are the driver's own (`uv run --group driver`): its
    # workers' venvs never get them, also where they are default groups.
    drivers = plugin_groups(target)
    picked["groups"] = [g for g in picked["groups"] if g not in drivers]
    picked["no_groups"].extend(g for g in drivers if g not in picked["no_groups"])
    # `--no-install-project` sets it False; uv installs a package project otherwise.
    install = (
        is_package(target) and picked.get("install_project", True) and not picked["only_groups"]
    )
    value = {"project": str(root), **selection.value(install, package)}
    try:  # as every node will read it: a value they all refuse would fail the whole job
        parse_spec({**value, "job_default": True})
    except ValueError as e:
        return _refused(
            " ".join(chosen), f"selects what no uv_project value can ({str(e).rstrip('.')})"
        )
    return UvRunDriver(value, root, None)
