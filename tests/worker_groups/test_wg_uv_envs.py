"""Two worker classes in two uv environments (real uv projects, real `uv sync` through the
`uv_project` plugin) colocated on the same bundles in one job; the driver has neither
environment's packages."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
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

A, B = "wg_env_a.TabulateWorker", "wg_env_b.TermcolorWorker"


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wg-projects")
    return {
        A: write_project(root / "env-a", dependencies=["tabulate"], name="wg-env-a"),
        B: write_project(root / "env-b", dependencies=["termcolor"], name="wg-env-b"),
    }


@pytest.fixture(scope="module")
def groups(
    two_node_cluster: Any, projects: dict[str, Path]
) -> Iterator[tuple[RayWorkerGroup, RayWorkerGroup]]:
    with pytest.MonkeyPatch.context() as mp:
        for fqn, path in projects.items():
            mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, fqn, {"project": str(path)})
        cluster = RayVirtualCluster([2, 2], max_colocated_worker_groups=2, num_gpus_per_node=2)
        a = RayWorkerGroup(
            cluster,
            RayWorkerBuilder(A),
            name_prefix="env-a",
            bundle_indices_list=[(0, [0, 1]), (1, [0, 1])],
            env_vars=WORKER_ENV,
        )
        b = RayWorkerGroup(cluster, RayWorkerBuilder(B), env_vars=WORKER_ENV)
        try:
            yield a, b
        finally:
            a.shutdown()
            b.shutdown()
            cluster.shutdown()


def test_each_group_runs_in_its_own_environment(
    groups: tuple[RayWorkerGroup, RayWorkerGroup],
) -> None:
    a, b = groups
    in_a = ray.get(a.run_all_workers_single_data("whoami"))
    in_b = ray.get(b.run_all_workers_single_data("whoami"))
    assert {w["importable"]["tabulate"] for w in in_a} == {True}
    assert {w["importable"]["termcolor"] for w in in_a} == {False}
    assert {w["importable"]["termcolor"] for w in in_b} == {True}
    assert {w["importable"]["tabulate"] for w in in_b} == {False}
    # One venv per environment, shared by both raylets of this host; neither is the driver's.
    exe_a, exe_b = {w["executable"] for w in in_a}, {w["executable"] for w in in_b}
    assert len(exe_a) == len(exe_b) == 1 and exe_a != exe_b
    assert sys.executable not in exe_a | exe_b
    assert in_a[0]["virtual_env"] == str(Path(next(iter(exe_a))).parent.parent)
    # The initializers import the class too: they run in the same environment.
    assert ray.get(a._initializer_pool[0].python_executable.remote()) in exe_a
    assert in_a[0]["table"].split() == ["1", "2"]


def test_the_driver_needs_none_of_their_packages(
    groups: tuple[RayWorkerGroup, RayWorkerGroup],
) -> None:
    for dist in ("tabulate", "termcolor"):
        assert importlib.util.find_spec(dist) is None, f"the driver should not have {dist}"
    assert not {"wg_env_a", "wg_env_b"} & set(sys.modules)


def test_groups_share_bundles_and_gpus(groups: tuple[RayWorkerGroup, RayWorkerGroup]) -> None:
    a, b = groups
    in_a = ray.get(a.run_all_workers_single_data("whoami"))
    in_b = ray.get(b.run_all_workers_single_data("whoami"))
    assert [(w["node_id"], w["gpu_ids"]) for w in in_a] == [
        (w["node_id"], w["gpu_ids"]) for w in in_b
    ]
    assert a.dp_size == 2 and b.dp_size == 4
    assert {w["master_port"] for w in in_a} != {w["master_port"] for w in in_b}
