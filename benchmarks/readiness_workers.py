"""Worker classes for `benchmarks.readiness`. Imported only inside the workers (by FQN, through
PYTHONPATH), in the venv of their uv_project: stdlib, Ray, and torch from the image."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import ray


class NodeWorker:
    """Says where it runs."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class RendezvousWorker(NodeWorker):
    """Enters a gloo `init_process_group` in its `__init__`, as a training rank does, with a
    rendezvous timeout of $RENDEZVOUS_TIMEOUT_S seconds, and sums its rank with the others'.
    `started`: its `__init__`'s start, before torch is imported; `entered`: the rendezvous'."""

    def __init__(self) -> None:
        self.started = time.time()
        import torch
        import torch.distributed as dist

        self.entered = time.time()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=float(os.environ["RENDEZVOUS_TIMEOUT_S"])),
        )
        self.joined = time.time()
        total = torch.tensor([rank])
        dist.all_reduce(total)
        self.sum = int(total.item())
        self.torch = torch.__version__

    def times(self) -> dict[str, Any]:
        return {
            "rank": int(os.environ["RANK"]),
            "node": self.node(),
            "started": self.started,
            "entered": self.entered,
            "joined": self.joined,
            "sum": self.sum,
            "torch": self.torch,
        }
