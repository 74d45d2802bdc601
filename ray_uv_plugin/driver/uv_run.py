"""A driver's `uv run` command line, read as a `uv_project` value. No Ray.

`uv run --extra vllm python train.py` synced the driver's project with that selection; the same
selection as a job-level `uv_project` gives every worker that environment from the node's venv
cache, instead of one `uv run` per worker. Only what a `uv sync` of the lock can express maps:
any other option that may shape the environment leaves the job to Ray's own per-worker
`uv run`, and the result says which option and why.

uv's options and whether each takes a value are our own table (checked against `uv run --help`
of uv 0.13.9, hidden negations included); uv stops reading options at the first word that is
not one, which starts the command, as it does at `--`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.agent.fields import FIELDS
from ray_uv_plugin.agent.spec import parse_spec
from ray_uv_plugin.driver.project_discovery import (
    find_project,
    is_package,
    plugin_groups,
    project_name,
    workspace_member,
)

# --- uv run's options ------------------------------------------------------------------------

# The options that decide the selection, read by `_Selection.apply`; value: takes a value.
_SELECTING = {
    "--extra": True,
    "--no-extra": True,
    "--all-extras": False,
    "--no-all-extras": False,
    "--group": True,
    "--no-group": True,
    "--only-group": True,
    "--all-groups": False,
    "--no-default-groups": False,
    "--dev": False,
    "--no-dev": False,
    "--only-dev": False,
    "--locked": False,
    "--no-locked": False,
    "--frozen": False,
    "--no-frozen": False,
    "--no-sync": False,
    "--project": True,
    "--package": True,
    "--no-install-project": False,  # not an option of uv 0.13.9's `uv run`; mapped if one has it
    "--python": True,
}

# Options that change output, the driver's own start or where uv fetches files, never what a
# sync of the lock installs (the lock names every file's URL and hash). `--directory`: the
# driver already runs there. `--exact`: our venvs hold exactly the selection anyway.
# `--compile-bytecode`: our venvs are compiled at build time anyway.
_IGNORED = {
    "--quiet": False,
    "--verbose": False,
    "--color": True,
    "--no-progress": False,
    "--native-tls": False,
    "--no-native-tls": False,
    "--system-certs": False,
    "--no-system-certs": False,
    "--offline": False,
    "--no-offline": False,
    "--cache-dir": True,
    "--no-cache": False,
    "--refresh": False,
    "--no-refresh": False,
    "--refresh-package": True,
    "--allow-insecure-host": True,
    "--keyring-provider": True,
    "--index": True,
    "--default-index": True,
    "--index-url": True,
    "--extra-index-url": True,
    "--find-links": True,
    "--no-index": False,
    "--index-strategy": True,
    "--require-build-hashes": False,
    "--no-require-build-hashes": False,
    "--module": False,
    "--managed-python": False,
    "--no-managed-python": False,
    "--no-python-downloads": False,
    "--allow-python-downloads": False,
    "--python-preference": True,
    "--preview": False,
    "--no-preview": False,
    "--preview-features": True,
    "--show-settings": False,
    "--max-recursion-depth": True,
    "--directory": True,
    "--exact": False,
    "--inexact": False,
    "--no-exact": False,
    "--editable": False,
    "--no-env-file": False,
    "--no-active": False,
    "--compile-bytecode": False,
    "--no-compile-bytecode": False,
    "--no-upgrade": False,
    "--no-reinstall": False,
    "--build": False,
    "--binary": False,
    "--build-isolation": False,
    "--help": False,
}

_NOT_IN_A_LOCK = "adds packages that uv.lock does not hold"
_BUILDS = "changes how uv builds or installs packages, which a sync of uv.lock does not repeat"
_RESOLVES = "changes how uv resolves, which a sync of uv.lock does not repeat"
# Options that may shape the environment in a way a `uv_project` value cannot express.
_UNMAPPABLE: dict[str, tuple[bool, str]] = {
    "--with": (True, _NOT_IN_A_LOCK),
    "--with-editable": (True, _NOT_IN_A_LOCK),
    "--with-requirements": (True, _NOT_IN_A_LOCK),
    "--isolated": (False, "runs in a throwaway environment, not the project's"),
    "--no-project": (False, "runs without the project, so there is no uv.lock to sync"),
    "--script": (False, "runs a PEP 723 script, whose dependencies no uv.lock holds"),
    "--gui-script": (False, "runs a PEP 723 script, whose dependencies no uv.lock holds"),
    "--active": (False, "runs in the active virtualenv, not the project's"),
    "--env-file": (True, "loads env vars that may steer uv and the driver"),
    "--all-packages": (False, "installs every workspace member, which uv_project cannot ask"),
    "--no-editable": (False, "installs editables as copies, which uv_project cannot"),
    "--no-editable-package": (True, "installs editables as copies, which uv_project cannot"),
    "--python-platform": (True, "installs for another platform than the node's"),
    "--no-binary": (False, _BUILDS),
    "--no-binary-package": (True, _BUILDS),
    "--no-build": (False, _BUILDS),
    "--no-build-package": (True, _BUILDS),
    "--config-setting": (True, _BUILDS),
    "--config-settings-package": (True, _BUILDS),
    "--no-build-isolation": (False, _BUILDS),
    "--no-build-isolation-package": (True, _BUILDS),
    "--link-mode": (True, _BUILDS),
    "--reinstall": (False, _BUILDS),
    "--reinstall-package": (True, _BUILDS),
    "--upgrade": (False, _RESOLVES),
    "--upgrade-package": (True, _RESOLVES),
    "--upgrade-group": (True, _RESOLVES),
    "--resolution": (True, _RESOLVES),
    "--prerelease": (True, _RESOLVES),
    "--prerelease-package": (True, _RESOLVES),
    "--fork-strategy": (True, _RESOLVES),
    "--exclude-newer": (True, _RESOLVES),
    "--exclude-newer-package": (True, _RESOLVES),
    "--no-sources": (False, _RESOLVES),
    "--no-sources-package": (True, _RESOLVES),
    "--config-file": (True, "reads a uv config the workers' nodes would not read"),
    "--no-config": (False, "skips the uv config the workers' nodes would read"),
}

_SHORT = {
    "-q": "--quiet",
    "-v": "--verbose",
    "-n": "--no-cache",
    "-m": "--module",
    "-h": "--help",
    "-p": "--python",
    "-w": "--with",
    "-s": "--script",
    "-i": "--index-url",
    "-f": "--find-links",
    "-U": "--upgrade",
    "-P": "--upgrade-package",
    "-C": "--config-setting",
}

_TAKES_VALUE = {
    **_SELECTING,
    **_IGNORED,
    **{name: takes for name, (takes, _) in _UNMAPPABLE.items()},
}

# The driver's env vars that uv reads as these options (a command-line option wins over them).
_ENV_FLAGS = {
    "UV_LOCKED": "--locked",
    "UV_FROZEN": "--frozen",
    "UV_NO_SYNC": "--no-sync",
    "UV_NO_DEV": "--no-dev",
    "UV_NO_DEFAULT_GROUPS": "--no-default-groups",
    "UV_ISOLATED": "--isolated",
    "UV_NO_PROJECT": "--no-project",
    "UV_NO_EDITABLE": "--no-editable",
    "UV_NO_SOURCES": "--no-sources",
    "UV_NO_BUILD": "--no-build",
    "UV_NO_BINARY": "--no-binary",
    "UV_NO_BUILD_ISOLATION": "--no-build-isolation",
    "UV_NO_CONFIG": "--no-config",
}
_ENV_VALUES = {
    "UV_PROJECT": "--project",
    "UV_PYTHON": "--python",
    "UV_ENV_FILE": "--env-file",
    "UV_CONFIG_FILE": "--config-file",
    "UV_RESOLUTION": "--resolution",
    "UV_PRERELEASE": "--prerelease",
    "UV_EXCLUDE_NEWER": "--exclude-newer",
    "UV_FORK_STRATEGY": "--fork-strategy",
    "UV_LINK_MODE": "--link-mode",
}
_TRUE = {"1", "true", "yes", "y", "t", "on"}  # as uv reads a boolean env var
# The options whose value names an extra, a group or a package: a blank one names none.
_NAMING = tuple(f.uv.split()[0] for f in FIELDS if f.kind in ("names", "name") and f.uv)


class UvRunParseError(ValueError):
    """A `uv run` command line we cannot read: `option` is the word that stopped us."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def split_options(argv: Sequence[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """`uv run [options] command...` -> ([(long option, value)], command). Raises
    UvRunParseError naming an option not in our table."""
    if len(argv) < 2 or os.path.basename(argv[0]) != "uv" or argv[1] != "run":
        raise UvRunParseError(" ".join(argv[:2]), f"not a `uv run` command line: {list(argv)!r}")
    options: list[tuple[str, str | None]] = []
    words = list(argv[2:])
    while words:
        word = words.pop(0)
        if word == "--":
            return options, words
        if not word.startswith("-") or word == "-":
            return options, [word, *words]
        if word.startswith("--"):
            name, eq, inline = word.partition("=")
            if name not in _TAKES_VALUE:
                raise UvRunParseError(name, f"`{name}` is not an option of `uv run` that we know")
            if _TAKES_VALUE[name]:
                options.append((name, inline if eq else _value(name, words)))
            elif eq:
                raise UvRunParseError(word, f"`{name}` takes no value")
            else:
                options.append((name, None))
            continue
        # Short options, clustered as clap reads them: `-qq`, `-p3.11`, `-p=3.11`, `-qp 3.11`.
        cluster = word[1:]
        while cluster:
            short, cluster = "-" + cluster[0], cluster[1:]
            if short not in _SHORT:
                raise UvRunParseError(short, f"`{short}` is not an option of `uv run` that we know")
            name = _SHORT[short]
            if _TAKES_VALUE[name]:
                value = cluster.removeprefix("=") if cluster else _value(short, words)
                options.append((name, value))
                break
            options.append((name, None))
    return options, []


def _value(name: str, words: list[str]) -> str:
    if not words:
        raise UvRunParseError(name, f"`{name}` needs a value")
    return words.pop(0)


def env_options(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The options the driver's env vars stand for, to be read before the command line's."""
    options: list[tuple[str, str | None]] = []
    for var, name in _ENV_FLAGS.items():
        if environ.get(var, "").strip().lower() in _TRUE:
            options.append((name, None))
    for var, name in _ENV_VALUES.items():
        if environ.get(var):
            options.append((name, environ[var]))
    return options


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


