"""`RayVirtualCluster`: one placement group per (virtual) node, one ``{"GPU": 1, "CPU": k}`` bundle
per GPU, reserved up front so every worker group placed on it starts where it was planned.

``k = max_colocated_worker_groups``: each colocated group's worker takes one CPU of its bundle and
``1 / k`` of its GPU. Logical GPUs work on CPU-only machines (``ray.init(num_gpus=4)``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


class ResourceInsufficientError(RuntimeError):
    """The cluster cannot give the placement groups the resources they ask for."""


class InfeasibleClusterError(ResourceInsufficientError, ValueError):
    """The request can never fit the cluster as it is (too many GPUs, a node too small)."""


class PlacementGroupTimeoutError(ResourceInsufficientError, TimeoutError):
    """The request fits the cluster, but its resources did not free up in time."""


@ray.remote(num_cpus=0)
def _node_ip_and_free_port() -> tuple[str, int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


class RayVirtualCluster:
    """Placement groups over nodes: ``[2, 2]`` is two nodes of two GPU bundles each."""

    def __init__(
        self,
        bundle_ct_per_node_list: Sequence[int],
        use_gpus: bool = True,
        max_colocated_worker_groups: int = 1,
        num_gpus_per_node: int = 8,
        name: str = "",
        placement_group_strategy: str = "STRICT_PACK",
        ready_timeout_s: float = 180.0,
    ) -> None:
        counts = list(bundle_ct_per_node_list)
        if not counts or any(
            not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts
        ):
            raise ValueError(
                f"bundle_ct_per_node_list={bundle_ct_per_node_list!r}: give a non-empty list of "
                "bundle counts (ints >= 0), one per node, e.g. [2, 2]"
            )
        if sum(counts) == 0:
            raise ValueError(
                "bundle_ct_per_node_list asks for no bundles at all: ask for at least 1"
            )
        if not isinstance(max_colocated_worker_groups, int) or max_colocated_worker_groups < 1:
            raise ValueError(
                f"max_colocated_worker_groups={max_colocated_worker_groups!r} must be an int >= 1"
            )
        if use_gpus and (not isinstance(num_gpus_per_node, int) or num_gpus_per_node < 1):
            raise ValueError(f"num_gpus_per_node={num_gpus_per_node!r} must be an int >= 1")
        if use_gpus and max(counts) > num_gpus_per_node:
            raise ValueError(
                f"bundle_ct_per_node_list={counts} puts {max(counts)} GPU bundles on one node but "
                f"num_gpus_per_node={num_gpus_per_node}: split the bundles over more nodes or "
                "raise num_gpus_per_node"
            )
        if placement_group_strategy not in STRATEGIES:
            raise ValueError(
                f"placement_group_strategy={placement_group_strategy!r}; use one of {STRATEGIES}"
            )
        self._bundle_ct_per_node_list = counts
        self.use_gpus = use_gpus
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.num_gpus_per_node = num_gpus_per_node
        self.name = name
        self.placement_group_strategy = placement_group_strategy
        self._ports_given: set[tuple[str, int]] = set()
        self._node_placement_groups: list[PlacementGroup] | None = None
        self._create_placement_groups(ready_timeout_s)

    def bundle_resources(self) -> dict[str, float]:
        return {"CPU": self.max_colocated_worker_groups, **({"GPU": 1} if self.use_gpus else {})}

    def _check_feasible(self) -> None:
        """Fail now, naming what is missing, instead of waiting out the timeout."""
        bundle = self.bundle_resources()
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        totals = {k: sum(n.get(k, 0) for n in nodes) for k in bundle}
        need = {k: v * sum(self._bundle_ct_per_node_list) for k, v in bundle.items()}
        short = {k: need[k] - totals[k] for k in need if need[k] > totals[k]}
        if short:
            raise InfeasibleClusterError(
                f"virtual cluster {self._bundle_ct_per_node_list} needs {_fmt(need)} in all but "
                f"the Ray cluster has {_fmt(totals)} over {len(nodes)} node(s): missing "
                f"{_fmt(short)}. Ask for fewer bundles or add nodes."
            )
        if self.placement_group_strategy != "STRICT_PACK":
            return
        for i, count in enumerate(self._bundle_ct_per_node_list):
            pg_need = {k: v * count for k, v in bundle.items()}
            if count and not any(all(n.get(k, 0) >= v for k, v in pg_need.items()) for n in nodes):
                largest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
                raise InfeasibleClusterError(
                    f"virtual node {i} needs {_fmt(pg_need)} on one node (STRICT_PACK) but the "
                    f"largest node has {_fmt({k: largest.get(k, 0) for k in bundle})}: use fewer "
                    "bundles per node or placement_group_strategy='PACK'."
                )

    def _create_placement_groups(self, timeout_s: float) -> None:
        self._check_feasible()
        bundle = self.bundle_resources()
        pgs = [
            placement_group(
                [dict(bundle) for _ in range(count)],
                strategy=self.placement_group_strategy,
                name=f"{self.name}-node-{i}" if self.name else "",
            )
            for i, count in enumerate(self._bundle_ct_per_node_list)
            if count
        ]
        start = time.perf_counter()
        ready, pending = ray.wait(
            [pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s
        )
        if pending:
            for pg in pgs:
                remove_placement_group(pg)
            raise PlacementGroupTimeoutError(
                f"placement groups for virtual cluster {self._bundle_ct_per_node_list} "
                f"({_fmt(bundle)} per bundle) were not ready after {timeout_s:g}s: "
                f"{len(pending)} of {len(pgs)} still pending; available now: "
                f"{_fmt({k: ray.available_resources().get(k, 0) for k in bundle})}. Other jobs or "
                "placement groups hold the resources: free them or ask for fewer bundles."
            )
        ray.get(ready)
        self._node_placement_groups = pgs
        logger.info(
            "virtual cluster %s: %d placement group(s) ready in %.2fs",
            self._bundle_ct_per_node_list,
            len(pgs),
            time.perf_counter() - start,
        )

    def get_placement_groups(self) -> list[PlacementGroup]:
        """One placement group per node that has bundles, in node order."""
        if self._node_placement_groups is None:
            raise RuntimeError("this RayVirtualCluster was shut down: create a new one")
        return list(self._node_placement_groups)

    def world_size(self) -> int:
        return sum(self._bundle_ct_per_node_list)

    def node_count(self) -> int:
        return len(self.get_placement_groups())

    def get_master_address_and_port(self) -> tuple[str, int]:
        """A free port on the node of the first bundle, never one this cluster handed out before,
        so two groups on the same bundles get distinct ``MASTER_PORT`` values."""
        pg = self.get_placement_groups()[0]
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        for _ in range(20):
            addr, port = ray.get(
                _node_ip_and_free_port.options(scheduling_strategy=strategy).remote()
            )
            if (addr, port) not in self._ports_given:
                self._ports_given.add((addr, port))
                return addr, port
        raise RuntimeError(f"no new free port found on {addr} after 20 tries")

    def shutdown(self) -> bool:
        """Remove the placement groups; safe to call twice."""
        pgs, self._node_placement_groups = self._node_placement_groups, None
        for pg in pgs or []:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - keep removing the others
                logger.warning("could not remove placement group %s: %s", pg.id.hex(), e)
        return True

    def __enter__(self) -> RayVirtualCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._node_placement_groups is None else "ready"
        per_bundle = _fmt(self.bundle_resources())
        return f"RayVirtualCluster({self._bundle_ct_per_node_list}, {per_bundle} each, {state})"
