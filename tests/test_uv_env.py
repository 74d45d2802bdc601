"""`agent.uv_env`: the environment uv builds in, and which of it shapes the venv (the key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_uv_plugin.agent.uv_env import (
    EMPTY_CONFIG_DIR,
    UvEnvError,
    keyed_settings,
    sync_environment,
)


def test_the_spec_and_the_plugin_decide_what_the_node_and_the_job_may_not() -> None:
    node = {"PATH": "/usr/bin", "VIRTUAL_ENV": "/node/venv", "UV_PYTHON": "3.9", "UV_LOCKED": "1"}
    job = {"UV_PROJECT_ENVIRONMENT": "/elsewhere", "UV_NO_PROGRESS": "0", "UV_FROZEN": "1"}
    env = sync_environment(job, node)
    for dropped in ("VIRTUAL_ENV", "UV_PYTHON", "UV_LOCKED", "UV_PROJECT_ENVIRONMENT", "UV_FROZEN"):
        assert dropped not in env
    assert env["PATH"] == "/usr/bin"
    assert env["UV_PYTHON_DOWNLOADS"] == "never" and env["UV_NO_PROGRESS"] == "1"


def test_defaults_give_way_to_the_node_and_the_job_over_it() -> None:
    assert sync_environment({}, {})["UV_COMPILE_BYTECODE"] == "1"
    assert sync_environment({}, {"UV_COMPILE_BYTECODE": "0"})["UV_COMPILE_BYTECODE"] == "0"
    env = sync_environment({"UV_COMPILE_BYTECODE": "1"}, {"UV_COMPILE_BYTECODE": "0"})
    assert env["UV_COMPILE_BYTECODE"] == "1"


def test_the_jobs_values_expand_variables_as_ray_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRROR_HOST", "mirror.internal")
    env = sync_environment({"UV_INDEX_URL": "https://${MIRROR_HOST}/simple"}, {})
    assert env["UV_INDEX_URL"] == "https://mirror.internal/simple"


def test_no_user_or_system_uv_toml_reaches_the_build() -> None:
    env = sync_environment({}, {"XDG_CONFIG_HOME": "/root/.config"})
    assert env["XDG_CONFIG_HOME"] == env["XDG_CONFIG_DIRS"] == str(EMPTY_CONFIG_DIR)
    config = (EMPTY_CONFIG_DIR / "uv" / "uv.toml").read_text()
    assert not [line for line in config.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("mode", ["hardlink", "copy", "clone"])
def test_link_modes_that_give_the_same_files_are_kept(mode: str) -> None:
    assert sync_environment({"UV_LINK_MODE": mode}, {})["UV_LINK_MODE"] == mode


def test_hardlink_is_the_default_and_symlink_is_refused() -> None:
    assert sync_environment({}, {})["UV_LINK_MODE"] == "hardlink"
    with pytest.raises(UvEnvError, match="UV_LINK_MODE='symlink' is not allowed"):
        sync_environment({}, {"UV_LINK_MODE": "symlink"})


def test_what_is_keyed() -> None:
    env = {
        "UV_INDEX_URL": "https://mirror/simple",  # only where uv resolves
        "UV_CACHE_DIR": "/cache",  # never: the same files whatever the cache
        "UV_INDEX_PRIVATE_PASSWORD": "secret",  # never: credentials
        "UV_NO_PROGRESS": "1",  # set by the plugin
        "UV_PRERELEASE": "allow",  # shapes the venv
        "TORCH_CUDA_ARCH_LIST": "9.0",  # a build variable
        "HOME": "/root",  # not uv's
    }
    assert keyed_settings(env) == (("TORCH_CUDA_ARCH_LIST", "9.0"), ("UV_PRERELEASE", "allow"))
    assert ("UV_INDEX_URL", "https://mirror/simple") in keyed_settings(env, resolves=True)
    assert not [n for n, _ in keyed_settings(env, resolves=True) if "PASSWORD" in n]


def test_a_config_file_is_keyed_by_its_content(tmp_path: Path) -> None:
    config = tmp_path / "uv.toml"
    config.write_text('index-url = "https://a/simple"\n')
    before = keyed_settings({"UV_CONFIG_FILE": str(config)})
    assert before[0][1].startswith(f"{config} sha256:")
    config.write_text('index-url = "https://b/simple"\n')
    assert keyed_settings({"UV_CONFIG_FILE": str(config)}) != before
    with pytest.raises(UvEnvError, match="cannot be read"):
        keyed_settings({"UV_CONFIG_FILE": str(tmp_path / "missing.toml")})
