"""Placement by readiness: the nodes whose env is ready decide where a group's bundles go, and
the driver says what each node is doing while a group waits for it.

Ray cannot label a node at run time, so readiness stays outside its scheduler: it is read from
the nodes (`ray_uv_plugin.cluster.readiness.node_setups`) and turned into placement. Where Ray
places bundles by label (`ray_compat.LABEL_SELECTORS_SINCE`), each bundle carries a
``ray.io/node-id`` selector of the ready nodes:

- ``"prefer"`` (the default): on ready nodes if they hold the request within `PREFER_WAIT_S`,
  else anywhere at once (too few ready nodes) or after it; no ready node at all: anywhere.
- ``"require"``: on ready nodes only, waiting up to the caller's timeout.
- ``"ignore"``: anywhere, as without readiness.

While a request waits on ready nodes, nodes that join the cluster are prepared for its env
(`cluster.watch.watch_nodes`, shipped from a ready node), and the request is made again when
the ready set grows: no driver restart. On older Rays every mode places anywhere. Either way,
the last step is the gate (`RayWorkerGroup`): no rank starts before the env is ready on every
node the group landed on, and while it waits the driver logs `WaitLines`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from ray_uv_plugin.cluster.readiness import elapsed
from worker_groups.feasibility import PlacementGroupTimeoutError, fmt

if TYPE_CHECKING:
    from ray_uv_plugin.cluster.readiness import NodeSetup

logger = logging.getLogger(__name__)

READINESS_MODES = ("prefer", "require", "ignore")
DEFAULT_READINESS = "prefer"
NODE_ID_LABEL = "ray.io/node-id"
# How long "prefer" waits for ready nodes that hold the request before it places anywhere: a
# warm start takes seconds, a cold build minutes.
PREFER_WAIT_S = 10.0
POLL_S = 2.0  # how often a pending request reads the ready set again
WAIT_LINE_INTERVAL_S = 5.0  # at most one wait line per node this often
JOIN_WATCH_INTERVAL_S = 2.0  # the watch's shortest interval: one GCS call listing the nodes

Make = Callable[[dict[str, str] | None], list[PlacementGroup]]
# The env_vars of the env's workers, which may shape its venv and so its key on every node
# (uv's settings, `build_env_vars`): None for the job's alone.
EnvVars = Mapping[str, str] | None


def check_readiness(readiness: Any) -> str:
    if readiness not in READINESS_MODES:
        raise ValueError(
            f"readiness={readiness!r}: use 'prefer' (ready nodes first, the default), "
            "'require' (ready nodes only) or 'ignore'"
        )
    return readiness


def label_selectors() -> bool:
    """Whether this Ray places bundles by label."""
    from ray_uv_plugin.agent.ray_compat import has_label_selectors

    return has_label_selectors(ray.__version__)


def node_id_selector(node_ids: Iterable[str]) -> dict[str, str]:
    """A label selector for these nodes, as tasks, actors and bundles take it."""
    return {NODE_ID_LABEL: f"in({','.join(sorted(node_ids))})"}


def _alive() -> dict[str, str]:
    """Alive nodes: id -> address."""
    from ray_uv_plugin.cluster.prepare import alive_nodes

    return dict(alive_nodes())


def _read_setups(
    uv_project: Mapping[str, Any], nodes: Iterable[str], env_vars: EnvVars = None
) -> dict[str, NodeSetup]:
    from ray_uv_plugin.cluster.readiness import node_setups

    nodes = list(nodes)
    return node_setups(uv_project, nodes=nodes, env_vars=env_vars) if nodes else {}


def _ready_nodes(uv_project: Mapping[str, Any], env_vars: EnvVars = None) -> set[str]:
    """The alive nodes where the env of `uv_project` (under `env_vars`) is ready now."""
    setups = _read_setups(uv_project, _alive(), env_vars)
    return {node for node, setup in setups.items() if setup.state == "ready"}


class NoReadyNodeError(RuntimeError):
    """No alive node has the env ready, and the caller asked for ready nodes only."""


def ready_node_selector(uv_project: Mapping[str, Any], env_vars: EnvVars = None) -> dict[str, str]:
    """The ``label_selector`` that puts a user's own actor or task on a node whose env of
    `uv_project` is ready: ``f.options(label_selector=ready_node_selector(value))``; `env_vars`:
    the actor's, where they shape the venv. The set is read now; call it again for a later
    actor."""
    if not label_selectors():
        raise RuntimeError(
            f"Ray {ray.__version__} has no label selectors for placement (Ray 2.50 and later): "
            "prepare the nodes first (`ray-uv prepare`), or upgrade Ray."
        )
    ready = _ready_nodes(uv_project, env_vars)
    if not ready:
        raise NoReadyNodeError(
            "no alive node has this uv_project env ready: make it ready with `ray-uv prepare` "
            "(or keep joining nodes ready with `ray-uv prepare --watch`)."
        )
    return node_id_selector(ready)


def placement_group_on_ready(
    bundles: list[dict[str, float]],
    uv_project: Mapping[str, Any],
    *,
    strategy: str = "PACK",
    readiness: str = DEFAULT_READINESS,
    name: str = "",
    lifetime: str | None = None,
    timeout_s: float = 600.0,
    env_vars: EnvVars = None,
) -> PlacementGroup:
    """`ray.util.placement_group` on the nodes where the env of `uv_project` is ready (under
    `env_vars`, the actors' own), as `readiness` asks. "require" returns it placed, or raises
    `PlacementGroupTimeoutError` after `timeout_s`; "prefer" and "ignore" may return it pending
    (``pg.ready()``)."""
    check_readiness(readiness)

    def make(selector: dict[str, str] | None) -> list[PlacementGroup]:
        labels = bundle_labels(selector, len(bundles))
        return [placement_group(bundles, strategy=strategy, name=name, lifetime=lifetime, **labels)]

    what = name or "placement group"
    return place_on_ready(make, uv_project, readiness, timeout_s, what, env_vars)[0]


def bundle_labels(selector: dict[str, str] | None, bundles: int) -> dict[str, Any]:
    """`placement_group`'s keyword for a selector on each of its bundles; none for None."""
    return {} if selector is None else {"bundle_label_selector": [selector] * bundles}


def _asked(pgs: list[PlacementGroup]) -> dict[str, float]:
    asked: dict[str, float] = {}
    for bundle in (b for pg in pgs for b in pg.bundle_specs):
        for k, v in bundle.items():
            asked[k] = asked.get(k, 0.0) + v
    return asked


def _fits(asked: Mapping[str, float], ready: set[str]) -> bool:
    """Whether the ready nodes have, in all, the resources asked for (a first look: too few
    ready nodes fall back at once)."""
    totals: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive") and node["NodeID"] in ready:
            for k, v in node["Resources"].items():
                totals[k] = totals.get(k, 0.0) + v
    return all(totals.get(k, 0.0) >= v for k, v in asked.items())


def _remove(pgs: list[PlacementGroup]) -> None:
    for pg in pgs:
        remove_placement_group(pg)


def place_on_ready(
    make: Make,
    uv_project: Mapping[str, Any],
    readiness: str,
    timeout_s: float,
    what: str,
    env_vars: EnvVars = None,
) -> list[PlacementGroup]:
    """The placement groups `make` creates (given a node selector, or None for anywhere),
    placed as `readiness` asks: see the module's docstring. Returns them placed on ready
    nodes, or pending anywhere (the caller waits for those). `env_vars`: the workers'."""
    if readiness == "ignore" or not label_selectors():
        return make(None)
    from ray_uv_plugin.cluster.readiness import ReadinessError

    alive = _alive()
    try:
        setups = _read_setups(uv_project, alive, env_vars)
    except ReadinessError as e:  # a job whose own runtime_env has uv_project
        if readiness == "require":
            raise
        logger.info("%s: %s: placed on any node", what, e)
        return make(None)
    ready = {n for n, s in setups.items() if s.state == "ready"}
    if not ready and readiness == "prefer":
        logger.info("%s: no node has its env ready: placed on any node", what)
        return make(None)
    wait = PREFER_WAIT_S if readiness == "prefer" else timeout_s
    deadline = time.perf_counter() + wait
    with _joining_nodes_prepared(uv_project, alive, setups, env_vars):
        pgs = make(node_id_selector(ready)) if ready else []  # "require": none ready yet
        asked = _asked(pgs)
        if readiness == "prefer" and not _fits(asked, ready):
            _remove(pgs)
            logger.info(
                "%s: the %d node(s) with its env ready cannot hold it: placed on any node",
                what,
                len(ready),
            )
            return make(None)
        placed = pending = [pg.ready() for pg in pgs]
        while True:
            if placed:
                _, pending = ray.wait(placed, num_returns=len(placed), timeout=POLL_S)
            else:
                time.sleep(POLL_S)
            if pgs and not pending:
                logger.info("%s: placed on nodes with its env ready (%d ready)", what, len(ready))
                return pgs
            if time.perf_counter() > deadline:
                _remove(pgs)
                if readiness == "prefer":
                    logger.info(
                        "%s: not placed on the %d node(s) with its env ready within %gs: "
                        "placed on any node",
                        what,
                        len(ready),
                        wait,
                    )
                    return make(None)
                held = f" ({fmt(asked)})" if asked else ""
                raise PlacementGroupTimeoutError(
                    f"{what}: readiness='require' and the {len(ready)} node(s) with its env "
                    f"ready could not hold its bundles{held} within {wait:g}s. "
                    "Make the env ready on more nodes (`ray-uv prepare`, or `ray-uv prepare "
                    "--watch` for nodes that join), free those nodes, or use readiness='prefer'."
                )
            now_ready = _ready_nodes(uv_project, env_vars)
            if now_ready - ready:
                logger.info(
                    "%s: the env is ready on %d more node(s): placing it again",
                    what,
                    len(now_ready - ready),
                )
                _remove(pgs)
                ready = now_ready  # alive ones only: a selector names no node that left
                pgs = make(node_id_selector(ready))
                asked, placed = _asked(pgs), [pg.ready() for pg in pgs]


@contextmanager
def _joining_nodes_prepared(
    uv_project: Mapping[str, Any],
    alive: Mapping[str, str],
    setups: Mapping[str, NodeSetup],
    env_vars: EnvVars = None,
) -> Iterator[None]:
    """While the block runs, each node that joins the cluster is prepared for the env (shipped
    from a node that has it ready, else built there), in a thread, as `ray-uv prepare --watch`
    does, under the workers' `env_vars` (the key they will ask for); the nodes alive now are
    left as they are."""
    from ray_uv_plugin.cluster.node_result import NodeResult
    from ray_uv_plugin.cluster.options import Quiet, WatchOptions
    from ray_uv_plugin.cluster.watch import watch_nodes
    from ray_uv_plugin.env.spec import parse_spec

    seen = [
        NodeResult(
            node,
            address,
            setups[node].state == "ready" if node in setups else False,
            0.0,
            key=setups[node].key if node in setups else None,
        )
        for node, address in alive.items()
    ]

    class Told(Quiet):
        def result(self, result: NodeResult) -> None:
            logger.info("node %s joined: uv_project env %s", result.address, result.summary)

    stop = threading.Event()
    options = WatchOptions(interval=JOIN_WATCH_INTERVAL_S)
    spec = parse_spec(uv_project)
    probe_env: dict[str, Any] = {"uv_project": spec.as_value()}
    if env_vars:
        probe_env["env_vars"] = dict(env_vars)
    thread = threading.Thread(
        target=watch_nodes, args=(spec, seen, options, Told(), stop, probe_env), daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()  # a round under way finishes: its node is then ready for later groups


def wait_line(setup: NodeSetup) -> str:
    """`node 10.0.0.3 (3f2a9c1d): building flash-attn 7m12s`: what a node is doing for an env
    (the id's start tells apart raylets that share a host)."""
    from ray_uv_plugin.store.units import format_bytes

    words = [setup.state]
    if setup.phase:
        words.append(setup.phase)
    if setup.seconds is not None:
        words.append(elapsed(setup.seconds))
    if setup.bytes:
        words.append(format_bytes(setup.bytes))
    if setup.source:
        words.append(f"from {setup.source}")
    text = f"node {setup.address} ({setup.node_id[:8]}): {' '.join(words)}"
    return f"{text}: {setup.cause}" if setup.cause else text


class WaitLines:
    """What a gate says while it waits: every `WAIT_LINE_INTERVAL_S`, one line for each node
    whose env is not ready yet (read from the nodes, never guessed). `last` keeps what each
    node said last, for the timeout's message."""

    def __init__(
        self,
        what: str,
        uv_project: Mapping[str, Any],
        nodes: Iterable[str],
        env_vars: EnvVars = None,
    ) -> None:
        self.what, self.value, self.env_vars = what, dict(uv_project), env_vars
        self.nodes = set(nodes)
        self.last: dict[str, NodeSetup] = {}
        self._stop = threading.Event()

    def read(self, nodes: Iterable[str] | None = None) -> dict[str, NodeSetup]:
        """The setups of `nodes` (default: those not ready yet), read now; none where they
        cannot be read (a job whose own runtime_env has uv_project)."""
        if nodes is None:
            nodes = self.nodes - {n for n, s in self.last.items() if s.state == "ready"}
        try:
            setups = _read_setups(self.value, nodes, self.env_vars)
        except Exception as e:  # noqa: BLE001 - a line not said costs nothing; a raise would
            logger.debug("%s: could not read the nodes' setups: %s", self.what, e)
            return {}
        self.last.update(setups)
        return setups

    def _run(self) -> None:
        while not self._stop.wait(WAIT_LINE_INTERVAL_S):
            for setup in self.read().values():
                if setup.state != "ready" and not self._stop.is_set():
                    logger.warning("%s waits: %s", self.what, wait_line(setup))

    @contextmanager
    def said(self) -> Iterator[WaitLines]:
        """Say the lines in a thread while the block runs."""
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()

    def not_ready(self, nodes: Iterable[str]) -> list[NodeSetup]:
        """The setups of `nodes` whose env is still on its way (queued, building, receiving),
        read now: a wait that ran out, not a failure."""
        setups = self.read(nodes).values()
        return [s for s in setups if s.state in ("queued", "building", "receiving")]
