"""Code that runs inside a worker's uv venv, for `prepare` and `demo`.

Those venvs hold the user's project, not ray_uv_plugin, so Ray pickles this module by value
(`pickle_by_value`): it may import only the standard library at module level, and the names it
needs from the package (the venv variable, the marker's name) come as arguments. What it
sends back is an `EnvironmentReport`: a plain dict on the wire (nothing to unpickle by value),
typed here, for both ends, and made in one place (`environment_report`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import sys
import time
from typing import Any, TypedDict


class EnvironmentReport(TypedDict):
    """What a probe finds in the worker it runs in."""

    python: str  # sys.executable: the venv's python, or the node's own without the plugin
    python_version: str
    venv: str | None  # the venv the plugin put the worker in (its `venv_env`), None without
    marker: dict[str, Any] | None  # the venv's ready-marker as read there (None: unreadable)
    packages: dict[str, str | None]  # the version of each package asked for (None: absent)
    hostname: str
    now: float  # the node's clock (`was_built_within` compares the marker's times with it)


def environment_report(
    packages: tuple[str, ...], venv_env: str, marker_name: str
) -> EnvironmentReport:
    """What the worker runs in: interpreter, venv, its ready-marker, and package versions.
    `venv_env` and `marker_name` are `store.layout`'s `VENV_ENV` and `MARKER`."""
    venv = os.environ.get(venv_env)  # set by the plugin in every worker
    marker: dict[str, Any] | None = None
    if venv:
        try:
            with open(os.path.join(venv, marker_name)) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            marker = None
    versions: dict[str, str | None] = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return EnvironmentReport(
        python=sys.executable,
        python_version=sys.version.split()[0],
        venv=venv,
        marker=marker,
        packages=versions,
        hostname=socket.gethostname(),
        now=time.time(),
    )


def was_built_within(report: EnvironmentReport, seconds: float) -> bool:
    """Whether the venv's build finished within the last `seconds` of the report's own clock
    (the node's clock, so that skew between driver and node does not matter); never for a
    venv received from another node (its `built_at` is the source's)."""
    marker = report["marker"] or {}
    if marker.get("received_at") is not None:
        return False
    built_at = marker.get("built_at")
    return built_at is not None and built_at >= report["now"] - seconds


class Probe:
    """An actor that reports its environment; `demo` starts one per uv environment."""

    def report(
        self, packages: tuple[str, ...], venv_env: str, marker_name: str
    ) -> EnvironmentReport:
        return environment_report(packages, venv_env, marker_name)

    def banner(self, text: str) -> str:
        try:
            import pyfiglet  # only the `banner` extra of the demo project has it
        except ImportError:
            return ""
        return str(pyfiglet.figlet_format(text, font="small"))  # a str subclass: send a str

    def toml(self, data: dict[str, Any]) -> str:
        try:
            import tomli_w  # only the `toml` extra of the demo project has it
        except ImportError:
            return ""
        return tomli_w.dumps(data)


def pickle_by_value() -> None:
    """Make Ray pickle this module's functions and classes by value, not by import path."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
