"""`node_setups`: where each node of a real cluster stands with an env, read by a task on each
node from its own venv dir, with the key made there as the node's plugin makes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from ray_uv_plugin.cluster.readiness import NodeSetup, node_setups
from tests.building.test_phase_events import slow_project
from tests.ship.test_ship import run_on
from tests.support.uvproject import write_project

RAY_UV = str(Path(sys.executable).parent / "ray-uv")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A head and a second node, each with a venv dir of its own; (head id, other id, the
    other's venv dir). The head's id is the cluster's: a driver on this host may be connected
    to either raylet (Ray 2.44.1 picks the second)."""
    base = tmp_path_factory.mktemp("readiness")
    saved = os.environ.get("RAY_UV_PLUGIN_VENV_DIR")
    os.environ["RAY_UV_PLUGIN_VENV_DIR"] = str(base / "head")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        other = cluster.add_node(num_cpus=1, env_vars={"RAY_UV_PLUGIN_VENV_DIR": str(base / "b")})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster.head_node.node_id, other.node_id, base / "b"
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is not None:
            os.environ["RAY_UV_PLUGIN_VENV_DIR"] = saved


def test_each_node_says_whether_it_has_the_env_and_how_it_came(two_nodes, tmp_path: Path) -> None:
    head, other, _ = two_nodes
    project = write_project(tmp_path / "p", ["six"], name=f"ready{time.monotonic_ns()}")
    value = {"project": str(project)}
    before = node_setups(value)
    assert [s.state for s in before.values()] == ["absent", "absent"]
    assert before[head].key == before[other].key  # one host, one interpreter: one key
    assert run_on(head, project)["venv"]
    after = node_setups(value)
    assert after[head] == NodeSetup(head, after[head].address, before[head].key, "ready", "built")
    assert after[other].state == "absent"
    assert node_setups(key=before[head].key, nodes=[other])[other].state == "absent"


def test_a_node_where_the_key_cannot_be_made_says_why(two_nodes) -> None:
    head, other, _ = two_nodes
    found = node_setups({"project": "/nowhere/at/all"}, nodes=[other, "ff" * 28])
    assert found[other].state == "failed" and found[other].key is None
    assert "/nowhere/at/all" in (found[other].cause or "")
    assert found["ff" * 28].cause == "not an alive node"
    with pytest.raises(ValueError, match="a uv_project value or a key"):
        node_setups()


def test_status_watch_shows_a_nodes_build_phase_within_2s(two_nodes, tmp_path: Path) -> None:
    """`ray-uv status --json --watch` while the second node builds a source package that takes
    8 s: its phase shows, with its time in it, within 2 s of the build entering it, and the node
    ends ready; SIGTERM ends the watch."""
    head, other, _ = two_nodes
    project = slow_project(tmp_path, seconds=8.0)
    address = ray.get_runtime_context().gcs_address
    watch = subprocess.Popen(
        [RAY_UV, "status", "--project", str(project), "--shared", "--json", "--watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    lines: list[dict] = []

    def collect() -> None:
        for line in watch.stdout:
            lines.append(json.loads(line))

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(n["node_id"] == other for n in lines) and time.monotonic() < deadline:
            assert watch.poll() is None, watch.stderr.read()
            time.sleep(0.2)
        built = threading.Thread(target=run_on, args=(other, project, 600))
        built.start()
        built.join(600)
        time.sleep(2.5)  # a read or two after the build
    finally:
        watch.send_signal(signal.SIGTERM)
        assert watch.wait(60) == 0
        reader.join(10)
    mine = [n for n in lines if n["node_id"] == other]
    building = [n for n in mine if (n["phase"] or "").startswith("building slow")]
    assert building, [(n["state"], n["phase"]) for n in mine]
    assert building[0]["seconds"] <= 2.0, building[0]  # seen within 2 s of the change
    assert max(n["seconds"] for n in building) >= 6.0  # live: its time grows
    assert (mine[-1]["state"], mine[-1]["how"]) == ("ready", "built")
    assert [n["state"] for n in lines if n["node_id"] == head][-1] == "absent"
    phases_seen = [n["phase"] for n in mine if n["state"] == "building"]
    assert "download" in phases_seen or building, phases_seen


def test_a_received_venv_says_so_and_from_where(two_nodes, tmp_path: Path) -> None:
    """Built on the head, then prepared with shipping from it (the node that has it ready):
    the other node receives; the view says how each got it, and the bytes and source of the
    shipped one."""
    from ray_uv_plugin.cluster.options import PrepareOptions
    from ray_uv_plugin.cluster.prepare import alive_nodes, prepare_nodes
    from ray_uv_plugin.env.spec import parse_spec

    head, other, _ = two_nodes
    project = write_project(tmp_path / "p", ["six"], name=f"ship{time.monotonic_ns()}")
    value = {"project": str(project)}
    assert run_on(head, project)["venv"]
    results = prepare_nodes(
        parse_spec(value), alive_nodes(), PrepareOptions(timeout=600, ship=True), ready=[head]
    )
    assert all(r.ok for r in results), results
    found = node_setups(value)
    assert (found[head].state, found[head].how) == ("ready", "built")
    assert (found[other].state, found[other].how) == ("ready", "shipped")
    assert found[other].bytes and found[other].source == f"{found[head].address} ({head[:8]})"
