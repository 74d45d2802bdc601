"""Shipping after a one-package change: what goes over the link when the receiving node has a
ready venv of the previous lock (`ray_uv_plugin.ship.delta`), against the whole venv.

A simulated cluster of two raylets (`benchmarks.netns`, as `cluster_ship --netns`: a namespace
and a shaped 1 Gbit/s link each (`--node-mbit`), a disk of its own each, a package index of
their own at 200 Mbit/s that also serves Ray and its dependencies, mirrored once from PyPI).
Lock A is Ray, its dependencies and `--wheels` generated packages of `--wheel-mb` MB;
`ray-uv prepare` builds it on node 0 and ships it to node 1, which has nothing yet (a whole
venv). Then, one after another, each lock B that differs from A in one package:

- `pure`: packaging 26.3 -> 26.4 (pure Python);
- `compiled`: msgpack 1.2.3 -> 1.2.4 (C extensions);

is prepared: node 0 builds it (seeded from A there), and node 1, which has A ready, is sent the
difference. Last, for each B, node 1's venvs are removed and B is prepared again: node 0 has B,
node 1 nothing, so it is sent whole. Per prepare: the wall time of `ray-uv prepare`, the stream's
bytes, the bytes node 0's link sent (the bridge port's counter: Ray's traffic included), the
ship's steps (offer, which on a seeded receiver includes copying the seed's files; stream;
install), and node 1's marker (`built`: the seed, the files and bytes it gave).

    uv run python -m benchmarks.ship_delta --json out.json [--node-mbit 100]

Everything it makes (namespaces, links, mounts, the work dir) is removed when it ends, on
failure and on SIGTERM as well.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from benchmarks import netns, node_disks
from benchmarks.cluster_ship_netns import INDEX_MBIT, NODE_MBIT
from benchmarks.counting_index import CountingIndex
from benchmarks.package_set import WHEEL_CACHE, make_wheel, mirror_pypi, write_project
from benchmarks.raylets import du, prepare, raylets, remove
from ray_uv_plugin.env.uv import uv_version
from ray_uv_plugin.store.layout import Venv

# Lock A's pins, and each case's one change.
BASE = {"packaging": "26.3", "msgpack": "1.2.3"}
CASES = {"pure": ("packaging", "26.4"), "compiled": ("msgpack", "1.2.4")}


def pins(changed: tuple[str, str] | None = None) -> list[str]:
    versions = dict(BASE)
    if changed:
        versions[changed[0]] = changed[1]
    return [f"{name}=={version}" for name, version in sorted(versions.items())]


def index_files(wheels: int, wheel_mb: int) -> list[Path]:
    """The generated wheels, Ray's mirror, and both versions of each changed package."""
    cache = WHEEL_CACHE / f"{wheel_mb}mb"
    cache.mkdir(parents=True, exist_ok=True)
    files = [make_wheel(cache, i, wheel_mb * 10**6) for i in range(wheels)]
    mirror = WHEEL_CACHE / "pypi"
    files += mirror_pypi(f"ray=={ray.__version__}", mirror)
    for name, version in [*BASE.items(), *CASES.values()]:
        files += mirror_pypi(f"{name}=={version}", mirror)
    return sorted(set(files))


def one_prepare(
    name: str, cluster: Any, project: Path, net: netns.Network, receiver_venvs: Path
) -> dict[str, Any]:
    """`ray-uv prepare` of `project`: its time, node 1's result and marker, node 0's link."""
    before = net.counters()
    seconds, per_node = prepare(cluster, project, ship=True)
    after = net.counters()
    received = [n for n in per_node if n["outcome"] == "shipped"]
    if per_node[0]["outcome"] not in ("built", "reused") or len(received) != 1:
        raise RuntimeError(f"{name}: expected node 0 to have it, node 1 to be sent it: {per_node}")
    node = received[0]
    marker = Venv.at(receiver_venvs / node["key"]).read_marker() or {}
    run = {
        "run": name,
        "prepare_seconds": round(seconds, 2),
        "stream_bytes": node["bytes"],
        "n0_sent_bytes": after["n0"]["sent"] - before["n0"]["sent"],
        "n1_received_bytes": after["n1"]["received"] - before["n1"]["received"],
        "ship_phases": node["ship_phases"],
        "build_seconds_n0": per_node[0]["build_seconds"],
        "venv_du_bytes": du(receiver_venvs / node["key"]),
        "key": node["key"],
        "built": marker.get("built"),
    }
    print(json.dumps(run), flush=True)
    return run


