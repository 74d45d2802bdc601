"""`env.uv_env`: the environment uv builds in, and which of it shapes the venv (the key)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from ray_uv_plugin.env.uv_env import (
    EMPTY_CONFIG_DIR,
    UvEnvError,
    job_variables,
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


def test_a_jobs_value_expands_the_nodes_paths_and_no_other_variable() -> None:
    node = {"HOME": "/home/ray", "PATH": "/usr/bin", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    job = {
        "UV_FIND_LINKS": "${HOME}/wheels",
        "UV_INDEX_URL": "https://user:$AWS_SECRET_ACCESS_KEY@mirror/simple",
        "UV_INDEX_PRIVATE_PASSWORD": "pa$$word$HOME",
    }
    env = sync_environment(job, node)
    assert env["UV_FIND_LINKS"] == "/home/ray/wheels"
    # A secret of the node's (the agent's) environment is never carried into uv's settings, its
    # key or its log: the reference stays as the job wrote it.
    assert env["UV_INDEX_URL"] == "https://user:$AWS_SECRET_ACCESS_KEY@mirror/simple"
    assert "s3cr3t" not in repr(keyed_settings(env, resolves=True))
    assert env["UV_INDEX_PRIVATE_PASSWORD"] == "pa$$word/home/ray"


def test_a_jobs_variables_reach_uv_only_where_keyed_or_harmless() -> None:
    node = {"PATH": "/usr/bin", "LD_PRELOAD": "/usr/lib/libjemalloc.so", "PYTHONPATH": "/hook"}
    job = {
        "PYTHONPATH": "/job/site",  # runs the job's sitecustomize in uv's bytecode step
        "PYTHONHOME": "/job/home",
        "LD_PRELOAD": "/job/evil.so",
        "LD_LIBRARY_PATH": "/job/lib",
        "PATH": "/job/bin:/usr/bin",  # picks another compiler
        "MYLIB_FLAVOR": "cuda",  # read by a build hook no list knows
        "WANDB_API_KEY": "k",  # a worker's
        "CMAKE_ARGS": "-DGPU=ON",  # a known build variable: keyed
        "HTTPS_PROXY": "http://proxy:3128",  # network: passed, not keyed
        "UV_NO_DEV": "1",  # uv's: keyed
    }
    env = sync_environment(job, node)
    assert env["PATH"] == "/usr/bin" and env["LD_PRELOAD"] == "/usr/lib/libjemalloc.so"
    for absent in ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "MYLIB_FLAVOR", "WANDB_API_KEY"):
        assert absent not in env, absent  # the node's PYTHONPATH neither: uv runs Pythons
    assert env["CMAKE_ARGS"] == "-DGPU=ON" and env["HTTPS_PROXY"] == "http://proxy:3128"
    keyed = dict(keyed_settings(env))
    assert keyed == {"CMAKE_ARGS": "-DGPU=ON", "UV_COMPILE_BYTECODE": "1", "UV_NO_DEV": "1"}
    split = job_variables(job, node_env=node)
    assert split.withheld == (
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "MYLIB_FLAVOR",
        "PATH",
        "PYTHONHOME",
        "PYTHONPATH",
        "WANDB_API_KEY",
    )


def test_build_env_vars_pass_a_jobs_variable_to_uv_and_key_it() -> None:
    job = {"MYLIB_FLAVOR": "cuda", "PATH": "/opt/cuda/bin:$PATH"}
    env = sync_environment(job, {"PATH": "/usr/bin"}, build_env_vars=["MYLIB_FLAVOR", "PATH"])
    assert env["MYLIB_FLAVOR"] == "cuda" and env["PATH"] == "/opt/cuda/bin:/usr/bin"
    keyed = dict(keyed_settings(env, build_env_vars=["MYLIB_FLAVOR", "PATH"]))
    assert keyed["MYLIB_FLAVOR"] == f"sha256:{hashlib.sha256(b'cuda').hexdigest()}"
    assert keyed["PATH"] == "/opt/cuda/bin:/usr/bin"  # a path variable: keyed as it is
    assert "MYLIB_FLAVOR" not in dict(keyed_settings(env))  # not named: not keyed


def test_a_named_variable_is_keyed_by_its_digest_so_no_secret_reaches_a_marker() -> None:
    """A job that names a node's variable in build_env_vars without setting it keyed the node's
    value in plain text, and every marker, `ray-uv list --json` and shipped venv carried it."""
    node = {"PATH": "/usr/bin", "CORP_TOKEN": "s3cret-node", "HTTPS_PROXY": "http://u:pw@proxy"}
    named = ["CORP_TOKEN", "HTTPS_PROXY", "PATH", "CMAKE_ARGS", "UV_RESOLUTION"]
    job = {"CMAKE_ARGS": "-DX=1", "UV_RESOLUTION": "lowest"}
    keyed = dict(keyed_settings(sync_environment(job, node, build_env_vars=named), False, named))
    assert {name: keyed[name] for name in named} == {
        "CORP_TOKEN": f"sha256:{hashlib.sha256(b's3cret-node').hexdigest()}",
        "HTTPS_PROXY": f"sha256:{hashlib.sha256(b'http://u:pw@proxy').hexdigest()}",
        "PATH": "/usr/bin",
        "CMAKE_ARGS": "-DX=1",  # keyed as it is wherever set: named or not
        "UV_RESOLUTION": "lowest",
    }
    other = sync_environment(job, {**node, "CORP_TOKEN": "other"}, build_env_vars=named)
    assert dict(keyed_settings(other, False, named))["CORP_TOKEN"] != keyed["CORP_TOKEN"]


@pytest.mark.parametrize(
    "name", ["PYTHONPATH", "PYTHONHOME", "LD_PRELOAD", "UV_PROJECT_ENVIRONMENT", "VIRTUAL_ENV"]
)
def test_build_env_vars_refuse_what_decides_the_builds_interpreter(name: str) -> None:
    with pytest.raises(UvEnvError, match=f"build_env_vars names {name}"):
        sync_environment({name: "/x"}, {}, build_env_vars=[name])


def test_an_unknown_uv_variable_of_a_job_is_refused_as_a_typo() -> None:
    with pytest.raises(UvEnvError, match=r"env_vars sets UV_JUNK, which uv does not read") as e:
        sync_environment({"UV_JUNK": "1"}, {})
    assert '"build_env_vars": ["UV_JUNK"]' in str(e.value)  # and how to pass it on purpose
    # ...unless named: then it reaches uv and is keyed (a setting of a newer uv).
    env = sync_environment({"UV_JUNK": "1"}, {}, build_env_vars=["UV_JUNK"])
    assert ("UV_JUNK", "1") in keyed_settings(env, build_env_vars=["UV_JUNK"])
    # Known names and index credentials pass; the node's own unknown ones stay keyed, as before.
    sync_environment({"UV_NO_DEV": "1", "UV_INDEX_CORP_PASSWORD": "p"}, {})
    assert ("UV_NODE_THING", "1") in keyed_settings(sync_environment({}, {"UV_NODE_THING": "1"}))


def test_uvs_credentials_are_never_keyed() -> None:
    env = sync_environment(
        {"UV_AUTH_TOKEN": "t", "UV_GITHUB_TOKEN": "g", "UV_INDEX_CORP_PASSWORD": "p"}, {}
    )
    assert env["UV_AUTH_TOKEN"] == "t"
    assert [name for name, _ in keyed_settings(env, resolves=True)] == ["UV_COMPILE_BYTECODE"]


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


# --- The uv cache is the node's; a source build keys what it fetches with ---------------------


@pytest.mark.parametrize("name", ["UV_CACHE_DIR", "UV_NO_CACHE"])
def test_a_jobs_uv_cache_is_refused_and_says_how_to_set_the_nodes(name: str) -> None:
    """uv checks a wheel's hash when it downloads it, not when it installs it from its cache: a
    job's cache would decide what a venv that other jobs reuse holds, under their key."""
    with pytest.raises(UvEnvError, match=f"env_vars sets {name}, which picks uv's cache") as e:
        sync_environment({name: "1" if name == "UV_NO_CACHE" else "cache"}, {})
    assert "UV_CACHE_DIR in the environment of `ray start` on every node" in str(e.value)
    # The node's is the operator's: it reaches uv, and is no part of the key.
    env = sync_environment({}, {"UV_CACHE_DIR": "/srv/uv-cache", "UV_NO_CACHE": "1"})
    assert env["UV_CACHE_DIR"] == "/srv/uv-cache" and env["UV_NO_CACHE"] == "1"
    assert keyed_settings(env) == (("UV_COMPILE_BYTECODE", "1"),)


