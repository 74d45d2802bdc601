"""`cluster_ship --netns`: the simulated cluster, each raylet and the index in a network
namespace with a shaped link (`benchmarks.netns`) and a disk of its own (`benchmarks.node_disks`).
For each N, a fresh cluster per mode (per-node sync, ship): the time until every node is ready,
what each link carried, the CPU the nodes used, and the ship's link bound and data-plane floor
(`benchmarks.bounds`), the floor's figures measured on the same cluster after the ship
(`benchmarks.data_plane`)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import ray

from benchmarks import data_plane, netns, node_disks
from benchmarks.bounds import HostCpu, NodeCgroups, NodeCpu, data_plane_floor, link_bound
from benchmarks.cluster_ship_report import summarize_netns
from benchmarks.counting_index import CountingIndex
from benchmarks.package_set import (
    WHEEL_CACHE,
    make_slow_sdist,
    make_wheel,
    mirror_pypi,
    write_project,
)
from benchmarks.raylets import Cluster, driver_env, du, prepare, raylets, remove
from ray_uv_plugin.env.uv import uv_version

NODE_MBIT = 1000  # each simulated node's link, both ways
INDEX_MBIT = 200  # the index's uplink, shared by every node that downloads


def netns_scenario(
    ship: bool,
    nodes: int,
    project: Path,
    index: CountingIndex,
    net: netns.Network,
    base: Path,
    disks: bool = True,
) -> dict[str, Any]:
    """One fresh cluster of `nodes` raylets in their namespaces, empty venv dirs and caches
    (each node's on a disk of its own where `disks`: `node_disks`); `ray-uv prepare` with or
    without shipping; what it took and what each link carried."""
    work = base / f"{'ship' if ship else 'sync'}-{nodes}"
    remove(work)
    work.mkdir(parents=True)
    hosts = [net.hosts[f"n{i}"] for i in range(nodes)]
    node_dirs = [work / f"node{i}" for i in range(nodes)] if disks else []
    # Ray's temp dir in the run's own: removed at the end even if a Ray process that the
    # stop here missed (one that renamed itself) writes to it until the namespaces go.
    cgroups = NodeCgroups(f"{netns.PREFIX}{net.run_id}-cpu{nodes}-", nodes)
    try:
        with (
            node_disks.mounted(node_dirs, work),
            raylets(nodes, work, hosts, 800_000_000, base, cgroups) as cluster,
        ):
            index.reset()
            before = net.counters()
            read = cgroups.usage if cgroups.available else None
            with HostCpu() as host_cpu, NodeCpu(cluster.roots, read=read) as node_cpu:
                ready, per_node = prepare(cluster, project, ship)
            after = net.counters()
            served = index.served
            venv_sizes = [du(p) for p in work.glob("node*/venvs/*") if p.is_dir()]
            floor = measure_floor(cluster, hosts, work, per_node) if ship else None
    finally:
        cgroups.remove()
    links = {
        host: {way: after[host][way] - before[host][way] for way in ("sent", "received")}
        for host in after
        if host == "index" or host in {h.name for h in hosts}
    }
    built = [n for n in per_node if n["outcome"] == "built"]
    shipped = [n for n in per_node if n["outcome"] == "shipped"]
    source = hosts[0].name  # the driver's node: `prepare` builds there and ships from it
    run: dict[str, Any] = {
        "scenario": "ship" if ship else "per-node sync",
        "nodes": nodes,
        "ready_seconds": round(ready, 2),
        "index_bytes": served,
        "builds": len(built),
        "shipped": len(shipped),
        "failed": sum(n["outcome"] == "failed" for n in per_node),
        "source_sent_bytes": links[source]["sent"],
        "links": links,
        # Each node's processes' CPU seconds during `prepare` (the head's GCS included).
        "node_cpu_seconds": node_cpu.used(0.0),
        "node_cpu_from": "cpuacct cgroups" if cgroups.available else "/proc, each node's tree",
        # The host's busy share of its cores, each second of `prepare`.
        "host_cpu_busy": host_cpu.shares,
        "per_node": per_node,
        "venv_du_bytes": venv_sizes,
    }
    if ship and shipped:
        stream = shipped[0]["bytes"]
        first_build = built[0]["seconds"] if built else 0.0
        run["stream_bytes"] = stream
        run["first_build_seconds"] = first_build
        run["bound_seconds"] = link_bound(first_build, stream, NODE_MBIT)
        # Each node's CPU seconds from the first build's end (the source node's first): where
        # the ship's time went, not a bound (it rises with the code's overheads).
        run["node_cpu_seconds_after_build"] = node_cpu.used(first_build)
        if floor:
            run["data_plane"] = floor
            run["floor_seconds"] = data_plane_floor(
                first_build, nodes - 1, floor["pipe_seconds"], floor["send_cpu_seconds"],
                floor["receive_cpu_seconds"], floor["worker_start_cpu_seconds"],
                os.cpu_count() or 1,
            )  # fmt: skip
        # How busy the host was after the first build: the ship's share of the run.
        run["host_cpu_busy_after_build"] = host_cpu.mean(first_build, ready)
    remove(work)
    return run


def measure_floor(
    cluster: Cluster, hosts: list[netns.Host], work: Path, per_node: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The data plane's figures for this cluster (`benchmarks.data_plane`), after the ship: the
    built venv's bytes piped from the source node to the first receiver's disk over their
    links, and a plain actor's start on that receiver. None without a build and a receiver."""
    built = [n for n in per_node if n["outcome"] == "built"]
    shipped = [n for n in per_node if n["outcome"] == "shipped"]
    if not built or not shipped:
        return None
    by_ip = {h.ip: i for i, h in enumerate(hosts)}
    source, receiver = by_ip[built[0]["address"]], by_ip[shipped[0]["address"]]
    dest = work / f"node{receiver}" / "data-plane-floor"
    measured = data_plane.pipe(
        work / f"node{source}" / "venvs" / built[0]["key"],
        dest,
        hosts[receiver].ip,
        tuple(hosts[source].exec()),
        tuple(hosts[receiver].exec()),
    )
    remove(dest)
    node_id = shipped[0]["node_id"]
    start = data_plane.worker_start(cluster.driver, cluster.gcs, node_id, driver_env())
    return {
        "pipe_bytes": measured.bytes,
        "pipe_seconds": measured.seconds,
        "send_cpu_seconds": measured.send_cpu_seconds,
        "receive_cpu_seconds": measured.receive_cpu_seconds,
        "worker_start_seconds": start["seconds"],
        "worker_start_cpu_seconds": start["cpu_seconds"],
    }


def run_netns(args: argparse.Namespace) -> dict[str, Any]:
    """The whole simulated-cluster measurement; everything it makes is gone when it returns or
    raises."""
    node_counts = sorted({int(n) for n in str(args.nodes).split(",")})
    cache = WHEEL_CACHE / f"{args.wheel_mb}mb"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = [make_wheel(cache, i, args.wheel_mb * 10**6) for i in range(args.wheels)]
    slow_dir = WHEEL_CACHE / f"slowbuild-{args.build_seconds}s"
    slow_dir.mkdir(parents=True, exist_ok=True)
    extra = []
    files = [*wheels, *mirror_pypi(f"ray=={ray.__version__}", WHEEL_CACHE / "pypi")]
    if args.build_seconds >= 0:
        files.append(make_slow_sdist(slow_dir, args.build_seconds))
        extra.append("slowbuild")
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs, {os.uname().release}",
        "loadavg_start": os.getloadavg(),
        "ray": ray.__version__,
        "uv": uv_version(),
        "links": {
            "node_mbit": NODE_MBIT,
            "index_uplink_mbit": INDEX_MBIT,
            "shaping": f"tc tbf, burst {netns.BURST}, latency {netns.QUEUE_LATENCY}, each way",
        },
        "wheels": {
            "count": args.wheels,
            "mb": args.wheel_mb,
            "index_files": len(files),
            "bytes": sum(f.stat().st_size for f in files),
        },
        "build_seconds": args.build_seconds,
        "runs": [],
    }
    no_disks = "--shared-fs" if args.shared_fs else node_disks.unavailable()
    results["node_disks"] = (
        f"each node's own ext4 with a journal ({node_disks.SIZE} sparse, a loop device)"
        if no_disks is None
        else f"one filesystem for every node: the host's ({no_disks})"
    )
    base = Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}w", dir="/tmp"))  # short: sockets
    results["workdir"] = str(base)
    try:
        with netns.network() as net:
            index_host = net.add_host("index", INDEX_MBIT, NODE_MBIT)
            for i in range(max(node_counts)):
                net.add_host(f"n{i}", NODE_MBIT, NODE_MBIT)
            results["network"] = net.run_id
            with netns.inside(index_host):
                index = CountingIndex(files, bind=index_host.ip)
            try:
                project = write_project(
                    base / "project", index.url, args.wheels, extra, net.hosts["n0"].exec()
                )
                for nodes in node_counts:
                    for ship in args.modes:
                        run = netns_scenario(
                            ship, nodes, project, index, net, base, no_disks is None
                        )
                        print(json.dumps({k: v for k, v in run.items() if k != "per_node"}))
                        results["runs"].append(run)
            finally:
                index.server.shutdown()
                index.server.server_close()
    finally:
        remove(base)
    results["summary"] = summarize_netns(results["runs"])
    results["loadavg_end"] = os.getloadavg()
    return results
