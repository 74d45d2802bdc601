"""The chaos run's cluster: three `ray start` nodes in network namespaces, token auth on, one
node's venv dir (and uv cache) on a small loop device, and a package index on a host of its own.

Built from the pieces of `cluster_ship --netns` (`netns`, `node_disks`, its `CountingIndex`
and PyPI mirror, its token), with one difference: a node can be restarted. A SIGKILLed raylet
or runtime-env agent takes its node down (`ray start --block` then stops the rest), so the run
starts that node's `ray start` again before the next round; a head restarted (a new GCS, with
no fault tolerance: a cluster of its own) has the other nodes started again too. Node 1's
processes read the wall clock through `clock_skew`'s library when it can be built. Everything
is stopped by the pids the run started (each `ray start --block` leads a process group) and by
the namespaces, which only this run's processes can be in; `ray stop` is never used.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import ray_uv_plugin
from benchmarks import clock_skew, netns
from benchmarks.raylets import BIN, CLUSTER_AUTH, driver_env, free_ports

NODES = 3
LOOP_NODE = 2  # the node whose venv dir and uv cache sit on a small loop device
# Its venv dir's budget (RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES), half its 3 GB disk: without one,
# seed 9's rounds filled the disk with their own venvs by round 5 (248 venvs, 2.7 GB), and every
# build there failed, faults or none. With it the plugin removes idle venvs before it builds.
LOOP_VENV_BUDGET = 1536 * 1024 * 1024
NODE_MBIT = 200  # slow enough that a venv's stream lasts seconds: a window for ship faults
BUILD_TIMEOUT_S = 240  # the nodes' RAY_UV_PLUGIN_BUILD_TIMEOUT_S: the bound for a held lock
SKEWED_NODE = 1  # the node whose wall clock a clock_skew fault moves
# The GCS counts a node dead after 5 failed health checks of 2 s every 2 s (about 20 s: Ray's
# defaults take a minute, past a round's window); a raylet or driver that lost the GCS gives up
# after 20 s (a restarted head is a new cluster: they cannot rejoin it).
HEALTH = {
    "RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5", "RAY_gcs_rpc_server_reconnect_timeout_s": "20",
}  # fmt: skip


@dataclass
class Node:
    index: int
    host: netns.Host
    venv_dir: Path
    uv_cache: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)  # node 1's clock library
    gcs: str = ""  # the GCS it joined at its last start

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def env(self) -> dict[str, str]:
        """The environment of this node's `ray start` (and of `ray-uv gc` for its venv dir)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "UV_"))}
        env.update(CLUSTER_AUTH)  # token auth: a token of this run's own
        env["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["RAY_UV_PLUGIN_VENV_DIR"] = str(self.venv_dir)
        env["RAY_UV_PLUGIN_BUILD_TIMEOUT_S"] = str(BUILD_TIMEOUT_S)
        env["UV_CACHE_DIR"] = str(self.uv_cache)
        env["UV_COMPILE_BYTECODE"] = "0"  # builds of seconds, not minutes, on 2 shared cores
        if self.index == LOOP_NODE:
            env["RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES"] = str(LOOP_VENV_BUDGET)
        env.update(HEALTH)
        env.update(self.extra_env)
        return env


@dataclass
class ChaosCluster:
    net: netns.Network
    nodes: list[Node]
    temp: Path  # Ray's temp dir (the head's --temp-dir; short: socket paths)
    gcs: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)  # every `ray start` made
    clock: clock_skew.Clock | None = None  # node 1's wall clock (None: cannot be made here)
    head_restarted: bool = False  # by a fault since the last heal

    @property
    def driver_prefix(self) -> list[str]:
        return self.nodes[0].host.exec()

    def start(self, node: Node) -> None:
        """`ray start --block` on `node` (the head first), fresh ports each time."""
        p = free_ports(9 + 8)
        args = [
            *node.host.exec(), str(BIN / "ray"), "start", "--block", "--num-cpus=4",
            "--object-store-memory=300000000", f"--node-manager-port={p[0]}",
            f"--object-manager-port={p[1]}", f"--dashboard-agent-listen-port={p[2]}",
            f"--dashboard-agent-grpc-port={p[3]}", f"--runtime-env-agent-port={p[4]}",
            f"--metrics-export-port={p[5]}", "--min-worker-port=20000", "--max-worker-port=29999",
            f"--node-ip-address={node.host.ip}",
        ]  # fmt: skip
        if node.index == 0:
            self.gcs = f"{node.host.ip}:{p[6]}"
            args += ["--head", f"--port={p[6]}", f"--temp-dir={self.temp}"]
            args += ["--include-dashboard=false", f"--ray-client-server-port={p[7]}"]
        else:
            args += [f"--address={self.gcs}"]
        node.gcs = self.gcs
        log = open(self.temp.parent / f"ray-start-{node.index}-{node.starts}.log", "w")  # noqa: SIM115
        node.proc = subprocess.Popen(
            args, env=node.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        node.starts += 1
        self.procs.append(node.proc)

    def alive_ips(self) -> set[str] | None:
        """The addresses of the nodes the GCS counts alive; None if it cannot be asked."""
        code = (
            "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(' '.join(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))"
        )
        try:
            out = subprocess.run(
                [*self.driver_prefix, sys.executable, "-c", code, self.gcs],
                capture_output=True, text=True, env=driver_env(), timeout=60,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
        lines = out.stdout.strip().splitlines()
        return set(lines[-1].split()) if out.returncode == 0 and lines else None

    def restart_head(self, keep: Iterable[int] = ()) -> None:
        """The head's `ray start` stopped (its processes SIGKILLed) and started again: a new
        GCS at a new address (`gcs`). The drivers (`keep`: their pids) live on, as on a real
        head; the other nodes are left to `heal`."""
        head = self.nodes[0]
        if head.proc is not None:
            _kill_group(head.proc, signal.SIGKILL)
        self.stop(head, keep)
        self.start(head)
        self.head_restarted = True

    def heal(self, timeout: float = 300, grace: float = 20) -> list[int]:
        """Start again the head if it is down, then every node whose `ray start` ended, that
        joined another GCS than today's (a head restarted), or that the GCS has counted dead
        for `grace` seconds (a raylet it gave up on while it was stopped or cut off); wait until
        the GCS counts every node alive. Returns the nodes restarted (the head too if a fault
        restarted it since the last heal)."""
        restarted: list[int] = [0] if self.head_restarted else []
        self.head_restarted = False
        if not self.nodes[0].alive:
            self.stop(self.nodes[0])
            self.start(self.nodes[0])
            restarted.append(0)
        missing_since: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ips = self.alive_ips()
            now = time.monotonic()
            if ips is not None and all(
                n.host.ip in ips and n.alive and n.gcs == self.gcs for n in self.nodes
            ):
                return restarted
            for node in self.nodes[1:]:
                if ips is not None and node.gcs != self.gcs:  # the new head answers
                    self.stop(node)
                    self.start(node)
                    restarted.append(node.index)
                    missing_since[node.index] = now + 180
                    continue
                if ips is not None and node.host.ip in ips and node.alive:
                    missing_since.pop(node.index, None)
                    continue
                since = missing_since.setdefault(node.index, now)
                if not node.alive or now - since > grace:
                    self.stop(node)
                    self.start(node)
                    restarted.append(node.index)
                    missing_since[node.index] = now + 180  # its start's own time (a busy host)
            time.sleep(2)
        raise RuntimeError(f"the cluster did not come back to {len(self.nodes)} nodes")

    def stop(self, node: Node, keep: Iterable[int] = ()) -> None:
        """Stop what `node`'s `ray start` leads (its process group), and what is left in its
        namespace of that start (a raylet's orphans), but the sessions of `keep`'s pids."""
        if node.proc is not None:
            _kill_group(node.proc)
        sessions = {_session(p) for p in keep}
        for pid in in_namespace(node.host):
            if _ray_process(pid) and _session(pid) not in sessions:
                _signal(pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in reversed(self.procs):
            _kill_group(proc)
        shutil.rmtree(self.temp, ignore_errors=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen, last: int = signal.SIGTERM) -> None:
    for sig in (signal.SIGCONT, last):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=20)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _ray_process(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"ray" in cmd


def namespace_inode(host: netns.Host) -> int:
    return os.stat(f"/run/netns/{host.ns}").st_ino


def in_namespaces(hosts: list[netns.Host]) -> list[list[int]]:
    """The live processes in each of `hosts`' namespaces (sorted pids), from one walk of /proc:
    only this run's can be there."""
    wants = {f"net:[{namespace_inode(h)}]": i for i, h in enumerate(hosts)}
    found: list[list[int]] = [[] for _ in hosts]
    for entry in sorted(os.listdir("/proc"), key=lambda e: (len(e), e)):
        if not entry.isdigit():
            continue
        try:
            i = wants.get(os.readlink(f"/proc/{entry}/ns/net"))
        except OSError:
            continue
        if i is not None:
            found[i].append(int(entry))
    return found


def in_namespace(host: netns.Host) -> list[int]:
    """The live processes in `host`'s namespace: only this run's can be there."""
    want = f"net:[{namespace_inode(host)}]"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") == want:
                found.append(int(entry))
        except OSError:
            continue
    return found
