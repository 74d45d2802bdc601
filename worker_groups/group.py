"""`RayWorkerGroup`: workers on a `RayVirtualCluster`'s bundles, with rank env vars, tied groups
and the dispatch helpers an RL loop calls every step.

Environment of each worker, as NeMo RL's: the builder's ``uv_project`` (the venv the plugin builds
per node); env vars, lowest to highest, the class's ``@ray.remote`` ``env_vars``, the driver's
environment (`driver_env_vars`), the group's ``env_vars`` with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` (the bundle's index on its node), ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (a
free port, distinct per group), then ``configure_worker``'s. A worker that should run in a venv and
does not (its node's raylet lacks the plugin) fails the group (`PluginNotLoadedError`).

GPUs: each worker asks for ``1 / max_colocated_worker_groups`` GPU of its bundle, and Ray sets
``CUDA_VISIBLE_DEVICES`` to that one GPU, so inside a worker the device is ``cuda:0`` (not
``cuda:LOCAL_RANK``); colocated groups on a bundle see the same GPU. A class that must see all the
GPUs of its tied group (a tensor-parallel engine leader) asks for it in ``configure_worker`` with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``; then Ray leaves ``CUDA_VISIBLE_DEVICES`` alone.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import ray
from ray.actor import ActorHandle

from worker_groups._helper_tasks import helper_runtime_env
from worker_groups._initializer import WorkerVenvReport, worker_venv_report
from worker_groups.builder import (
    RayWorkerBuilder,
    check_runtime_env_config,
    restore_method_signatures,
)
from worker_groups.cluster import RayVirtualCluster
from worker_groups.dispatch import check_layout_covers
from worker_groups.group_dispatch import WorkerDispatch
from worker_groups.placement import bundles_from_workers_per_node, check_bundle_indices
from worker_groups.readiness import DEFAULT_READINESS, WaitLines, check_readiness, wait_line
from worker_groups.sharding import NamedSharding
from worker_groups.worker_env import (
    PluginNotLoadedError,
    driver_env_vars,
    initializer_outside_venv,
    job_default_uv_project,
    outside_venvs_error,
    runs_outside_its_venv,
)

logger = logging.getLogger(__name__)

# Long enough for a cold multi-GB environment build (Ray's own setup timeout is 600 s, tried
# 3 times), short enough that a worker that can never be scheduled does not hang the job.
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


class WorkerStartupTimeoutError(TimeoutError):
    """Workers of a group were not up within `startup_timeout_s`; the group was shut down."""


class RayWorkerGroup(WorkerDispatch):
    """Workers placed on a virtual cluster; ``bundle_indices_list`` ties workers into groups that
    share one data-parallel shard (e.g. the ranks of one tensor-parallel engine)."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        remote_worker_builder: RayWorkerBuilder,
        workers_per_node: int | list[int] | None = None,
        name_prefix: str = "",
        bundle_indices_list: list[tuple[int, list[int]]] | None = None,
        sharding_annotations: NamedSharding | None = None,
        env_vars: dict[str, str] | None = None,
        *,
        startup_timeout_s: float | None = DEFAULT_STARTUP_TIMEOUT_S,
        runtime_env_config: dict[str, Any] | None = None,
        readiness: str = DEFAULT_READINESS,
    ) -> None:
        if not isinstance(remote_worker_builder, RayWorkerBuilder):
            raise TypeError(
                f"remote_worker_builder must be a RayWorkerBuilder, got "
                f"{type(remote_worker_builder).__name__}"
            )
        env_vars = dict(env_vars or {})
        bad = {
            k: v for k, v in env_vars.items() if not isinstance(k, str) or not isinstance(v, str)
        }
        if bad:
            raise TypeError(f"env_vars must map str to str; fix {bad!r}")
        if startup_timeout_s is not None and startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0 or None, got {startup_timeout_s}")
        self.startup_timeout_s = startup_timeout_s
        self.runtime_env_config = check_runtime_env_config(runtime_env_config)
        self.readiness = check_readiness(readiness)
        self.cluster = cluster
        self.name_prefix = name_prefix
        self.sharding_annotations = sharding_annotations
        self.ray_actor_class_fqn = remote_worker_builder.ray_actor_class_fqn
        self._workers: list[ActorHandle] = []
        self._worker_metadata: list[dict[str, Any]] = []
        self._initializer_pool: dict[int, ActorHandle] = {}
        self.dp_leader_worker_indices: list[int] = []
        self.worker_to_tied_group_index: dict[int, int] = {}
        group_env: dict[str, Any] = {"env_vars": {**driver_env_vars(), **env_vars}}
        if self.runtime_env_config is not None:
            group_env["config"] = dict(self.runtime_env_config)
        base = remote_worker_builder.worker_options({"runtime_env": group_env})  # may refuse
        self._uv_project = base["runtime_env"].get("uv_project") or job_default_uv_project(
            base["runtime_env"]
        )
        pgs = cluster.get_placement_groups(
            self._uv_project, self.readiness, base["runtime_env"].get("env_vars")
        )
        counts = [pg.bundle_count for pg in pgs]
        if bundle_indices_list is None:
            bundle_indices_list = bundles_from_workers_per_node(counts, workers_per_node)
        else:
            bundle_indices_list = check_bundle_indices(counts, bundle_indices_list)
        self.world_size = sum(len(b) for _, b in bundle_indices_list)
        if sharding_annotations is not None:
            if not isinstance(sharding_annotations, NamedSharding):
                raise TypeError("sharding_annotations must be a NamedSharding")
            check_layout_covers(sharding_annotations, self.world_size)
        self._create_workers_from_bundle_indices(remote_worker_builder, bundle_indices_list, base)

    def _create_workers_from_bundle_indices(
        self,
        remote_worker_builder: RayWorkerBuilder,
        bundle_indices_list: list[tuple[int, list[int]]],
        base: dict[str, Any],
    ) -> None:
        """Create every worker at once (one initializer per node), once the env is ready on
        all their nodes (`_prepare_env`), then wait for all of them. `base`: the workers'
        options (`RayWorkerBuilder.worker_options`)."""
        pgs = self.cluster.get_placement_groups()
        self._prepare_env(base["runtime_env"], pgs)
        self.master_address, self.master_port = self.cluster.get_master_address_and_port()
        pairs = [(node, b) for node, bundles in bundle_indices_list for b in bundles]
        addresses = self.cluster.get_available_addresses_and_ports_batch(pairs)
        num_gpus = 1 / self.cluster.max_colocated_worker_groups if self.cluster.use_gpus else 0
        futures = []
        rank = 0
        for group_idx, (node, bundles) in enumerate(bundle_indices_list):
            pg = pgs[0] if len(pgs) == 1 else pgs[node]
            if node not in self._initializer_pool:
                self._initializer_pool[node] = remote_worker_builder.make_initializer(
                    base["runtime_env"], pg, bundles[0]
                )
            self.dp_leader_worker_indices.append(rank)
            for local_rank, bundle in enumerate(bundles):
                name = (
                    f"{self.name_prefix}-grp{group_idx}-{local_rank}"
                    if len(bundles) > 1
                    else f"{self.name_prefix}-{node}-{bundle}"
                )
                options = copy.deepcopy(base)
                options["runtime_env"]["env_vars"].update(
                    RANK=str(rank),
                    WORLD_SIZE=str(self.world_size),
                    LOCAL_RANK=str(bundle),
                    NODE_RANK=str(node),
                    MASTER_ADDR=self.master_address,
                    MASTER_PORT=str(self.master_port),
                    AVAILABLE_ADDR_LIST=str([a for a, _ in addresses]),
                    AVAILABLE_PORT_LIST=str([p for _, p in addresses]),
                )
                if self.name_prefix:  # named actors must be unique: only when asked for
                    options["name"] = name
                leader_bundles = (node, list(bundles)) if local_rank == 0 else None
                futures.append(
                    self._initializer_pool[node].create_worker.remote(
                        pg,
                        bundle,
                        num_gpus,
                        leader_bundles,
                        num_gpus_per_node=self.cluster.num_gpus_per_node,
                        **options,
                    )
                )
                self.worker_to_tied_group_index[rank] = group_idx
                self._worker_metadata.append(
                    {
                        "node_idx": node,
                        "bundle_idx": bundle,
                        "local_rank": local_rank,
                        "global_rank": rank,
                        "name": name,
                        "bundle_indices": leader_bundles,
                        "dp_shard_idx": group_idx,
                        "tied_group_idx": group_idx,
                    }
                )
                rank += 1
        start = time.perf_counter()
        try:
            self._workers = self._get_before_deadline(futures, start, "created")
            first = next(iter(self._initializer_pool.values()))
            specs = ray.get(first.method_specs.remote())
            for worker in self._workers:
                restore_method_signatures(worker, specs)
            self._wait_ready(start)
        except BaseException as error:
            self.shutdown(force=True)
            problem = initializer_outside_venv(error)
            if problem is not None:
                raise PluginNotLoadedError(f"{problem} The group has been shut down.") from error
            raise
        logger.info(
            "%s: %d workers of %s ready in %.2fs",
            self.name_prefix or "worker group",
            len(self._workers),
            self.ray_actor_class_fqn,
            time.perf_counter() - start,
        )

    def _prepare_env(self, runtime_env: dict[str, Any], pgs: list) -> None:
        """The gate, before any worker starts: build the workers' uv_project env on one of the
        group's nodes (or take one that has it ready) and ship it to the others
        (`ray_uv_plugin.cluster.prepare`), as `ray-uv prepare` does; with RAY_UV_PLUGIN_SHIP=0
        each node builds its own. Nodes that have it already cost one small task each.
        Workers without a uv_project of their own under a `uv run` driver run in the job's
        default env (`job_default_uv_project`): that one is prepared then. While it waits, a
        line per node not ready (`WaitLines`); if the startup timeout runs out first,
        `WorkerStartupTimeoutError` names each node still on its way and what it is doing,
        and no rank has started: none waits in a rendezvous for ranks whose env is still
        building."""
        from ray.util import placement_group_table

        from ray_uv_plugin.cluster.node_result import NodeResult, outcome_counts
        from ray_uv_plugin.cluster.options import PrepareOptions, Quiet
        from ray_uv_plugin.cluster.prepare import prepare_nodes
        from ray_uv_plugin.env.spec import parse_spec

        value = self._uv_project
        if value is None:
            return
        node_ids = {
            n for pg in pgs for n in placement_group_table(pg)["bundles_to_node_id"].values()
        }
        if len(node_ids) < 2:
            return  # one node builds it once, for all its ranks
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        nodes = [(n, addresses.get(n, n[:8])) for n in sorted(node_ids)]
        what = self.name_prefix or "worker group"
        timeout = self.startup_timeout_s or DEFAULT_STARTUP_TIMEOUT_S
        start = time.perf_counter()
        lines = WaitLines(what, value, node_ids, runtime_env.get("env_vars"))
        ready = [n for n, setup in lines.read().items() if setup.state == "ready"]

        class Logged(Quiet):
            def result(self, r: NodeResult) -> None:
                logger.info("%s: uv_project env: %s: %s", what, r.label, r.summary)

        with lines.said():
            results = prepare_nodes(
                parse_spec(value),
                nodes,
                PrepareOptions(timeout=timeout),
                Logged(),
                runtime_env=helper_runtime_env(),
                probe_env={**runtime_env, "uv_project": value},
                ready=ready,  # shipped from a node that has it, not built first
            )
        logger.info(
            "%s: uv_project env ready on %d of %d nodes in %.2fs (%s)",
            what,
            sum(r.ok for r in results),
            len(results),
            time.perf_counter() - start,
            outcome_counts(results),
        )
        failed = [r.node_id for r in results if not r.ok]
        # A node whose build failed is left to its workers, whose error is the build's own.
        on_its_way = lines.not_ready(failed) if failed else []
        if on_its_way:
            raise WorkerStartupTimeoutError(
                f"{self.world_size} workers of {self.ray_actor_class_fqn} not started: their "
                f"uv_project env was not ready on {len(on_its_way)} of {len(nodes)} nodes "
                f"after {timeout:g}s: "
                + "; ".join(wait_line(setup) for setup in on_its_way)
                + ". No rank was started. Warm the nodes with `ray-uv prepare`, or raise "
                "startup_timeout_s."
            )

    def _remaining(self, start: float) -> float | None:
        if self.startup_timeout_s is None:
            return None
        return max(0.0, self.startup_timeout_s - (time.perf_counter() - start))

    def _timed_out(self, pending_ranks: list[int], stage: str) -> WorkerStartupTimeoutError:
        return WorkerStartupTimeoutError(
            f"{len(pending_ranks)} of {self.world_size} workers of {self.ray_actor_class_fqn} "
            f"not {stage} after {self.startup_timeout_s:g}s (ranks {pending_ranks}). Either "
            "they cannot be scheduled on their bundles (what configure_worker or the options "
            "ask for must fit in a bundle: see `ray status`), or their environment is still "
            "building (warm the nodes with `ray-uv prepare`, or raise startup_timeout_s). "
            "The group has been shut down."
        )

    def _get_before_deadline(self, refs: list, start: float, stage: str) -> list:
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=self._remaining(start))
        if pending:
            raise self._timed_out([refs.index(r) for r in pending], stage)
        return ray.get(refs)

    def _wait_ready(self, start: float) -> None:
        """Wait for every worker's `worker_venv_report` (its readiness call), failing at the
        first startup error or worker outside its venv."""
        # `fn` by name: a handle whose class the driver cannot import takes keywords only.
        refs = [w.__ray_call__.remote(fn=worker_venv_report) for w in self._workers]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = refs
        total = len(pending)
        while pending:
            remaining = self._remaining(start)
            if remaining == 0.0:
                raise self._timed_out([refs.index(r) for r in pending], "ready")
            wait = 30.0 if remaining is None else min(30.0, remaining)
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
            # Raises the first startup error (runtime env, import, __init__).
            reports: list[WorkerVenvReport] = ray.get(done)
            outside = {
                rank_of[ref]: report
                for ref, report in zip(done, reports, strict=True)
                if runs_outside_its_venv(report)
            }
            if outside:
                raise outside_venvs_error(self.ray_actor_class_fqn, outside)
            if pending:
                logger.info(
                    "%d/%d workers of %s ready after %.0fs",
                    total - len(pending),
                    total,
                    self.ray_actor_class_fqn,
                    time.perf_counter() - start,
                )

    # -- introspection ----------------------------------------------------------------------------

    @property
    def workers(self) -> list[ActorHandle]:
        return self._workers

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        return self._worker_metadata

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards: one per tied group."""
        return len(self.dp_leader_worker_indices)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        """The first worker of a data-parallel shard's tied group."""
        if not 0 <= dp_shard_idx < self.dp_size:
            raise IndexError(f"dp_shard_idx {dp_shard_idx} not in 0..{self.dp_size - 1}")
        return self.dp_leader_worker_indices[dp_shard_idx]

    # -- teardown -------------------------------------------------------------------------------

    def shutdown(
        self, cleanup_method: str | None = None, timeout: float | None = 30.0, force: bool = False
    ) -> bool:
        """Call ``cleanup_method`` on every worker (unless ``force``), waiting at most
        ``timeout`` seconds, then kill the workers and their initializers. Returns False if a
        cleanup failed or timed out; the workers are killed either way. Safe to call twice."""
        success = True
        if cleanup_method is not None and not force and self._workers:
            try:
                self._check_method(cleanup_method)
                refs = [self._method(w, cleanup_method).remote() for w in self._workers]
                done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
                if pending:
                    logger.warning(
                        "%d workers did not finish %s in %ss; killing them",
                        len(pending),
                        cleanup_method,
                        timeout,
                    )
                    success = False
                ray.get(done)
            except Exception as e:  # noqa: BLE001 - clean up the rest regardless
                logger.warning("cleanup %s failed: %s; killing the workers", cleanup_method, e)
                success = False
        # Workers first: their initializers own them.
        for actor in [*self._workers, *self._initializer_pool.values()]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # noqa: BLE001
                logger.warning("could not kill %s: %s", actor, e)
                success = False
        self._workers, self._initializer_pool, self._worker_metadata = [], {}, []
        return success

    def __len__(self) -> int:
        return len(self._workers)

    def __repr__(self) -> str:
        return (
            f"RayWorkerGroup({self.ray_actor_class_fqn!r}, {len(self._workers)} workers, "
            f"dp_size={self.dp_size})"
        )
