"""The chaos run's faults: a plan drawn from a seed, and the injectors that carry it out.

Each round's plan comes from `random.Random(f"{seed}-{round}")` alone: the same seed gives the
same faults (kind, action, node, moment, how long) in the same rounds, whatever happened before.
What a fault hits is found when its moment comes, in this run's namespaces only (a process's
network namespace is one of the run's nodes': nothing else on the host can be touched), and
it waits for a target while the round's jobs run (a `uv sync` or a ship actor lives for
seconds); a fault that found none is recorded so and not counted. A `uv sync` lasts a second or
two, a ship actor a few, and most are over early in a round: so each such fault has what it
hits start at its moment (`cold_starts`: the round starts a job then that asks for a fresh key,
by actors on every node for a `uv_sync` fault, by `prepare` with shipping for a ship fault),
and its injector looks for a sync every `SYNC_POLL_S` from that moment on, until the round's
jobs end.

Kinds: SIGKILL, or SIGSTOP then SIGCONT, of a `uv sync`, a runtime-env agent, a raylet, a ship
sender and a receiver (the `VenvSender`/`VenvReceiver` actors' processes) and a driver; a node's
link dropped or delayed (a `tbf` in place of its shaping, put back after: this kernel has no
`netem`); the loop node's
disk filled (a file that takes all its free room, removed after).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import netns
from benchmarks.chaos_cluster import LOOP_NODE, NODE_MBIT, ChaosCluster, in_namespaces

PROCESS_KINDS = ("uv_sync", "agent", "raylet", "ship_sender", "ship_receiver", "driver")
KINDS = (*PROCESS_KINDS, "link_drop", "link_delay", "disk_full")
# A SIGKILLed raylet or agent takes its node down: never the head's (the GCS lives there).
HEAD_SAFE = ("agent", "raylet")
POLL_S = 0.2  # how often a process fault looks for its target
SYNC_POLL_S = 0.05  # a `uv sync`: it may last under a second


@dataclass(frozen=True)
class Fault:
    round: int
    kind: str
    action: str  # kill | stop (process kinds); drop | delay | fill
    node: int  # the node it is aimed at (a process kind takes another node's if it has none)
    offset_s: float  # when, from the round's start
    hold_s: float  # how long a stop, a link fault or a full disk lasts
    delay_ms: int = 0  # link_delay: the rate (kbit/s) of its long queue


def plan(seed: int, round_no: int, per_round: int, window_s: float, nodes: int) -> list[Fault]:
    """The faults of one round: each kind once per `len(KINDS)` faults, in a random order, at
    random moments of the first `window_s` seconds. Depends only on (seed, round)."""
    rng = random.Random(f"{seed}-{round_no}")
    kinds: list[str] = []
    while len(kinds) < per_round:
        deck = list(KINDS)
        rng.shuffle(deck)
        kinds += deck
    faults = []
    for kind in kinds[:per_round]:
        if kind in PROCESS_KINDS:
            action = rng.choice(("kill", "stop"))
        else:
            action = {"link_drop": "drop", "link_delay": "delay", "disk_full": "fill"}[kind]
        if kind == "disk_full":
            node = LOOP_NODE
        elif kind in HEAD_SAFE and action == "kill":
            node = rng.randrange(1, nodes)
        elif kind == "driver":
            node = 0  # drivers run on the head
        else:
            node = rng.randrange(nodes)
        faults.append(
            Fault(
                round=round_no,
                kind=kind,
                action=action,
                node=node,
                offset_s=round(rng.uniform(0, window_s), 2),
                hold_s=round(rng.uniform(1, 8) if action == "stop" else rng.uniform(2, 12), 2),
                delay_ms=rng.randrange(100, 600) if kind == "link_delay" else 0,
            )
        )
    return sorted(faults, key=lambda f: f.offset_s)


# What a fault of these kinds needs started at its moment: actors (three builds) or `prepare`.
COLD_JOBS = {"uv_sync": "cold", "ship_sender": "cold_ship", "ship_receiver": "cold_ship"}


def cold_starts(faults: list[Fault]) -> list[tuple[float, str]]:
    """The round's extra jobs, (seconds from its start, job kind): one at the moment of each
    fault of `COLD_JOBS`, so that a sync or a ship begins after it whatever the round's other
    jobs did. A function of the plan, hence of the seed alone."""
    return sorted((f.offset_s, COLD_JOBS[f.kind]) for f in faults if f.kind in COLD_JOBS)


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def _is(kind: str, argv: list[str]) -> bool:
    if not argv:
        return False
    if kind == "uv_sync":
        return os.path.basename(argv[0]) == "uv" and "sync" in argv[1:3]
    if kind == "agent":
        return argv[0].startswith("ray::RuntimeEnvAgent")  # its process title
    if kind == "raylet":
        return argv[0].endswith("/raylet")
    if kind == "ship_sender":
        return argv[0].startswith("ray::VenvSender")
    if kind == "ship_receiver":
        return argv[0].startswith("ray::VenvReceiver")
    return False


class Injector:
    """Carries out faults against one cluster; `stopped` are the pids it holds stopped (let go
    on the way out, whatever happens)."""

    def __init__(self, cluster: ChaosCluster, driver_pids: Callable[[], list[int]]) -> None:
        self.cluster = cluster
        self.driver_pids = driver_pids
        self.stopped: set[int] = set()
        self.lock = threading.Lock()
        self.loop_dir = cluster.nodes[LOOP_NODE].venv_dir.parent

    def find(self, fault: Fault) -> tuple[int, int] | None:
        """(pid, node) of a live target, the planned node's first."""
        if fault.kind == "driver":
            pids = self.driver_pids()
            return (random.Random(fault.offset_s).choice(pids), 0) if pids else None
        order = [fault.node] + [i for i in range(len(self.cluster.nodes)) if i != fault.node]
        hosts = [n.host for n in self.cluster.nodes]
        pids = in_namespaces(hosts)  # one walk of /proc for every node
        for i in order:
            if fault.kind in HEAD_SAFE and fault.action == "kill" and i == 0:
                continue
            for pid in pids[i]:
                if _is(fault.kind, _cmdline(pid)) and not _zombie(pid):
                    return pid, i
        return None

    def run(self, fault: Fault, start: float, jobs_done: threading.Event) -> dict[str, Any]:
        """Wait for the fault's moment, then for a target (while the jobs run), then inject it
        and undo it after its hold. The record of what happened."""
        record: dict[str, Any] = {**asdict(fault), "target": None}
        if jobs_done.wait(max(0.0, start + fault.offset_s - time.monotonic())):
            pass  # the jobs ended before its moment: it still hits what is there
        if fault.kind in PROCESS_KINDS:
            found = self.find(fault)
            poll = SYNC_POLL_S if fault.kind == "uv_sync" else POLL_S
            while found is None and not jobs_done.is_set():
                time.sleep(poll)
                found = self.find(fault)
            if found is None:
                return record
            pid, node = found
            record["at_s"] = round(time.monotonic() - start, 2)
            record["target"] = {"pid": pid, "node": node, "cmd": " ".join(_cmdline(pid))[:160]}
            self.signal_process(pid, fault)
        else:
            record["at_s"] = round(time.monotonic() - start, 2)
            record["target"] = {"node": fault.node}
            if fault.kind == "disk_full":
                record["target"]["filled_bytes"] = self.fill_disk(fault.hold_s)
            else:
                self.shape_link(fault)
        return record

    def signal_process(self, pid: int, fault: Fault) -> None:
        if fault.action == "kill":
            _signal(pid, signal.SIGKILL)
            return
        with self.lock:
            self.stopped.add(pid)
        _signal(pid, signal.SIGSTOP)
        time.sleep(fault.hold_s)
        _signal(pid, signal.SIGCONT)
        with self.lock:
            self.stopped.discard(pid)

    def shape_link(self, fault: Fault) -> None:
        """The node's uplink through a `tbf` that drops nearly every packet (`drop`), or that
        holds packets in a long queue at a low rate (`delay`: seconds, under traffic). This
        kernel has no `netem` (nor classifiers): `tbf` is what `tc` can do here."""
        host = self.cluster.nodes[fault.node].host
        if fault.action == "drop":  # one packet in the bucket, 1 kbit/s, no queue
            tbf = ["rate", "1kbit", "burst", "1600", "latency", "1ms"]
        else:
            tbf = ["rate", f"{fault.delay_ms}kbit", "burst", "16kb", "latency", "2s"]
        subprocess.run(
            ["tc", "-n", host.ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", *tbf],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            time.sleep(fault.hold_s)
        finally:
            netns.shape(host.ns, "eth0", NODE_MBIT)

    def fill_disk(self, hold_s: float) -> int:
        """A file that takes all the loop disk's free room, for `hold_s` seconds."""
        filler = self.loop_dir / f"filler-{threading.get_ident()}"
        size = 0
        try:
            with open(filler, "wb") as f:
                free = os.statvfs(self.loop_dir).f_bavail * os.statvfs(self.loop_dir).f_frsize
                size = max(free - 4096, 0)
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                except OSError:
                    pass  # took what there was: the disk is full either way
            time.sleep(hold_s)
        finally:
            filler.unlink(missing_ok=True)
        return size

    def release(self) -> None:
        """Let every process held stopped go (on the way out)."""
        with self.lock:
            pids, self.stopped = list(self.stopped), set()
        for pid in pids:
            _signal(pid, signal.SIGCONT)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
