"""`RayVirtualCluster`: ``{"GPU": 1, "CPU": k}`` bundles over nodes, reserved as placement groups
on first use, so that every worker group placed on them starts where it was planned.

``k = max_colocated_worker_groups``: each colocated group's worker takes one CPU of its bundle and
``1 / k`` of its GPU. Logical GPUs work on CPU-only machines (``ray.init(num_gpus=4)``).

Two layouts, as in NeMo RL: one ``PACK`` placement group per node (the default), or, with
``_init_placement_groups(use_unified_pg=True)``, one group over all bundles whose bundle order
``_sorted_bundle_indices`` follows the hardware (see `topology`), for model-parallel groups that
span nodes. Creating the cluster touches no Ray; the placement groups are made when first asked
for, and removed by `shutdown` or when the cluster is garbage collected.

A request that does not fit the nodes alive now fails at once with `InfeasibleClusterError`,
unless nodes may still join: an autoscaler manages the cluster (see
`autoscaler_state`), or the caller asked to wait (``wait_for_nodes=True`` or
``WORKER_GROUPS_WAIT_FOR_NODES=1``). Then it waits up to ``ready_timeout_s`` for the placement
groups, as NeMo RL does on clusters that scale up from 0 GPU nodes, with a progress line every
`PROGRESS_INTERVAL_S`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from worker_groups._helper_tasks import (
    gpu_and_topology,
    helper_runtime_env,
    node_ip_and_free_port,
    run_helpers,
)
from worker_groups.autoscaling import (
    WAIT_FOR_NODES_ENV,
    WAIT_HINT,
    autoscaler_state,
    wait_for_nodes_setting,
)
from worker_groups.feasibility import (
    InfeasibleClusterError,
    PlacementGroupTimeoutError,
    check_feasible,
    fmt,
)
from worker_groups.readiness import (
    DEFAULT_READINESS,
    bundle_labels,
    check_readiness,
    place_on_ready,
)
from worker_groups.topology import BundleInfo, sort_bundle_indices_by_topology

logger = logging.getLogger(__name__)

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
# Below the usual ephemeral range (32768+), so a port picked here is not taken by the kernel for
# an outgoing connection before the rendezvous binds it. Half-open: [low, high).
DEFAULT_MASTER_PORT_RANGE_LOW = 1400
DEFAULT_MASTER_PORT_RANGE_HIGH = 1999
PROGRESS_INTERVAL_S = 30.0


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RayVirtualCluster:
    """Placement groups over nodes: ``[2, 2]`` is two nodes of two GPU bundles each."""

    def __init__(
        self,
        bundle_ct_per_node_list: Sequence[int],
        use_gpus: bool = True,
        max_colocated_worker_groups: int = 1,
        num_gpus_per_node: int = 8,
        name: str = "",
        placement_group_strategy: str = "SPREAD",
        port_range_low: int | None = None,
        port_range_high: int | None = None,
        segment_size: None = None,
        node_resource_constraints: list[dict[str, float]] | None = None,
        *,
        ready_timeout_s: float = 180.0,
        wait_for_nodes: bool | None = None,
    ) -> None:
        counts = list(bundle_ct_per_node_list)
        if not counts or not all(_is_count(c) and c >= 0 for c in counts):
            raise ValueError(
                f"bundle_ct_per_node_list={bundle_ct_per_node_list!r}: give a non-empty list of "
                "bundle counts (ints >= 0), one per node, e.g. [2, 2]"
            )
        if sum(counts) == 0:
            raise ValueError(
                "bundle_ct_per_node_list asks for no bundles at all: ask for at least 1"
            )
        if not _is_count(max_colocated_worker_groups) or max_colocated_worker_groups < 1:
            raise ValueError(
                f"max_colocated_worker_groups={max_colocated_worker_groups!r} must be an int >= 1"
            )
        if use_gpus and (not _is_count(num_gpus_per_node) or num_gpus_per_node < 1):
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
        low = DEFAULT_MASTER_PORT_RANGE_LOW if port_range_low is None else port_range_low
        high = DEFAULT_MASTER_PORT_RANGE_HIGH if port_range_high is None else port_range_high
        if not (_is_count(low) and _is_count(high) and 1 <= low < high <= 65536):
            raise ValueError(
                f"port range [{low!r}, {high!r}) must be ints with 1 <= low < high <= 65536"
            )
        if segment_size is not None:
            raise ValueError(
                f"segment_size={segment_size!r}: NVLink-domain segment trimming is not supported "
                "here; leave it None (bundles are still sorted by topology, see docs)"
            )
        if node_resource_constraints is not None and len(node_resource_constraints) != len(counts):
            raise ValueError(
                f"node_resource_constraints has {len(node_resource_constraints)} entries for "
                f"{len(counts)} nodes: give one dict (or None) per node"
            )
        if ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s={ready_timeout_s!r} must be > 0")
        self.wait_for_nodes = wait_for_nodes_setting(wait_for_nodes)
        self._bundle_ct_per_node_list = counts
        self._world_size = sum(counts)
        self.use_gpus = use_gpus
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.num_gpus_per_node = num_gpus_per_node
        self.name = name
        self.placement_group_strategy = placement_group_strategy
        self.port_range_low, self.port_range_high = low, high
        self.segment_size = None
        self.node_resource_constraints = node_resource_constraints
        self.ready_timeout_s = ready_timeout_s
        self._allocated_master_ports: set[int] = set()
        self._node_placement_groups: list[PlacementGroup] | None = None
        self._sorted_bundle_indices: list[int] | None = None
        self._nvlink_domain_per_bundle_index: tuple[str, ...] | None = None
        self._shut_down = False

    def bundle_resources(self, node_idx: int = 0) -> dict[str, float]:
        extra = (self.node_resource_constraints or [None] * (node_idx + 1))[node_idx] or {}
        gpu = {"GPU": 1} if self.use_gpus else {}
        return {"CPU": self.max_colocated_worker_groups, **gpu, **extra}

    # -- placement groups -------------------------------------------------------------------

    def _init_placement_groups(
        self,
        strategy: str | None = None,
        use_unified_pg: bool = False,
        uv_project: Mapping[str, Any] | None = None,
        readiness: str = DEFAULT_READINESS,
        env_vars: Mapping[str, str] | None = None,
    ) -> list[PlacementGroup]:
        """Create the placement groups unless they exist: one ``PACK`` group per node, or one
        group of every bundle with ``strategy`` (default: the cluster's) when ``use_unified_pg``.
        Waits at most ``ready_timeout_s``; a request that the nodes alive now cannot hold fails
        at once, unless nodes may still join (`_why_wait_for_nodes`). With a `uv_project`
        value, the bundles go on the nodes where its env (under the workers' `env_vars`) is
        ready, as `readiness` asks (`readiness.place_on_ready`); the first caller's env decides,
        for every group on them."""
        if self._shut_down:
            raise RuntimeError("this RayVirtualCluster was shut down: create a new one")
        if self._node_placement_groups is not None:
            return self._node_placement_groups
        strategy = self.placement_group_strategy if strategy is None else strategy
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}; use one of {STRATEGIES}")
        per_node = [
            [self.bundle_resources(i)] * count
            for i, count in enumerate(self._bundle_ct_per_node_list)
        ]
        if use_unified_pg:
            requests = [([b for node in per_node for b in node], strategy, "unified")]
        else:
            requests = [(b, "PACK", f"node{i}") for i, b in enumerate(per_node) if b]
        waiting_for = None
        try:
            check_feasible(self._bundle_ct_per_node_list, requests)
        except InfeasibleClusterError as e:
            waiting_for = self._why_wait_for_nodes()
            if waiting_for is None:
                if self.wait_for_nodes is None:
                    raise InfeasibleClusterError(f"{e} {WAIT_HINT}") from None
                raise
            logger.warning(
                "virtual cluster %s does not fit the nodes alive now: %s Waiting up to %gs for "
                "nodes to join (%s).",
                self._bundle_ct_per_node_list,
                e,
                self.ready_timeout_s,
                waiting_for,
            )

        def make(selector: dict[str, str] | None) -> list[PlacementGroup]:
            return [
                placement_group(
                    bundles,
                    strategy=s,
                    name=f"{self.name}-{n}" if self.name else "",
                    **bundle_labels(selector, len(bundles)),
                )
                for bundles, s, n in requests
            ]

        if uv_project is None:
            pgs = make(None)
        else:
            what = f"virtual cluster {self._bundle_ct_per_node_list}"
            pgs = place_on_ready(
                make, uv_project, check_readiness(readiness), self.ready_timeout_s, what, env_vars
            )
        self._wait_ready(pgs, waiting_for)
        self._node_placement_groups = pgs
        if use_unified_pg and self.use_gpus:
            self._sort_unified_bundles(pgs[0])
        return pgs

    def _why_wait_for_nodes(self) -> str | None:
        """Why nodes may still join, or None: the caller asked to wait, or an autoscaler manages
        the cluster (whose node types may not fit either: its log and `ray status` say so)."""
        if self.wait_for_nodes is not None:
            return f"wait_for_nodes / {WAIT_FOR_NODES_ENV}" if self.wait_for_nodes else None
        types = autoscaler_state().node_types
        return f"an autoscaler runs; node types now: {sorted(types)}" if types else None

    def _placement_state(
        self, pgs: list[PlacementGroup], pending: list[PlacementGroup], autoscaling: bool
    ) -> str:
        """What is still pending and what the cluster has now, for progress lines and errors."""
        keys = {k for pg in pgs for b in pg.bundle_specs for k in b}
        asked = {k: sum(b.get(k, 0) for pg in pending for b in pg.bundle_specs) for k in keys}
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        totals = {k: sum(n.get(k, 0) for n in nodes) for k in keys}
        available = ray.available_resources()
        state = (
            f"{len(pending)} of {len(pgs)} placement group(s) pending ({fmt(asked)}); the Ray "
            f"cluster has {fmt(totals)} over {len(nodes)} node(s), available now: "
            f"{fmt({k: available.get(k, 0) for k in keys})}"
        )
        launching = autoscaler_state().launching if autoscaling else {}
        return state + (f"; the autoscaler is launching {fmt(launching)}" if launching else "")

    def _wait_ready(self, pgs: list[PlacementGroup], waiting_for: str | None) -> None:
        """Wait for the placement groups until ``ready_timeout_s``, saying what is pending every
        `PROGRESS_INTERVAL_S`; on timeout remove them and say what was asked and what is there."""
        start = time.perf_counter()
        deadline = start + self.ready_timeout_s
        pg_of = {pg.ready(): pg for pg in pgs}
        pending = list(pg_of)
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            _, pending = ray.wait(
                pending, num_returns=len(pending), timeout=min(PROGRESS_INTERVAL_S, left)
            )
            left = deadline - time.perf_counter()
            if pending and left > 0:
                state = self._placement_state(
                    pgs, [pg_of[r] for r in pending], waiting_for is not None
                )
                logger.warning(
                    "virtual cluster %s: %s; %.0fs left",
                    self._bundle_ct_per_node_list,
                    state,
                    left,
                )
        if pending:
            state = self._placement_state(pgs, [pg_of[r] for r in pending], waiting_for is not None)
            for pg in pgs:
                remove_placement_group(pg)
            advice = (
                f"Waited for nodes to join ({waiting_for}) but none that fits came: check that "
                "a node type has these resources and can still be launched (`ray status`, and "
                "the autoscaler's log: monitor.* in the head's session logs), or raise "
                "ready_timeout_s (a GPU node can take minutes to start)."
                if waiting_for
                else "Other jobs or placement groups hold the resources: free them or ask for "
                "fewer bundles."
            )
            raise PlacementGroupTimeoutError(
                f"placement groups for virtual cluster {self._bundle_ct_per_node_list} "
                f"({fmt(self.bundle_resources())} per bundle) were not ready after "
                f"{self.ready_timeout_s:g}s: {state}. {advice}"
            )
        ray.get(list(pg_of))
        logger.info(
            "virtual cluster %s: %d placement group(s) ready in %.2fs",
            self._bundle_ct_per_node_list,
            len(pgs),
            time.perf_counter() - start,
        )

    def _sort_unified_bundles(self, pg: PlacementGroup) -> None:
        """One probe per bundle (its GPU id and topology) and the hardware order of bundles."""
        nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        refs = [
            gpu_and_topology.options(
                runtime_env=helper_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
            ).remote()
            for i in range(pg.bundle_count)
        ]
        facts = run_helpers(refs, "topology probe of the unified placement group")
        infos = [BundleInfo(g, d, r, nodes[i]) for i, (g, d, r) in enumerate(facts)]
        self._nvlink_domain_per_bundle_index = tuple(i.nvlink_domain for i in infos)
        self._sorted_bundle_indices = sort_bundle_indices_by_topology(infos)

    def get_placement_groups(
        self,
        uv_project: Mapping[str, Any] | None = None,
        readiness: str = DEFAULT_READINESS,
        env_vars: Mapping[str, str] | None = None,
    ) -> list[PlacementGroup]:
        """The placement groups (created on first call, where `uv_project`'s env, under the
        workers' `env_vars`, is ready as `readiness` asks): one per node that has bundles, in
        node order, or the single unified one."""
        pgs = self._init_placement_groups(
            uv_project=uv_project, readiness=readiness, env_vars=env_vars
        )
        return [pg for pg in pgs if pg.bundle_specs]

    def world_size(self) -> int:
        return self._world_size

    def node_count(self) -> int:
        return sum(1 for count in self._bundle_ct_per_node_list if count > 0)

    # -- addresses and ports ----------------------------------------------------------------

    def get_available_address_and_port(self, pg_idx: int, bundle_idx: int) -> tuple[str, int]:
        """The node IP of a bundle and a port in the cluster's range that is free there."""
        return self.get_available_addresses_and_ports_batch([(pg_idx, bundle_idx)])[0]

    def get_available_addresses_and_ports_batch(
        self, pg_bundle_pairs: list[tuple[int, int]], batch_size: int = 256
    ) -> list[tuple[str, int]]:
        """`get_available_address_and_port` for many bundles at once, in input order; at most
        ``batch_size`` results are fetched at a time."""
        pgs = self.get_placement_groups()
        refs = []
        for pg_idx, bundle_idx in pg_bundle_pairs:
            pg = pgs[0] if len(pgs) == 1 else pgs[pg_idx]
            if not 0 <= bundle_idx < pg.bundle_count:
                raise IndexError(f"bundle {bundle_idx} not in 0..{pg.bundle_count - 1}")
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_idx)
            refs.append(
                node_ip_and_free_port.options(
                    runtime_env=helper_runtime_env(), scheduling_strategy=strategy
                ).remote(self.port_range_low, self.port_range_high)
            )
        results: list[tuple[str, int]] = []
        for start in range(0, len(refs), batch_size):
            chunk = refs[start : start + batch_size]
            results.extend(tuple(r) for r in run_helpers(chunk, "address and port probe"))
        return results

    def get_master_address_and_port(self) -> tuple[str, int]:
        """An address and free port on the first bundle (in hardware order), never a port this
        cluster handed out before, so two groups on the same bundles get distinct ports."""
        bundle = self._sorted_bundle_indices[0] if self._sorted_bundle_indices else 0
        for _ in range(10):
            addr, port = self.get_available_address_and_port(0, bundle)
            if port not in self._allocated_master_ports:
                self._allocated_master_ports.add(port)
                return addr, port
        raise RuntimeError(
            f"no new free port in [{self.port_range_low}, {self.port_range_high}) after 10 tries; "
            f"handed out already: {sorted(self._allocated_master_ports)}"
        )

    # -- teardown ---------------------------------------------------------------------------

    def shutdown(self) -> bool:
        """Remove the placement groups; safe to call twice, and a no-op once Ray is down."""
        self._shut_down = True
        pgs, self._node_placement_groups = self._node_placement_groups, None
        self._sorted_bundle_indices = self._nvlink_domain_per_bundle_index = None
        if not pgs or not ray.is_initialized():
            return True
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - keep removing the others
                logger.warning("could not remove placement group %s: %s", pg.id.hex(), e)
        return True

    def __del__(self) -> None:
        # A cluster dropped without shutdown() must not hold its GPUs until the job ends.
        if getattr(self, "_node_placement_groups", None) is not None:
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001, S110 - at interpreter exit Ray may be half gone
                pass

    def __enter__(self) -> RayVirtualCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = (
            "shut down"
            if self._shut_down
            else "not placed yet"
            if self._node_placement_groups is None
            else "placed"
        )
        per_bundle = fmt(self.bundle_resources())
        return f"RayVirtualCluster({self._bundle_ct_per_node_list}, {per_bundle} each, {state})"
