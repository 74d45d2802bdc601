"""A venv that Ray still holds for a live job is in use: Ray's agent keeps a
runtime_env it set up while a job refers to it and starts the job's later workers without the
plugin, so the plugin holds the venv (`store.holds`) until the agent releases its URI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray
from ray._private.runtime_env.context import RuntimeEnvContext
from ray._private.runtime_env.plugin import create_for_plugin_if_needed
from ray._private.runtime_env.uri_cache import URICache

from benchmarks.log_lines import capturing_logger
from ray_uv_plugin.agent.plugin import RELEASED_AT_ONCE, UvProjectPlugin
from ray_uv_plugin.building.ensure import Outcome, ensure_venv
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.settings import VENV_DIR_ENV, VENV_DIR_MAX_BYTES_ENV
from ray_uv_plugin.store import holds, processes
from ray_uv_plugin.store.layout import MARKER
from tests.support.uvproject import project_variants, write_project

GIB = 1024**3


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(tmp_path_factory.mktemp("holds") / "base", ["six"])


def prebuilt(project: Path, root: Path) -> Path:
    """The venv the plugin hands a runtime_env `{"uv_project": {"project": project}}`."""
    return ensure_venv(parse_spec({"project": str(project)}), load_project(project), root=root).path


def age(venv: Path, hours: float) -> None:
    t = time.time() - hours * 3600
    os.utime(venv / MARKER, (t, t))


def test_the_runtime_env_uri_is_one_per_runtime_env_and_never_raises() -> None:
    plugin = UvProjectPlugin()
    env = {"uv_project": {"project": "/p"}, "env_vars": {"A": "1"}}
    (uri,) = plugin.get_uris(env)
    assert uri.startswith("uv_project://")
    assert plugin.get_uris(dict(reversed(env.items()))) == [uri]
    # `create` takes Ray's `uv run` interpreter out: a retry's count is the first try's.
    assert plugin.get_uris({**env, "py_executable": "uv run --with x python"}) == [uri]
    assert plugin.get_uris({**env, "py_executable": "/usr/bin/python3"}) != [uri]
    assert plugin.get_uris({**env, "env_vars": {"A": "2"}}) != [uri]
    # Ray's working_dir plugin extends PYTHONPATH in place before ours runs, on every try.
    assert plugin.get_uris({**env, "env_vars": {"A": "1", "PYTHONPATH": "/wd:/wd"}}) == [uri]
    # Ray's agent asks every plugin of every runtime_env, on every reference.
    assert plugin.get_uris({"pip": ["six"]}) == plugin.get_uris({"uv_project": None}) == []
    assert plugin.get_uris({"uv_project": {}, "odd": {1: "a", "b": 2}}) == []  # keys unsortable


def test_ray_holds_the_venv_until_no_reference_is_left(base, tmp_path, monkeypatch) -> None:
    """Ray's own URI cache and setup step over the plugin, without a cluster: the URI is held
    from `create`, reused without `create`, and released when it is unused."""
    root = tmp_path / "venvs"
    monkeypatch.setenv(VENV_DIR_ENV, str(root))
    (project,) = project_variants(base, tmp_path, 1)
    venv = prebuilt(project, root)
    plugin = UvProjectPlugin()
    cache = URICache(plugin.delete_uri)  # as Ray's agent makes it: 10 GiB
    env = {"uv_project": {"project": str(project)}, "env_vars": {"A": "1"}}
    (uri,) = plugin.get_uris(env)

    def set_up() -> RuntimeEnvContext:
        context = RuntimeEnvContext(env_vars=env["env_vars"])  # as Ray's agent makes it
        asyncio.run(create_for_plugin_if_needed(env, plugin, cache, context))
        return context

    first = set_up()
    assert first.py_executable == str(venv / "bin" / "python")
    assert first.env_vars["RAY_UV_PLUGIN_VENV"] == str(venv) and first.env_vars["A"] == "1"
    assert env["env_vars"] == {"A": "1"} and plugin.get_uris(env) == [uri]  # as Ray counted it
    assert holds.holders(root) == {os.path.realpath(venv): {os.getpid()}}
    age(venv, 2)
    second = set_up()  # Ray skips `create` for a URI it holds: the marker is not touched
    assert second.py_executable == first.py_executable
    assert time.time() - (venv / MARKER).stat().st_mtime > 3600
    assert holds.holders(root) == {os.path.realpath(venv): {os.getpid()}}
    assert RELEASED_AT_ONCE > 1024 * GIB  # more than a URI cache keeps: deleted once unused
    cache.mark_unused(uri)  # no job or worker refers to it any more
    assert uri not in cache and holds.holders(root) == {}
    assert venv.exists() and not [n for n in os.listdir(root) if holds.is_record(n)]


def test_a_hold_that_cannot_be_recorded_leaves_the_setup_as_it_was(tmp_path) -> None:
    """A venv dir this user may only read (a trusted group's) or a full disk: Ray gets the
    venv, and the setup log says that it is not held."""
    plugin = UvProjectPlugin()
    venv = tmp_path / "gone" / "0123456789abcdef"  # a venv dir where no record can be made
    logger, lines = capturing_logger("holds")
    outcome = Outcome("0123456789abcdef", venv, built=False, seconds=0.0)
    plugin._hold("uv_project://x", outcome, logger)
    (line,) = lines.having("cannot record that Ray holds this venv")
    assert line.startswith("uv_project 0123456789abcdef: ")
    assert line.endswith("may remove it while this job's workers on the node are all gone")
    context = RuntimeEnvContext()
    plugin.modify_context(["uv_project://x"], {}, context)  # Ray reuses the URI: same venv
    assert context.py_executable == str(venv / "bin" / "python")
    assert plugin.delete_uri("uv_project://x") == RELEASED_AT_ONCE


# --- real Ray --------------------------------------------------------------------------------

JOB = textwrap.dedent(
    """
    import json, sys
    import ray
    from ray.exceptions import RuntimeEnvSetupError

    runtime_env = {"uv_project": {"project": sys.argv[2]}, **json.loads(sys.argv[3])}
    ray.init(address=sys.argv[1], runtime_env=runtime_env)

    @ray.remote(num_cpus=0)
    def where():
        import sys
        return sys.executable

    try:
        print(json.dumps({"executable": ray.get(where.remote(), timeout=240)}))
    except RuntimeEnvSetupError as e:
        print(json.dumps({"error": str(e)}))
    """
)


def run_job(address: str, project: Path, **more: object) -> dict:
    """A job of its own: a driver that runs one task in the project's venv, then ends; `more`:
    other fields of its runtime_env."""
    out = subprocess.run(
        [sys.executable, "-c", JOB, address, str(project), json.dumps(more)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_until(done, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        time.sleep(0.2)


@ray.remote(num_cpus=0)
class Where:
    def executable(self) -> str:
        import sys

        return sys.executable


def test_the_budget_keeps_the_venv_of_a_live_job_whose_workers_are_gone(
    base, tmp_path, monkeypatch
) -> None:
    root = tmp_path / "venvs"
    monkeypatch.setenv(VENV_DIR_ENV, str(root))
    held_job, ended_job, builder_job = project_variants(base, tmp_path, 3)
    a, c = prebuilt(held_job, root), prebuilt(ended_job, root)
    # A budget nothing fits: a build removes every venv that nothing uses, then fails.
    monkeypatch.setenv(VENV_DIR_MAX_BYTES_ENV, "1")
    ray.init(address="local", num_cpus=2, runtime_env={"uv_project": {"project": str(held_job)}})
    try:
        address = ray.get_runtime_context().gcs_address
        first = Where.remote()
        assert ray.get(first.executable.remote(), timeout=120) == str(a / "bin" / "python")
        ray.kill(first)  # the job stays up with no worker on the node
        wait_until(lambda: os.path.realpath(a) not in processes.processes().users, "the kill")
        age(a, 2)

        # A job that ends: Ray releases its runtime_env, and its venv is unused again (with
        # a working_dir, whose plugin changes the runtime_env's env_vars while it is set up).
        (tmp_path / "wd").mkdir()
        more = {"working_dir": str(tmp_path / "wd"), "env_vars": {"JOB": "c"}}
        assert run_job(address, ended_job, **more) == {"executable": str(c / "bin" / "python")}
        wait_until(lambda: os.path.realpath(c) not in holds.holders(root), "the release")
        age(c, 2)

        # Another job's build passes the budget: it removes c, keeps a, and cannot fit.
        error = run_job(address, builder_job)["error"]
        assert "over its budget of" in error and "no more venvs can be removed" in error
        assert not c.exists()
        assert a.exists() and (a / MARKER).exists()
        agent = int(error.split(f"{a.name}: in use by pid ")[1].split(")")[0].split(";")[0])
        assert Path(f"/proc/{agent}/cmdline").read_bytes().startswith(b"ray::RuntimeEnvAgent")

        # The job's next worker starts in its venv, which Ray handed out from its cache.
        second = Where.remote()
        assert ray.get(second.executable.remote(), timeout=120) == str(a / "bin" / "python")
    finally:
        ray.shutdown()
