"""`env.uv_cache`: the uv cache is the node's; a job's choice of it is refused.
No Ray: `make_request`, as the plugin keys a request (tests/agent/test_job_env.py: through Ray)."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import ProjectError, load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv_env import UvEnvError
from tests.support.uvproject import write_project

FIX = "UV_CACHE_DIR in the environment of `ray start` on every node (docs/operations.md)"


@pytest.fixture(scope="module")
def six_project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("cache") / "proj", ["six"])


@pytest.fixture
def proj(six_project: Path, tmp_path: Path) -> Path:
    """A copy of the six project in `tmp_path/parent/proj`, without its `[tool.uv]`."""
    copy = tmp_path / "parent" / "proj"
    shutil.copytree(six_project, copy)
    text = (copy / "pyproject.toml").read_text()
    (copy / "pyproject.toml").write_text(text.split("\n[tool.uv]")[0] + "\n")
    return copy


def request(proj: Path, env_vars: dict[str, str] | None = None):
    return make_request(parse_spec({}), load_project(proj), env_vars or {})


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("pyproject", '\n[tool.uv]\ncache-dir = ".cache"\n'),
        ("uv.toml", 'cache-dir = "wd-cache"\n'),
        ("uv.toml", "no-cache = true\n"),
        ("uv.toml", '"\\u0063ache-dir" = "wd-cache"\n'),  # the same key, spelled with an escape
        ("above", 'cache-dir = "/tmp/mine"\n'),
    ],
    ids=["tool-uv", "uv-toml", "no-cache", "escaped", "uv-toml-above"],
)
def test_a_cache_dir_in_the_projects_config_is_refused(proj: Path, where: str, text: str) -> None:
    """A relative `cache-dir` is a dir inside the job's working_dir: a cache the job wrote."""
    config = proj / "pyproject.toml" if where == "pyproject" else None
    if config is None:
        config = (proj if where == "uv.toml" else proj.parent) / "uv.toml"
        config.write_text("no-build-isolation = true\n")
        assert request(proj).inputs.config  # another setting there: keyed, as before
    with open(config, "a") as f:
        f.write(text)
    with pytest.raises(
        ProjectError, match=r"sets (cache-dir|no-cache), which picks uv's cache"
    ) as e:
        request(proj)
    assert str(config) in str(e.value) and FIX in str(e.value)


def test_a_jobs_uv_config_file_may_not_set_the_cache_and_the_nodes_may(
    proj: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "uv-extra.toml"
    config.write_text('cache-dir = "/tmp/job-cache"\n')
    with pytest.raises(ProjectError, match=r"UV_CONFIG_FILE of env_vars .* sets cache-dir"):
        request(proj, {"UV_CONFIG_FILE": str(config)})
    (proj / "job.toml").write_text('cache-dir = "c"\n')  # relative: the project's, as uv reads it
    with pytest.raises(ProjectError, match=r"sets cache-dir"):
        request(proj, {"UV_CONFIG_FILE": "job.toml"})
    other = tmp_path / "other" / "pyproject.toml"  # a table of either kind, whatever its name
    other.parent.mkdir()
    other.write_text('[tool.uv]\ncache-dir = "c"\n')
    with pytest.raises(ProjectError, match=r"sets cache-dir"):
        request(proj, {"UV_CONFIG_FILE": str(other)})
    # The node's UV_CONFIG_FILE is the operator's: it may set the cache (keyed by content).
    monkeypatch.setenv("UV_CONFIG_FILE", str(config))
    assert request(proj).inputs.env[-1][0] == "UV_CONFIG_FILE"


@pytest.mark.parametrize("name", ["UV_CACHE_DIR", "UV_NO_CACHE"])
def test_a_jobs_uv_cache_variable_is_refused(proj: Path, name: str) -> None:
    with pytest.raises(UvEnvError, match=f"env_vars sets {name}, which picks uv's cache") as e:
        request(proj, {name: str(proj / "my-cache")})
    assert FIX in str(e.value)


def test_a_fifo_as_a_jobs_uv_config_file_does_not_block(proj: Path, tmp_path: Path) -> None:
    """The cache check reads the file before the key does: a FIFO must not hang the agent."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    pool = ThreadPoolExecutor(1)
    future = pool.submit(request, proj, {"UV_CONFIG_FILE": str(fifo)})
    try:
        error = future.exception(timeout=10)  # TimeoutError: it blocks on the FIFO
    finally:
        if not future.done():  # let a blocked reader go: a writer that closes at once
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pool.shutdown()
    assert isinstance(error, UvEnvError) and "is no regular file" in str(error)
