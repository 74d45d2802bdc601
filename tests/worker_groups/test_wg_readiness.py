"""Placement by readiness and the gate: where a group's env is ready decides where it
is placed (Ray 2.50+), a node that joins while a group waits is prepared and used, and no rank
starts before its env is ready on every node, with a line per node while it waits and a
timeout that names the node and what it is doing.

Real Ray: raylets added to the package's cluster, each a simulated machine with its own venv
dir and uv (`tests.support.raylets`), and a resource of their own (`RDY`) that the groups'
bundles ask for, so that they land on these nodes only. Node B's uv sleeps `SLOW_S` before each
sync: its build is that much slower than A's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from ray_uv_plugin.cluster.options import PrepareOptions
from ray_uv_plugin.cluster.prepare import prepare_nodes
from ray_uv_plugin.cluster.readiness import NodeSetup, node_setups
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.store.layout import Venv
from tests.support.raylets import Raylet
from tests.support.uvproject import write_project
from tests.worker_groups.conftest import (
    WORKER_ENV,
    alive_actors,
    live_placement_groups,
    wait_until,
)
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    PlacementGroupTimeoutError,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
    WorkerStartupTimeoutError,
)
from worker_groups import readiness as placement
from worker_groups.readiness import (
    check_readiness,
    label_selectors,
    node_id_selector,
    placement_group_on_ready,
    ready_node_selector,
    wait_line,
)

pytestmark = pytest.mark.timeout(600)

STARTED = "wg_workers.StartedWorker"
RDY = {"wg_rdy": 1}
SLOW_S = 40
needs_label_selectors = pytest.mark.skipif(
    not label_selectors(), reason=f"Ray {ray.__version__} places no bundle by label: gate only"
)


# --- pure ------------------------------------------------------------------------------------


def test_the_modes_are_checked() -> None:
    assert check_readiness("require") == "require"
    with pytest.raises(ValueError, match="use 'prefer' .* 'require' .* or 'ignore'"):
        check_readiness("ready")


def test_a_selector_names_the_nodes() -> None:
    assert node_id_selector(["b2", "a1"]) == {"ray.io/node-id": "in(a1,b2)"}


def test_a_wait_line_says_what_the_node_does() -> None:
    building = NodeSetup(
        "3f2a9c1d" + "0" * 48, "10.0.0.3", "k", "building", phase="flash-attn", seconds=432.5
    )
    assert wait_line(building) == "node 10.0.0.3 (3f2a9c1d): building flash-attn 7m12s"
    receiving = NodeSetup(
        "ab" * 28, "10.0.0.4", "k", "receiving", seconds=3, bytes=3 * 2**20, source="10.0.0.3"
    )
    assert wait_line(receiving).startswith("node 10.0.0.4 (abababab): receiving 3s 3")
    assert wait_line(receiving).endswith("from 10.0.0.3")
    failed = NodeSetup("cd" * 28, "10.0.0.5", None, "failed", cause="no key here: boom")
    assert wait_line(failed) == "node 10.0.0.5 (cdcdcdcd): failed: no key here: boom"


# --- real Ray ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nodes(two_node_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Nodes A and B (B's builds `SLOW_S` slower), one CPU and one `RDY` each; `join(name)`
    adds a node like A (C, D or E), removed at the end."""
    base = tmp_path_factory.mktemp("readiness")
    raylets = {name: Raylet(base / name) for name in "abcde"}
    slow = {"SLOW_UV_SECONDS": str(SLOW_S)}
    added = {
        "a": two_node_cluster.add_node(num_cpus=1, resources=RDY, env_vars=raylets["a"].env()),
        "b": two_node_cluster.add_node(
            num_cpus=1, resources=RDY, env_vars={**raylets["b"].env(), **slow}
        ),
    }
    two_node_cluster.wait_for_nodes()

    def join(name: str) -> str:
        added[name] = two_node_cluster.add_node(
            num_cpus=1, resources=RDY, env_vars=raylets[name].env()
        )
        return added[name].node_id

    try:
        yield SimpleNamespace(
            **{f"{n}_id": node.node_id for n, node in added.items()}, raylets=raylets, join=join
        )
    finally:
        for node in added.values():
            two_node_cluster.remove_node(node)


def new_project(tmp_path: Path) -> Path:
    return write_project(tmp_path / "proj", ["six"], name=f"ready{time.monotonic_ns()}")


def group_of(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    counts: list[int],
    env_vars: dict[str, str] | None = None,
    **kw: Any,
):
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, STARTED, {"project": str(project)})
    cluster = RayVirtualCluster(
        counts, use_gpus=False, node_resource_constraints=[RDY] * len(counts)
    )
    env_vars = {**WORKER_ENV, **(env_vars or {})}
    try:
        group = RayWorkerGroup(cluster, RayWorkerBuilder(STARTED), env_vars=env_vars, **kw)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, group


