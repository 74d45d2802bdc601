"""RayWorkerGroup on a real 2-node Ray cluster with 2 logical GPUs per node: placement, rank env
vars, CUDA_VISIBLE_DEVICES, tied groups, colocated groups and every dispatch helper.

The worker classes run on the job's interpreter (registry entry None); uv environments are
covered in test_wg_uv_envs.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.worker_groups.conftest import WORKER_ENV
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    MultiWorkerFuture,
    NamedSharding,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
    ShardingError,
    UnknownWorkerMethodError,
)

pytestmark = pytest.mark.timeout(300)

TIED = [(0, [0, 1]), (1, [0, 1])]


@pytest.fixture(scope="module")
def vcluster(two_node_cluster: Any) -> Iterator[RayVirtualCluster]:
    with pytest.MonkeyPatch.context() as mp:
        for cls in ("EchoWorker", "ConfiguredWorker"):
            mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, f"wg_workers.{cls}", None)
        cluster = RayVirtualCluster(
            [2, 2], max_colocated_worker_groups=2, num_gpus_per_node=2, name="wg-group"
        )
        yield cluster
        cluster.shutdown()


@pytest.fixture(scope="module")
def tied(vcluster: RayVirtualCluster) -> Iterator[RayWorkerGroup]:
    """Two tied groups of two (think: two tensor-parallel engines), one per node."""
    group = RayWorkerGroup(
        vcluster,
        RayWorkerBuilder("wg_workers.EchoWorker", tag="tied"),
        name_prefix="tied",
        bundle_indices_list=TIED,
        sharding_annotations=NamedSharding([[0, 1], [2, 3]], ["dp", "tp"]),
        env_vars=WORKER_ENV,
    )
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def configured(vcluster: RayVirtualCluster, tied: RayWorkerGroup) -> Iterator[RayWorkerGroup]:
    """A second group on the same bundles, of a class with its own `configure_worker`."""
    group = RayWorkerGroup(
        vcluster,
        RayWorkerBuilder("wg_workers.ConfiguredWorker", tag="configured"),
        bundle_indices_list=TIED,
        env_vars={**WORKER_ENV, "WG_MODE": "from-the-group"},
    )
    yield group
    group.shutdown()


def infos(group: RayWorkerGroup) -> list[dict]:
    return ray.get(group.run_all_workers_single_data("info"))


def test_virtual_cluster_places_one_placement_group_per_node(vcluster: RayVirtualCluster) -> None:
    pgs = vcluster.get_placement_groups()
    assert [pg.bundle_specs for pg in pgs] == [[{"CPU": 2, "GPU": 1}] * 2] * 2
    table = ray.util.placement_group_table()
    nodes = [set(table[pg.id.hex()]["bundles_to_node_id"].values()) for pg in pgs]
    assert all(len(n) == 1 for n in nodes) and nodes[0] != nodes[1]
    assert (vcluster.world_size(), vcluster.node_count()) == (4, 2)


def test_rank_env_vars(tied: RayWorkerGroup) -> None:
    info = infos(tied)
    assert [i["RANK"] for i in info] == ["0", "1", "2", "3"]
    assert {i["WORLD_SIZE"] for i in info} == {"4"}
    assert [i["LOCAL_RANK"] for i in info] == ["0", "1", "0", "1"]
    assert [i["NODE_RANK"] for i in info] == ["0", "0", "1", "1"]
    assert {(i["MASTER_ADDR"], i["MASTER_PORT"]) for i in info} == {
        (tied.master_address, str(tied.master_port))
    }
    # NODE_RANK is the real node: both workers of a tied group share one, the groups do not.
    assert info[0]["node_id"] == info[1]["node_id"] != info[2]["node_id"] == info[3]["node_id"]
    assert info[0]["tag"] == "tied"
    assert "wg_workers" not in sys.modules  # the driver never imported the class


def test_cuda_visible_devices_is_the_workers_own_logical_gpu(tied: RayWorkerGroup) -> None:
    for i in infos(tied):
        assert len(i["gpu_ids"]) == 1
        assert i["CUDA_VISIBLE_DEVICES"] == i["gpu_ids"][0]
    by_node: dict[str, set[str]] = {}
    for i in infos(tied):
        by_node.setdefault(i["node_id"], set()).add(i["CUDA_VISIBLE_DEVICES"])
    assert list(by_node.values()) == [{"0", "1"}, {"0", "1"}]


def test_tied_groups_and_metadata(tied: RayWorkerGroup) -> None:
    assert tied.dp_size == 2 and len(tied.workers) == 4
    assert [tied.get_dp_leader_worker_idx(i) for i in range(2)] == [0, 2]
    with pytest.raises(IndexError, match="dp_shard_idx 2 not in 0..1"):
        tied.get_dp_leader_worker_idx(2)
    assert tied.worker_to_tied_group_index == {0: 0, 1: 0, 2: 1, 3: 1}
    meta = tied.worker_metadata
    assert [m["bundle_indices"] for m in meta] == [(0, [0, 1]), None, (1, [0, 1]), None]
    assert [m["name"] for m in meta] == ["tied-grp0-0", "tied-grp0-1", "tied-grp1-0", "tied-grp1-1"]
    assert ray.get_actor("tied-grp1-1") is not None


def test_colocated_group_shares_bundles_with_its_own_port_and_configuration(
    tied: RayWorkerGroup, configured: RayWorkerGroup
) -> None:
    ours, theirs = infos(configured), infos(tied)
    # Same bundle, same logical GPU: the two groups share each GPU half and half.
    assert [i["gpu_ids"] for i in ours] == [i["gpu_ids"] for i in theirs]
    assert [i["node_id"] for i in ours] == [i["node_id"] for i in theirs]
    assert configured.master_port != tied.master_port
    assert {i["MASTER_PORT"] for i in ours} == {str(configured.master_port)}
    # configure_worker wins over the group's env var, and adds init kwargs.
    assert {i["WG_MODE"] for i in ours} == {"configured"}
    assert [i["init_kwargs"]["leader_of"] for i in ours] == [(0, [0, 1]), None, (1, [0, 1]), None]
    assert {i["init_kwargs"]["asked_gpus"] for i in ours} == {0.5}
    # Leaders asked Ray not to narrow CUDA_VISIBLE_DEVICES (they drive the whole tied group).
    assert [i["CUDA_VISIBLE_DEVICES"] is None for i in ours] == [True, False, True, False]


@pytest.fixture
def puts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every ray.put (and still put): how often the driver serializes data."""
    seen: list[Any] = []
    real = ray.put

    def counting_put(value: Any, **kwargs: Any) -> ray.ObjectRef:
        seen.append(value)
        return real(value, **kwargs)

    monkeypatch.setattr(ray, "put", counting_put)
    return seen