def clear(venvs: Path) -> None:
    """Remove every venv of a node's venv dir (its raylet keeps running: the next prepare
    finds nothing there)."""
    for path in venvs.iterdir():
        if path.is_dir() and not path.is_symlink():
            remove(path)


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for case in CASES:
        seeded, whole = runs[f"{case}-seeded"], runs[f"{case}-whole"]
        rows.append(
            {
                "case": case,
                "seeded_stream_bytes": seeded["stream_bytes"],
                "whole_stream_bytes": whole["stream_bytes"],
                "bytes_ratio": round(seeded["stream_bytes"] / whole["stream_bytes"], 4),
                "seeded_n0_sent_bytes": seeded["n0_sent_bytes"],
                "whole_n0_sent_bytes": whole["n0_sent_bytes"],
                "seeded_prepare_seconds": seeded["prepare_seconds"],
                "whole_prepare_seconds": whole["prepare_seconds"],
                "seeded_ship_phases": seeded["ship_phases"],
                "whole_ship_phases": whole["ship_phases"],
                "seed_gave": seeded["built"],
            }
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    files = index_files(args.wheels, args.wheel_mb)
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs, {os.uname().release}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ray": ray.__version__,
        "uv": uv_version(),
        "links": {"node_mbit": args.node_mbit, "index_uplink_mbit": INDEX_MBIT},
        "lock_a": {"wheels": args.wheels, "wheel_mb": args.wheel_mb, "pins": pins()},
        "cases": {case: f"{n} {BASE[n]} -> {v}" for case, (n, v) in CASES.items()},
        "runs": {},
    }
    no_disks = node_disks.unavailable()
    results["node_disks"] = no_disks or f"each node's own ext4 ({node_disks.SIZE} sparse)"
    base = Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}d", dir="/tmp"))  # short: sockets
    runs = results["runs"]
    try:
        with netns.network() as net:
            index_host = net.add_host("index", INDEX_MBIT, args.node_mbit)
            hosts = [net.add_host(f"n{i}", args.node_mbit, args.node_mbit) for i in range(2)]
            with netns.inside(index_host):
                index = CountingIndex(files, bind=index_host.ip)
            try:
                lock = hosts[0].exec()
                projects = {"a": base / "a"}
                projects.update({case: base / case for case in CASES})
                for name, path in projects.items():
                    extra = pins(CASES.get(name))
                    write_project(path, index.url, args.wheels, extra, lock)
                work = base / "cluster"
                work.mkdir()
                node_dirs = [work / "node0", work / "node1"] if no_disks is None else []
                venvs = work / "node1" / "venvs"
                with (
                    node_disks.mounted(node_dirs, work),
                    raylets(2, work, hosts, 800_000_000, base) as cluster,
                ):
                    runs["a-whole"] = one_prepare("a-whole", cluster, projects["a"], net, venvs)
                    for case in CASES:
                        name = f"{case}-seeded"
                        runs[name] = one_prepare(name, cluster, projects[case], net, venvs)
                    for case in CASES:
                        clear(venvs)
                        name = f"{case}-whole"
                        runs[name] = one_prepare(name, cluster, projects[case], net, venvs)
            finally:
                index.server.shutdown()
                index.server.server_close()
    finally:
        remove(base)
    results["summary"] = summarize(runs)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=int, default=2, help="generated packages in every lock")
    parser.add_argument("--wheel-mb", type=int, default=50)
    parser.add_argument("--node-mbit", type=int, default=NODE_MBIT, help="each node's link")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("network namespaces need root")
    signal.signal(signal.SIGTERM, netns.interrupted)  # the teardown runs
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    for row in results["summary"]:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
