"""vLLM generation workers: each tied group of ``tp`` bundles is one tensor-parallel engine, and
the group's data-parallel shards each get their slice of the prompts.

Only the tied group's leader (the worker that receives ``bundle_indices``) builds the engine;
vLLM's Ray executor then places its tensor-parallel ranks on the tied bundles of the same
placement group (the builder sets ``placement_group_capture_child_tasks``). The other members
hold their bundle's share and stay idle, so results come back once per engine.

    export RAY_RUNTIME_ENV_PLUGINS=$(uv run ray-uv plugin-config)
    uv run python examples/vllm_worker.py --model Qwen/Qwen2.5-0.5B-Instruct --tp 2 --dp 1
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class VllmGenerationWorker:
    """vllm is imported here, in the worker's venv (extra ``vllm``), never on the driver."""

    @staticmethod
    def configure_worker(
        num_gpus: float, bundle_indices: tuple[int, list[int]] | None = None
    ) -> tuple[dict, dict, dict]:
        init_kwargs: dict[str, Any] = {"bundle_indices": None}
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        resources: dict[str, Any] = {}
        if bundle_indices is not None:
            init_kwargs["bundle_indices"] = list(bundle_indices[1])
            if len(bundle_indices[1]) > 1:
                # The engine's own Ray workers take the GPUs of the tied bundles: the leader
                # needs none, and must see every GPU of the node, not just one.
                resources["num_gpus"] = 0
                env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
                init_kwargs["fraction_of_gpus"] = num_gpus
        return resources, env, init_kwargs

    def __init__(
        self,
        model: str,
        tp: int = 1,
        bundle_indices: list[int] | None = None,
        fraction_of_gpus: float = 1.0,
        max_model_len: int = 1024,
    ) -> None:
        self.llm = None
        if bundle_indices is None:
            return  # a member of a tied group, not its leader: the leader's engine uses our GPU
        from vllm import LLM

        executor = None
        if tp > 1:
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(fraction_of_gpus)
            executor = "ray"
        self.llm = LLM(
            model=model,
            tensor_parallel_size=tp,
            distributed_executor_backend=executor,
            max_model_len=max_model_len,
            gpu_memory_utilization=0.6,
            enforce_eager=True,
        )

    def generate(self, prompts: list[str] | None, max_tokens: int = 16) -> list[str] | None:
        if self.llm is None or prompts is None:
            return None
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return [out.outputs[0].text for out in self.llm.generate(prompts, params)]

    def is_leader(self) -> bool:
        return self.llm is not None


def run(
    model: str,
    tp: int,
    dp: int,
    prompts: list[str],
    uv_project: dict | None = None,
    env_vars: dict[str, str] | None = None,
) -> list[list[str]]:
    """``dp`` engines of ``tp`` GPUs (one node each); returns one list of texts per engine."""
    from worker_groups import NamedSharding, RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup

    builder = RayWorkerBuilder("examples.vllm_worker.VllmGenerationWorker", model=model, tp=tp)
    if uv_project is not None:
        builder = builder.with_uv_project(uv_project)
    cluster = RayVirtualCluster([tp] * dp, num_gpus_per_node=tp)
    try:
        group = RayWorkerGroup(
            cluster,
            builder,
            name_prefix="vllm",
            bundle_indices_list=[(node, list(range(tp))) for node in range(dp)],
            sharding_annotations=NamedSharding(
                [[d * tp + t for t in range(tp)] for d in range(dp)],
                ["data_parallel", "tensor_parallel"],
            ),
            env_vars=env_vars,
        )
        try:
            shards = [prompts[d::dp] for d in range(dp)]
            future = group.run_all_workers_sharded_data(
                "generate",
                prompts=shards,
                in_sharded_axes=["data_parallel"],
                replicate_on_axes=["tensor_parallel"],
                output_is_replicated=["tensor_parallel"],
            )
            return group.get_all_worker_results(future)
        finally:
            group.shutdown()
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    args = parser.parse_args()

    import ray

    import ray_uv_plugin

    os.environ.setdefault("RAY_RUNTIME_ENV_PLUGINS", ray_uv_plugin.plugin_config())
    ray.init(runtime_env={"working_dir": str(REPO)})
    try:
        prompts = ["The capital of France is", "1 + 1 =", "Ray is", "uv is"]
        for engine, texts in enumerate(run(args.model, args.tp, args.dp, prompts)):
            print(f"engine {engine}: {texts}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
