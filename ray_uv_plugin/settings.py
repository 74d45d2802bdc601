"""The plugin's settings and the names it shares with Ray, defined here once: every
`RAY_UV_PLUGIN_*` variable, the plugin's class as Ray's `RAY_RUNTIME_ENV_PLUGINS` names it, and
the runtime_env fields with which a job chooses its own Python.

The node's settings come from the environment of `ray start` (or of the driver that starts a
local Ray). `NodeSettings.read` takes them all at once into a frozen value, as given; each is
parsed by its method where it is used, so that a bad one fails what uses it, saying what to set,
and nothing else. Booleans read as uv reads its own (`boolish`).

The bottom of the package: it imports nothing of it, so every layer may import it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

# How Ray registers a runtime_env plugin: this class, in this variable of every node.
PLUGIN_CLASS = "ray_uv_plugin.UvProjectPlugin"
PLUGINS_ENV = "RAY_RUNTIME_ENV_PLUGINS"

# What an actor or task sets to choose its own interpreter or packages (the agent's plugin, the
# `uv run` driver hook and worker groups read it). Ray merges its runtime_env over the job's
# field by field, so it also inherits the job's `uv_project`.
OWN_CHOICE_FIELDS = ("py_executable", "pip", "uv", "conda")

# The node's settings (`NodeSettings`).
VENV_DIR_ENV = "RAY_UV_PLUGIN_VENV_DIR"  # where venvs live
DEFAULT_VENV_DIR = Path("~/.cache/ray-uv-plugin/venvs")
UV_ENV_VAR = "RAY_UV_PLUGIN_UV"  # the uv binary
BUILD_TIMEOUT_ENV = "RAY_UV_PLUGIN_BUILD_TIMEOUT_S"  # how long a build may hold its key's lock
DEFAULT_BUILD_TIMEOUT = 1800.0  # a vLLM + torch env from a cold cache, on a slow link
MAX_BUILDS_ENV = "RAY_UV_PLUGIN_MAX_BUILDS"  # builds at once per venv dir
VENV_DIR_MAX_BYTES_ENV = "RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES"  # the venv dir's budget
TRUSTED_GROUP_ENV = "RAY_UV_PLUGIN_TRUSTED_GROUP"  # a group that shares the venv dir
FAILED_BUILD_MEMO_ENV = "RAY_UV_PLUGIN_FAILED_BUILD_MEMO_S"  # how long a failed sync is recalled
DEFAULT_FAILED_BUILD_MEMO = 60.0
# "0" on the driver: `prepare` and worker groups never ship.
SHIP_ENV = "RAY_UV_PLUGIN_SHIP"
# "0" on the driver: a ship sends the whole venv, never the difference from a receiver's seed
# (`delta`): where the link is faster than a node's disk copies them.
SHIP_SEEDS_ENV = "RAY_UV_PLUGIN_SHIP_SEEDS"

# Set by the plugin, not by an operator.
# In every worker it starts in a venv: the venv's path (for `ray-uv gc`, which must not remove
# it, and for the worker's own code: worker groups, the in-venv probe).
VENV_ENV = "RAY_UV_PLUGIN_VENV"
# By the driver hook's settings: a hook that was set before ours, which ours calls first.
PREVIOUS_HOOK_ENV = "RAY_UV_PLUGIN_PREVIOUS_HOOK"

# Booleans as uv reads its own environment variables (and so `UV_NO_CACHE` and the like).
TRUE = frozenset({"1", "true", "yes", "y", "t", "on"})
FALSE = frozenset({"0", "false", "no", "n", "f", "off"})

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


class VenvDirError(ValueError):
    """A node setting of ours that cannot be used; says what to set."""


def boolish(value: str | None) -> bool | None:
    """True or False for a value uv reads as one (`1`/`0`, `true`/`false`, `yes`/`no`,
    `on`/`off`, `y`/`n`, `t`/`f`, any case); None for anything else, unset or empty."""
    text = (value or "").strip().lower()
    return True if text in TRUE else False if text in FALSE else None


def parse_size(text: str) -> int | None:
    """Bytes from `50G`, `1.5T`, `500MiB`, `1048576` (K, M, G, T: powers of 1024, as `du -h`
    and `ray-uv list` print them); None for anything else or less than one byte."""
    found = _SIZE.match(text.strip())
    if found is None:
        return None
    size = int(float(found[1]) * _UNITS[found[2].upper()])
    return size if size >= 1 else None


def _seconds(value: str | None, default: float, valid: Callable[[float], bool]) -> float | None:
    """`default` where `value` is unset or empty, None where it is no number `valid` accepts
    (the caller says what it must be)."""
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if valid(seconds) else None


@dataclass(frozen=True)
class NodeSettings:
    """The node's settings as one environment gives them, each as set (None: unset)."""

    venv_dir: str | None = None
    uv: str | None = None
    build_timeout: str | None = None
    max_builds: str | None = None
    venv_dir_max_bytes: str | None = None
    trusted_group: str | None = None
    failed_build_memo: str | None = None
    ship: str | None = None
    ship_seeds: str | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> NodeSettings:
        """This process's settings (or those of `environ`), read at once."""
        environ = os.environ if environ is None else environ
        return cls(**{f.name: environ.get(VARIABLES[f.name]) for f in fields(cls)})

    def venv_dir_path(self) -> Path:
        """The venv dir as set, `~` expanded (`layout.venv_root` resolves it)."""
        root = Path(self.venv_dir or DEFAULT_VENV_DIR).expanduser()
        if not root.is_absolute():
            raise VenvDirError(
                f"uv_project: {VENV_DIR_ENV}={str(root)!r} is relative, so it would mean another "
                "directory in every worker and session: set an absolute path in the environment "
                "of `ray start` on every node."
            )
        return root

    def uv_binary(self) -> str | None:
        """The uv binary set for the node; None: find one (`uv.find_uv`, which checks it)."""
        return self.uv or None

    def build_timeout_s(self) -> float:
        """How long a build may hold its key's lock: uv is killed then, a ship receiver gives
        up, and a waiter waits that plus the lock's margin."""
        seconds = _seconds(self.build_timeout, DEFAULT_BUILD_TIMEOUT, lambda s: not s <= 0)
        if seconds is None:
            raise VenvDirError(
                f"uv_project: {BUILD_TIMEOUT_ENV}={self.build_timeout!r} must be a number of "
                "seconds > 0."
            )
        return seconds

    def max_builds_at_once(self, default: Callable[[], int]) -> int:
        """Builds at once per venv dir; unset: `default()` (the node's usable cores)."""
        value = (self.max_builds or "").strip()
        if not value:
            return default()
        if value.isdigit() and int(value) >= 1:
            return int(value)
        raise VenvDirError(
            f"uv_project: {MAX_BUILDS_ENV}={value!r} must be a whole number >= 1 (builds at once "
            f"per venv dir); unset, it is this node's usable cores ({default()})."
        )

    def budget_bytes(self) -> int | None:
        """The venv dir's budget in bytes, None if unset."""
        value = (self.venv_dir_max_bytes or "").strip()
        if not value:
            return None
        size = parse_size(value)
        if size is None:
            raise VenvDirError(
                f"uv_project: {VENV_DIR_MAX_BYTES_ENV}={value!r} is no size: set bytes, or a "
                "number with K, M, G or T (powers of 1024), e.g. 50G; unset it for no budget."
            )
        return size

    def trusted_group_name(self) -> str | None:
        """The group name or gid that shares the venv dir, None if unset (`trust` looks it up)."""
        return (self.trusted_group or "").strip() or None

    def failed_build_memo_s(self) -> float:
        """How long a failed sync is remembered, and not run again for the same inputs."""
        seconds = _seconds(
            self.failed_build_memo, DEFAULT_FAILED_BUILD_MEMO, lambda s: 0 <= s < float("inf")
        )
        if seconds is None:
            raise ValueError(
                f"uv_project: {FAILED_BUILD_MEMO_ENV}={self.failed_build_memo!r} must be a "
                "number of seconds >= 0 (0: Ray's retries of a failed setup run uv again) in the "
                "environment of `ray start`."
            )
        return seconds

    def ships(self) -> bool:
        """Whether `prepare` and worker groups ship a venv built on one node to the others."""
        return boolish(self.ship) is not False

    def ships_seeds(self) -> bool:
        """Whether a ship sends only what a receiver's seed lacks."""
        return boolish(self.ship_seeds) is not False


