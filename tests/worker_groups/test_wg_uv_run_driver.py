"""A driver started with `uv run --no-sync`: Ray's hook gives the job a `uv run --no-sync ...`
interpreter in each node's copy of the working_dir, which has no venv. The package's helper
tasks (port and topology probes) still run, and a worker class without `uv_project`, which would
never start there, fails at once with a message that says what to do."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from ray_uv_plugin.uv import find_uv

REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent(
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


@pytest.mark.timeout(600)
def test_helpers_run_and_system_workers_fail_fast_under_uv_run_no_sync(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "1"}
    for name in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "WORKER_GROUPS_HELPER_PYTHON"):
        env.pop(name, None)
    proc = subprocess.run(
        [find_uv(), "run", "--no-sync", "python", str(script)],
        cwd=REPO,  # the project, and so the hook's working_dir
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert "uv run --no-sync" in out["job_py_executable"]  # the hook did apply
    # Each node's own Ray Python, not the driver's path (which other nodes may lack).
    assert out["helper_env"] == {"py_executable": ""}
    assert sorted(out["sorted"]) == [0, 1] and 1400 <= out["port"] < 1999
    assert out["probes_s"] < 100  # not minutes of retried worker starts
    assert "has no uv_project" in out["error"] and "PY_EXECUTABLES.BASE" in out["error"]
    assert out["error_s"] < 30