def test_sharded_dispatch_2x2_one_put_per_replicated_slice(
    tied: RayWorkerGroup, puts: list[Any]
) -> None:
    batch = [["dp0-a", "dp0-b"], ["dp1-a", "dp1-b"]]
    future = tied.run_all_workers_sharded_data(
        "echo",
        batch=batch,
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
        output_is_replicated=["tp"],
        common_kwargs={"step": 7},
    )
    assert isinstance(future, MultiWorkerFuture)
    assert puts == batch  # one put per data-parallel slice, not one per worker
    every = ray.get(future.futures)
    assert [(r["rank"], r["kwargs"]["batch"]) for r in every] == [
        (0, batch[0]),
        (1, batch[0]),
        (2, batch[1]),
        (3, batch[1]),
    ]
    assert {r["kwargs"]["step"] for r in every} == {7}
    results = tied.get_all_worker_results(future)
    assert [(r["rank"], r["kwargs"]["batch"]) for r in results] == [(0, batch[0]), (2, batch[1])]


def test_sharded_on_both_axes_sends_each_worker_its_own(
    tied: RayWorkerGroup, puts: list[Any]
) -> None:
    future = tied.run_all_workers_sharded_data(
        "echo", [["a", "b"], ["c", "d"]], in_sharded_axes=["dp", "tp"]
    )
    assert puts == []  # nothing is replicated: no extra copy in the object store
    results = future.get_results(tied)
    assert [(r["rank"], r["args"]) for r in results] == [
        (0, ["a"]),
        (1, ["b"]),
        (2, ["c"]),
        (3, ["d"]),
    ]


