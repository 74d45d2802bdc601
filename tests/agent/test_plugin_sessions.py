"""Across Ray sessions, raylets and drivers: reuse, once per node, and `uv run` drivers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import UV_ENV_VAR, VENV_DIR_ENV
from ray_uv_plugin.store.layout import MARKER
from tests.support.uvproject import CountingUv, write_project

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def node_env(tmp_path, monkeypatch):
    """uv calls counted, venvs in this test's own dir; Ray started after this inherits both."""
    uv = CountingUv(tmp_path / "uvbin")
    monkeypatch.setenv(UV_ENV_VAR, str(uv.path))
    monkeypatch.setenv(VENV_DIR_ENV, str(tmp_path / "venvs"))
    return uv


@ray.remote(num_cpus=0)
def interpreter() -> tuple[str, str]:
    import sys

    import ray

    return sys.executable, ray.get_runtime_context().get_node_id()


def test_a_second_ray_session_reuses_the_venv_without_uv(tmp_path, node_env):
    project = write_project(tmp_path / "proj", ["six"])
    seen, logs = [], []
    for _ in range(2):
        # A new dict each time: ray.init replaces the working_dir path by its upload's URI.
        runtime_env = {"working_dir": str(project), "uv_project": {}}  # project: the working_dir
        ray.init(address="local", num_cpus=1, runtime_env=runtime_env)
        try:
            seen.append(ray.get(interpreter.remote(), timeout=120)[0])
            logs.append(ray._private.worker.global_worker.node.get_logs_dir_path())
        finally:
            ray.shutdown()
    assert seen[0] == seen[1] == str(tmp_path / "venvs" / Path(seen[0]).parts[-3] / "bin/python")
    assert node_env.syncs() == 1

    def setup_log(logs_dir: str) -> str:
        return "".join(p.read_text() for p in Path(logs_dir).glob("runtime_env_setup-*.log"))

    first, second = setup_log(logs[0]), setup_log(logs[1])
    assert ": built in " in first and "uv: Installed" in first  # uv's output is in the log
    assert ": reused in " in second and ": built in " not in second
    assert f"{Path(seen[0]).parts[-3]} (made: full)" in second  # how the reused venv was made


def _on_each_node(cluster_nodes: list[str], project: Path) -> list[tuple[str, str]]:
    refs = [
        interpreter.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"uv_project": {"project": str(project)}},
        ).remote()
        for node_id in cluster_nodes
        for _ in range(3)
    ]
    return ray.get(refs, timeout=240)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-venv-dir", "venv-dir-per-node"])
def test_two_raylets_on_one_host(tmp_path, node_env, monkeypatch, shared):
    project = write_project(tmp_path / "proj", ["pyfiglet"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        if not shared:  # the second raylet (and its runtime_env agent) gets a dir of its own
            monkeypatch.setenv(VENV_DIR_ENV, str(tmp_path / "venvs-node2"))
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 2
        results = _on_each_node(nodes, project)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert {node for _, node in results} == set(nodes)
    pythons = {python for python, _ in results}
    markers = list(tmp_path.glob(f"venvs*/*/{MARKER}"))
    if shared:
        assert len(pythons) == 1 and len(markers) == 1 and node_env.syncs() == 1
    else:
        assert len(pythons) == 2 and len(markers) == 2 and node_env.syncs() == 2


@pytest.mark.slow
def test_a_node_that_lacks_the_plugin_is_named(tmp_path, node_env, monkeypatch):
    """A raylet started without RAY_RUNTIME_ENV_PLUGINS ignores the field (Ray only warns in
    its setup log) and would run workers in the node's own Python: prepare and worker groups
    say which node and how to register the plugin."""
    from ray_uv_plugin.cluster.options import PrepareOptions
    from ray_uv_plugin.cluster.prepare import alive_nodes, prepare_nodes
    from ray_uv_plugin.env.spec import parse_spec
    from worker_groups import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
    from worker_groups.registry import ACTOR_ENVIRONMENT_REGISTRY

    project = write_project(tmp_path / "proj", ["six"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1})
    monkeypatch.setitem(
        ACTOR_ENVIRONMENT_REGISTRY, "wg_workers.EchoWorker", {"project": str(project)}
    )
    try:
        monkeypatch.delenv("RAY_RUNTIME_ENV_PLUGINS")  # the second raylet: no plugin
        cluster.add_node(num_cpus=1, num_gpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        results = prepare_nodes(
            parse_spec({"project": str(project)}), alive_nodes(), PrepareOptions(timeout=240)
        )
        virtual = RayVirtualCluster([1, 1], num_gpus_per_node=1)
        with pytest.raises(Exception) as group_error:
            RayWorkerGroup(
                virtual,
                RayWorkerBuilder("wg_workers.EchoWorker"),
                env_vars={"PYTHONPATH": str(Path(__file__).parents[1] / "worker_groups")},
            )
        virtual.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert "ran this worker in its own Python" in str(group_error.value)
    assert 'eval "$(ray-uv plugin-config --shell)"' in str(group_error.value)
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    assert len(ok) == 1 and ok[0].built and len(bad) == 1
    assert f"node {bad[0].address} ran the worker in its own Python" in bad[0].error
    assert 'eval "$(ray-uv plugin-config --shell)"' in bad[0].error


DRIVER = textwrap.dedent(
    """
    import json, sys
    import ray

    ray.init(address="local", num_cpus=1)

    @ray.remote
    def where():
        import os, sys
        return sys.executable

    job_env = ray.get_runtime_context().runtime_env
    with_uv = ray.get(where.options(runtime_env={"uv_project": {"project": sys.argv[1]}}).remote())
    print("RESULT", json.dumps({"job_env": job_env, "uv_project": with_uv}))
    ray.shutdown()
    """
)


@pytest.mark.parametrize("launcher", ["uv-run", "python"])
def test_drivers_started_with_or_without_uv_run(tmp_path, node_env, launcher):
    """Ray's `uv run` hook puts py_executable="uv run ..." into the job; uv_project still wins."""
    project = write_project(tmp_path / "proj", ["six"])
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    if launcher == "uv-run":  # as a uv user starts a driver: in the project of the repo
        cmd = [find_uv(), "run", "--project", str(ROOT), "python", str(script), str(project)]
        hook = "1"
    else:  # this test process runs under `uv run` itself: turn the hook off to be a plain driver
        cmd = [sys.executable, str(script), str(project)]
        hook = "0"
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": hook}
    proc = subprocess.run(
        cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    if launcher == "uv-run":
        assert "uv run" in result["job_env"].get("py_executable", "")
    else:
        assert "py_executable" not in result["job_env"]
    venv = Path(result["uv_project"]).parent.parent
    assert venv.parent == tmp_path / "venvs" and (venv / MARKER).exists()
