"""The order of a unified placement group's bundles: neighbours in the order are neighbours on
the hardware, so consecutive slices (a tensor-parallel engine, a Megatron model-parallel group)
stay on one node, or one NVLink domain, wherever the topology allows.

Pure Python: the bundle facts come from `_helper_tasks.gpu_and_topology`, one task per bundle.
"""

from __future__ import annotations

from typing import NamedTuple

from worker_groups._helper_tasks import NVLINK_DOMAIN_UNKNOWN, TOPO_RANK_UNKNOWN


class BundleInfo(NamedTuple):
    """What is known of one bundle: its GPU id on its node, its node's NVLink domain and
    topology rank (``unknown`` / ``-1`` when the cluster registers none), and its node id."""

    gpu_id: int
    nvlink_domain: str
    topo_rank: int
    node_id: str


def sort_bundle_indices_by_topology(bundles: list[BundleInfo]) -> list[int]:
    """Bundle indices in hardware order.

    Without topology facts: by ``(node_id, gpu_id)``, a stable order that keeps each node's GPUs
    together. With them: domains by their lowest topology rank, then nodes by rank, then GPUs.
    """
    bundles = [BundleInfo(*b) for b in bundles]
    known = any(
        b.nvlink_domain != NVLINK_DOMAIN_UNKNOWN or b.topo_rank != TOPO_RANK_UNKNOWN
        for b in bundles
    )
    if not known:
        return sorted(range(len(bundles)), key=lambda i: (bundles[i].node_id, bundles[i].gpu_id))
    domain_rank: dict[str, int] = {}
    for b in bundles:
        domain_rank[b.nvlink_domain] = min(
            domain_rank.get(b.nvlink_domain, b.topo_rank), b.topo_rank
        )
    return sorted(
        range(len(bundles)),
        key=lambda i: (
            domain_rank[bundles[i].nvlink_domain],
            bundles[i].topo_rank,
            bundles[i].node_id,
            bundles[i].gpu_id,
        ),
    )
