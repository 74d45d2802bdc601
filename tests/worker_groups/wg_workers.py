"""Worker classes for the worker_groups tests. Imported only inside the workers (by FQN, through
PYTHONPATH), never by the test driver: stdlib and Ray only."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import ray

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


class EchoWorker:
    """A plain class: the builder turns it into an actor."""

    def __init__(self, tag: str = "", **init_kwargs: Any) -> None:
        self.tag = tag
        self.init_kwargs = init_kwargs

    def info(self) -> dict[str, Any]:
        return {
            **{k: os.environ.get(k) for k in (*RANK_VARS, "CUDA_VISIBLE_DEVICES", "WG_MODE")},
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "node_id": ray.get_runtime_context().get_node_id(),
            "executable": sys.executable,
            "tag": self.tag,
            "init_kwargs": self.init_kwargs,
        }

    def echo(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.n_calls = getattr(self, "n_calls", 0) + 1
        return {"rank": int(os.environ.get("RANK", -1)), "args": list(args), "kwargs": kwargs}

    def calls(self) -> int:
        return getattr(self, "n_calls", 0)

    def stream(self, n: int) -> Iterator[str]:
        for i in range(n):
            yield f"{os.environ['RANK']}:{i}"

    def cleanup(self) -> str:
        return f"cleaned {os.environ['RANK']}"

    def hang(self) -> None:
        time.sleep(600)


@ray.remote
class ConfiguredWorker(EchoWorker):
    """Decorated, with a `configure_worker` that overrides the caller's options."""

    @staticmethod
    def configure_worker(
        num_gpus: float, bundle_indices: tuple[int, list[int]] | None = None
    ) -> tuple[dict, dict, dict]:
        env = {"WG_MODE": "configured"}
        if bundle_indices is not None:  # the tied group's leader sees all its GPUs
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        return {"num_cpus": 0.5}, env, {"leader_of": bundle_indices, "asked_gpus": num_gpus}


class BrokenWorker:
    def __init__(self) -> None:
        raise RuntimeError("BrokenWorker refuses to start")


@ray.remote(
    num_cpus=1,
    runtime_env={
        "env_vars": {
            "WG_SYSTEM_A": "decorator",
            "WG_LAYER_1": "decorator",
            "WG_LAYER_2": "decorator",
            "WG_LAYER_3": "decorator",
        },
        "config": {"setup_timeout_seconds": 777},
    },
)
class DecoratedWorker:
    """Options of its own in the decorator, and a `configure_worker` in NeMo RL's 4-tuple form."""

    @staticmethod
    def configure_worker(
        num_gpus: float, bundle_indices: tuple | None = None, num_gpus_per_node: int | None = None
    ) -> tuple[dict, dict, dict, dict]:
        return {"num_gpus": num_gpus}, {"WG_LAYER_1": "configure_worker"}, {}, {}

    def env(self) -> dict[str, Any]:
        config = ray.get_runtime_context().runtime_env.get("config") or {}
        names = [*(k for k in os.environ if k.startswith(("WG_", "AVAILABLE_"))), *RANK_VARS]
        return {
            **{k: os.environ.get(k) for k in names},
            "config": dict(config),
            "node_id": ray.get_runtime_context().get_node_id(),
        }


class StartedWorker(EchoWorker):
    """An `EchoWorker` that knows when its `__init__` ran: where a rank would enter its
    rendezvous."""

    def __init__(self, tag: str = "", **init_kwargs: Any) -> None:
        super().__init__(tag, **init_kwargs)
        self.started = time.time()

    def started_at(self) -> float:
        return self.started
