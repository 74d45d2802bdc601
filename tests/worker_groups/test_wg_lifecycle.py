"""Creation and teardown on a real cluster: infeasible requests, busy resources, startup errors,
the builder on its own, and shutdowns that leave no actor or placement group behind."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.worker_groups.conftest import WORKER_ENV, alive_actors, live_placement_groups, wait_until
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    InfeasibleClusterError,
    PlacementGroupTimeoutError,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
    UnregisteredWorkerError,
    WorkerStartupTimeoutError,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def registered(two_node_cluster: Any) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for cls in ("EchoWorker", "BrokenWorker", "NoSuchWorker"):
            mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, f"wg_workers.{cls}", None)
        mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, "wg_no_such_module.Worker", None)
        yield


@pytest.fixture
def small() -> Iterator[RayVirtualCluster]:
    """One GPU bundle per node; checks afterwards that nothing of it is left."""
    before = set(live_placement_groups())
    cluster = RayVirtualCluster([1, 1], num_gpus_per_node=2, name="wg-life")
    cluster.get_placement_groups()  # reserved now: some tests need the resources held
    yield cluster
    cluster.shutdown()
    wait_until(lambda: set(live_placement_groups()) <= before, what="placement groups removed")


def actor_ids(group: RayWorkerGroup) -> set[str]:
    return {a._actor_id.hex() for a in [*group.workers, *group._initializer_pool.values()]}


def test_infeasible_cluster_fails_fast_naming_what_is_missing() -> None:
    start = time.monotonic()
    with pytest.raises(InfeasibleClusterError, match=r"missing \{GPU: 2\}") as e:
        RayVirtualCluster([2, 2, 2], num_gpus_per_node=2).get_placement_groups()
    assert "needs {CPU: 6, GPU: 6} in all but the Ray cluster has {CPU: 8, GPU: 4}" in str(e.value)
    strict = RayVirtualCluster([3], num_gpus_per_node=4, placement_group_strategy="STRICT_PACK")
    with pytest.raises(InfeasibleClusterError, match=r"unified needs \{CPU: 3, GPU: 3\} on one"):
        strict._init_placement_groups(use_unified_pg=True)
    with pytest.raises(InfeasibleClusterError, match=r"missing \{CPU: 8\}"):
        RayVirtualCluster(
            [2, 2], num_gpus_per_node=2, max_colocated_worker_groups=4
        ).get_placement_groups()
    assert time.monotonic() - start < 5  # no waiting on a request that can never fit
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bundle_ct_per_node_list": []}, "non-empty list"),
        ({"bundle_ct_per_node_list": [0, 0]}, "no bundles at all"),
        ({"bundle_ct_per_node_list": [3], "num_gpus_per_node": 2}, "puts 3 GPU bundles on one"),
        ({"bundle_ct_per_node_list": [1], "max_colocated_worker_groups": 0}, ">= 1"),
        ({"bundle_ct_per_node_list": [1], "placement_group_strategy": "PACKED"}, "use one of"),
        (
            {"bundle_ct_per_node_list": [1], "port_range_low": 2000, "port_range_high": 2000},
            "low <",
        ),
        ({"bundle_ct_per_node_list": [1], "port_range_high": 70000}, "<= 65536"),
        ({"bundle_ct_per_node_list": [1], "segment_size": 2}, "segment trimming is not"),
        ({"bundle_ct_per_node_list": [1, 1], "node_resource_constraints": [{}]}, "one dict"),
        ({"bundle_ct_per_node_list": [1], "ready_timeout_s": 0}, "must be > 0"),
    ],
)
def test_bad_cluster_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RayVirtualCluster(**kwargs)


def test_busy_resources_time_out_and_leave_nothing(small: RayVirtualCluster) -> None:
    before = set(live_placement_groups())
    start = time.monotonic()
    with pytest.raises(PlacementGroupTimeoutError, match="not ready after 2s.*available now") as e:
        RayVirtualCluster([2, 2], num_gpus_per_node=2, ready_timeout_s=2).get_placement_groups()
    assert time.monotonic() - start < 10
    assert isinstance(e.value, TimeoutError)
    wait_until(lambda: set(live_placement_groups()) <= before, what="timed-out groups removed")


def test_shutdown_twice_and_use_after_shutdown() -> None:
    cluster = RayVirtualCluster([1], num_gpus_per_node=2)
    assert len(cluster.get_placement_groups()) == 1
    assert cluster.shutdown() and cluster.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        cluster.get_placement_groups()


def test_shutdown_with_cleanup_leaves_no_actor(small: RayVirtualCluster) -> None:
    group = RayWorkerGroup(small, RayWorkerBuilder("wg_workers.EchoWorker"), env_vars=WORKER_ENV)
    ids = actor_ids(group)
    assert len(ids) == 4  # two workers, two initializers (one per node)
    assert group.shutdown(cleanup_method="cleanup", timeout=20) is True
    assert group.workers == [] and group.shutdown() is True  # twice is fine
    wait_until(lambda: not ids & {a["ActorID"] for a in alive_actors()}, what="actors dead")


def test_shutdown_timeout_kills_hung_workers(small: RayVirtualCluster) -> None:
    group = RayWorkerGroup(small, RayWorkerBuilder("wg_workers.EchoWorker"), env_vars=WORKER_ENV)
    ids = actor_ids(group)
    start = time.monotonic()
    assert group.shutdown(cleanup_method="hang", timeout=1) is False
    assert time.monotonic() - start < 10
    wait_until(lambda: not ids & {a["ActorID"] for a in alive_actors()}, what="actors dead")


def test_workers_that_cannot_be_scheduled_time_out_clearly(small: RayVirtualCluster) -> None:
    first = RayWorkerGroup(small, RayWorkerBuilder("wg_workers.EchoWorker"), env_vars=WORKER_ENV)
    before = {a["ActorID"] for a in alive_actors()}
    try:
        # max_colocated_worker_groups=1: the first group holds every bundle's CPU and GPU.
        with pytest.raises(WorkerStartupTimeoutError, match=r"of 2 workers .* after 3s"):
            RayWorkerGroup(
                small,
                RayWorkerBuilder("wg_workers.EchoWorker"),
                env_vars=WORKER_ENV,
                startup_timeout_s=3,
            )
        wait_until(lambda: {a["ActorID"] for a in alive_actors()} <= before, what="no leftovers")
        assert ray.get(first.run_all_workers_single_data("calls"))  # the first group is fine
    finally:
        first.shutdown()
    with pytest.raises(ValueError, match="startup_timeout_s must be > 0"):
        RayWorkerGroup(small, RayWorkerBuilder("wg_workers.EchoWorker"), startup_timeout_s=0)


def test_unregistered_class_fails_before_any_actor() -> None:
    before = {a["ActorID"] for a in alive_actors()}
    with pytest.raises(UnregisteredWorkerError, match="wg_workers.Unlisted"):
        # The cluster is not even touched: the lookup happens first.
        RayWorkerBuilder("wg_workers.Unlisted").runtime_env()
    assert {a["ActorID"] for a in alive_actors()} == before


@pytest.mark.parametrize(
    ("fqn", "message"),
    [
        ("wg_workers.BrokenWorker", "BrokenWorker refuses to start"),
        ("wg_workers.NoSuchWorker", "module 'wg_workers' has no class 'NoSuchWorker'"),
        ("wg_no_such_module.Worker", "cannot import module 'wg_no_such_module'"),
    ],
)
def test_startup_errors_surface_and_clean_up(
    small: RayVirtualCluster, fqn: str, message: str
) -> None:
    before = {a["ActorID"] for a in alive_actors()}
    with pytest.raises(ray.exceptions.RayError, match=message):
        RayWorkerGroup(small, RayWorkerBuilder(fqn), env_vars=WORKER_ENV)
    wait_until(lambda: {a["ActorID"] for a in alive_actors()} <= before, what="no leftovers")


def test_builder_creates_one_worker_and_keeps_its_initializer(small: RayVirtualCluster) -> None:
    builder = RayWorkerBuilder("wg_workers.EchoWorker", tag="solo", extra=1)
    pg = small.get_placement_groups()[1]
    worker = builder(pg, 0, 0.5, runtime_env={"env_vars": {**WORKER_ENV, "WG_MODE": "solo"}})
    info = ray.get(worker.info.remote())
    assert (info["tag"], info["init_kwargs"], info["WG_MODE"]) == ("solo", {"extra": 1}, "solo")
    table = ray.util.placement_group_table()[pg.id.hex()]
    assert info["node_id"] == table["bundles_to_node_id"][0]
    assert ray.get(worker.echo.remote(1, 2))["args"] == [1, 2]  # positional args work
    with pytest.raises(TypeError, match="too many positional arguments"):
        worker.calls.remote(1)  # and wrong ones fail on the driver
    # The bundle's one CPU is taken: a second worker there must ask for none.
    future, initializer = builder.create_worker_async(
        pg, 0, 0.5, runtime_env={"env_vars": WORKER_ENV}, num_cpus=0
    )
    second = ray.get(future, timeout=60)
    assert ray.get(second.info.remote(), timeout=60)["tag"] == "solo"
    for actor in (worker, worker._RAY_INITIALIZER_ACTOR_REF_TO_AVOID_GC, second, initializer):
        ray.kill(actor)
