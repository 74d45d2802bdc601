"""Shared fixtures: a real local Ray with the plugin registered, venvs in a temporary dir."""

from __future__ import annotations

import os
import subprocess
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
# Token auth as Ray sets it up: a local `ray.init()` turns it on (with `~/.ray/auth_token`,
# made at the first), `ray.cluster_utils.Cluster` leaves it to RAY_AUTH_MODE, and `ray start`
# turns it on where a token exists. The `ray start` clusters of tests/agent/test_jobs.py and
# tests/cluster/test_token_auth.py run in token mode, with their shells given what a user gives
# them.
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
    # Venvs built as root are immutable below their top dir: let pytest remove old runs.
    from ray_uv_plugin.store.freezing import thaw

    thaw(tmp_path_factory.getbasetemp())
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def plugin_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dir holding the plugin's wheel, built from the checkout once per test session by the
    uv of the lock (the README's `uv build --wheel --out-dir dist`)."""
    out = tmp_path_factory.mktemp("dist")
    uv = Path(sys.executable).parent / "uv"
    build = [str(uv), "build", "--wheel", "--quiet", "--out-dir", str(out), str(ROOT)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="session")
def other_user() -> Iterator[tuple[str, int, int]]:
    """A second Unix user (name, uid, gid), created for the run and removed after it; the tests
    that need one are about what another user may plant or remove. Needs root."""
    import pwd
    import secrets
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("creating a second Unix user needs root; run the suite as root to cover it")
    name = f"rayuv{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
        check=True,
    )
    try:
        entry = pwd.getpwnam(name)
        yield name, entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", name], check=False, capture_output=True)
