"""Ready before placed, measured on simulated nodes: the gate, placement by
readiness, a node that joins, `ray-uv status` and the setup metrics.

Four raylets of `ray.cluster_utils.Cluster` on this host (and a head with no CPU), each a
simulated machine with its own venv dir, its own uv (a wrapper that logs each call:
`tests.support.uvproject.CountingUv`) and its own metrics endpoint; node 3's uv sleeps
`--slow-s` seconds before each sync, so that its builds take that much longer. The groups are
`worker_groups` groups whose bundles ask for a resource only these four nodes have, one per node.

1. **Rendezvous**: a 4-rank group, each node building its own env (RAY_UV_PLUGIN_SHIP=0), node
   3 `--slow-s` later. Each worker enters a gloo `init_process_group` in its `__init__`, with a
   rendezvous timeout shorter than the slow node's delay: the spread of the ranks' entries,
   and whether any timed out. The workers' uv_project takes torch from the image (`from_image`:
   the nodes' Python has torch), so that the venv itself is small. Meanwhile `ray-uv status
   --key K --json --watch` runs, and node 3's metrics endpoint is scraped every second: how
   long each phase of node 3 took to show in the status, and the phases its endpoint showed.
2. **Prefer ready**: an env ready on nodes 0-2 only; a 3-bundle group in "prefer" mode, then,
   with the env ready on node 3 too, the same group with readiness "ignore" (a warm start):
   the nodes each landed on, its time, and the uv syncs it caused.
3. **A node joins**: an env ready on nodes 0-2, node 3 held by another actor; a 4-bundle group
   in "require" mode waits; a fifth node joins: the time from its join to the group's workers
   ready, the node its fourth worker runs on, and whether that node built (uv syncs) or
   received the env.

On a Ray without label selectors (before 2.50) every mode places anywhere and the gate alone
holds the ranks: scenario 2 then says where the group landed, and scenario 3's group waits
for resources, not readiness.

    VENV/bin/python -m benchmarks.readiness --json ready.json

VENV: a venv whose Python runs the nodes and the driver, with this checkout installed
(editable), Ray (the lock's, or 2.44.1) and a CPU torch, which the workers take from it:
`uv venv VENV && uv pip install --python VENV/bin/python -e . torch` (and `ray==2.44.1`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ray_uv_plugin
from benchmarks.raylets import free_ports
from ray_uv_plugin.cluster.options import PrepareOptions
from ray_uv_plugin.cluster.prepare import prepare_nodes
from ray_uv_plugin.cluster.readiness import node_setups
from ray_uv_plugin.cluster.setup_metrics import export_setup_metrics
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.store.layout import Venv
from tests.support.raylets import Raylet
from tests.support.uvproject import write_project
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
)
from worker_groups.readiness import label_selectors

REPO = Path(__file__).resolve().parent.parent
WORKERS = "benchmarks.readiness_workers"
RESOURCE = "bench_rdy"
BIN = Path(sys.executable).parent


class Nodes:
    """The four simulated machines (and the fifth, once it joined), by index."""

    def __init__(self, cluster: Cluster, base: Path, slow_s: float) -> None:
        self.cluster, self.base, self.slow_s = cluster, base, slow_s
        self.ids: list[str] = []
        self.raylets: list[Raylet] = []
        self.ports: list[int] = []

    def add(self) -> str:
        i = len(self.ids)
        raylet = Raylet(self.base / f"node{i}")
        env = raylet.env()
        if i == 3:
            env["SLOW_UV_SECONDS"] = str(self.slow_s)
        (port,) = free_ports(1)
        node = self.cluster.add_node(
            num_cpus=1, resources={RESOURCE: 1}, env_vars=env, metrics_export_port=port
        )
        self.ids.append(node.node_id)
        self.raylets.append(raylet)
        self.ports.append(port)
        return node.node_id

    def syncs(self) -> list[int]:
        return [r.uv.syncs() for r in self.raylets]

    def pairs(self, indices: range | list[int]) -> list[tuple[str, str]]:
        return [(self.ids[i], f"node{i}") for i in indices]


@contextmanager
def simulated_nodes(base: Path, slow_s: float) -> Iterator[Nodes]:
    os.environ["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
    os.environ["RAY_UV_PLUGIN_VENV_DIR"] = str(base / "head" / "venvs")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "_system_config": {"metrics_report_interval_ms": 500},
        },
    )
    try:
        nodes = Nodes(cluster, base, slow_s)
        for _ in range(4):
            nodes.add()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def project(base: Path, name: str) -> dict[str, Any]:
    return {"project": str(write_project(base / name, ["six"], name=f"bench-{name}"))}


def start_group(
    value: dict[str, Any],
    fqn: str,
    counts: list[int],
    env_vars: dict[str, str] | None = None,
    **kw: Any,
) -> tuple[float, RayVirtualCluster, RayWorkerGroup]:
    """A group of `fqn` workers with `value`'s env, one bundle per count: (seconds until its
    workers were ready, its cluster, the group)."""
    ACTOR_ENVIRONMENT_REGISTRY[fqn] = value
    vcluster = RayVirtualCluster(
        counts,
        use_gpus=False,
        node_resource_constraints=[{RESOURCE: 1}] * len(counts),
        wait_for_nodes=kw.pop("wait_for_nodes", None),
        ready_timeout_s=kw.pop("ready_timeout_s", 180.0),
    )
    env = {"PYTHONPATH": str(REPO), **(env_vars or {})}
    start = time.perf_counter()
    try:
        group = RayWorkerGroup(vcluster, RayWorkerBuilder(fqn), env_vars=env, **kw)
    except BaseException:
        vcluster.shutdown()
        raise
    return time.perf_counter() - start, vcluster, group


def worker_nodes(nodes: Nodes, group: RayWorkerGroup) -> list[int]:
    ids = ray.get([w.node.remote() for w in group.workers])
    return sorted(nodes.ids.index(n) for n in ids)


class StatusWatch:
    """`ray-uv status --key KEY --json --watch` in a process of its own: each line as read."""

    def __init__(self, address: str, key: str) -> None:
        args = [str(BIN / "ray-uv"), "status", "--address", address, "--key", key]
        self.proc = subprocess.Popen(
            [*args, "--json", "--watch"], stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.append(json.loads(line))
            except json.JSONDecodeError:
                pass

    def wait_for(self, node: str, timeout: float = 180.0) -> None:
        """Until the status has shown `node` once: it reads the cluster from then on."""
        deadline = time.monotonic() + timeout
        while not any(x["node_id"] == node for x in self.lines):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"ray-uv status showed no line for {node} in {timeout:g}s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.thread.join(timeout=5)

    def changes(self, node: str) -> list[dict[str, Any]]:
        """Each (state, phase) of `node` as first shown. How late the status showed the change:
        `seconds`, the time in the phase when first shown (for a state that times its phase),
        and for any change at most `since_last_read_s`, from the last read that still showed
        the state before."""
        seen, out, before = set(), [], None
        for line in (x for x in self.lines if x["node_id"] == node):
            if (line["state"], line["phase"]) not in seen:
                seen.add((line["state"], line["phase"]))
                change = {k: line[k] for k in ("state", "phase", "seconds", "how", "at")}
                if before is not None:
                    change["since_last_read_s"] = round(line["at"] - before["at"], 3)
                out.append(change)
            before = line
        return out


PHASE_LINE = re.compile(r'^ray_uv_project_setup_phase_seconds\{[^}]*phase="([^"]*)"[^}]*\} (\S+)')
STATE_LINE = re.compile(r'^ray_uv_project_setup_state\{[^}]*state="([^"]*)"[^}]*\} 1(\.0)?$')


class Scraper:
    """Node `port`'s metrics endpoint, read every second: the phases (with a time above 0)
    and states it showed for `key`, and its last text."""

    def __init__(self, port: int, key: str) -> None:
        self.port, self.key = port, key
        self.phases: dict[str, float] = {}
        self.states: list[str] = []
        self.text = ""
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def scrape(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.text = self.scrape() or self.text
            for line in self.text.splitlines():
                if f'key="{self.key}"' not in line:
                    continue
                if (m := PHASE_LINE.match(line)) and float(m.group(2)) > 0:
                    self.phases[m.group(1)] = max(self.phases.get(m.group(1), 0), float(m.group(2)))
                if (m := STATE_LINE.match(line)) and m.group(1) not in self.states:
                    self.states.append(m.group(1))

    def stop(self) -> list[str]:
        """Stop; the endpoint's lines for the key now (its counters included)."""
        self._stop.set()
        self.thread.join(timeout=5)
        time.sleep(3)  # the counters of the setup that just ended
        text = self.scrape() or self.text
        return [line for line in text.splitlines() if f'key="{self.key}"' in line]


