"""Fixtures for the worker_groups tests: one 2-node Ray cluster (2 logical GPUs per node) for the
whole package, each module on its own `RayVirtualCluster`, and small uv projects whose
environments differ observably."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

HERE = Path(__file__).resolve().parent
# The test worker classes live beside this file; workers import them through PYTHONPATH.
WORKER_ENV = {"PYTHONPATH": str(HERE)}
SYSTEM_ENV = {"WG_SYSTEM_A": "system", "WG_SYSTEM_B": "system"}


@pytest.fixture(scope="package")
def two_node_cluster() -> Iterator[Cluster]:
    """Two raylets on this host, each with 4 CPUs and 2 logical GPUs. The raylets, and so every
    worker, inherit `SYSTEM_ENV`: the node environment, lowest in env-var precedence."""
    saved = {k: os.environ.get(k) for k in SYSTEM_ENV}
    os.environ.update(SYSTEM_ENV)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=4, num_gpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_until(check: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll until `check()` is true: Ray applies kills and removals asynchronously."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def alive_actors(class_substring: str = "") -> list[dict]:
    """Actors of this job that are not DEAD, read from the GCS (no dashboard needed)."""
    job = ray.get_runtime_context().get_job_id()
    return [
        a
        for a in ray._private.state.actors().values()
        if a["State"] != "DEAD" and a["JobID"] == job and class_substring in a["ActorClassName"]
    ]


def live_placement_groups() -> list[str]:
    return [
        pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"
    ]
