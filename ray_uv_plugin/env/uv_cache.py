"""The uv cache is the node's: no job chooses where it is, or that there is none.

uv checks a file's hash when it downloads it, not when it installs it from its cache. A job that
pointed uv at a cache it wrote (its `UV_CACHE_DIR`, a relative path inside its working_dir, a
`cache-dir` in the project's config) would build the venv from files it rewrote, under the key
of a job without it, and every later job with the same lock would reuse that venv. Keying the
cache's path would not help: the next job that names the same path gets what is there now. So the
cache is the operator's, set in the environment of `ray start` (`UV_CACHE_DIR`, else uv's
`~/.cache/uv`), and a job's setting of it is refused:

- `UV_CACHE_DIR`, `UV_NO_CACHE` in env_vars or build_env_vars (`uv_env.job_variables`), and
  `HOME`, `XDG_CACHE_HOME` in build_env_vars, which move uv's default cache;
- `cache-dir`, `no-cache` in the uv config that uv applies to the project (`[tool.uv]`, a
  `uv.toml` beside or above it: `project.config_files`) or in a `UV_CONFIG_FILE` the job names.

`UV_NO_CACHE` would give a fresh cache of uv's own, but a venv whose files share no inode with
the node's cache (which the seed's index and the venv dir's budget count on), and it is the
node's choice too. The node's own `UV_CONFIG_FILE` is the operator's, and may set `cache-dir`.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `project` imports `spec`, which imports `uv_env`, which imports this
    from ray_uv_plugin.env.project import ConfigFile, ProjectFiles

NODE_CACHE_VARS = frozenset({"UV_CACHE_DIR", "UV_NO_CACHE"})
NODE_CACHE_DIRS = frozenset({"HOME", "XDG_CACHE_HOME"})  # uv's default: $XDG_CACHE_HOME/uv...
CONFIG_KEYS = ("cache-dir", "no-cache")
WHY = (
    "The uv cache is the node's: uv checks a file's hash when it downloads it, not when it "
    "installs it from its cache, so a job's cache would decide what a venv that other jobs "
    "reuse holds."
)
FIX = (
    "set the node's uv cache instead: UV_CACHE_DIR in the environment of `ray start` on every "
    "node (docs/operations.md)"
)


def cache_refusal(name: str, said: str, field: str) -> str:
    """Why a job's variable `name` is refused, and what to do: `said` is where it was given
    (`uv_project: env_vars sets`), `field` the runtime_env field to drop it from."""
    return (
        f"{said} {name}, which picks uv's cache for the build. {WHY} Drop {name!r} from "
        f"{field} and {FIX}."
    )


def _settings(data: bytes) -> set[str]:
    """The names set in a config file, at its top level (a `uv.toml`, or any file a
    `UV_CONFIG_FILE` names) and in its `[tool.uv]` (a `pyproject.toml`); none read where it
    holds no `cache` (a key spelled with escapes, `"\\u0063ache-dir"`, is read)."""
    if b"cache" not in data and b"\\u" not in data.lower():
        return set()
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return set()  # uv says what is wrong with it
    tool = table.get("tool")
    uv = tool.get("uv") if isinstance(tool, dict) else None
    return set(table) | (set(uv) if isinstance(uv, dict) else set())


def _refusal(data: bytes, label: str) -> str | None:
    found = [key for key in CONFIG_KEYS if key in _settings(data)]
    if not found:
        return None
    return (
        f"uv_project: {label} sets {found[0]}, which picks uv's cache for the build. {WHY} "
        f"Remove {found[0]} from it and {FIX}."
    )


def project_cache_refusal(
    files: ProjectFiles, configs: Iterable[ConfigFile], job_config_file: str | None
) -> str | None:
    """Why the project's config is refused: a `cache-dir` or `no-cache` in the config uv
    applies to it (`configs`: `project.config_files`) or in the file a job's `UV_CONFIG_FILE`
    names (as uv reads it); None where it sets neither."""
    found = [(files.pyproject, f"{files.path}/pyproject.toml")]
    found += [(read_regular(c.path), str(c.path)) for c in configs]
    if job_config_file:
        label = f"the UV_CONFIG_FILE of env_vars ({job_config_file})"
        found.append((read_regular(job_config_file), label))
    return next((why for why in (_refusal(*f) for f in found) if why), None)


def read_regular(path: Path | str) -> bytes:
    """A regular file's bytes; none of anything else (a FIFO would block the node's agent):
    keying it says what is wrong with it (`uv_env.keyed_settings`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return b""
    with open(fd, "rb") as f:
        return f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else b""
