"""A simulated cluster network on one host: a network namespace per host, shaped veth links.

Each host (a raylet, the package index) gets a namespace of its own with one interface, `eth0`,
whose other end is a port of a bridge in a switch namespace, also made here: the host's root
namespace is never touched, and the hosts have no route anywhere but to each other (addresses
in 198.18.0.0/24, RFC 2544's range for benchmarks). Each link is shaped both ways with `tc tbf`:
the host's uplink on its `eth0`, its downlink on the bridge port toward it. The bridge ports'
counters say how many bytes each host sent and received.

Every name carries `PREFIX` and a run id (`ruvship-1a2b3c-n0`; bridge ports `rs1a2b3c-n0`), so
a crashed run's leftovers are recognisable (`ip netns list | grep ruvship-`) and a run removes
only its own. `network()` removes everything it made when its block ends, on failure and on
Ctrl-C as well: the processes left in its namespaces (only what the run started can be in
them), then the namespaces, which takes their links with them.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "ruvship-"
SUBNET = "198.18.0"  # /24, inside the namespaces made here only
CLONE_NEWNET = 0x40000000
# tbf: the bucket must hold a few of the largest (GSO) packets a veth passes; `latency` bounds
# the queue. Both are far below what a link moves in a second, so the rate is what counts.
BURST = "512kb"
QUEUE_LATENCY = "50ms"


class NetnsError(RuntimeError):
    """A namespace, link or shaping step failed; the message names the command."""


@dataclass(frozen=True)
class Host:
    name: str  # `n0`, `index`: the suffix of its names
    ns: str  # its namespace
    ip: str
    port: str  # its bridge port in the switch namespace
    up_mbit: int
    down_mbit: int

    def exec(self) -> list[str]:
        """The command prefix that runs a program in this host's namespace."""
        return ["ip", "netns", "exec", self.ns]


@dataclass
class Network:
    run_id: str
    hosts: dict[str, Host] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # namespaces, in the order they were made

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.run_id}-sw"

    def add_host(self, name: str, up_mbit: int, down_mbit: int) -> Host:
        """A namespace with `eth0` at the next address, linked to the bridge and shaped:
        `up_mbit` from the host, `down_mbit` to it."""
        host = Host(
            name=name,
            ns=f"{PREFIX}{self.run_id}-{name}",
            ip=f"{SUBNET}.{len(self.hosts) + 1}",
            port=f"rs{self.run_id}-{name}"[:15],
            up_mbit=up_mbit,
            down_mbit=down_mbit,
        )
        _ip("netns", "add", host.ns)
        self.made.append(host.ns)
        self.hosts[name] = host
        sw, ns = self.switch, host.ns
        _ip("-n", sw, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", sw, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        shape(ns, "eth0", up_mbit)
        shape(sw, host.port, down_mbit)
        return host

    def counters(self) -> dict[str, dict[str, int]]:
        """{host: {"sent": bytes, "received": bytes}} so far, from its bridge port (what the
        port received the host sent)."""
        out = _ip("-n", self.switch, "-s", "-j", "link", "show")
        ports = {link["ifname"]: link.get("stats64", {}) for link in json.loads(out)}
        found = {}
        for host in self.hosts.values():
            stats = ports.get(host.port, {})
            found[host.name] = {
                "sent": stats.get("rx", {}).get("bytes", 0),
                "received": stats.get("tx", {}).get("bytes", 0),
            }
        return found

    def pids(self) -> list[int]:
        """The live processes in this network's namespaces: only what the run started (a
        zombie is dead already: its parent reaps it)."""
        pids: list[int] = []
        for ns in self.made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids += [int(p) for p in out.stdout.split() if p.isdigit() and not _zombie(p)]
        return pids

    def remove(self) -> list[str]:
        """Kill what runs in the namespaces, then delete them (their links go with them);
        returns what could not be removed."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while pids and self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        left = []
        for ns in reversed(self.made):
            done = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True)
            if done.returncode != 0 and ns in namespaces():
                left.append(f"{ns}: {done.stderr.strip()}")
        self.made = [ns for ns in self.made if ns in namespaces()]
        return left


def _zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def shape(ns: str, dev: str, mbit: int) -> None:
    """Egress of `dev` in `ns` at `mbit` Mbit/s (a token bucket)."""
    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
          "burst", BURST, "latency", QUEUE_LATENCY])  # fmt: skip


@contextmanager
def cut(a: Host, b: Host) -> Iterator[None]:
    """`a` and `b` cannot reach each other (a blackhole route to the other in each namespace)
    while the block runs; each still reaches every other host. This kernel has no netfilter
    here (no iptables, nft): a route is what cuts one peer off."""
    made = []
    try:
        for here, there in ((a, b), (b, a)):
            _ip("-n", here.ns, "route", "add", "blackhole", f"{there.ip}/32")
            made.append((here, there))
        yield
    finally:
        for here, there in made:
            subprocess.run(
                ["ip", "-n", here.ns, "route", "del", "blackhole", f"{there.ip}/32"],
                capture_output=True,
            )


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True)
    try:
        return [entry["name"] for entry in json.loads(out.stdout or "[]")]
    except (ValueError, KeyError, TypeError):
        return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None if they can): root, `ip` and `tc`, and a
    namespace, a bridge, a veth pair and a `tbf` made and removed for real (well under 1 s)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    try:
        with network() as net:
            net.add_host("probe", 100, 100)
    except (NetnsError, OSError) as e:
        return f"cannot make a shaped namespace link here: {e}"
    return None


@contextmanager
def network() -> Iterator[Network]:
    """A switch namespace with a bridge; `add_host` links hosts to it. Everything is removed
    when the block ends, however it ends."""
    net = Network(secrets.token_hex(3))
    try:
        _ip("netns", "add", net.switch)
        net.made.append(net.switch)
        _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.switch, "link", "set", "br0", "up")
        yield net
    finally:
        left = net.remove()
        if left:
            raise NetnsError("could not remove " + "; ".join(left))


def interrupted(signum: int, frame: object) -> None:
    """A SIGTERM handler that makes the signal a Ctrl-C: `network()`'s teardown runs."""
    raise KeyboardInterrupt(f"signal {signum}")


_libc = ctypes.CDLL(None, use_errno=True)


@contextmanager
def inside(host: Host) -> Iterator[None]:
    """This thread in `host`'s namespace for the block: sockets made in it stay there (the
    package index binds its listening socket so, and serves it from a thread of this process)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{host.ns}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise NetnsError(f"setns into {host.ns}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise NetnsError(f"setns back: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(own)
        os.close(target)
