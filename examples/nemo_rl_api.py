"""A toy RL training step written against NeMo RL's worker-group API: only the imports differ.

With NeMo RL, the one import below would read:

    from nemo_rl.distributed.named_sharding import NamedSharding
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES, RayVirtualCluster
    from nemo_rl.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

A 2 x 2 "policy" (data parallel x tensor parallel) on two virtual nodes of two GPUs; logical
GPUs make it run on a CPU-only machine:

    uv run python examples/nemo_rl_api.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import ray

from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    PY_EXECUTABLES,
    NamedSharding,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
)

REPO = Path(__file__).resolve().parents[1]
POLICY = "examples.nemo_rl_api.ToyPolicyWorker"
ACTOR_ENVIRONMENT_REGISTRY[POLICY] = PY_EXECUTABLES.SYSTEM


@ray.remote(runtime_env={"env_vars": {"TOY_POLICY_LOG_LEVEL": "info"}})
class ToyPolicyWorker:
    """One rank of the policy: a scalar weight fitted to its data-parallel shard."""

    def __init__(self, config: dict[str, Any], lr: float = 0.1, leader_of: Any = None) -> None:
        self.weight = config["init_weight"]
        self.lr = lr
        self.leader_of = leader_of

    @staticmethod
    def configure_worker(
        num_gpus: float, bundle_indices: tuple | None = None, num_gpus_per_node: int | None = None
    ) -> tuple[dict, dict, dict, dict]:
        """NeMo RL's hook: resources, env vars, init kwargs and runtime_env overrides."""
        return {"num_gpus": num_gpus}, {"TOY_CONFIGURED": "1"}, {"leader_of": bundle_indices}, {}

    def train(self, data: list[float], step: int) -> dict[str, Any]:
        loss = sum((self.weight - x) ** 2 for x in data) / len(data)
        self.weight -= self.lr * sum(2 * (self.weight - x) for x in data) / len(data)
        return {"rank": int(os.environ["RANK"]), "step": step, "loss": loss}

    def rank_info(self) -> dict[str, Any]:
        names = ("RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "MASTER_PORT")
        return {
            **{n: os.environ[n] for n in names},
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "env": (os.environ.get("TOY_POLICY_LOG_LEVEL"), os.environ.get("TOY_CONFIGURED")),
            "leader_of": self.leader_of,
        }

    def get_weight(self) -> float:
        return self.weight

    def finish(self) -> bool:
        return True


def run(steps: int = 3) -> None:
    cluster = RayVirtualCluster(
        bundle_ct_per_node_list=[2, 2], use_gpus=True, num_gpus_per_node=2, name="toy"
    )
    sharding = NamedSharding(
        layout=np.arange(4).reshape(2, 2), names=["data_parallel", "tensor_parallel"]
    )
    policy = RayWorkerGroup(
        cluster=cluster,
        remote_worker_builder=RayWorkerBuilder(POLICY, {"init_weight": 0.0}, lr=0.25),
        workers_per_node=None,
        name_prefix="toy_policy",
        sharding_annotations=sharding,
    )
    for step in range(steps):
        futures = policy.run_all_workers_sharded_data(
            "train",
            data=[[1.0, 2.0], [3.0, 5.0]],  # one batch per data-parallel shard
            in_sharded_axes=["data_parallel"],
            replicate_on_axes=["tensor_parallel"],
            output_is_replicated=["tensor_parallel"],
            common_kwargs={"step": step},
        )
        results = policy.get_all_worker_results(futures)  # one per data-parallel shard
        print(f"step {step}: loss per data-parallel shard {[round(r['loss'], 3) for r in results]}")
    for info in ray.get(policy.run_all_workers_single_data("rank_info")):
        print(f"worker {info}")
    worker = sharding.get_ranks(data_parallel=1, tensor_parallel=0)
    weight = ray.get(policy.run_single_worker_single_data("get_weight", worker_idx=worker))
    print(f"weight of data-parallel shard 1 (worker {worker}): {weight:.3f}")
    policy.shutdown(cleanup_method="finish", timeout=30)
    cluster.shutdown()


if __name__ == "__main__":
    # Workers import this module by name: the repository goes on their path.
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=4,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    try:
        run(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    finally:
        ray.shutdown()
