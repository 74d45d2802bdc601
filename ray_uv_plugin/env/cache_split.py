"""Whether uv will hardlink a build's files from its cache, or copy them: a check asked per build
(and by `ray-uv check`), whose note says how to put the cache and the venv dir on one volume."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import boolish


def _device(path: Path) -> int | None:
    """`st_dev` of `path`, or of its nearest existing ancestor (where uv would create it)."""
    for candidate in (path, *path.parents):
        try:
            return os.stat(candidate).st_dev
        except OSError:
            continue
    return None


def cache_split_note(uv_env: Mapping[str, str], venv_dir: Path, cwd: Path) -> str | None:
    """Why uv will copy every file into a venv of `venv_dir` instead of hardlinking it from its
    cache (the two are on different file systems), with the fix; None if it will not.

    One `uv cache dir` (a few ms, in uv's environment and the project's dir, where a uv.toml
    may set `cache-dir`) and two stats: asked per build, never per reuse."""
    no_cache = boolish(uv_env.get("UV_NO_CACHE"))  # as uv reads it
    if no_cache or uv_env.get("UV_LINK_MODE") == "copy":  # copies whatever the volumes
        return None
    cache = uv_cache_dir(uv_env, cwd)
    if cache is None:
        return None
    cache_device, venv_device = _device(cache), _device(venv_dir)
    if cache_device is None or cache_device == venv_device:
        return None
    return (
        f"the uv cache {cache} and the venv dir {venv_dir} are on different file systems, so "
        "uv copies every file into the venv instead of hardlinking it from the cache: builds "
        "take longer and each venv takes its full size on disk again. Put both on one volume: "
        f"set UV_CACHE_DIR to a directory on the venv dir's file system (e.g. "
        f"{venv_dir.parent / 'uv-cache'}) in the environment of `ray start` on every node"
    )


def uv_cache_dir(uv_env: Mapping[str, str], cwd: Path) -> Path | None:
    """The uv cache a `uv sync` in `uv_env` and the project dir `cwd` uses (`uv cache dir`: a
    uv.toml there may set `cache-dir`); None where uv cannot say (the build says what is
    wrong with uv)."""
    try:
        out = subprocess.run(
            [find_uv(), "cache", "dir"],
            env=dict(uv_env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out) if out else None