def test_free_axis_and_dummy_calls(tied: RayWorkerGroup) -> None:
    free = tied.run_all_workers_sharded_data("echo", x=["x0", "x1"], in_sharded_axes=["dp"])
    assert free.called_workers == [0, 2]
    assert [r["kwargs"]["x"] for r in free.get_results(tied)] == ["x0", "x1"]
    dummy = tied.run_all_workers_sharded_data(
        "echo", x=["x0", "x1"], in_sharded_axes=["dp"], make_dummy_calls_to_free_axes=True
    )
    assert [r["kwargs"]["x"] for r in ray.get(dummy.futures)] == ["x0", None, "x1", None]
    assert [r["rank"] for r in dummy.get_results(tied)] == [0, 2]


def test_bad_dispatch_fails_before_anything_is_sent(tied: RayWorkerGroup, puts: list[Any]) -> None:
    before = ray.get(tied.run_all_workers_single_data("calls"))
    puts.clear()
    with pytest.raises(ShardingError, match=r"unknown axis \['data_parallel'\]"):
        tied.run_all_workers_sharded_data(
            "echo", x=[1, 2], in_sharded_axes=["data_parallel"], replicate_on_axes=["tp"]
        )
    with pytest.raises(ShardingError, match="x has 3 slices along axis 'dp', which has size 2"):
        tied.run_all_workers_sharded_data(
            "echo", x=[1, 2, 3], in_sharded_axes=["dp"], replicate_on_axes=["tp"]
        )
    with pytest.raises(
        UnknownWorkerMethodError, match="has no method 'ech0'; its methods are"
    ) as e:
        tied.run_all_workers_sharded_data("ech0", x=[1, 2], in_sharded_axes=["dp"])
    assert "'echo'" in str(e.value) and isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="x has 3 entries but 4 workers"):
        tied.run_all_workers_multiple_data("echo", x=[1, 2, 3])
    with pytest.raises(ValueError, match=r"\['x'\] given both per worker and in common_kwargs"):
        tied.run_all_workers_multiple_data("echo", x=[1, 2, 3, 4], common_kwargs={"x": 0})
    assert puts == []
    assert ray.get(tied.run_all_workers_single_data("calls")) == before


def test_single_and_multiple_data(tied: RayWorkerGroup, puts: list[Any]) -> None:
    same = ray.get(tied.run_all_workers_single_data("echo", 1, key="v"))
    assert [(r["rank"], r["args"], r["kwargs"]) for r in same] == [
        (w, [1], {"key": "v"}) for w in range(4)
    ]
    assert puts == [1, "v"]  # each argument stored once for all four workers
    leaders = ray.get(tied.run_all_workers_single_data("echo", run_rank_0_only_axes=["tp"]))
    assert [r["rank"] for r in leaders] == [0, 2]
    multi = ray.get(
        tied.run_all_workers_multiple_data("echo", [10, 11, 12, 13], y=["a", "b", "c", "d"])
    )
    assert [(r["args"], r["kwargs"]["y"]) for r in multi] == [
        ([10], "a"),
        ([11], "b"),
        ([12], "c"),
        ([13], "d"),
    ]
    only = tied.run_all_workers_multiple_data(
        "echo", y=["first", "second"], run_rank_0_only_axes=["tp"], common_kwargs={"z": 1}
    )
    assert [(r["rank"], r["kwargs"]) for r in ray.get(only)] == [
        (0, {"y": "first", "z": 1}),
        (2, {"y": "second", "z": 1}),
    ]
    one = ray.get(tied.run_single_worker_single_data("echo", 3, k=2))
    assert (one["rank"], one["kwargs"]) == (3, {"k": 2})
    with pytest.raises(IndexError, match="worker_idx 4 not in 0..3"):
        tied.run_single_worker_single_data("echo", 4)


def test_plain_futures_deduplicate_by_tied_group(tied: RayWorkerGroup) -> None:
    refs = tied.run_all_workers_single_data("echo")
    assert [r["rank"] for r in MultiWorkerFuture(refs).get_results(tied)] == [0, 2]
    assert [r["rank"] for r in MultiWorkerFuture(refs).get_results()] == [0, 1, 2, 3]
    proxies = MultiWorkerFuture(refs).get_results(tied, return_generators_as_proxies=True)
    assert proxies == [refs[0], refs[2]]


def test_streaming_results_are_consumed_in_order(tied: RayWorkerGroup) -> None:
    gens = [tied.workers[w].stream.options(num_returns="streaming").remote(3) for w in (0, 2)]
    future = MultiWorkerFuture(gens, return_from_workers=[0, 2], called_workers=[0, 2])
    assert future.get_results(tied) == ["0:0", "0:1", "0:2", "2:0", "2:1", "2:2"]