# Each field of `NodeSettings`: its variable.
VARIABLES = {
    "venv_dir": VENV_DIR_ENV,
    "uv": UV_ENV_VAR,
    "build_timeout": BUILD_TIMEOUT_ENV,
    "max_builds": MAX_BUILDS_ENV,
    "venv_dir_max_bytes": VENV_DIR_MAX_BYTES_ENV,
    "trusted_group": TRUSTED_GROUP_ENV,
    "failed_build_memo": FAILED_BUILD_MEMO_ENV,
    "ship": SHIP_ENV,
    "ship_seeds": SHIP_SEEDS_ENV,
}


def plugin_config() -> str:
    """The value of ``RAY_RUNTIME_ENV_PLUGINS`` that registers the ``uv_project`` field."""
    return json.dumps([{"class": PLUGIN_CLASS}])


def plugins_setting(current: str | None) -> str:
    """The `RAY_RUNTIME_ENV_PLUGINS` value that registers this plugin beside those already in
    `current` (the variable as set): a site may register plugins of its own, which a plain
    replacement would drop. Ray refuses a plugin listed twice, so ours stays single however
    often `eval "$(ray-uv plugin-config --shell)"` runs; an entry of ours already there (with
    the `priority` an operator gave it) is kept as it is. A value Ray cannot read is a
    ValueError that says what to do."""
    if current is None or not current.strip():
        return plugin_config()
    try:
        plugins = json.loads(current)
    except ValueError:
        plugins = None
    if not isinstance(plugins, list) or not all(
        isinstance(p, dict) and isinstance(p.get("class"), str) for p in plugins
    ):
        raise ValueError(
            f"{PLUGINS_ENV}={current!r} is not what Ray reads there, a JSON list of "
            '{"class": "module.Class"} objects: fix or unset it, then run `ray-uv '
            "plugin-config` again."
        )
    ours = [i for i, p in enumerate(plugins) if p["class"] == PLUGIN_CLASS]
    if len(ours) == 1:
        return current
    if not ours:
        return json.dumps([*plugins, {"class": PLUGIN_CLASS}])
    return json.dumps([p for i, p in enumerate(plugins) if i not in ours[1:]])