def worker_nodes(group: RayWorkerGroup) -> list[str]:
    return [info["node_id"] for info in ray.get([w.info.remote() for w in group.workers])]


def test_no_rank_starts_before_every_node_has_its_env(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each node builds its own (shipping off), B `SLOW_S` later than A: the gate holds A's
    rank until B's env is ready too, so both enter their `__init__` (where a rendezvous
    starts) within seconds of each other, and the driver says what B is doing meanwhile."""
    monkeypatch.setenv("RAY_UV_PLUGIN_SHIP", "0")
    project = new_project(tmp_path)
    with caplog.at_level(logging.WARNING, logger="worker_groups.readiness"):
        cluster, group = group_of(project, monkeypatch, [1, 1])
    try:
        assert sorted(worker_nodes(group)) == sorted([nodes.a_id, nodes.b_id])
        started = ray.get([w.started_at.remote() for w in group.workers])
        assert max(started) - min(started) < 5, started
        lines = [r.getMessage() for r in caplog.records]
        about_b = [line for line in lines if f"({nodes.b_id[:8]}): " in line]
        assert about_b, lines
    finally:
        group.shutdown()
        cluster.shutdown()


def test_a_timeout_names_the_node_and_what_it_is_doing(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's build outlasts the startup timeout: the error names B and its state, not A (ready),
    and no rank was started."""
    monkeypatch.setenv("RAY_UV_PLUGIN_SHIP", "0")
    project = new_project(tmp_path)
    with pytest.raises(WorkerStartupTimeoutError) as caught:
        group_of(project, monkeypatch, [1, 1], startup_timeout_s=SLOW_S / 2)
    message = str(caught.value)
    assert f"({nodes.b_id[:8]}): " in message, message
    assert any(f"({nodes.b_id[:8]}): {state}" in message for state in ("queued", "building"))
    assert nodes.a_id[:8] not in message
    assert "No rank was started" in message
    assert not alive_actors("StartedWorker")