@pytest.mark.parametrize("name", ["UV_CACHE_DIR", "UV_NO_CACHE", "HOME", "XDG_CACHE_HOME"])
def test_build_env_vars_may_not_move_uvs_cache(name: str) -> None:
    """`HOME` and `XDG_CACHE_HOME` move uv's default cache (`$XDG_CACHE_HOME/uv`,
    `~/.cache/uv`): a job passes them to uv only through build_env_vars, refused there."""
    with pytest.raises(UvEnvError, match=f"build_env_vars names {name}, which picks uv's cache"):
        sync_environment({name: "/job/cache"}, {}, build_env_vars=[name])


def test_a_source_build_keys_its_fetch_settings_without_credentials() -> None:
    """A build from source fetches its build requirements from the indexes and through the
    proxy it is given: keyed where the lock builds from source, from the node or the job, a
    URL's password never in the key (the marker and `ray-uv list --json` show it)."""
    job = {
        "HTTPS_PROXY": "http://user:s3cret@proxy:3128",
        "SSL_CERT_FILE": "/job/ca.pem",
        "UV_INSECURE_HOST": "mirror",
        "UV_INDEX_URL": "https://token@mirror/simple",
        "UV_HTTP_TIMEOUT": "30",  # how long, never what: not keyed
    }
    env = sync_environment(job, {"NO_PROXY": "localhost"})
    assert keyed_settings(env) == (("UV_COMPILE_BYTECODE", "1"),)  # wheels only
    assert dict(keyed_settings(env, builds_from_source=True)) == {
        "HTTPS_PROXY": "http://***@proxy:3128",
        "NO_PROXY": "localhost",
        "SSL_CERT_FILE": "/job/ca.pem",
        "UV_COMPILE_BYTECODE": "1",
        "UV_INDEX_URL": "https://***@mirror/simple",
        "UV_INSECURE_HOST": "mirror",
    }
    assert "s3cret" not in repr(keyed_settings(env, resolves=True, builds_from_source=True))


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


