"""`ray-uv prepare --watch`: nodes that join a running cluster receive the env, not build it.

The cluster tests start raylets on this host with `ray.cluster_utils.Cluster`, each with a venv
dir and a uv of its own (a counting wrapper), as separate machines have, and add nodes while the
watch runs, as an autoscaler would; the watch is the real console script in a subprocess,
stopped as an operator or a pod's end stops it (SIGTERM).
"""

from __future__ import annotations

import os
import re
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

from ray_uv_plugin.cluster.node_result import NodeResult
from ray_uv_plugin.cluster.prepare import alive_nodes
from ray_uv_plugin.store.layout import Venv
from tests.ship.test_ship import run_on
from tests.support.raylets import Raylet
from tests.support.uvproject import write_project

RAY_UV = str(Path(sys.executable).parent / "ray-uv")
ROOT = Path(__file__).resolve().parents[2]


# --- without Ray -----------------------------------------------------------------------------


def result(node_id: str, ok: bool = True, key: str | None = "k1") -> NodeResult:
    return NodeResult(node_id, "10.0.0.1", ok, 1.0, key=key if ok else None)


def test_the_source_is_a_live_node_that_has_the_env_the_drivers_first() -> None:
    from ray_uv_plugin.cluster.watch import pick_source

    results = {n: result(n) for n in ("a", "b", "c")} | {"f": result("f", ok=False)}
    assert pick_source(results, {"a", "b", "c", "f"}, here="b").node_id == "b"
    assert pick_source(results, {"a", "c", "f"}, here="b").node_id == "a"  # b left (scale-down)
    assert pick_source(results, {"f", "x"}, here="x") is None  # nobody has it: they build
    assert pick_source({}, {"x"}, here="x") is None


def test_each_round_prepares_the_new_nodes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's logic, with the cluster scripted (each sleep is a look at the node list): a
    node is prepared once, from a node alive and ready; a round that raises fails its nodes,
    not the watch; a node that fails after it left is said to have left; with no live node
    that has the env, the new nodes build."""
    from ray_uv_plugin.cluster import watch
    from ray_uv_plugin.cluster.options import Quiet, WatchOptions
    from ray_uv_plugin.env.spec import parse_spec

    looks = iter(
        [
            ["a"],  # nothing new
            ["a", "b"],  # b joins: shipped from a
            ["a", "b", "c"],  # c joins: its round raises
            ["b", "c", "d", "f"],  # a left: d, f from b (f leaves); c is not tried again
            ["e"],  # everyone else left: e builds
        ]
    )
    alive: list[str] = []
    rounds: list[tuple[str | None, list[str]]] = []
    reported: list[NodeResult] = []

    def look(seconds: float) -> None:
        assert seconds == 7.0
        alive[:] = next(looks, None) or []
        if not alive:
            raise KeyboardInterrupt

    def ship_and_probe(given, source, nodes, options, told, probe_env) -> None:
        assert given is env  # parsed once, before the rounds
        assert options.timeout == 3600.0 and options.ship
        assert probe_env is None  # the value's own: `prepare --watch` has no workers' env
        rounds.append((source.node_id, [n for n, _ in nodes]))
        if nodes[0][0] == "c":
            raise RuntimeError("boom")
        for n, address in nodes:
            if n == "f":
                alive.remove("f")
                told.result(NodeResult(n, address, False, 1.0, error="gone"))
            else:
                told.result(NodeResult(n, address, True, 1.0, key="k1"))

    def prepare_nodes(given, nodes, options, told, probe_env) -> None:
        assert given is env and probe_env is None
        rounds.append((None, [n for n, _ in nodes]))

    monkeypatch.setattr(watch, "sleep", look)
    monkeypatch.setattr(watch.prepare, "alive_nodes", lambda: [(n, n.upper()) for n in alive])
    monkeypatch.setattr(watch.prepare, "ship_and_probe", ship_and_probe)
    monkeypatch.setattr(watch.prepare, "prepare_nodes", prepare_nodes)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _Here("x"))

    class Reporter(Quiet):
        def result(self, result: NodeResult) -> None:
            reported.append(result)

    env = parse_spec({"project": "/p"})
    with pytest.raises(KeyboardInterrupt):
        watch.watch_nodes(env, [result("a")], WatchOptions(interval=7.0, ship=True), Reporter())
    assert rounds == [("a", ["b"]), ("a", ["c"]), ("b", ["d", "f"]), (None, ["e"])]
    outcomes = [(r.node_id, r.ok) for r in reported]
    assert outcomes == [("b", True), ("c", False), ("d", True), ("f", False)]
    assert reported[1].error == "RuntimeError: boom"
    assert reported[3].error == "the node left the cluster (gone)"


class _Here:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def get_node_id(self) -> str:
        return self.node_id


def test_sigterm_stops_the_watch_as_ctrl_c_does_and_nohup_is_kept() -> None:
    from ray_uv_plugin.cluster.watch import stop_on_signals

    before = signal.getsignal(signal.SIGTERM)
    saved_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under `nohup`
    try:
        with pytest.raises(KeyboardInterrupt), stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in this thread at once
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGHUP, saved_hup)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "5"], "--interval goes with --watch"),
        (["--watch", "--json"], "--json does not go with --watch"),
        (["--watch", "--interval", "0.5"], "--interval 0.5: the watch asks the GCS"),
        (["--watch", "--interval", "nan"], "give a number of seconds, at least 2"),
    ],
)
def test_bad_watch_options_are_clear_errors(args: list[str], message: str) -> None:
    out = subprocess.run(
        [RAY_UV, "prepare", "--project", "examples/demo_project", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# --- a running cluster that grows ------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A one-node cluster (the head), to add nodes to; this driver is connected to it."""
    head = Raylet(tmp_path_factory.mktemp("head"))
    saved = {k: os.environ.get(k) for k in head.env()}
    os.environ.update(head.env())  # the head's raylet inherits the driver's environment
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def join(cluster: Cluster, raylet: Raylet, **env: str):
    node = cluster.add_node(num_cpus=1, env_vars={**raylet.env(), **env})
    cluster.wait_for_nodes()
    return node


