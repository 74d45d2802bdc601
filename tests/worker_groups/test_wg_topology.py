"""The hardware order of a unified placement group's bundles, without Ray."""

from __future__ import annotations

from worker_groups.topology import BundleInfo, sort_bundle_indices_by_topology

UNKNOWN = ("unknown", -1)


def test_without_topology_bundles_sort_by_node_then_gpu() -> None:
    bundles = [
        BundleInfo(0, *UNKNOWN, "node-c"),
        BundleInfo(1, *UNKNOWN, "node-a"),
        BundleInfo(0, *UNKNOWN, "node-a"),
        BundleInfo(0, *UNKNOWN, "node-b"),
    ]
    assert sort_bundle_indices_by_topology(bundles) == [2, 1, 3, 0]
    assert sort_bundle_indices_by_topology([]) == []


def test_domains_by_lowest_rank_then_nodes_by_rank_then_gpus() -> None:
    # Domain B holds the lowest topology rank (1), so its nodes come first, even though its
    # bundles come last and its node ids sort after A's.
    bundles = [
        BundleInfo(1, "nvlink_domain_A", 5, "a1"),
        BundleInfo(0, "nvlink_domain_A", 5, "a1"),
        BundleInfo(0, "nvlink_domain_A", 3, "a0"),
        BundleInfo(0, "nvlink_domain_B", 2, "z1"),
        BundleInfo(0, "nvlink_domain_B", 1, "z0"),
    ]
    order = sort_bundle_indices_by_topology(bundles)
    assert order == [4, 3, 2, 1, 0]
    assert [bundles[i].nvlink_domain[-1] for i in order] == ["B", "B", "A", "A", "A"]