# --- found by the uv_env fuzzer (tests/fuzz/uv_env.py) -----------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "device", "dir"])
def test_a_uv_config_file_that_is_no_regular_file_is_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO once blocked the node's agent in `keyed_settings` until someone wrote to it (and
    /dev/zero would have been read until memory ran out)."""
    path = {"fifo": tmp_path / "fifo", "device": Path("/dev/zero"), "dir": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    outcome: list[BaseException | None] = []

    def key() -> None:
        try:
            keyed_settings({"UV_CONFIG_FILE": str(path)})
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - asserted below
            outcome.append(e)

    thread = threading.Thread(target=key, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "keyed_settings blocks on it"
    assert isinstance(outcome[0], UvEnvError)
    assert "is no regular file" in str(outcome[0]) or "cannot be read" in str(outcome[0])


@pytest.mark.parametrize(
    ("env_vars", "build_env_vars"),
    [
        ({"CMAKE_ARGS": "-DX=1\x00"}, ()),
        ({"MYLIB_FLAVOR": "a\x00b"}, ("MYLIB_FLAVOR",)),
        ({"CMAKE_A=B": "1"}, ()),
        ({"UV_CONFIG_FILE": "/etc/uv.toml\x00"}, ()),
    ],
    ids=["nul-in-build-var", "nul-in-named", "equals-in-name", "nul-in-config-path"],
)
def test_a_job_variable_no_process_environment_holds_is_refused(
    env_vars: dict[str, str], build_env_vars: tuple[str, ...]
) -> None:
    """Once passed on to uv's environment, where `subprocess` fails the build with
    `embedded null byte` (or makes another variable of `CMAKE_A=B`)."""
    with pytest.raises(UvEnvError, match="no environment variable uv can be started with"):
        sync_environment(env_vars, {}, build_env_vars=build_env_vars)
