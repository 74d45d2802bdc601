"""The environment `uv sync` runs in, and what of it shapes the venv.

Every variable that reaches uv (the node's environment, the runtime_env's `env_vars` over it)
is one of:

- controlled: the plugin sets it itself, whatever the job says (`CONTROLLED`);
- refused: a value that would make a venv that breaks later (`UV_LINK_MODE=symlink`);
- not keyed: it can change where and how packages are fetched, never which files a locked
  install puts into the venv (`NOT_KEYED`: indexes, network, cache, credentials, output);
- keyed: every other `UV_*` variable, and the build variables of packages built from source
  (`BUILD_VARS`): its value is part of the venv's key, so a job that sets `UV_NO_DEV=1` gets a
  venv of its own instead of changing the one every other job uses.

The user's and the system's uv config files (`~/.config/uv/uv.toml`, `/etc/uv/uv.toml`) are
controlled too: uv is pointed at config dirs that hold none. The project's own config
(`[tool.uv]`, a `uv.toml` beside or above it) is keyed by content (`project.config_files`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

# Set by the plugin for every build (UV_PROJECT_ENVIRONMENT is added per venv).
CONTROLLED = {
    "UV_PYTHON_DOWNLOADS": "never",  # the venv uses the node's interpreter, named by --python
    "UV_NO_PROGRESS": "1",
}
# Defaults the node or the job may change (both keyed): the venv is read-only after the build,
# so workers of another user than root could not write `.pyc` files; compile them once, here.
DEFAULTS = {"UV_COMPILE_BYTECODE": "1"}
# Dropped from the node's environment: the spec and the plugin decide these.
DROPPED = (
    "VIRTUAL_ENV",
    "UV_PROJECT_ENVIRONMENT",
    "UV_PYTHON",
    "UV_LOCKED",
    "UV_FROZEN",
    "UV_NO_SYNC",
)
LINK_MODES = ("hardlink", "copy", "clone")  # all give the same files; `symlink` is refused
DEFAULT_LINK_MODE = "hardlink"
EMPTY_CONFIG_DIR = Path(__file__).parent / "uv_config"  # holds an empty uv/uv.toml

# Where uv resolves from: no locked install depends on them (every file comes from the URL and
# hash in uv.lock), but `locked: false` resolves with them, and then they are keyed.
RESOLVE_VARS = frozenset(
    {
        "UV_INDEX_URL",
        "UV_EXTRA_INDEX_URL",
        "UV_DEFAULT_INDEX",
        "UV_INDEX",
        "UV_FIND_LINKS",
        "UV_INDEX_STRATEGY",
        "UV_OFFLINE",
    }
)
NOT_KEYED = RESOLVE_VARS | frozenset(
    {
        "UV_CACHE_DIR",
        "UV_NO_CACHE",
        "UV_KEYRING_PROVIDER",
        "UV_NATIVE_TLS",
        "UV_INSECURE_HOST",
        "UV_HTTP_TIMEOUT",
        "UV_HTTP_RETRIES",
        "UV_REQUEST_TIMEOUT",
        "UV_CONCURRENT_DOWNLOADS",
        "UV_CONCURRENT_BUILDS",
        "UV_CONCURRENT_INSTALLS",
        "UV_LINK_MODE",
        "UV_NO_PROGRESS",
        "UV_NO_WRAP",
        "UV_LOG_CONTEXT",
        "UV_PYTHON_INSTALL_DIR",
        "UV_TOOL_DIR",
        "UV_PYTHON_PREFERENCE",
        "UV_PYTHON_DOWNLOADS",
        "UV_RUN_RECURSION_DEPTH",  # set by `uv run` in whatever started Ray
        "UV_INTERNAL__PARENT_INTERPRETER",
    }
)
# Credentials of a named index (`UV_INDEX_<NAME>_USERNAME`/`_PASSWORD`): never in a key.
NOT_KEYED_PREFIXES = ("UV_INDEX_",)
BUILD_VARS = (
    "CC",
    "CXX",
    "CFLAGS",
    "CXXFLAGS",
    "CPPFLAGS",
    "LDFLAGS",
    "MAX_JOBS",
    "CUDA_HOME",
    "TORCH_CUDA_ARCH_LIST",
    "NVCC_APPEND_FLAGS",
)


class UvEnvError(ValueError):
    """An env var the plugin cannot build with; the message says what to set instead."""


def sync_environment(
    extra_env: Mapping[str, str], node_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The node's environment with the runtime_env's env_vars over it, as uv will see it
    (less UV_PROJECT_ENVIRONMENT, which names the venv and so comes after the key)."""
    node_env = os.environ if node_env is None else node_env
    env = {k: v for k, v in node_env.items() if k not in DROPPED}
    env.update({k: os.path.expandvars(v) for k, v in extra_env.items() if k not in DROPPED})
    env.update(CONTROLLED)
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    link_mode = env.setdefault("UV_LINK_MODE", DEFAULT_LINK_MODE)
    if link_mode not in LINK_MODES:
        raise UvEnvError(
            f"uv_project: UV_LINK_MODE={link_mode!r} is not allowed: a venv of symlinks into "
            "the uv cache breaks when the cache is cleaned or belongs to another job. Use one "
            f"of {', '.join(LINK_MODES)} (the default is {DEFAULT_LINK_MODE}), or unset it."
        )
    # No user or system uv.toml: both dirs hold an empty `uv/uv.toml`; without one, uv falls
    # back to /etc/uv/uv.toml.
    env["XDG_CONFIG_HOME"] = env["XDG_CONFIG_DIRS"] = str(EMPTY_CONFIG_DIR)
    return env


def _keyed(name: str) -> bool:
    if name in BUILD_VARS:
        return True
    if not name.startswith("UV_") or name in NOT_KEYED or name in CONTROLLED:
        return False
    return not name.startswith(NOT_KEYED_PREFIXES)


def keyed_settings(env: Mapping[str, str], resolves: bool = False) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that shape the venv, with their values (a config file named by
    `UV_CONFIG_FILE` by its content)."""
    items = []
    for name in sorted(n for n in env if _keyed(n) or (resolves and n in RESOLVE_VARS)):
        value = env[name]
        if name == "UV_CONFIG_FILE":
            try:
                value = f"{value} sha256:{hashlib.sha256(Path(value).read_bytes()).hexdigest()}"
            except OSError as e:
                raise UvEnvError(
                    f"uv_project: UV_CONFIG_FILE={value!r} cannot be read ({e.strerror}): "
                    "point it at a uv.toml that every node has, or unset it."
                ) from e
        items.append((name, value))
    return tuple(items)