# `uv run`'s options that name extras or groups, one per name: the `uv_project` list fields'
# (`--extra` -> extras), from the table of fields.
_LISTED = {f.uv.split()[0]: f.name for f in FIELDS if f.kind == "names" and f.uv}


class _Selection:
    """The selection that a sequence of options builds, as uv reads them (later wins)."""

    def __init__(self) -> None:
        self.lists: dict[str, list[str]] = {k: [] for k in _LISTED.values()}
        self.all_extras = self.all_groups = self.no_default_groups = False
        self.locked = self.frozen = self.no_sync = self.no_install_project = False
        self.project: str | None = None
        self.package: str | None = None

    def apply(self, name: str, value: str | None) -> None:
        if name in _LISTED and value is not None:
            self.lists[_LISTED[name]].append(value)
        elif name in (
            "--no-dev",
            "--only-dev",
        ):  # uv: aliases of `--no-group dev` / `--only-group dev`
            self.lists["no_groups" if name == "--no-dev" else "only_groups"].append("dev")
        elif name in ("--all-extras", "--no-all-extras"):
            self.all_extras = name == "--all-extras"
        elif name == "--all-groups":
            self.all_groups = True
        elif name == "--no-default-groups":
            self.no_default_groups = True
        elif name in ("--locked", "--no-locked"):
            self.locked = name == "--locked"
        elif name in ("--frozen", "--no-frozen"):
            self.frozen = name == "--frozen"
        elif name == "--no-sync":
            self.no_sync = True
        elif name == "--no-install-project":
            self.no_install_project = True
        elif name == "--project":
            self.project = value
        elif name == "--package":
            self.package = value

    def value(self, install_project: bool, package: str | None) -> dict[str, Any]:
        """The `uv_project` value, defaults left out. Without --locked or --frozen, `uv run`
        has just locked the project on the driver: the workers' sync checks the lock is
        still current (`locked`)."""
        value: dict[str, Any] = {name: names for name, names in self.lists.items() if names}
        frozen = self.frozen or self.no_sync  # uv: --no-sync implies --frozen
        flags = {
            "all_extras": self.all_extras,
            "all_groups": self.all_groups,
            "no_default_groups": self.no_default_groups,
            "frozen": frozen,
            "install_project": install_project,
        }
        value.update({name: True for name, on in flags.items() if on})
        if not frozen:
            value["locked"] = True
        if package is not None:
            value["package"] = package
        return value


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
        if name in _UNMAPPABLE:
            return _refused(_shown(name, value), _UNMAPPABLE[name][1])
        if name in _NAMING and value is not None and not value.strip():
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
        if name in _SELECTING and name not in ("--project", "--python"):
            chosen.append(_shown(name, value))
    start = cwd / selection.project if selection.project else cwd
    layout = find_project(start.resolve())
    if layout is None:
        return _refused(
            _shown("--project", selection.project) if selection.project else "(no project)",
            f"found no pyproject.toml at or above {start}, so there is no uv.lock to sync",
        )
    root, member = layout
    package = selection.package
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
    lists = selection.lists
    lists["groups"] = [g for g in lists["groups"] if g not in drivers]
    lists["no_groups"].extend(g for g in drivers if g not in lists["no_groups"])
    install = (
        is_package(target)
        and not selection.no_install_project
        and not selection.lists["only_groups"]
    )
    value = {"project": str(root), **selection.value(install, package)}
    try:  # as every node will read it: a value they all refuse would fail the whole job
        parse_spec({**value, "job_default": True})
    except ValueError as e:
        return _refused(
            " ".join(chosen), f"selects what no uv_project value can ({str(e).rstrip('.')})"
        )
    return UvRunDriver(value, root, None)