def leave(cluster: Cluster, node) -> None:
    """Remove a node and wait until the GCS no longer lists it alive (a driver of its own, the
    watch, would otherwise see it)."""
    cluster.remove_node(node)
    deadline = time.monotonic() + 120
    while any(n == node.node_id for n, _ in alive_nodes()) and time.monotonic() < deadline:
        time.sleep(0.5)


def new_project(tmp_path: Path) -> Path:
    return write_project(tmp_path / "proj", ["six"], name=f"watch{time.monotonic_ns()}")


def test_a_node_that_joins_without_the_watch_builds_the_env(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Today's behaviour without the watch: the env is on the head, and the first job that
    lands on a node that joined later builds it there from the index."""
    project = new_project(tmp_path)
    head = ray.get_runtime_context().get_node_id()
    assert run_on(head, project, timeout=600)["venv"]  # the head has it
    late = Raylet(tmp_path / "late")
    node = join(cluster, late)
    try:
        venv = Path(run_on(node.node_id, project, timeout=600)["venv"])
        assert venv.parent == late.venvs and late.uv.syncs() == 1
        assert "shipped_from" not in Venv.at(venv).read_marker()
    finally:
        leave(cluster, node)


class Watch:
    """`ray-uv prepare --watch` in a subprocess; its stderr lines as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [RAY_UV, "prepare", "--watch", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._read = threading.Thread(target=self._collect, daemon=True)
        self._read.start()

    def _collect(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if re.search(pattern, line)]
            if found:
                return found[0]
            assert self.proc.poll() is None, f"the watch ended: {self.text()}"
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} in {timeout}s: {self.text()}")

    def text(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        """SIGTERM, as `kill`, systemd or a pod's end sends it; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=120)
        self._read.join(timeout=30)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_nodes_that_join_receive_the_env_while_the_watch_runs(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The watch prepares the head, then ships the venv to a node that joins (no uv sync
    there, and a job landing there finds it ready). Nodes that join meanwhile are prepared in
    the next round: one whose uv settings key the venv differently builds its own and says
    why; one without the plugin fails, once, and is not tried again. SIGTERM stops it, with
    the table and the exit status of `prepare`."""
    project = new_project(tmp_path)
    watch = Watch(
        "--address", cluster.address, "--project", str(project), "--shared", "--interval", "2"
    )
    joined = []
    try:
        watch.wait_for("Watching for nodes that join, every 2s")
        assert re.search(r"\(\w{8}\): uv_project \w+: built in ", watch.text()), watch.text()
        b = Raylet(tmp_path / "b")
        joined.append(node_b := join(cluster, b))
        watch.wait_for(rf"1 node joined: .*\({node_b.node_id[:8]}\): shipping from ")
        # These join while B's round may still run.
        c = Raylet(tmp_path / "c")
        joined.append(node_c := join(cluster, c, UV_COMPILE_BYTECODE="1"))
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("RAY_RUNTIME_ENV_PLUGINS")
            joined.append(node_d := join(cluster, Raylet(tmp_path / "d")))
        on_b = watch.wait_for(rf"\({node_b.node_id[:8]}\): uv_project \w+: ")
        assert re.search(r": shipped [\d.]+MiB in ", on_b), on_b
        key = on_b.split("uv_project ")[1].split(":")[0]
        assert b.uv.syncs() == 0 and Venv(b.venvs, key).check_ready()
        assert Venv.at(b.venvs / key).read_marker()["shipped_from"]
        assert run_on(node_b.node_id, project, timeout=600)["venv"] == str(b.venvs / key)
        assert b.uv.syncs() == 0  # the job's task on B ran in the received venv
        on_c = watch.wait_for(rf"\({node_c.node_id[:8]}\): uv_project \w+: ")
        assert "built in" in on_c and "not shipped: another set of uv settings here" in on_c
        assert c.uv.syncs() == 1
        on_d = watch.wait_for(rf"\({node_d.node_id[:8]}\): failed: ")
        assert "ran the worker in its own Python" in on_d, on_d
        time.sleep(3 * 2)  # a few more looks at the node list
        assert watch.stop() == 1, watch.text()
    finally:
        watch.kill()
        for node in joined:
            leave(cluster, node)
    lines = watch.lines
    assert "Stopped watching" in lines, watch.text()
    d8 = f"({node_d.node_id[:8]})"
    assert sum(f"{d8}: failed: " in line for line in lines) == 1, watch.text()
    assert sum("joined: " in line and d8 in line for line in lines) == 1, watch.text()
    assert f"error: 1 of 4 nodes failed: {on_d.split(': ')[0]}" in lines, watch.text()
    assert not list(b.venvs.glob("*.ship-*"))
