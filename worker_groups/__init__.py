"""Tied GPU worker groups on Ray (the API of NeMo RL's ``nemo_rl.distributed.worker_groups``),
every worker in the uv environment its class is registered for.

    ACTOR_ENVIRONMENT_REGISTRY["my_rl.policy.PolicyWorker"] = {"extras": ["torch"]}
    cluster = RayVirtualCluster([2, 2], num_gpus_per_node=2)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("my_rl.policy.PolicyWorker", lr=1e-5),
                           bundle_indices_list=[(0, [0, 1]), (1, [0, 1])])

Placed where the env is ready (`readiness`: "prefer", the default, "require" or "ignore"),
and no rank starts before its node's env is ready.
"""

from worker_groups._helper_tasks import HELPER_PYTHON_ENV, HelperTaskError
from worker_groups.builder import RayWorkerBuilder
from worker_groups.cluster import (
    DEFAULT_MASTER_PORT_RANGE_HIGH,
    DEFAULT_MASTER_PORT_RANGE_LOW,
    RayVirtualCluster,
)
from worker_groups.feasibility import (
    InfeasibleClusterError,
    PlacementGroupTimeoutError,
    ResourceInsufficientError,
)
from worker_groups.futures import MultiWorkerFuture
from worker_groups.group import RayWorkerGroup, WorkerStartupTimeoutError
from worker_groups.group_dispatch import UnknownWorkerMethodError
from worker_groups.readiness import (
    NoReadyNodeError,
    placement_group_on_ready,
    ready_node_selector,
)
from worker_groups.registry import (
    ACTOR_ENVIRONMENT_REGISTRY,
    PY_EXECUTABLES,
    UnregisteredWorkerError,
    get_actor_uv_project,
    register_actor_environment,
)
from worker_groups.sharding import REPLICATED_AXES, NamedSharding, ShardingError
from worker_groups.worker_env import PluginNotLoadedError

__all__ = [
    "ACTOR_ENVIRONMENT_REGISTRY",
    "DEFAULT_MASTER_PORT_RANGE_HIGH",
    "DEFAULT_MASTER_PORT_RANGE_LOW",
    "HELPER_PYTHON_ENV",
    "REPLICATED_AXES",
    "HelperTaskError",
    "PY_EXECUTABLES",
    "InfeasibleClusterError",
    "MultiWorkerFuture",
    "NamedSharding",
    "NoReadyNodeError",
    "PlacementGroupTimeoutError",
    "PluginNotLoadedError",
    "RayVirtualCluster",
    "RayWorkerBuilder",
    "RayWorkerGroup",
    "ResourceInsufficientError",
    "ShardingError",
    "UnknownWorkerMethodError",
    "UnregisteredWorkerError",
    "WorkerStartupTimeoutError",
    "get_actor_uv_project",
    "placement_group_on_ready",
    "ready_node_selector",
    "register_actor_environment",
]
