"""A worker group's venv is the one the same selection gives a plain actor: the
driver's environment, copied into every worker's runtime_env, holds build variables and
anything else the driver's shell had, and none of it may give the group a key of its own or
reach the build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from tests.support.uvproject import write_project
from tests.worker_groups.conftest import WORKER_ENV
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
)

pytestmark = pytest.mark.timeout(600)

A = "wg_env_a.TabulateWorker"
# What a driver's shell may hold: a compiler and flags (build variables the plugin keys), a
# variable some build hook reads, an interpreter path. Workers get them (NeMo RL's behaviour
# for the rest); the venv's build must not.
DRIVER_SHELL = {
    "CC": "/opt/other-gcc/bin/gcc",
    "CMAKE_ARGS": "-DGPU=ON",
    "MYLIB_FLAVOR": "cuda",
    "LD_LIBRARY_PATH": "/opt/driver/lib",
}


@ray.remote(num_cpus=0)
def plain_actor_venv() -> str:
    import os

    return os.environ["RAY_UV_PLUGIN_VENV"]


def test_a_groups_venv_is_a_plain_actors_whatever_the_drivers_shell_holds(
    two_node_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = write_project(tmp_path / "env-a", dependencies=["tabulate"], name="wg-job-env")
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, A, {"project": str(project)})
    for name, value in DRIVER_SHELL.items():
        monkeypatch.setenv(name, value)
    cluster = RayVirtualCluster([1], max_colocated_worker_groups=1, num_gpus_per_node=1)
    group = RayWorkerGroup(cluster, RayWorkerBuilder(A), env_vars=WORKER_ENV)
    try:
        seen = ray.get(group.run_all_workers_single_data("whoami"))
    finally:
        group.shutdown()
        cluster.shutdown()
    plain = ray.get(
        plain_actor_venv.options(
            runtime_env={"uv_project": {"project": str(project)}, "env_vars": WORKER_ENV}
        ).remote(),
        timeout=300,
    )
    assert {w["virtual_env"] for w in seen} == {plain}
