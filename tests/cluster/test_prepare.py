"""`ops.prepare`'s decisions without a cluster: what each node's result says, what the driver
asks for, and how shipping folds into a node's result."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ray_uv_plugin.cluster.node_result import NodeResult, outcome_counts
from ray_uv_plugin.cluster.prepare import (
    EXCLUDES,
    PrepareError,
    check_locally,
    env_spec,
    job_runtime_env,
    source_first,
)
from ray_uv_plugin.cluster.probe import Probes, _with_shipping
from ray_uv_plugin.env.spec import ParsedUvProject, parse_spec

NODE = "77aa00ff11223344"


def ship_result(node_id: str, outcome: str, **fields: object) -> SimpleNamespace:
    """`ship.messages.ShipResult`'s fields, without importing Ray (this module runs without)."""
    return SimpleNamespace(
        node_id=node_id, outcome=outcome, **{"bytes": None, "seconds": 0.0, "why": None, **fields}
    )


def result(**fields: object) -> NodeResult:
    return NodeResult(NODE, "10.0.0.8", **{"ok": True, "seconds": 2.5, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "outcome", "summary"),
    [
        ({}, "reused", "reused in 2.50s"),
        ({"built": True}, "built", "built in 2.50s"),
        ({"built": True, "note": "not shipped: x"}, "built", "built in 2.50s (not shipped: x)"),
        ({"shipped_bytes": 3 * 1024**3 // 2}, "shipped", "shipped 1.5GiB in 2.50s"),
        ({"ok": False, "error": "gone"}, "failed", "failed: gone"),
        ({"ok": False}, "failed", "failed: unknown error"),
    ],
)
def test_a_nodes_outcome_and_summary(fields: dict, outcome: str, summary: str) -> None:
    r = result(**fields)
    assert (r.outcome, r.summary) == (outcome, summary)
    assert r.as_json()["outcome"] == outcome and r.label == "10.0.0.8 (77aa00ff)"


def test_outcome_counts_name_every_way_even_at_zero() -> None:
    results = [result(built=True), result(), result(), result(ok=False)]
    assert outcome_counts(results) == "1 built, 0 shipped, 2 reused"


def test_the_project_is_shipped_as_working_dir_unless_shared(tmp_path: Path) -> None:
    assert job_runtime_env(tmp_path, shared=False) == {
        "working_dir": str(tmp_path),
        "excludes": EXCLUDES,
    }
    assert job_runtime_env(tmp_path, shared=True) is None
    selection = parse_spec({"extras": ["a"], "groups": ["g"], "frozen": True, "project": "x"})
    assert env_spec(tmp_path, True, selection).project == str(tmp_path)
    assert env_spec(tmp_path, False, selection) == replace(selection, project=None)


def test_a_missing_project_fails_here_unless_only_the_nodes_have_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(PrepareError, match="does not exist: pass --project DIR"):
        check_locally(missing, ParsedUvProject(), shared=False)
    check_locally(missing, ParsedUvProject(), shared=True)  # it may exist only on the nodes


def test_shipping_folds_into_the_nodes_result() -> None:
    phases = {"check": 0.1, "open": 0.5, "offer": 0.2, "stream": 1.5, "install": 0.25}
    shipped = ship_result(NODE, "shipped", bytes=1024, seconds=1.75, phases=phases)
    # the probe was submitted when the node took the offer: its 2.5 s cover the receive
    taken = _with_shipping(result(seconds=2.5), shipped)
    assert (taken.outcome, taken.shipped_bytes, taken.seconds) == ("shipped", 1024, 2.5)
    assert taken.ship_phases == {**phases, "probe": 0.75}
    assert taken.as_json()["ship_phases"] == taken.ship_phases
    refused = ship_result(NODE, "refused", why="another CPU")
    assert _with_shipping(result(built=True), refused).note == "not shipped: another CPU"
    assert _with_shipping(result(), refused) == result()  # reused anyway: nothing to say
    assert _with_shipping(result(), None) == result()
    # a node whose probe failed stays failed, whatever shipping did there
    assert _with_shipping(result(ok=False, error="x"), shipped).outcome == "failed"


def test_a_received_venv_is_never_counted_as_built_on_its_node() -> None:
    """A probe submitted when its node took a shipped venv may answer long after the source's
    build (whose `built_at` a received marker keeps): still not a build there."""
    from ray_uv_plugin.cluster.probe import was_built_within

    now = 1000.0
    built = {"now": now, "marker": {"built_at": now - 5}}
    assert was_built_within(built, 10) and not was_built_within(built, 3)
    received = {"now": now, "marker": {"built_at": now - 5, "received_at": now - 1}}
    assert not was_built_within(received, 10)


def test_a_probe_may_take_as_long_as_the_whole_prepare_to_set_up() -> None:
    """Ray's runtime_env setup timeout (600 s by default) would fail a probe waiting for a long
    build or receive: probes get the prepare's timeout, unless the env sets its own."""

    assert Probes({"uv_project": {}}, 1800.0).env == {
        "uv_project": {},
        "config": {"setup_timeout_seconds": 1800},
    }
    own = {"uv_project": {}, "config": {"setup_timeout_seconds": 60, "eager_install": True}}
    assert Probes(own, 1800.0).env == own


def test_the_value_is_parsed_once_where_it_comes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare_env` parses its keywords; what follows (the local check, each watch round, the
    ship's settings) takes the `ParsedUvProject`, never a value again."""
    from ray_uv_plugin.cluster import prepare
    from ray_uv_plugin.cluster.options import PrepareOptions
    from ray_uv_plugin.env.spec import UvProjectTypeError

    parsed: list[object] = []
    taken: list[PrepareOptions] = []
    monkeypatch.setattr(prepare, "parse_spec", lambda v: parsed.append(v) or parse_spec(v))
    monkeypatch.setattr(prepare, "prepare", lambda options, reporter: taken.append(options))
    prepare.prepare_env("/p", extras=["a"], build_env_vars=["CC"], groups=[])
    assert len(parsed) == 1 and taken[0].selection == parse_spec(
        {"extras": ["a"], "build_env_vars": ["CC"]}
    )
    with pytest.raises(UvProjectTypeError, match="uv_project.extras must be a list of strings"):
        prepare.prepare_env("/p", extras="a")


def test_the_options_and_the_reporter_reach_the_nodes_as_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`prepare` hands its `PrepareOptions` and its reporter down whole; the ship tells that same
    reporter of each chunk, and of each node through the probes, within the time they have
    left."""
    import ray

    from ray_uv_plugin.cluster import prepare
    from ray_uv_plugin.cluster.options import PrepareOptions, Quiet
    from ray_uv_plugin.ship import transfer

    spec = parse_spec({"extras": ["a"]})
    options = PrepareOptions("/p", timeout=60.0, ship=True)
    reporter = Quiet()
    nodes = [("a1", "10.0.0.1"), ("b2", "10.0.0.2")]
    handed: list[tuple] = []
    monkeypatch.setattr(prepare, "connect_for", lambda o: spec if o is options else None)
    monkeypatch.setattr(prepare, "alive_nodes", lambda: nodes)
    monkeypatch.setattr(prepare, "prepare_nodes", lambda *a: handed.append(a) or [])
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    prepare.prepare(options, reporter)
    assert handed == [(spec, nodes, options, reporter)]

    told: list[object] = []

    class Told(Quiet):
        def result(self, result: NodeResult) -> None:
            told.append(result.node_id)

        def progress(self, progress: object) -> None:
            told.append(progress)

    class FakeProbes:
        env: dict = {"uv_project": spec.as_value()}
        submitted: list = []

        def left(self) -> float:
            return 42.0

        def submit(self, node: tuple[str, str]) -> None:
            self.submitted.append(node)

        def collect(self, on_result, shipped=None) -> list[NodeResult]:
            results = [NodeResult(n, a, True, 1.0, key="k") for n, a in self.submitted]
            for r in results:
                on_result(r)
            return results

    def ship(key, source, targets, ship_options, ship_reporter, actors):
        assert ship_options.timeout == 42.0 and ship_options.settings.spec == spec
        for node in targets:
            ship_reporter.decided(node, "take")
        ship_reporter.progress("chunk 1")
        return {}

    monkeypatch.setattr(transfer, "ship", ship)
    source = NodeResult("a1", "10.0.0.1", True, 1.0, key="k")
    prepare.ship_and_probe(spec, source, nodes[1:], options, Told(), probes=FakeProbes())
    assert told == ["chunk 1", "b2"]


def test_every_reporter_has_every_event_of_the_watch() -> None:
    """`Quiet` and `ray-uv prepare`'s `PrepareLines` implement `WatchReporter` (and so
    `PrepareReporter`) whole: an event added to the protocol must be shown or ignored there."""
    from ray_uv_plugin.cluster.options import PrepareReporter, Quiet, WatchReporter
    from ray_uv_plugin.ops.cli_make_ready import PrepareLines

    def events(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_")}

    wanted = events(WatchReporter) | events(PrepareReporter)
    assert wanted == {"started", "result", "progress", "watching", "round"}
    for reporter in (Quiet, PrepareLines):
        assert wanted <= {name for name in dir(reporter) if callable(getattr(reporter, name))}


def test_the_ship_comes_from_a_node_that_has_the_env_ready() -> None:
    """A node with the env ready is the source whatever the nodes' order (none builds); with
    none ready, the driver's own node builds it, else the first."""
    nodes = [("a1", "10.0.0.1"), ("b2", "10.0.0.2"), ("c3", "10.0.0.3")]
    assert source_first(nodes, {"c3"}, here="a1") == (nodes[2], nodes[:2])
    assert source_first(nodes, set(), here="b2") == (nodes[1], [nodes[0], nodes[2]])
    assert source_first(nodes, {"zz"}, here="head") == (nodes[0], nodes[1:])
