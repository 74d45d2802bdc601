"""Shared fixtures: a real local Ray with the plugin registered, venvs in a temporary dir."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ray_uv_plugin  # noqa: E402

# `uv run pytest` would trigger Ray's `uv run` driver hook in every ray.init (it reads this at
# import): tests start from a plain driver, and tests/test_uv_run_driver.py covers the hook.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The plugin compiles bytecode at build time by default (its venvs are read-only): ~6 s per
# venv with Ray on 2 cores. The tests run as root, who writes `.pyc` files anyway; a test of its
# own covers the default.
os.environ.setdefault("UV_COMPILE_BYTECODE", "0")


@pytest.fixture(scope="session", autouse=True)
def _plugin_registered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every Ray these tests start loads the plugin; venvs go to a dir of this run's own."""
    saved = {k: os.environ.get(k) for k in ("RAY_RUNTIME_ENV_PLUGINS", "RAY_UV_PLUGIN_VENV_DIR")}
    os.environ["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
    os.environ["RAY_UV_PLUGIN_VENV_DIR"] = str(tmp_path_factory.mktemp("venvs"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
