"""`node_setups`: where each node of a real cluster stands with an env, read by a task on each
node from its own venv dir, with the key made there as the node's plugin makes it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from ray_uv_plugin.cluster.readiness import NodeSetup, node_setups
from tests.ship.test_ship import run_on
from tests.support.uvproject import write_project


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A head and a second node, each with a venv dir of its own; (head id, other id, the
    other's venv dir)."""
    base = tmp_path_factory.mktemp("readiness")
    saved = os.environ.get("RAY_UV_PLUGIN_VENV_DIR")
    os.environ["RAY_UV_PLUGIN_VENV_DIR"] = str(base / "head")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        other = cluster.add_node(num_cpus=1, env_vars={"RAY_UV_PLUGIN_VENV_DIR": str(base / "b")})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield ray.get_runtime_context().get_node_id(), other.node_id, base / "b"
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
