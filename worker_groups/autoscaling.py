"""Whether nodes may still join the cluster: the caller's choice (``wait_for_nodes``,
``WORKER_GROUPS_WAIT_FOR_NODES``), else what Ray's autoscaler reports (`autoscaler_state`, read
from the GCS as `ray status` reads it). `RayVirtualCluster` waits for placement groups that do
not fit the nodes alive now only where one of them says nodes may come."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from typing import Any, NamedTuple

import ray

from ray_uv_plugin.settings import boolish

logger = logging.getLogger(__name__)

# Set on the driver: "1" waits for nodes to join, "0" never does; unset: wait only where an
# autoscaler manages the cluster. For scripts that construct the cluster themselves (NeMo RL's).
WAIT_FOR_NODES_ENV = "WORKER_GROUPS_WAIT_FOR_NODES"
# Ray's autoscaler on a cluster started by hand (its read-only provider) gives each node a type of
# its own, "node_<node id>": such a cluster cannot grow.
_READONLY_NODE_TYPE = re.compile(r"node_[0-9a-f]+")

WAIT_HINT = (
    "If nodes are about to join (nodes you add, or an autoscaler Ray does not report), pass "
    f"wait_for_nodes=True or set {WAIT_FOR_NODES_ENV}=1 to wait up to ready_timeout_s for them."
)


def wait_for_nodes_setting(value: bool | None) -> bool | None:
    """The caller's choice, else ``WORKER_GROUPS_WAIT_FOR_NODES``'s; None leaves it to the
    autoscaler (`autoscaler_state`). Read when the cluster is made, so a typo fails there."""
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(
                f"wait_for_nodes={value!r}: use True (wait for nodes to join), False (never "
                "wait) or None (wait where an autoscaler manages the cluster)"
            )
        return value
    raw = os.environ.get(WAIT_FOR_NODES_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    wait = boolish(raw)
    if wait is not None:
        return wait
    raise ValueError(
        f"{WAIT_FOR_NODES_ENV}={raw!r}: use 1 (wait for nodes to join), 0 (never wait) or leave "
        "it unset (wait where an autoscaler manages the cluster)"
    )


class AutoscalerState(NamedTuple):
    """What Ray's autoscaler reports: the node types of the nodes it manages now (its config's
    types that have nodes; empty where none runs, or where it is the read-only one of a cluster
    started by hand) and the nodes it is launching, by type."""

    node_types: frozenset[str]
    launching: dict[str, int]


NO_AUTOSCALER = AutoscalerState(frozenset(), {})


def _state_of(types: list[str], launching: Counter[str]) -> AutoscalerState:
    launches = {t: n for t, n in sorted(launching.items()) if t and n > 0}
    named = [*types, *launches]
    scaling = frozenset(t for t in named if t and not _READONLY_NODE_TYPE.fullmatch(t))
    return AutoscalerState(scaling, launches)


def autoscaler_state_from_v1(status_json: bytes | str | None) -> AutoscalerState:
    """From the v1 autoscaler's status (what `ray status` prints, kept in the GCS)."""
    if not status_json:
        return NO_AUTOSCALER
    report = json.loads(status_json).get("autoscaler_report") or {}
    launching: Counter[str] = Counter(report.get("pending_launches") or {})
    # (ip, type, status); newer Rays put the node id first: the type is always second to last.
    launching.update(node[-2] for node in report.get("pending_nodes") or [])
    types = [*(report.get("node_type_mapping") or {}).values(), *(report.get("active_nodes") or {})]
    return _state_of(types, launching)


def autoscaler_state_from_v2(status: Any) -> AutoscalerState:
    """From the v2 autoscaler's `ray.autoscaler.v2.schema.ClusterStatus`: nodes carry the type
    they were launched as (``RAY_NODE_TYPE_NAME``, which its providers and KubeRay set)."""
    launching: Counter[str] = Counter()
    for request in status.pending_launches:
        launching[request.ray_node_type_name] += request.count
    launching.update(node.ray_node_type_name for node in status.pending_nodes)
    nodes = [*status.active_nodes, *status.idle_nodes]
    return _state_of([n.ray_node_type_name for n in nodes], launching)


def autoscaler_state() -> AutoscalerState:
    """What the cluster's autoscaler reports, read from the GCS as `ray status` reads it (Ray
    2.44-2.60, autoscaler v1 or v2). Never raises: a state it cannot read is no autoscaler."""
    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        if is_autoscaler_v2(fetch_from_server=True):
            from ray.autoscaler.v2.sdk import get_cluster_status

            gcs = ray.get_runtime_context().gcs_address
            return autoscaler_state_from_v2(get_cluster_status(gcs, timeout=10))
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.experimental.internal_kv import _internal_kv_get

        return autoscaler_state_from_v1(_internal_kv_get(DEBUG_AUTOSCALING_STATUS))
    except Exception as e:  # noqa: BLE001 - Ray internals: treat anything odd as no autoscaler
        logger.debug("could not read the autoscaler's state: %r", e)
        return NO_AUTOSCALER