@needs_label_selectors
def test_prefer_places_on_the_ready_node_and_builds_nothing(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The env is ready on A only: a one-bundle group lands there (B, free too, is not
    ready), with no build anywhere; a user's own placement group and task too."""
    project = new_project(tmp_path)
    value = {"project": str(project)}
    (ready,) = prepare_nodes(parse_spec(value), [(nodes.a_id, "a")], PrepareOptions(timeout=300))
    assert ready.ok, ready
    syncs = {n: r.uv.syncs() for n, r in nodes.raylets.items()}

    assert ready_node_selector(value) == node_id_selector([nodes.a_id])
    pg = placement_group_on_ready([{"CPU": 1, **RDY}], value, readiness="require", timeout_s=60)
    try:
        table = ray.util.placement_group_table(pg)
        assert set(table["bundles_to_node_id"].values()) == {nodes.a_id}
    finally:
        ray.util.remove_placement_group(pg)

    cluster, group = group_of(project, monkeypatch, [1])
    try:
        assert worker_nodes(group) == [nodes.a_id]
    finally:
        group.shutdown()
        cluster.shutdown()
    assert {n: r.uv.syncs() for n, r in nodes.raylets.items()} == syncs


@needs_label_selectors
def test_prefer_places_anywhere_when_too_few_nodes_are_ready(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The env is ready on A only and the group needs two nodes: it is placed at once on A
    and B, and the gate sends B the env from A (no build there)."""
    project = new_project(tmp_path)
    (ready,) = prepare_nodes(
        parse_spec({"project": str(project)}), [(nodes.a_id, "a")], PrepareOptions(timeout=300)
    )
    assert ready.ok, ready
    with caplog.at_level(logging.INFO, logger="worker_groups.readiness"):
        cluster, group = group_of(project, monkeypatch, [1, 1])
    try:
        assert sorted(worker_nodes(group)) == sorted([nodes.a_id, nodes.b_id])
    finally:
        group.shutdown()
        cluster.shutdown()
    said = [r.getMessage() for r in caplog.records]
    assert any("the 1 node(s) with its env ready cannot hold it" in line for line in said), said
    # B received it from A, not built it (B's uv counts no project: the earlier tests' slow
    # builds on B may still be running under their own keys' locks)
    assert Venv.at(nodes.raylets["b"].venvs / ready.key).read_marker()["shipped_from"]


@needs_label_selectors
def test_require_with_no_ready_node_says_so_after_the_wait(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = new_project(tmp_path)
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, STARTED, {"project": str(project)})
    cluster = RayVirtualCluster([1], use_gpus=False, node_resource_constraints=[RDY])
    cluster.ready_timeout_s = 4.0
    started = time.monotonic()
    with pytest.raises(PlacementGroupTimeoutError) as caught:
        RayWorkerGroup(cluster, RayWorkerBuilder(STARTED), readiness="require")
    assert time.monotonic() - started >= 4.0
    message = str(caught.value)
    assert "readiness='require' and the 0 node(s) with its env ready" in message, message
    assert "`ray-uv prepare`" in message
    assert not any(s.state == "ready" for s in node_setups({"project": str(project)}).values())
    wait_until(lambda: not live_placement_groups(), what="the pending group removed")
    cluster.shutdown()


def placed_on_a_and_a_joined_node(
    nodes: Any, name: str, project: Path, key: str, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> None:
    """A two-bundle group (`kw`: the group's; readiness "require" unless given), made in a
    thread while A only can take it: it is still waiting 5 s on, then node `name` joins, and
    the group is placed on A and that node, which was sent the env of `key` (no build
    there)."""
    kw.setdefault("readiness", "require")
    made: dict[str, Any] = {}

    def make() -> None:  # the wait: in a thread, as a node is added from the main one only
        try:
            made["group"] = group_of(project, monkeypatch, [1, 1], **kw)
        except BaseException as e:  # noqa: BLE001 - raised below
            made["error"] = e

    waiting = threading.Thread(target=make)
    waiting.start()
    time.sleep(5.0)
    assert waiting.is_alive(), made  # one ready node cannot hold two bundles
    joined = nodes.join(name)
    waiting.join(timeout=400)
    assert "group" in made, made
    cluster, group = made["group"]
    try:
        assert sorted(worker_nodes(group)) == sorted([nodes.a_id, joined])
    finally:
        group.shutdown()
        cluster.shutdown()
    raylet = nodes.raylets[name]
    assert raylet.uv.syncs() == 0
    assert Venv.at(raylet.venvs / key).read_marker()["shipped_from"]


@needs_label_selectors
def test_a_node_that_joins_while_a_group_waits_is_prepared_and_used(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "require" with the env ready on A only: a two-bundle group waits; node C joins, is sent
    the env from A (no build there), and the group is placed again, on A and C."""
    monkeypatch.setattr(placement, "POLL_S", 1.0)
    project = new_project(tmp_path)
    (ready,) = prepare_nodes(
        parse_spec({"project": str(project)}), [(nodes.a_id, "a")], PrepareOptions(timeout=300)
    )
    assert ready.ok, ready
    placed_on_a_and_a_joined_node(nodes, "c", project, ready.key, monkeypatch)


@needs_label_selectors
def test_a_joining_node_gets_the_env_of_the_groups_env_vars(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's env_vars shape its venv (a build variable: another key than the plain
    value's). With that env ready on A only, a two-bundle group in "require" waits; node D
    joins, is sent the env of that key from A (no build there), and the group is placed on A
    and D."""
    monkeypatch.setattr(placement, "POLL_S", 1.0)
    project = new_project(tmp_path)
    value, shaping = {"project": str(project)}, {"MAX_JOBS": "3"}
    probe_env = {"uv_project": value, "env_vars": shaping}
    (ready,) = prepare_nodes(
        parse_spec(value), [(nodes.a_id, "a")], PrepareOptions(timeout=300), probe_env=probe_env
    )
    assert ready.ok, ready
    assert node_setups(value, nodes=[nodes.a_id])[nodes.a_id].key != ready.key  # shaped
    shaped = node_setups(value, nodes=[nodes.a_id], env_vars=shaping)[nodes.a_id]
    assert (shaped.key, shaped.state) == (ready.key, "ready")
    placed_on_a_and_a_joined_node(nodes, "d", project, ready.key, monkeypatch, env_vars=shaping)


@ray.remote(num_cpus=0, resources=RDY)
class Holder:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_a_node_that_joins_while_a_group_waits_for_room_gets_its_env_by_the_gate(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On every Ray (the gate's path, as on one without label selectors): the env is ready on
    A only and every other node is held by another actor; a two-bundle group in "prefer" waits
    for room; node E joins, the group is placed on A and E, and the gate sends E the env from
    A (no build there)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    project = new_project(tmp_path)
    (ready,) = prepare_nodes(
        parse_spec({"project": str(project)}), [(nodes.a_id, "a")], PrepareOptions(timeout=300)
    )
    assert ready.ok, ready
    others = [
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and "wg_rdy" in n["Resources"] and n["NodeID"] != nodes.a_id
    ]
    holders = [
        Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        for n in others
    ]
    try:
        assert sorted(ray.get([h.node.remote() for h in holders])) == sorted(others)
        placed_on_a_and_a_joined_node(
            nodes, "e", project, ready.key, monkeypatch, readiness="prefer"
        )
    finally:
        for holder in holders:
            ray.kill(holder)
