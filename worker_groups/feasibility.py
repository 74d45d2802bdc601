"""Whether a virtual cluster's placement groups can fit the nodes alive now, and the errors
that say why not: `InfeasibleClusterError` at once (it never fits as the cluster is),
`PlacementGroupTimeoutError` after waiting (it fits, but the resources did not free up)."""

from __future__ import annotations

import ray


class ResourceInsufficientError(RuntimeError):
    """The cluster cannot give the placement groups the resources they ask for."""


class InfeasibleClusterError(ResourceInsufficientError, ValueError):
    """The request can never fit the cluster as it is (too many GPUs, a node too small)."""


class PlacementGroupTimeoutError(ResourceInsufficientError, TimeoutError):
    """The request fits the cluster, but its resources did not free up in time."""


def fmt(resources: dict[str, float]) -> str:
    """`{CPU: 2, GPU: 1}`: resources as the errors and progress lines name them."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def check_feasible(shape: list[int], requests: list[tuple[list[dict], str, str]]) -> None:
    """Fail now, naming what is missing, instead of waiting out the timeout: the placement
    groups `requests` (bundles, strategy, label) of the virtual cluster `shape` (bundles per
    node) against the nodes alive now."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    keys = {k for bundles, _, _ in requests for b in bundles for k in b}
    need = {k: sum(b.get(k, 0) for bs, _, _ in requests for b in bs) for k in keys}
    totals = {k: sum(n.get(k, 0) for n in nodes) for k in keys}
    short = {k: need[k] - totals[k] for k in keys if need[k] > totals[k]}
    if short:
        raise InfeasibleClusterError(
            f"virtual cluster {shape} needs {fmt(need)} in all but "
            f"the Ray cluster has {fmt(totals)} over {len(nodes)} node(s): missing "
            f"{fmt(short)}. Ask for fewer bundles or add nodes."
        )

    def fits(res: dict[str, float]) -> bool:
        return any(all(n.get(k, 0) >= v for k, v in res.items()) for n in nodes)

    for bundles, strategy, label in requests:
        whole = {k: sum(b.get(k, 0) for b in bundles) for k in keys}
        if not fits(bundles[0]):
            raise InfeasibleClusterError(
                f"no node can hold one bundle {fmt(bundles[0])} of placement group {label}"
            )
        if strategy == "STRICT_PACK" and not fits(whole):
            raise InfeasibleClusterError(
                f"placement group {label} needs {fmt(whole)} on one node (STRICT_PACK) but "
                "no node has that much: use placement_group_strategy='PACK' or fewer bundles"
            )
        if strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
            raise InfeasibleClusterError(
                f"placement group {label} has {len(bundles)} bundles but STRICT_SPREAD needs "
                f"a node for each and the cluster has {len(nodes)}"
            )
