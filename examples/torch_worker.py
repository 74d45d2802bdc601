"""A torch.distributed worker group: every worker joins one process group from the rank env vars
that `RayWorkerGroup` sets (``env://``) and all-reduces. gloo on CPU, nccl on GPU.

The driver needs no torch: the class is named by its FQN and imported only in the workers' venv
(this repo's project with the ``torch`` extra; see `worker_groups.ACTOR_ENVIRONMENT_REGISTRY`).

    export RAY_RUNTIME_ENV_PLUGINS=$(uv run ray-uv plugin-config)
    uv run python examples/torch_worker.py --workers 2          # gloo, CPU only
    uv run python examples/torch_worker.py --workers 2 --gpus   # nccl, one GPU per worker
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class TorchWorker:
    """One rank. torch is imported here, in the worker, never at module level."""

    def __init__(self, backend: str | None = None) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # Ray narrows CUDA_VISIBLE_DEVICES to this worker's GPU: it is cuda:0, not LOCAL_RANK.
        self.device = torch.device("cuda:0" if self.backend == "nccl" else "cpu")
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        # env:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun would set them.
        dist.init_process_group(self.backend, init_method="env://", timeout=timedelta(seconds=300))

    def all_reduce(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return t.item()

    def info(self) -> dict[str, Any]:
        return {
            "rank": self.dist.get_rank(),
            "world_size": self.dist.get_world_size(),
            "backend": self.backend,
            "device": str(self.device),
            "torch": str(self.torch.__version__),  # a TorchVersion: the driver has no torch
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def shutdown(self) -> bool:
        self.dist.destroy_process_group()
        return True


def run(
    bundles: list[int],
    gpus: bool,
    uv_project: dict | None = None,
    env_vars: dict[str, str] | None = None,
) -> list[float]:
    """All-reduce ``rank + 1`` over one rank per bundle (``[2, 2]``: two nodes of two); returns
    every rank's sum. Ray must already be initialized with the plugin registered."""
    import ray

    from worker_groups import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup

    builder = RayWorkerBuilder("examples.torch_worker.TorchWorker")
    if uv_project is not None:
        builder = builder.with_uv_project(uv_project)
    cluster = RayVirtualCluster(bundles, use_gpus=gpus, num_gpus_per_node=max(bundles))
    try:
        group = RayWorkerGroup(cluster, builder, name_prefix="torch", env_vars=env_vars)
        try:
            for info in ray.get(group.run_all_workers_single_data("info")):
                print(info, flush=True)
            values = [rank + 1.0 for rank in range(len(group))]
            return ray.get(group.run_all_workers_multiple_data("all_reduce", value=values))
        finally:
            group.shutdown(cleanup_method="shutdown", timeout=30)
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus", action="store_true", help="one GPU per worker, nccl")
    args = parser.parse_args()

    import ray

    import ray_uv_plugin

    os.environ.setdefault("RAY_RUNTIME_ENV_PLUGINS", ray_uv_plugin.plugin_config())
    # The repo is the job's working_dir: workers import `examples.torch_worker` from it, and the
    # plugin builds the venv from its pyproject.toml + uv.lock (uv_project's default project).
    ray.init(runtime_env={"working_dir": str(REPO)})
    try:
        sums = run([args.workers], args.gpus)
    finally:
        ray.shutdown()
    expected = args.workers * (args.workers + 1) / 2
    print(f"all_reduce over {args.workers} ranks: {sums} (expected {expected} on every rank)")
    if sums != [expected] * args.workers:
        raise SystemExit("all_reduce gave a wrong sum")


if __name__ == "__main__":
    main()
