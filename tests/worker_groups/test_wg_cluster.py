"""RayVirtualCluster on a real 2-node cluster: placement groups made on first use, per-node
`PACK` groups or one unified group in hardware order, master ports from a configurable range,
the `AVAILABLE_*_LIST` variables, and placement groups released when a cluster is dropped."""

from __future__ import annotations

import ast
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.worker_groups.conftest import WORKER_ENV, live_placement_groups, wait_until
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    DEFAULT_MASTER_PORT_RANGE_HIGH,
    DEFAULT_MASTER_PORT_RANGE_LOW,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
)
from worker_groups._helper_tasks import HELPER_PYTHON_ENV, helper_runtime_env

pytestmark = pytest.mark.timeout(300)

LOW, HIGH = 23100, 23200


@pytest.fixture(scope="module", autouse=True)
def registered(two_node_cluster: Any) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, "wg_workers.DecoratedWorker", None)
        yield


def table(pg: Any) -> dict:
    return ray.util.placement_group_table(pg)


def test_placement_groups_are_made_on_first_use_one_pack_group_per_node() -> None:
    before = set(live_placement_groups())
    cluster = RayVirtualCluster([2, 2], num_gpus_per_node=2)
    try:
        assert set(live_placement_groups()) == before  # creating it reserved nothing
        assert cluster.placement_group_strategy == "SPREAD"
        assert (cluster.port_range_low, cluster.port_range_high) == (
            DEFAULT_MASTER_PORT_RANGE_LOW,
            DEFAULT_MASTER_PORT_RANGE_HIGH,
        )
        assert (cluster.world_size(), cluster.node_count()) == (4, 2)
        pgs = cluster.get_placement_groups()
        assert [table(pg)["strategy"] for pg in pgs] == ["PACK", "PACK"]
        assert cluster.get_placement_groups() == pgs  # made once
        assert cluster._sorted_bundle_indices is None  # only a unified group is sorted
    finally:
        cluster.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        cluster.get_placement_groups()


def test_unified_group_in_hardware_order_with_ports_from_the_range() -> None:
    cluster = RayVirtualCluster(
        [2, 2], num_gpus_per_node=2, port_range_low=LOW, port_range_high=HIGH
    )
    try:
        (pg,) = cluster._init_placement_groups(use_unified_pg=True)
        assert pg.bundle_count == 4 and table(pg)["strategy"] == "SPREAD"
        order = cluster._sorted_bundle_indices
        nodes = table(pg)["bundles_to_node_id"]
        on = [nodes[b] for b in order]
        assert sorted(order) == [0, 1, 2, 3] and on == sorted(on)
        assert on[0] == on[1] != on[2] == on[3]  # neighbours in the order share a node
        assert cluster._nvlink_domain_per_bundle_index == ("unknown",) * 4
        # As NeMo RL's generation code does: tied groups are consecutive slices of the order,
        # and node_idx is only a label (there is one placement group).
        group = RayWorkerGroup(
            cluster,
            RayWorkerBuilder("wg_workers.DecoratedWorker"),
            bundle_indices_list=[(0, order[:2]), (1, order[2:])],
            env_vars=WORKER_ENV,
        )
        try:
            envs = ray.get(group.run_all_workers_single_data("env"))
        finally:
            group.shutdown()
        assert [e["node_id"] for e in envs] == on
        assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1", "1"]
        assert [e["LOCAL_RANK"] for e in envs] == [str(b) for b in order]
        assert LOW <= int(envs[0]["MASTER_PORT"]) < HIGH
        assert len({(e["AVAILABLE_ADDR_LIST"], e["AVAILABLE_PORT_LIST"]) for e in envs}) == 1
        addrs = ast.literal_eval(envs[0]["AVAILABLE_ADDR_LIST"])
        ports = ast.literal_eval(envs[0]["AVAILABLE_PORT_LIST"])
        assert len(addrs) == len(ports) == 4 and all(LOW <= p < HIGH for p in ports)
        assert addrs[0] == envs[0]["MASTER_ADDR"]
        first, second = cluster.get_master_address_and_port(), cluster.get_master_address_and_port()
        assert first[1] != second[1] and all(LOW <= p < HIGH for _, p in (first, second))
    finally:
        cluster.shutdown()


def test_a_dropped_cluster_releases_its_placement_groups() -> None:
    before = set(live_placement_groups())
    cluster = RayVirtualCluster([1, 1], num_gpus_per_node=2)
    cluster.get_placement_groups()
    assert len(set(live_placement_groups()) - before) == 2
    del cluster
    gc.collect()
    wait_until(lambda: set(live_placement_groups()) <= before, what="placement groups removed")


def test_helper_tasks_run_on_an_interpreter_with_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    # No job-level py_executable here: Ray's default (the node's Ray Python) is kept.
    assert ray.get_runtime_context().runtime_env.get("py_executable") is None
    assert helper_runtime_env() == {}
    monkeypatch.setenv(HELPER_PYTHON_ENV, "/opt/ray-python/bin/python")
    assert helper_runtime_env() == {"py_executable": "/opt/ray-python/bin/python"}
