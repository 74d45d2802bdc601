"""Worker groups under drivers started with `uv run`, with the plugin's driver hook set up as
`ray-uv plugin-config --shell` sets it (RAY_RUNTIME_ENV_HOOK ours, Ray's own hook off).

- A command line the hook maps: the job's env is a job-default `uv_project` of the driver's
  project and selection. A class registered as `PY_EXECUTABLES.SYSTEM` runs in it on every node
  (built on one, shipped to the other: the plugin's shipping actors run on each node's own
  Python under such a job), and `uv run --no-sync` is no dead end.
- A command line it leaves to Ray (`--env-file`, unmappable): Ray's hook gives the job a
  `uv run --no-sync ...` interpreter in each node's copy of the working_dir, which has no venv.
  The package's helper tasks still run, and a worker class without `uv_project`, which would
  never start there, fails at once with a message that says what to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.store.layout import MARKER
from tests.support.uvproject import CountingUv, write_project
from tests.worker_groups.conftest import WORKER_ENV

REPO = Path(__file__).resolve().parents[2]
OUR_HOOK = {
    "RAY_RUNTIME_ENV_HOOK": "ray_uv_plugin.driver_hook.hook",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}

NO_SYNC_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from worker_groups import (
        ACTOR_ENVIRONMENT_REGISTRY, RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup,
    )

    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False)
    out = {"job_py_executable": ray.get_runtime_context().runtime_env.get("py_executable")}
    from worker_groups._helper_tasks import helper_runtime_env
    out["helper_env"] = helper_runtime_env()
    cluster = RayVirtualCluster([2], num_gpus_per_node=2)
    start = time.monotonic()
    cluster._init_placement_groups(use_unified_pg=True)  # one topology probe per bundle
    out["sorted"] = cluster._sorted_bundle_indices
    out["port"] = cluster.get_master_address_and_port()[1]  # the address and port probe
    out["probes_s"] = time.monotonic() - start
    ACTOR_ENVIRONMENT_REGISTRY["wg_workers.EchoWorker"] = None
    start = time.monotonic()
    try:
        RayWorkerGroup(cluster, RayWorkerBuilder("wg_workers.EchoWorker"))
    except RuntimeError as e:
        out["error"], out["error_s"] = str(e), time.monotonic() - start
    cluster.shutdown()
    print("RESULT " + json.dumps(out))
    ray.shutdown()
    """
)

# Two raylets, each with its own venv dir and uv (a counting wrapper), as two machines have.
JOB_DEFAULT_DRIVER = textwrap.dedent(
    """
    import json, logging, sys
    import ray
    from ray.cluster_utils import Cluster
    from worker_groups import (
        ACTOR_ENVIRONMENT_REGISTRY, PY_EXECUTABLES, RayVirtualCluster, RayWorkerBuilder,
        RayWorkerGroup,
    )
    from worker_groups._helper_tasks import helper_runtime_env

    node_b_env, worker_env = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    lines = []  # what the group says about preparing the env on its nodes
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("worker_groups.group").addHandler(handler)
    logging.getLogger("worker_groups.group").setLevel(logging.INFO)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        nodes.add_node(num_cpus=2, env_vars=node_b_env)
        nodes.wait_for_nodes()
        # Ray installs a job's runtime_env on every node when the job starts (eager_install):
        # off, so that the group prepares the env itself, shipping it.
        ray.init(address=nodes.address, runtime_env={"config": {"eager_install": False}})
        job_env = ray.get_runtime_context().runtime_env
        out = {k: job_env.get(k) for k in ("uv_project", "py_executable", "working_dir")}
        out["helper_env"] = helper_runtime_env()
        ACTOR_ENVIRONMENT_REGISTRY["wg_workers.EchoWorker"] = PY_EXECUTABLES.SYSTEM
        cluster = RayVirtualCluster([1, 1], use_gpus=False)
        builder = RayWorkerBuilder("wg_workers.EchoWorker")
        group = RayWorkerGroup(cluster, builder, env_vars=worker_env)
        out["workers"] = ray.get([w.info.remote() for w in group.workers])
        out["log"] = lines
        group.shutdown()
        cluster.shutdown()
        print("RESULT " + json.dumps(out))
    finally:
        ray.shutdown()
        nodes.shutdown()
    """
)


