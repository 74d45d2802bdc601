"""A cluster of real raylets on this host, each started by `ray start --block` with a venv dir
and a uv cache of its own (as separate machines have), optionally each in a network namespace
(`benchmarks.netns`) and a cpuacct cgroup (`benchmarks.bounds`); and `ray-uv prepare` run
against it. Shared by `cluster_ship`, `ship_delta` and the chaos runs."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray_uv_plugin
from benchmarks import netns
from benchmarks.bounds import NodeCgroups
from ray_uv_plugin.store.freezing import thaw

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Cluster:
    gcs: str  # the head's GCS address
    driver: list[str]  # the command prefix a driver runs under: the head's namespace, or none
    roots: tuple[int, ...] = ()  # each node's `ray start --block`: every Ray process is below it


# The simulated cluster runs with token auth, as Ray 2.61 runs every cluster: every node's
# `ray start` and every driver hold its token (KubeRay's way: in the environment).
CLUSTER_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextmanager
def raylets(
    nodes: int,
    base: Path,
    hosts: list[netns.Host] | None = None,
    object_store: int = 1_500_000_000,
    temp_parent: Path = Path("/tmp"),
    cgroups: NodeCgroups | None = None,
) -> Iterator[Cluster]:
    """`nodes` raylets via `ray start --block`, each with its own venv dir and uv cache, and in
    its own network namespace where `hosts` names them (and its own cpuacct cgroup where
    `cgroups` has them); yields the cluster; stops them by their process groups and their own
    temp dir (made in `temp_parent`)."""
    temp = Path(tempfile.mkdtemp(prefix="rship-", dir=temp_parent))  # short: socket paths
    procs: list[subprocess.Popen] = []
    env0 = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "UV_"))}
    env0["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
    env0.update(CLUSTER_AUTH)  # token auth, as the drivers below: a token of this run's own
    env0["RAY_USAGE_STATS_ENABLED"] = "0"
    env0["UV_COMPILE_BYTECODE"] = os.environ.get("UV_COMPILE_BYTECODE", "1")
    prefix = [h.exec() for h in hosts] if hosts else [[] for _ in range(nodes)]
    ip = [h.ip for h in hosts] if hosts else ["127.0.0.1"] * nodes
    cluster = None
    try:
        for i in range(nodes):
            p = free_ports(9 + 8)
            node_env = {
                **env0,
                "RAY_UV_PLUGIN_VENV_DIR": str(base / f"node{i}" / "venvs"),
                "UV_CACHE_DIR": str(base / f"node{i}" / "uv-cache"),
            }
            args = [
                *prefix[i], str(BIN / "ray"), "start", "--block", "--num-cpus=1",
                f"--object-store-memory={object_store}", f"--node-manager-port={p[0]}",
                f"--object-manager-port={p[1]}", f"--dashboard-agent-listen-port={p[2]}",
                f"--dashboard-agent-grpc-port={p[3]}", f"--runtime-env-agent-port={p[4]}",
                f"--metrics-export-port={p[5]}", "--worker-port-list=" + ",".join(map(str, p[9:])),
                f"--node-ip-address={ip[i]}",
            ]  # fmt: skip
            if cluster is None:
                args += ["--head", f"--port={p[6]}", f"--temp-dir={temp}"]
                args += ["--include-dashboard=false", f"--ray-client-server-port={p[7]}"]
                cluster = Cluster(f"{ip[0]}:{p[6]}", prefix[0])
            else:
                args += [f"--address={cluster.gcs}"]
            log = open(base / f"ray-start-{i}.log", "w")  # noqa: SIM115 - lives with the node
            procs.append(
                subprocess.Popen(
                    cgroups.wrap(i, args) if cgroups else args,
                    env=node_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            wait_for_nodes(cluster, i + 1)  # one at a time: they share the head's session dir
        assert cluster is not None
        yield replace(cluster, roots=tuple(proc.pid for proc in procs))
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in os.listdir("/proc"):  # what Ray started under our own temp dir
            if pid.isdigit():
                try:
                    if str(temp).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_nodes(cluster: Cluster | None, count: int, timeout: float = 180) -> None:
    assert cluster is not None
    code = (
        "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [*cluster.driver, sys.executable, "-c", code, cluster.gcs],
            capture_output=True, text=True, env=driver_env(),
        )  # fmt: skip
        if out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout) >= count:
            return
        time.sleep(1)
    raise RuntimeError(f"{count} raylets did not come up within {timeout:.0f}s")


def driver_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    env.update(CLUSTER_AUTH)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def remove(path: Path) -> None:
    """Venvs the plugin made are read-only (and immutable, as root): thaw them first."""
    if path.exists():
        thaw(path)
        shutil.rmtree(path)


def prepare(cluster: Cluster, project: Path, ship: bool) -> tuple[float, list[dict[str, Any]]]:
    """`ray-uv prepare --json` on the cluster: (wall seconds, the per-node results)."""
    args = [*cluster.driver, str(BIN / "ray-uv"), "prepare", "--address", cluster.gcs]
    args += ["--project", str(project), "--json"] + ([] if ship else ["--no-ship"])
    start = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True, env=driver_env(), timeout=3600)
    ready = time.monotonic() - start
    if out.returncode != 0:
        raise RuntimeError(f"prepare failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ready, json.loads(out.stdout)["nodes"]


def du(path: Path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0])
