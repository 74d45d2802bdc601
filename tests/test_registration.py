"""A driver whose Ray does not load the plugin hears of it, where the package's code runs on the
driver: its `uv run` hook at `ray.init()`, a `UvProject`, `setup_driver()`. Real Ray, started
without `RAY_RUNTIME_ENV_PLUGINS` as a user forgets it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import ray
from ray.cluster_utils import Cluster

from ray_uv_plugin import PLUGIN_CLASS, PLUGINS_ENV, plugin_config, registration
from ray_uv_plugin.registration import Raylet, loads_plugin, unloaded_message

# A driver as a user writes it, on a machine where the plugin is not registered.
DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import ray
    import ray_uv_plugin

    way = sys.argv[1]
    os.environ.pop("RAY_RUNTIME_ENV_PLUGINS", None)  # never set (or set only after ray.init)
    if way == "uv_project_first":
        ray_uv_plugin.UvProject(extras=["table"])
    try:
        ray.init(address="local", num_cpus=1, include_dashboard=False)
    except ray_uv_plugin.PluginNotLoadedError as e:
        print(json.dumps({"init": str(e), "initialized": ray.is_initialized()}))
        sys.exit()

    @ray.remote(num_cpus=0)
    def where():
        return [sys.executable, os.environ.get("RAY_UV_PLUGIN_VENV")]

    # A plain dict: nothing of the package runs on the driver for it.
    out = {"plain": ray.get(where.options(runtime_env={"uv_project": {}}).remote(), timeout=120)}
    for name, call in (
        ("uv_project", lambda: ray_uv_plugin.UvProject(extras=["table"])),
        ("setup_driver", ray_uv_plugin.setup_driver),
    ):
        try:
            call()
        except ray_uv_plugin.PluginNotLoadedError as e:
            out[name] = str(e)
    print(json.dumps(out))
    ray.shutdown()
    """
)


def run_driver(way: str) -> dict:
    from ray_uv_plugin.driver.hook import hook_settings

    env = dict(os.environ)
    if way == "hook":  # the driver's side of `ray-uv plugin-config --shell`, less the plugin
        env.update(hook_settings(env, portable=True))
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, way], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loads_plugin_reads_the_variable_as_ray_does() -> None:
    assert loads_plugin(plugin_config())
    assert loads_plugin(json.dumps([{"class": "site.Other"}, {"class": PLUGIN_CLASS}]))
    for value in (None, "", "[]", "not json", '{"class": "x"}', '[{"class": "site.Other"}]'):
        assert not loads_plugin(value), value


def test_the_message_is_certain_only_where_no_node_loads_it() -> None:
    one = Raylet(pid=7, node_ip="10.0.0.2", python="/usr/bin/python3", plugins=None)
    every = unloaded_message("10.0.0.1:6379", [one], alive=1)
    assert "does not load the uv_project plugin: the raylet at 10.0.0.2 (pid 7" in every
    assert "every actor or task that asks for a uv_project in its own Python" in every
    assert 'eval "$(ray-uv plugin-config --shell)"' in every and "setup_driver()" in every
    some = unloaded_message("10.0.0.1:6379", [one], alive=3)
    assert some.startswith("uv_project: 1 of the 3 nodes of the Ray at 10.0.0.1:6379 do not")


@pytest.mark.parametrize("way", ["hook", "uv_project_first"])
def test_a_ray_without_the_plugin_fails_ray_init_of_a_driver_that_uses_it(way: str) -> None:
    """Through the `uv run` driver hook (`ray-uv plugin-config --shell` on the driver's side),
    or a `UvProject` built before `ray.init()`: `ray.init()` fails, and leaves nothing up."""
    out = run_driver(way)
    assert "does not load the uv_project plugin" in out["init"]
    assert f"started without {PLUGIN_CLASS} in {PLUGINS_ENV}" in out["init"]
    assert out["initialized"] is False


def test_after_ray_init_a_uv_project_or_setup_driver_says_so() -> None:
    """The issue's case: the plain dict "succeeds" in the node's Python (a driver that uses
    nothing of the package cannot be told); then the package's first call says why."""
    out = run_driver("after_init")
    python, venv = out["plain"]
    assert venv is None and python == sys.executable  # the wrong Python, silently
    for name in ("uv_project", "setup_driver"):
        assert "does not load the uv_project plugin" in out[name], name


@pytest.fixture
def fresh_checks(monkeypatch):
    """This test's own list of Ray's post-init hooks and the check's memory: nothing armed by
    an earlier test runs here, and nothing armed here runs after."""
    import ray._private.worker as worker

    monkeypatch.setattr(worker, "_post_init_hooks", [])
    monkeypatch.setattr(registration, "_fine", set())
    monkeypatch.setattr(registration, "_warned", set())


def test_a_node_without_the_plugin_beside_one_with_it_is_named_in_a_warning(
    fresh_checks, monkeypatch, caplog
) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        with monkeypatch.context() as mp:
            mp.delenv(PLUGINS_ENV)
            bare = cluster.add_node(num_cpus=1, resources={"bare_node": 1})
        cluster.wait_for_nodes()
        registration.UvProject()  # Ray imported, not connected: armed for ray.init
        with caplog.at_level(logging.WARNING, logger=registration.__name__):
            ray.init(address=cluster.address)
        (warning,) = [r.getMessage() for r in caplog.records if r.name == registration.__name__]
        assert warning.startswith("uv_project: 1 of the 2 nodes of the Ray at ")
        assert f"(pid {bare.all_processes['raylet'][0].process.pid}," in warning

        @ray.remote(num_cpus=0, resources={"bare_node": 0.1})
        def where() -> str | None:
            return os.environ.get("RAY_UV_PLUGIN_VENV")

        # What the warning is about: a uv_project actor placed there gets no venv.
        assert ray.get(where.options(runtime_env={"uv_project": {}}).remote(), timeout=120) is None
        caplog.clear()
        registration.UvProject()  # once per raylet, not per value built
        assert not [r for r in caplog.records if r.name == registration.__name__]
    finally:
        ray.shutdown()
        cluster.shutdown()
