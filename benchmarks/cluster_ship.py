"""One registry download per cluster: per-node `uv sync` against build-once-and-ship, measured.

A cluster of raylets started with `ray start`, each with its own venv dir and its own uv cache
(as separate machines have), and a package index that serves generated wheels of a realistic
size and counts the bytes it serves. For each scenario, on a fresh cluster:

- `ray-uv prepare --no-ship`: every node runs `uv sync` against the index;
- `ray-uv prepare` (shipping): one node syncs, the others receive its venv through Ray's object
  store.

On one host (the default): the raylets and the index share loopback; then the time to the first
call of a worker group with one worker per node, in that env. Figures: bytes the index served,
wall time until every node is ready, the group's first call.

    uv run python -m benchmarks.cluster_ship --json out.json --plot out.png

With `--netns` (root): a simulated cluster with real links (`benchmarks.netns`). Each raylet
and the index get a network namespace and a shaped link of their own (nodes 1 Gbit/s each way,
the index's uplink 200 Mbit/s, shared by every node that downloads: a NAT gateway's or a proxy's
share), and each raylet a disk of its own for its venv dir and uv cache (`benchmarks.node_disks`;
`--shared-fs` for the host's filesystem); the driver runs in the head's namespace, and nothing
can reach beyond these hosts, so the index also serves Ray and its dependencies (mirrored once
from PyPI for this interpreter) and `slowbuild`, an sdist whose build backend sleeps
`--build-seconds` (a package built from source on every node that syncs). For each N of
`--nodes`: the time until every node is ready, the index's bytes, the bytes each host sent (the
bridge ports' counters: the source node's show whether receivers pull from each other), how busy
the host's cores were, and two lower bounds for shipping (`benchmarks.bounds`): the link bound,
the first node's build plus the venv's stream over one node's link, and the data-plane floor,
the first node's build plus the least work any code must do to ship it (a tar pipe with sha256
from the source node to a receiver over their links, and a plain actor's start, measured apart
from the plugin on the same cluster: `benchmarks.data_plane`) spread over the host's cores; a
ship is judged against the larger. The CPU each node used is recorded beside them.

    uv run python -m benchmarks.cluster_ship --netns --nodes 2,4,8 --json out.json --plot out.png

The pieces: `package_set` (the wheels, `slowbuild`, the PyPI mirror and the project),
`counting_index` (the index), `raylets` (the cluster and `ray-uv prepare` on it),
`cluster_ship_netns` (the simulated cluster's run), `data_plane` (the floor's figures),
`cluster_ship_report` (summary and charts); this module is the one-host mode and the command
line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import ray

from benchmarks import netns
from benchmarks.cluster_ship_netns import run_netns
from benchmarks.cluster_ship_report import plot, plot_netns
from benchmarks.counting_index import CountingIndex
from benchmarks.package_set import WHEEL_CACHE, make_wheel, write_project
from benchmarks.raylets import Cluster, driver_env, du, prepare, raylets, remove
from ray_uv_plugin.env.uv import uv_version

FIRST_CALL = textwrap.dedent(
    """\
    import json, sys, time
    import ray
    from worker_groups import (ACTOR_ENVIRONMENT_REGISTRY, RayVirtualCluster, RayWorkerBuilder,
                               RayWorkerGroup)

    gcs, project, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(address=gcs, runtime_env={"working_dir": project}, logging_level="ERROR")
    ACTOR_ENVIRONMENT_REGISTRY["benchworker.Pinger"] = {}
    start = time.monotonic()
    cluster = RayVirtualCluster([1] * nodes, use_gpus=False)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("benchworker.Pinger"))
    venvs = ray.get(group.run_all_workers_single_data("ping"))
    took = time.monotonic() - start
    group.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps({"seconds": took, "venvs": venvs}))
    """
)


def first_call(cluster: Cluster, project: Path, nodes: int) -> dict[str, Any]:
    out = subprocess.run(
        [*cluster.driver, sys.executable, "-c", FIRST_CALL, cluster.gcs, str(project), str(nodes)],
        capture_output=True, text=True, env=driver_env(), timeout=1200,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the worker group failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def scenario(ship: bool, nodes: int, project: Path, index: CountingIndex, base: Path) -> dict:
    work = base / ("ship" if ship else "sync")
    remove(work)
    work.mkdir(parents=True)
    with raylets(nodes, work) as cluster:
        index.reset()
        ready, per_node = prepare(cluster, project, ship)
        served = index.served
        call = first_call(cluster, project, nodes)
        venv_sizes = [du(p) for p in sorted(work.glob("node*/venvs/*")) if p.is_dir()]
    return {
        "scenario": "ship" if ship else "per-node sync",
        "nodes": nodes,
        "index_bytes": served,
        "ready_seconds": round(ready, 2),
        "first_call_seconds": round(call["seconds"], 2),
        "per_node": per_node,
        "venv_du_bytes": venv_sizes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=int, default=20)
    parser.add_argument("--wheel-mb", type=int, default=50)
    parser.add_argument("--nodes", default="4", help="N, or with --netns a list: 2,4,8")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ruv-ship-bench"))
    parser.add_argument("--netns", action="store_true", help="a simulated cluster, real links")
    parser.add_argument(
        "--build-seconds", type=int, default=30, help="--netns: slowbuild's build (-1: none)"
    )
    parser.add_argument(
        "--modes", default="sync,ship", help="--netns: sync, ship or both (in that order)"
    )
    parser.add_argument(
        "--shared-fs",
        action="store_true",
        help="--netns: every node's venv dir and uv cache on the host's filesystem, not on a "
        "disk of its own (benchmarks.node_disks)",
    )
    args = parser.parse_args(argv)
    if args.netns:
        args.modes = [m == "ship" for m in args.modes.split(",")]
        signal.signal(signal.SIGTERM, netns.interrupted)  # the teardown runs
        results = run_netns(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        if args.plot:
            plot_netns(results, args.plot)
        for row in results["summary"]:
            print(json.dumps(row))
        return 0
    return main_one_host(args)


def main_one_host(args: argparse.Namespace) -> int:
    args.nodes = int(args.nodes)
    cache = WHEEL_CACHE / f"{args.wheel_mb}mb"  # a wheel's size is in its directory's name
    cache.mkdir(parents=True, exist_ok=True)
    wheels = [make_wheel(cache, i, args.wheel_mb * 10**6) for i in range(args.wheels)]
    index = CountingIndex(wheels)
    base = args.workdir
    remove(base)
    project = write_project(base / "project", index.url, args.wheels)
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs, {os.uname().release}",
        "loadavg_start": os.getloadavg(),
        "ray": ray.__version__,
        "uv": uv_version(),
        "nodes": args.nodes,
        "wheels": {
            "count": args.wheels,
            "mb": args.wheel_mb,
            "bytes": sum(w.stat().st_size for w in wheels),
        },
        "runs": [],
    }
    for ship in (False, True):
        run = scenario(ship, args.nodes, project, index, base)
        print(json.dumps({k: v for k, v in run.items() if k != "per_node"}), flush=True)
        for n in run["per_node"]:
            print("   ", n["address"], n["outcome"], n["seconds"], n["bytes"], n["note"] or "")
        results["runs"].append(run)
    results["loadavg_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    remove(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
