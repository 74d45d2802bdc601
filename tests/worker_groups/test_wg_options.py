"""A worker class's own `@ray.remote(...)` options under the group's: env-var precedence
(node < decorator < driver < group env_vars < configure_worker), and runtime_env `config`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.worker_groups.conftest import WORKER_ENV, alive_actors
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
)

pytestmark = pytest.mark.timeout(300)

FQN = "wg_workers.DecoratedWorker"


@pytest.fixture(scope="module")
def cpu_cluster(two_node_cluster: Any) -> Iterator[RayVirtualCluster]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, FQN, None)
        cluster = RayVirtualCluster([2], use_gpus=False)
        yield cluster
        cluster.shutdown()


def test_env_var_precedence_and_config(
    cpu_cluster: RayVirtualCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WG_DRIVER_ONLY", "driver")
    group = RayWorkerGroup(
        cpu_cluster,
        RayWorkerBuilder(FQN),
        workers_per_node=1,
        env_vars={**WORKER_ENV, "WG_LAYER_1": "group", "WG_LAYER_2": "group"},
        runtime_env_config={"setup_timeout_seconds": 1234},
    )
    try:
        env = ray.get(group.run_single_worker_single_data("env", 0))
    finally:
        group.shutdown()
    assert env["WG_LAYER_1"] == "configure_worker"  # configure_worker over everything
    assert env["WG_LAYER_2"] == "group"  # the group over the decorator
    assert env["WG_LAYER_3"] == "decorator"  # the decorator's env_vars survive the group's
    # The driver's environment (here the node's too) over the decorator: test_wg_env_checks.
    assert env["WG_SYSTEM_A"] == "system"
    assert env["WG_SYSTEM_B"] == "system"  # the node's environment reaches the worker
    assert env["WG_DRIVER_ONLY"] == "driver"  # the driver's environment is copied, as NeMo RL's
    assert env["config"]["setup_timeout_seconds"] == 1234  # the group's config over the class's


def test_decorator_options_without_group_ones(cpu_cluster: RayVirtualCluster) -> None:
    pg = cpu_cluster.get_placement_groups()[0]
    worker = RayWorkerBuilder(FQN)(pg, 1, 0, runtime_env={"env_vars": WORKER_ENV})
    try:
        env = ray.get(worker.env.remote())
        assert env["config"]["setup_timeout_seconds"] == 777
        assert (env["WG_LAYER_2"], env["WG_LAYER_1"]) == ("decorator", "configure_worker")
    finally:
        ray.kill(worker)
        ray.kill(worker._RAY_INITIALIZER_ACTOR_REF_TO_AVOID_GC)


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"setup_timeout_second": 5}, TypeError, "unexpected keyword argument"),
        ({"setup_timeout_seconds": 0}, ValueError, "greater than zero"),
        ([("setup_timeout_seconds", 5)], TypeError, "must be a dict"),
    ],
)
def test_bad_runtime_env_config_fails_before_any_actor(
    cpu_cluster: RayVirtualCluster, config: Any, error: type, message: str
) -> None:
    before = {a["ActorID"] for a in alive_actors()}
    with pytest.raises(error, match=message):
        RayWorkerGroup(cpu_cluster, RayWorkerBuilder(FQN), runtime_env_config=config)
    assert {a["ActorID"] for a in alive_actors()} == before