def run_driver(
    uv_run_args: list[str], script: Path, cwd: Path, env: dict[str, str], *args: str
) -> dict:
    """`uv run <uv_run_args> python <script> <args>` in `cwd`; the driver's RESULT line."""
    env = {**os.environ, **env}
    for name in ("VIRTUAL_ENV", "WORKER_GROUPS_HELPER_PYTHON"):
        env.pop(name, None)
    proc = subprocess.run(
        [find_uv(), "run", *uv_run_args, "python", str(script), *args],
        cwd=cwd,  # the project, and so the hook's working_dir
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_system_workers_run_in_the_jobs_default_env_shipped_to_each_node(
    tmp_path: Path,
) -> None:
    """`uv run --no-sync --extra six` maps to the job's `uv_project`: SYSTEM workers on both
    nodes run in its venv (exactly the driver's extra), built by one uv sync on one node and
    shipped to the other (the shipping actors on each node's own Python, under a job whose
    default is that venv), none per worker; the helper tasks run on each node's own Python."""
    project = write_project(tmp_path / "p", extras={"six": ["six"], "ini": ["iniconfig"]})
    a, b = CountingUv(tmp_path / "uv-a"), CountingUv(tmp_path / "uv-b")
    venvs_a, venvs_b = tmp_path / "venvs-a", tmp_path / "venvs-b"
    node_a = {"RAY_UV_PLUGIN_VENV_DIR": str(venvs_a), "RAY_UV_PLUGIN_UV": str(a.path)}
    node_b = {"RAY_UV_PLUGIN_VENV_DIR": str(venvs_b), "RAY_UV_PLUGIN_UV": str(b.path)}
    # The driver's interpreter is this checkout's venv (the project's own would need a sync).
    driver_env = {**OUR_HOOK, **node_a, "UV_PROJECT_ENVIRONMENT": str(REPO / ".venv")}
    script = tmp_path / "driver.py"
    script.write_text(JOB_DEFAULT_DRIVER)
    out = run_driver(
        ["--no-sync", "--extra", "six"],
        script,
        project,
        driver_env,
        json.dumps(node_b),
        json.dumps(WORKER_ENV),
    )
    assert out["uv_project"] == {"extras": ["six"], "frozen": True, "job_default": True}, out
    assert out["py_executable"] is None
    assert out["helper_env"] == {"py_executable": ""}  # not a wait for the job's venv
    venvs = {Path(w["executable"]).parents[1] for w in out["workers"]}
    assert {v.parent for v in venvs} == {venvs_a, venvs_b}, out["workers"]
    assert len({w["node_id"] for w in out["workers"]}) == 2
    assert (a.syncs(), b.syncs()) == (1, 0), out["log"]
    assert any("ready on 2 of 2 nodes" in x and "1 shipped" in x for x in out["log"]), out["log"]
    for venv in venvs:
        meta = json.loads((venv / MARKER).read_text())
        assert meta["extras"] == ["six"] and meta["name"] == "testproj", meta


@pytest.mark.timeout(600)
def test_helpers_run_and_system_workers_fail_fast_under_rays_uv_run_no_sync(
    tmp_path: Path,
) -> None:
    """`--env-file` is a flag the hook leaves to Ray: the job keeps Ray's `uv run --no-sync`."""
    env_file, script = tmp_path / "driver.env", tmp_path / "driver.py"
    env_file.write_text("")
    script.write_text(NO_SYNC_DRIVER)
    out = run_driver(["--no-sync", "--env-file", str(env_file)], script, REPO, OUR_HOOK)
    assert "uv run --no-sync" in out["job_py_executable"]  # Ray's hook did apply
    # Each node's own Ray Python, not the driver's path (which other nodes may lack).
    assert out["helper_env"] == {"py_executable": ""}
    assert sorted(out["sorted"]) == [0, 1] and 1400 <= out["port"] < 1999
    assert out["probes_s"] < 100  # not minutes of retried worker starts
    assert "has no uv_project" in out["error"] and "PY_EXECUTABLES.BASE" in out["error"]
    assert out["error_s"] < 30
