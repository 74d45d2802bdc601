"""`ray-uv status`'s rendering without Ray: each state's detail and line as an operator reads
them, and one JSON object per node with when it was read. (A real cluster's: tests/cluster/
test_readiness.py, `--json --watch`.)"""

from __future__ import annotations

import json

import pytest

from ray_uv_plugin.cluster.readiness import NodeSetup, elapsed
from ray_uv_plugin.ops.cli_status import json_lines

NODE = "5c1e07aa" + "0" * 48


@pytest.mark.parametrize(
    ("fields", "detail"),
    [
        ({"state": "ready", "how": "shipped"}, "shipped"),
        ({"state": "ready"}, "-"),
        ({"state": "queued", "phase": "build-slot queue", "seconds": 3.2},
         "build-slot queue for 3s"),
        (
            {"state": "building", "phase": "building flash-attn==2.7.4", "seconds": 432.9,
             "bytes": 312_400_000},
            "building flash-attn==2.7.4 for 7m12s 297.9MiB",
        ),
        (
            {"state": "receiving", "phase": "ship bytes", "seconds": 7200, "bytes": 2048,
             "source": "10.0.0.7 (3f2a9c1d)"},
            "ship bytes for 2h00m 2.0KiB from 10.0.0.7 (3f2a9c1d)",
        ),
        ({"state": "building"}, "building"),
        ({"state": "failed", "cause": "no wheel"}, "no wheel"),
        ({"state": "absent"}, "-"),
    ],
)  # fmt: skip
def test_each_state_says_what_it_knows(fields: dict, detail: str) -> None:
    setup = NodeSetup(NODE, "10.0.0.9", "8e1f0c2a9d3b4e5f", **fields)
    assert setup.detail == detail
    assert setup.line() == f"node 10.0.0.9 (5c1e07aa): {fields['state']}: {detail}"
    assert setup.ready == (fields["state"] == "ready")


def test_elapsed_reads_as_a_clock() -> None:
    assert [elapsed(s) for s in (0.4, 59.9, 60, 432, 3599, 3600, 7530)] == [
        "0s", "59s", "1m00s", "7m12s", "59m59s", "1h00m", "2h05m",
    ]  # fmt: skip


def test_json_is_one_object_per_node_with_when_it_was_read() -> None:
    setups = {
        NODE: NodeSetup(NODE, "10.0.0.9", "8e1f0c2a9d3b4e5f", "building", phase="install"),
        "b" * 56: NodeSetup("b" * 56, "10.0.0.7", None, "failed", cause="gone"),
    }
    lines = [json.loads(line) for line in json_lines(setups, now=1795870000.0)]
    assert [(n["node_id"], n["state"], n["at"]) for n in lines] == [
        (NODE, "building", 1795870000.0),
        ("b" * 56, "failed", 1795870000.0),
    ]
    assert set(lines[0]) == {*NodeSetup.__dataclass_fields__, "at"}
