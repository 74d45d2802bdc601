"""Which bundles a group's workers take: ``(node_idx, [bundle, ...])`` per tied group, from
``workers_per_node`` or checked from an explicit ``bundle_indices_list``. Pure Python, given the
bundle count of each placement group, so every bad request fails before any actor exists."""

from __future__ import annotations

from typing import Any

TiedGroup = tuple[int, list[int]]


def bundles_from_workers_per_node(
    counts: list[int], workers_per_node: int | list[int] | None
) -> list[TiedGroup]:
    """One single-worker group per bundle used: all bundles (``None``), the first ``n`` of every
    node (an int), or of each node (a list, one count per placement group)."""
    if workers_per_node is None:
        wanted = counts
    elif isinstance(workers_per_node, int) and not isinstance(workers_per_node, bool):
        wanted = [workers_per_node] * len(counts)
    elif isinstance(workers_per_node, list) and len(workers_per_node) == len(counts):
        wanted = list(workers_per_node)
    else:
        raise ValueError(
            f"workers_per_node={workers_per_node!r}: use None (one worker per bundle), an "
            f"int, or a list with one count per node ({len(counts)} nodes)"
        )
    for node, (want, have) in enumerate(zip(wanted, counts, strict=True)):
        if not isinstance(want, int) or isinstance(want, bool) or not 0 <= want <= have:
            raise ValueError(
                f"workers_per_node asks for {want!r} workers on node {node}, which has "
                f"{have} bundles"
            )
    return [(node, [b]) for node, want in enumerate(wanted) for b in range(want)]


def check_bundle_indices(counts: list[int], groups: Any) -> list[TiedGroup]:
    """An explicit ``bundle_indices_list``, checked. With one placement group (one node, or a
    unified group over all nodes, as NeMo RL's Megatron and vLLM placement builds), ``node_idx``
    is only a label (the workers' ``NODE_RANK``) and bundles index that one group."""
    unified = len(counts) == 1
    seen: set[tuple[int, int]] = set()
    checked = []
    for entry in groups:
        try:
            node, bundles = entry
            node, bundles = int(node), [int(b) for b in bundles]
        except (TypeError, ValueError):
            raise TypeError(
                f"bundle_indices_list entry {entry!r}: use (node_idx, [bundle, ...])"
            ) from None
        if node < 0 or not (unified or node < len(counts)):
            raise ValueError(f"bundle_indices_list: node {node} not in 0..{len(counts) - 1}")
        if not bundles:
            raise ValueError(f"bundle_indices_list: tied group on node {node} has no bundles")
        pg = 0 if unified else node
        for b in bundles:
            if not 0 <= b < counts[pg]:
                raise ValueError(
                    f"bundle_indices_list: bundle {b} is not in node {node}'s bundles "
                    f"0..{counts[pg] - 1}"
                )
            if (pg, b) in seen:
                raise ValueError(
                    f"bundle_indices_list: bundle {b} of node {node} is used twice; to share "
                    "bundles, create another group (max_colocated_worker_groups)"
                )
            seen.add((pg, b))
        checked.append((node, bundles))
    if not checked:
        raise ValueError("bundle_indices_list is empty: give at least one tied group")
    return checked