def sync_ends(raylet: Raylet) -> list[float]:
    return [float(w) for s, w in (x.split() for x in raylet.uv.spans.read_text().splitlines())
            if s == "end"]  # fmt: skip


def rendezvous(nodes: Nodes, base: Path, timeout_s: float) -> dict[str, Any]:
    value = {**project(base, "rendezvous"), "from_image": ["torch"]}
    fqn = f"{WORKERS}.RendezvousWorker"
    (key,) = {s.key for s in node_setups(value, nodes=nodes.ids[:4]).values()}
    watch = StatusWatch(nodes.cluster.address, key)
    scraper = Scraper(nodes.ports[3], key)
    os.environ["RAY_UV_PLUGIN_SHIP"] = "0"
    out: dict[str, Any] = {"key": key, "rendezvous_timeout_s": timeout_s}
    try:
        watch.wait_for(nodes.ids[3])
        seconds, vcluster, group = start_group(
            value, fqn, [1, 1, 1, 1], {"RENDEZVOUS_TIMEOUT_S": str(timeout_s)},
            startup_timeout_s=900,
        )  # fmt: skip
        try:
            times = ray.get([w.times.remote() for w in group.workers])
        finally:
            group.shutdown()
            vcluster.shutdown()
        started, entered = [t["started"] for t in times], [t["entered"] for t in times]
        out.update(
            seconds=round(seconds, 2),
            ranks=len(times),
            start_spread_s=round(max(started) - min(started), 3),
            torch_import_s=[round(t["entered"] - t["started"], 3) for t in times],
            entry_spread_s=round(max(entered) - min(entered), 3),
            rendezvous_s=[round(t["joined"] - t["entered"], 3) for t in times],
            all_reduce_sum=[t["sum"] for t in times],
            torch=times[0]["torch"],
            nodes=sorted(nodes.ids.index(t["node"]) for t in times),
        )
    except Exception as e:  # noqa: BLE001 - a rank that timed out is this figure's result
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        os.environ.pop("RAY_UV_PLUGIN_SHIP", None)
        time.sleep(3)  # the status's read after node 3 became ready
        watch.stop()
        out["metrics"] = {"phases": scraper.phases, "states": scraper.states}
        out["metrics"]["lines"] = scraper.stop()
    ends = [max(sync_ends(r), default=0.0) for r in nodes.raylets[:4]]
    out["sync_end_after_first_s"] = [round(e - min(ends), 1) for e in ends]
    out["status_changes_node3"] = watch.changes(nodes.ids[3])
    reads = sorted({x["at"] for x in watch.lines})
    gaps = sorted(b - a for a, b in zip(reads, reads[1:], strict=False))
    if gaps:  # how often the status read every node: at most how late it shows a change
        out["status_read_every_s"] = [round(gaps[0], 2), round(gaps[len(gaps) // 2], 2),
                                      round(gaps[-1], 2)]  # fmt: skip
    return out


def prefer_ready(nodes: Nodes, base: Path, repeats: int) -> dict[str, Any]:
    value = project(base, "prefer")
    fqn = f"{WORKERS}.NodeWorker"
    results = prepare_nodes(parse_spec(value), nodes.pairs(range(3)), PrepareOptions(timeout=600))
    assert all(r.ok for r in results), results
    runs: list[dict[str, Any]] = []

    def run(readiness: str) -> None:
        before = nodes.syncs()
        seconds, vcluster, group = start_group(value, fqn, [1, 1, 1], readiness=readiness)
        try:
            where = worker_nodes(nodes, group)
        finally:
            group.shutdown()
            vcluster.shutdown()
        syncs = [a - b for a, b in zip(nodes.syncs(), before, strict=True)]
        runs.append({"readiness": readiness, "seconds": round(seconds, 2), "nodes": where,
                     "syncs": syncs})  # fmt: skip

    for _ in range(repeats):
        run("prefer")  # the env ready on nodes 0-2 only
    shipped = prepare_nodes(
        parse_spec(value), nodes.pairs(range(4)), PrepareOptions(timeout=600), ready=nodes.ids[:3]
    )
    assert all(r.ok for r in shipped), shipped
    for _ in range(repeats):
        run("ignore")  # ready everywhere: a warm start
    return {"runs": runs}


def a_node_joins(nodes: Nodes, base: Path) -> dict[str, Any]:
    value = project(base, "join")
    fqn = f"{WORKERS}.NodeWorker"
    results = prepare_nodes(parse_spec(value), nodes.pairs(range(3)), PrepareOptions(timeout=600))
    assert all(r.ok for r in results), results
    blocker = ray.remote(num_cpus=0, resources={RESOURCE: 1})(NodeHolder)
    holder = blocker.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes.ids[3], soft=False)
    ).remote()
    ray.get(holder.node.remote())
    made: dict[str, Any] = {}

    def make() -> None:
        try:
            made["group"] = start_group(
                value, fqn, [1, 1, 1, 1], readiness="require", wait_for_nodes=True,
                ready_timeout_s=600.0,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - reported
            made["error"] = f"{type(e).__name__}: {e}"[:2000]

    waiting = threading.Thread(target=make)
    waiting.start()
    time.sleep(10)
    out: dict[str, Any] = {"pending_before_join": waiting.is_alive()}
    joined_at = time.perf_counter()
    nodes.add()
    added_s = time.perf_counter() - joined_at
    waiting.join(timeout=900)
    out["node_added_s"] = round(added_s, 2)
    out["join_to_workers_ready_s"] = round(time.perf_counter() - joined_at, 2)
    ray.kill(holder)
    if "group" not in made:
        out["error"] = made.get("error", "still waiting")
        return out
    _, vcluster, group = made["group"]
    try:
        out["nodes"] = worker_nodes(nodes, group)
    finally:
        group.shutdown()
        vcluster.shutdown()
    (setup,) = node_setups(value, nodes=[nodes.ids[4]]).values()
    marker = Venv.at(nodes.raylets[4].venvs / setup.key).read_marker() if setup.key else {}
    out.update(joined_node_syncs=nodes.syncs()[4], joined_node_state=setup.state,
               joined_node_how=setup.how, shipped_from=marker.get("shipped_from"))  # fmt: skip
    return out


class NodeHolder:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--slow-s", type=float, default=60.0, help="node 3's extra build time")
    parser.add_argument(
        "--rendezvous-timeout-s", type=float, default=30.0, help="each rank's gloo timeout"
    )
    parser.add_argument("--repeats", type=int, default=3, help="groups per mode in scenario 2")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-ready-"))
    figures: dict[str, Any] = {
        "ray": ray.__version__,
        "label_selectors": label_selectors(),
        "load_before": os.getloadavg(),
        "slow_s": args.slow_s,
    }
    with simulated_nodes(base, args.slow_s) as nodes:
        export_setup_metrics(interval=1.0)
        for name, scenario in (
            ("rendezvous", lambda: rendezvous(nodes, base, args.rendezvous_timeout_s)),
            ("prefer_ready", lambda: prefer_ready(nodes, base, args.repeats)),
            ("a_node_joins", lambda: a_node_joins(nodes, base)),
        ):
            started = time.perf_counter()
            figures[name] = scenario()
            figures[name]["wall_s"] = round(time.perf_counter() - started, 1)
            figures[name]["load"] = os.getloadavg()
            print(name, json.dumps(figures[name], indent=1), flush=True)
    figures["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
