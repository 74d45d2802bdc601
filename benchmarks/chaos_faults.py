"""The chaos run's faults: a plan drawn from a seed, and the injectors that carry them out and
say what each met.

Each round's plan comes from `random.Random(f"{seed}-{round}")` alone: the same seed gives the
same faults (kind, action, node, moment, how long, step) in the same rounds, whatever happened
before. What a fault hits is found when its moment comes, in this run's namespaces only (a
process's network namespace is one of the run's nodes': nothing else on the host can be
touched). A fault is *sent* when it was carried out (a signal, a cut link, a fill, a restart),
and *met* only when it met the operation it is named for, seen at that moment (`MEETS`); each
record says both, and what it met. A `uv sync` or a ship lasts seconds: so the faults that
need one have it start at their moment (`cold_starts`: the round starts a job then that asks
for a fresh key, by actors on every node or by `prepare` with shipping), and wait for it.

The faults that take a node down fall past the window (`plan`), a head restart last. Before,
every node is up for the builds, ships and fills that the other faults hit on nodes 1 and 2
(the published run before this, seed 3, had nodes 1 and 2 down within seconds of nearly every
round, and shipped 2 venvs in all).
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

from benchmarks import clock_skew, netns
from benchmarks.chaos_cluster import LOOP_NODE, NODE_MBIT, SKEWED_NODE, ChaosCluster, in_namespaces
from benchmarks.chaos_invariants import check_whole, ready
from ray_uv_plugin.store.layout import MARKER, SHIP_INFIX

PROCESS_KINDS = ("uv_sync", "agent", "raylet", "ship_sender", "ship_receiver", "driver")
OTHER_ACTIONS = {
    "link_drop": "drop", "link_delay": "delay", "disk_full": "fill", "head_restart": "restart",
    "gcs_partition": "partition", "node_split": "split", "marker_kill": "kill", "gc": "gc",
    "cache_write": "write", "clock_skew": "skew",
}  # fmt: skip
KINDS = (*PROCESS_KINDS, *OTHER_ACTIONS)
# What a fault must meet to count (its record's `met`).
MEETS = {
    "uv_sync": "a `uv sync` running on the node it names",
    "agent": "the agent of a node that was up",
    "raylet": "the raylet of a node that was up",
    "ship_sender": "a sender while a stream is in flight (a receiver's `<key>.ship-*` dir)",
    "ship_receiver": "a receiver while its node's `<key>.ship-*` dir is being written",
    "driver": "a job's driver while it runs",
    "link_drop": "a node that was up",
    "link_delay": "a node that was up",
    "disk_full": "node 2's disk full for root (a write as root fails with ENOSPC) at its step",
    "head_restart": "a head that was up, started again",
    "gcs_partition": "a node cut from the GCS in its build or receive, counted alive, then dead",
    "node_split": "nodes 1 and 2 cut from each other, both counted alive by the GCS",
    "marker_kill": "the agent SIGKILLed after a fresh venv's marker, before its worker started",
    "gc": "`ray-uv gc` on a node's venv dir while jobs run",
    "cache_write": "a write into a ready venv through a file hardlinked from uv's cache",
    "clock_skew": "node 1's processes reading a wall clock set off (a probe on the node saw it)",
}
# A SIGKILLed raylet or agent takes its node down: never the head's (the GCS lives there).
HEAD_SAFE = ("agent", "raylet")
DISK_STEPS = ("uv_link", "manifest", "marker", "receive")  # when a disk_full fault fills
# The node-killing faults: `LATE_S` past the window (a `prepare` there took 60-110 s on 2 busy
# cores: at 10-30 s past it, every ship of a round of seed 12 was cut, and 6 venvs were shipped
# in the 6 rounds of seed 4), in steps of `STEP_S`, and never before the window's ships ended
# (`LateGate`: in seed 6 they took over 95 s at a load of 20-40, and not one venv was shipped
# in 4 rounds), at most `LATE_MAX_S` past the window.
LATE_S = 55.0
STEP_S = 8.0
LATE_MAX_S = 150.0
STAGE_MAX_S = 240.0  # how long a late stage waits for the ones before it, at most (`late_stage`)
POLL_S = 0.2  # how often a process fault looks for its target
SYNC_POLL_S = 0.05  # a `uv sync`: it may last under a second
MARKER_POLL_S = 0.002  # marker_kill: how often it looks for a fresh marker
PARTITION_S = (25.0, 35.0)  # past the GCS's count of a dead node (`chaos_cluster.HEALTH`)
PROBE = 1 << 20  # disk_full: a write as root of this many bytes must fail
WANT_S = 40.0  # how long a fault waits for what it must meet, past its moment, at most
# ... and one whose operation its own job's build must reach first (a ship's stream follows the
# head's build, a marker ends a build, a partition waits for a build or receive): a build of a
# fresh key took 30-120 s on 2 busy cores, past `WANT_S` (seed 6: 1 `marker_kill` met of 12).
AFTER_BUILD = ("ship_sender", "ship_receiver", "marker_kill", "gcs_partition")
WANT_AFTER_BUILD_S = 150.0


def want_s(kind: str) -> float:
    """How long a fault of `kind` waits for what it must meet, past its moment, at most."""
    return WANT_AFTER_BUILD_S if kind in AFTER_BUILD else WANT_S


@dataclass(frozen=True)
class Fault:
    round: int
    kind: str
    action: str  # kill | stop (process kinds); OTHER_ACTIONS' otherwise
    node: int  # the node it is aimed at
    offset_s: float  # when, from the round's start
    hold_s: float  # how long a stop, a link fault, a full disk, a partition, a skew lasts
    delay_ms: int = 0  # link_delay: the rate (kbit/s) of its long queue
    step: str = ""  # disk_full: the step it fills at (`DISK_STEPS`)
    skew_s: int = 0  # clock_skew: how far node 1's wall clock is set off
    wave: int = 0  # marker_kill, gcs_partition: the first or second of the round (`late_stage`)


class LateGate:
    """When a round's late faults (`plan`: past the window, from `LATE_S` on) and the jobs they
    start begin: at their planned moment, and never before the window's ships ended (`ended`:
    true once every `prepare` started in the window has exited), shifted by as much, so their
    order and spacing stay the plan's; at most `LATE_MAX_S` past the window. A node taken down
    while a `prepare` still ships cuts that ship, and the round ships nothing."""

    def __init__(
        self, start: float, window_s: float, ended: Callable[[], bool], done: threading.Event
    ) -> None:
        self.start, self.window_s, self.ended, self.done = start, window_s, ended, done
        self.lock = threading.Lock()
        self.opened: float | None = None  # monotonic: when the window's ships had ended

    def open_at(self) -> float:
        """When the late part of the round began (monotonic): the ships' end, or the bound."""
        bound = self.start + self.window_s + LATE_MAX_S
        while True:
            with self.lock:
                if self.opened is not None:
                    return self.opened
                if self.ended() or time.monotonic() >= bound or self.done.is_set():
                    self.opened = max(time.monotonic(), self.start + self.window_s + LATE_S)
                    return self.opened
            time.sleep(POLL_S)

    def moment(self, offset_s: float) -> float:
        """The monotonic time a fault or job planned at `offset_s` begins; blocks until the
        gate has opened where that is a late one (waiting for the window's ships)."""
        planned = self.start + offset_s
        late = self.window_s + LATE_S
        if offset_s < late:
            return planned
        return max(planned, self.open_at() + offset_s - late)

    def wait(self, offset_s: float) -> None:
        """Until the moment of `offset_s` (or the round's jobs are done)."""
        self.done.wait(max(0.0, self.moment(offset_s) - time.monotonic()))


def late_stage(fault: Fault) -> int:
    """Which part of a round's late faults `fault` is in (0: none, a fault of the window): 1
    and 2 the two waves of kills after a marker and GCS partitions (`plan`), 3 the SIGKILLs of
    agents and raylets, 4 the head's restart. A stage begins once every fault of the stages
    before it has ended (`Injector.begin`), the second wave once the nodes the first took down
    are up again: a SIGKILL or a restarted head while a partition waits for the GCS to count
    its node dead cuts that short (seed 7: 2 partitions sent, none met, a head restart 14 s
    after them)."""
    if fault.kind in ("marker_kill", "gcs_partition"):
        return fault.wave or 1
    if fault.kind in HEAD_SAFE and fault.action == "kill":
        return 3
    return 4 if fault.kind == "head_restart" else 0


def node_killing(kind: str, action: str) -> bool:
    return (kind in HEAD_SAFE and action == "kill") or kind in (
        "head_restart", "gcs_partition", "marker_kill",
    )  # fmt: skip


def plan(seed: int, round_no: int, per_round: int, window_s: float, nodes: int) -> list[Fault]:
    """The faults of one round: each kind once per `len(KINDS)` faults, in a random order, at
    random moments of the first `window_s` seconds; those that take a node down after it, when
    the window's ships have had time to end: `marker_kill` and `gcs_partition` (they wait for
    the build their moment starts) in the `STEP_S` from `LATE_S` past it, then SIGKILLs of
    agents and raylets, then a head restart. Depends only on (seed, round)."""
    rng = random.Random(f"{seed}-{round_no}")
    kinds: list[str] = []
    while len(kinds) < per_round:
        deck = list(KINDS)
        rng.shuffle(deck)
        kinds += deck
    faults = []
    # Kills after a marker and GCS partitions in two waves, with the nodes that went down
    # started again between them (`Injector.heal_between`): in each wave one of nodes 1 and 2
    # for the kills, the other for the partitions, swapped in the second, and the first swapped
    # from round to round. A node taken down stays down until it is started again: a kind that
    # shares a node with the other in a wave finds it down (seed 7, both kinds on both nodes:
    # 4 `marker_kill`s met and no partition in 2 rounds; one wave, seed 8: one of each a round;
    # drawn at random, seed 4 put a round's on one node). An agent or raylet is SIGKILLed in one
    # of three faults, stopped in the others (a stop meets its node up; in seed 4, 12 of the 18
    # kills found their node down already).
    turn = {"marker_kill": round_no % 2, "gcs_partition": round_no % 2 + 1}
    drawn = kinds[:per_round]
    seen: dict[str, int] = {}
    for kind in drawn:
        wave = 0
        if kind in turn:
            seen[kind] = seen.get(kind, 0) + 1
            wave = 1 if seen[kind] <= (drawn.count(kind) + 1) // 2 else 2
        if kind in HEAD_SAFE:
            action = rng.choice(("kill", "stop", "stop"))
        else:
            action = rng.choice(("kill", "stop")) if kind in PROCESS_KINDS else OTHER_ACTIONS[kind]
        step, skew_s, hold_s = "", 0, round(rng.uniform(2, 12), 2)
        if action == "stop":
            hold_s = round(rng.uniform(1, 8), 2)
        if kind == "disk_full":
            node, step = LOOP_NODE, rng.choice(DISK_STEPS)
        elif kind == "driver" or kind == "head_restart":
            node = 0  # drivers run on the head
        elif kind in turn:
            node = 1 + (turn[kind] + wave - 1) % (nodes - 1)
        elif node_killing(kind, action):
            node = rng.randrange(1, nodes)
        elif kind == "node_split":
            node = 1  # and node 2: both keep the GCS (on the head)
        elif kind == "clock_skew":
            node, skew_s = SKEWED_NODE, rng.choice((-1, 1)) * rng.randrange(60, 3600)
        else:
            node = rng.randrange(nodes)
        if kind == "gcs_partition":
            hold_s = round(rng.uniform(*PARTITION_S), 2)
        late = window_s + LATE_S
        if kind == "head_restart":
            offset = late + 3 * STEP_S + rng.uniform(0, 2)
        elif kind in turn:  # their build begins at the moment
            offset = rng.uniform(late + (wave - 1) * STEP_S, late + wave * STEP_S)
        elif node_killing(kind, action):
            offset = rng.uniform(late + 2 * STEP_S, late + 3 * STEP_S)
        else:
            offset = rng.uniform(0, window_s)
        faults.append(
            Fault(
                round=round_no, kind=kind, action=action, node=node, offset_s=round(offset, 2),
                hold_s=hold_s, delay_ms=rng.randrange(100, 600) if kind == "link_delay" else 0,
                step=step, skew_s=skew_s, wave=wave,
            )
        )  # fmt: skip
    return sorted(faults, key=lambda f: f.offset_s)


def cold_job(fault: Fault) -> str | None:
    """The job a fault needs started at its moment, so that what it must meet begins after it:
    actors on every node on a fresh key (`cold`: a build on each node) or `prepare` with
    shipping on one (`cold_ship`: a build and two receives)."""
    if fault.kind in ("ship_sender", "ship_receiver") or fault.step == "receive":
        return "cold_ship"
    if fault.kind in ("uv_sync", "disk_full", "marker_kill", "gcs_partition"):
        return "cold"
    return None


def cold_faults(faults: list[Fault]) -> list[Fault]:
    """The faults that need a job of their own (`cold_job`), in the order their jobs start:
    each job begins when its fault does (`Injector.begin`)."""
    needing = [f for f in faults if cold_job(f) is not None]
    return sorted(needing, key=lambda f: (f.offset_s, cold_job(f)))


def cold_starts(faults: list[Fault]) -> list[tuple[float, str]]:
    """The round's extra jobs, (seconds from its start, job kind): one at the moment of each
    fault that needs one (`cold_faults`). A function of the plan, hence of the seed alone."""
    return [(f.offset_s, str(cold_job(f))) for f in cold_faults(faults)]


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
    on the way out, whatever happens). `reports`: where workers report as they start
    (marker_kill reads it); `ray_uv`: the CLI (gc)."""

    def __init__(
        self,
        cluster: ChaosCluster,
        driver_pids: Callable[[], list[int]],
        reports: Path | None = None,
        ray_uv: str = "ray-uv",
    ) -> None:
        self.cluster = cluster
        self.driver_pids = driver_pids
        self.reports = reports
        self.ray_uv = ray_uv
        self.stopped: set[int] = set()
        self.lock = threading.Lock()
        self.head_lock = threading.Lock()
        self.cuts = {pair: threading.Lock() for pair in ((0, 1), (0, 2), (1, 2))}
        self.claimed: set[Path] = set()  # markers a marker_kill met: each meets one of its own
        self.cache_writes = threading.Lock()  # one at a time: each puts back what it found
        self.loop_dir = cluster.nodes[LOOP_NODE].venv_dir.parent
        self.gate: LateGate | None = None  # when the round's late faults begin (`LateGate`)
        self.pending: dict[int, int] = {}  # late faults not yet ended, by stage (`late_stage`)
        self.healed: list[int] = []  # the nodes started again between the waves
        self.heal_lock = threading.Lock()
        self.heal_done = False

    def plan_round(self, faults: list[Fault]) -> None:
        """The round's faults, before any runs: what each late stage waits for."""
        with self.lock:
            self.pending, self.healed, self.heal_done = {}, [], False
            for fault in faults:
                if stage := late_stage(fault):
                    self.pending[stage] = self.pending.get(stage, 0) + 1

    def begin(self, fault: Fault, start: float, done: threading.Event) -> None:
        """Until the moment of `fault` (`gate`), or of the job it starts: its planned one, and
        for a late one, once the stages before its own have ended (at most `STAGE_MAX_S`) and,
        for the second wave, the nodes the first took down are up again (`heal_between`)."""
        if self.gate is not None:
            self.gate.wait(fault.offset_s)
        else:
            done.wait(max(0.0, start + fault.offset_s - time.monotonic()))
        stage = late_stage(fault)
        if stage > 1:
            self._earlier_stages_ended(stage, done, time.monotonic() + STAGE_MAX_S)
        if stage == 2:
            self.heal_between()

    def heal_between(self) -> None:
        """Nodes 1 and 2 up again after the first wave, once (whoever comes first waits for
        it, the others for it to end): `ChaosCluster.heal`, as between rounds."""
        with self.heal_lock:
            if self.heal_done:
                return
            self.heal_done = True
            try:
                self.healed = self.cluster.heal()
            except RuntimeError:  # not back in time: the second wave finds its nodes down
                self.healed = []

    def _earlier_stages_ended(self, stage: int, done: threading.Event, until: float) -> None:
        """Until every late fault of a stage before `stage` has ended (or the jobs are done,
        or `until`)."""
        while not done.is_set() and time.monotonic() < until:
            with self.lock:
                if not any(n for s, n in self.pending.items() if s < stage):
                    return
            time.sleep(POLL_S)

    def processes(self, kind: str, node: int) -> list[int]:
        pids = in_namespaces([self.cluster.nodes[node].host])[0]
        return [p for p in pids if _is(kind, _cmdline(p)) and not _zombie(p)]

    def receiving(self, node: int) -> list[str]:
        """The `<key>.ship-*` dirs of `node`'s venv dir: streams in flight to it."""
        return _entries(self.cluster.nodes[node].venv_dir, lambda n: SHIP_INFIX in n)

    def in_flight(self, node: int) -> dict[str, Any]:
        """What goes on at `node` now: its `uv sync`s, the streams it receives, its venvs
        without a marker yet."""
        venvs = self.cluster.nodes[node].venv_dir
        return {
            "up": self.cluster.nodes[node].alive,
            "syncs": len(self.processes("uv_sync", node)),
            "receiving": len(self.receiving(node)),
            "building": len(_unmarked(venvs)),
        }

    def run(self, fault: Fault, start: float, jobs_done: threading.Event) -> dict[str, Any]:
        """Wait for the fault's moment (`begin`), then for what it must meet (while the jobs run,
        at most `want_s`), then inject it and undo it after its hold. The record of what happened:
        `sent` (carried out), `met` (its operation was there: `MEETS`), `what` it met."""
        record: dict[str, Any] = {**asdict(fault), "target": None, "sent": False, "met": False}
        stage = late_stage(fault)
        try:
            self.begin(fault, start, jobs_done)
            record["moment_s"] = round(time.monotonic() - start, 2)
            until = time.monotonic() + want_s(fault.kind)
            getattr(self, f"_{fault.kind}", self._process)(fault, record, jobs_done, until, start)
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            record["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            if stage:
                with self.lock:
                    self.pending[stage] = self.pending.get(stage, 1) - 1
        record["sent"] = record["target"] is not None
        record["met"] = bool(record["met"]) and record["sent"]
        return record

    def _mark(self, record: dict[str, Any], start: float, target: dict[str, Any]) -> None:
        record["at_s"] = round(time.monotonic() - start, 2)
        record["target"] = target

    def _wait(self, ready: Callable[[], Any], done: threading.Event, until: float, poll: float):
        """`ready()`'s first true value while the jobs run (and before `until`); None if none."""
        found = ready()
        while not found and not done.is_set() and time.monotonic() < until:
            time.sleep(poll)
            found = ready()
        return found or None

    def _process(self, fault: Fault, record, done, until, start) -> None:
        if fault.kind == "driver":
            pids = self.driver_pids()
            if pids:
                pid = random.Random(fault.offset_s).choice(pids)
                self._mark(record, start, {"pid": pid, "node": 0})
                record["met"], record["what"] = True, "a running driver"
                self.signal_process(pid, fault)
            return
        node = self.cluster.nodes[fault.node]
        if fault.kind == "ship_sender":
            # a sender streams while some receiver's dir is being written
            def ready() -> Any:
                flows = [r for i in range(len(self.cluster.nodes)) for r in self.receiving(i)]
                senders = [(p, i) for i in range(len(self.cluster.nodes))
                           for p in self.processes("ship_sender", i)]  # fmt: skip
                return (senders[0], flows) if senders and flows else None
        elif fault.kind == "ship_receiver":

            def ready() -> Any:
                n = len(self.cluster.nodes)
                for i in [fault.node, *(j for j in range(n) if j != fault.node)]:
                    flows, pids = self.receiving(i), self.processes("ship_receiver", i)
                    if flows and pids:
                        return (pids[0], i), flows
                return None
        else:  # on the node it names only

            def ready() -> Any:
                pids = self.processes(fault.kind, fault.node) if node.alive else []
                return ((pids[0], fault.node), []) if pids else None

        poll = SYNC_POLL_S if fault.kind in ("uv_sync", "ship_sender", "ship_receiver") else POLL_S
        found = self._wait(ready, done, until, poll)
        if found is None:
            return
        (pid, at), flows = found
        self._mark(record, start, {"pid": pid, "node": at, "cmd": " ".join(_cmdline(pid))[:160]})
        record["met"] = True
        record["what"] = (
            f"streams in flight: {', '.join(flows)}"
            if flows
            else f"node {at} up" + (": a uv sync" if fault.kind == "uv_sync" else "")
        )
        self.signal_process(pid, fault)

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

    def _link_drop(self, fault: Fault, record, done, until, start) -> None:
        self._mark(record, start, {"node": fault.node})
        record["what"] = self.in_flight(fault.node)
        record["met"] = record["what"]["up"]
        self.shape_link(fault)

    _link_delay = _link_drop

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

    def _disk_full(self, fault: Fault, record, done, until, start) -> None:
        """Waits for its step on node 2 (a `uv sync` linking; a build whose sync ended, before
        its manifest; a manifest written, before the marker; a receive), then fills the loop
        disk for root and checks that root cannot write."""
        venvs = self.cluster.nodes[LOOP_NODE].venv_dir

        def ready() -> Any:
            if fault.step == "uv_link":
                return self.processes("uv_sync", LOOP_NODE)
            if fault.step == "receive":
                return self.receiving(LOOP_NODE)
            unmarked = _unmarked(venvs)
            has = [v for v in unmarked if (venvs / v / f"{MARKER}.manifest").exists()]
            if fault.step == "marker":
                return has
            if not [v for v in unmarked if v not in has]:
                return None
            if self.processes("uv_sync", LOOP_NODE):  # one walk of /proc, with a candidate
                linked.append(True)
                return None  # still linking
            return linked  # a sync was seen, and has ended: the manifest comes next

        linked: list[bool] = []

        poll = SYNC_POLL_S if fault.step == "uv_link" else 0.01
        if self._wait(ready, done, until, poll) is None:
            return
        self._mark(record, start, {"node": LOOP_NODE, "step": fault.step})
        filler = self.loop_dir / f"filler-{threading.get_ident()}"
        try:
            record["target"]["filled_bytes"] = fill(filler)
            record["what"] = f"{fault.step}: {root_cannot_write(self.loop_dir)}"
            record["met"] = record["what"].endswith("ENOSPC")
            time.sleep(fault.hold_s)
        finally:
            filler.unlink(missing_ok=True)

    def _head_restart(self, fault: Fault, record, done, until, start) -> None:
        """Restarts the head once its GCS answers (a head restarted a moment ago is not up)."""
        with self.head_lock:
            up = False
            while not up and time.monotonic() < until:
                up = self.cluster.nodes[0].alive and self.cluster.alive_ips() is not None
            self._mark(record, start, {"node": 0, "gcs_before": self.cluster.gcs})
            self.cluster.restart_head(keep=self.driver_pids())
            record["target"]["gcs_after"] = self.cluster.gcs
        record["met"] = up
        record["what"] = "the head's GCS answered" if up else "the head's GCS did not answer"

    def _gcs_partition(self, fault: Fault, record, done, until, start) -> None:
        """Node `fault.node` cut from the head (a blackhole route each way: the index and the
        other node stay reachable) once its build or receive goes on; met if the GCS counted
        it alive when cut and dead before the hold ended."""
        node, head = self.cluster.nodes[fault.node], self.cluster.nodes[0]

        def ready() -> Any:  # a receive: its dir and a receiver (a killed one leaves the dir)
            now = self.in_flight(fault.node)
            if not now["up"] or not self.processes("raylet", fault.node):
                return None  # down, or counted dead by an earlier partition (its raylet left)
            receives = now["receiving"] and self.processes("ship_receiver", fault.node)
            return now if now["syncs"] or receives else None

        busy = self._wait(ready, done, until, SYNC_POLL_S)
        if busy is None:
            return
        alive = self.cluster.alive_ips()  # counted alive when cut, not dead already
        record["alive_when_cut"] = alive is not None and node.host.ip in alive
        with self.cuts[(0, fault.node)], netns.cut(node.host, head.host):
            self._mark(record, start, {"node": fault.node})
            deadline = time.monotonic() + fault.hold_s
            dead = False
            while not dead and time.monotonic() < deadline - 3:
                time.sleep(3)
                alive = self.cluster.alive_ips()
                dead = alive is not None and node.host.ip not in alive
            record["counted_dead_at_s"] = round(time.monotonic() - start, 2) if dead else None
            time.sleep(max(0.0, deadline - time.monotonic()))
        record["met"] = dead and record["alive_when_cut"]  # seed 9: a second partition of a
        # wave met the node the first had got counted dead, its raylet not yet gone
        record["what"] = f"{busy}; counted alive when cut: {record['alive_when_cut']}, dead: {dead}"

    def _node_split(self, fault: Fault, record, done, until, start) -> None:
        a, b = self.cluster.nodes[1], self.cluster.nodes[2]
        with self.cuts[(1, 2)], netns.cut(a.host, b.host):
            self._mark(record, start, {"nodes": [1, 2]})
            time.sleep(min(fault.hold_s, 2.0))
            alive = self.cluster.alive_ips() or set()
            both = a.host.ip in alive and b.host.ip in alive
            time.sleep(max(0.0, fault.hold_s - 2.0))
        record["met"] = both
        record["what"] = f"both counted alive by the GCS during the split: {both}"

    def _marker_kill(self, fault: Fault, record, done, until, start) -> None:
        """Looks every `MARKER_POLL_S` for a venv of node `fault.node` that had no marker and
        now has one, and SIGKILLs that node's agent at once; met if no worker had started in
        that venv yet (the workers report as they start: `reports`)."""
        node = self.cluster.nodes[fault.node]
        venvs = node.venv_dir
        seen = set(_unmarked(venvs))

        def ready() -> Any:
            now = set(_unmarked(venvs))
            fresh = [v for v in seen if v not in now and (venvs / v / MARKER).exists()]
            seen.update(now)
            with self.lock:  # another marker_kill's marker is not this one's
                fresh = [v for v in fresh if venvs / v not in self.claimed]
                self.claimed.update(venvs / v for v in fresh[:1])
            return fresh[:1]

        fresh = self._wait(ready, done, until, MARKER_POLL_S)
        if fresh is None:
            return
        marked_at = time.monotonic()
        agents = self.processes("agent", fault.node)
        if not agents:
            return
        _signal(agents[0], signal.SIGKILL)
        took_ms = round((time.monotonic() - marked_at) * 1000, 1)
        self._mark(record, start, {"pid": agents[0], "node": fault.node, "venv": fresh[0]})
        started = self._worker_started(venvs / fresh[0])
        record["met"] = not started
        record["what"] = (
            f"marker of {fresh[0]} seen, agent killed {took_ms} ms later; "
            f"a worker had started in it: {started}"
        )

    def _worker_started(self, venv: Path) -> bool:
        if self.reports is None:
            return False
        for path in self.reports.glob("*.json"):
            try:
                if str(venv) in path.read_text():
                    return True
            except OSError:
                continue
        return False

    def _gc(self, fault: Fault, record, done, until, start) -> None:
        node = self.cluster.nodes[fault.node]
        busy = self.in_flight(fault.node)
        drivers = len(self.driver_pids())
        self._mark(record, start, {"node": fault.node})
        out = subprocess.run(
            [self.ray_uv, "gc"], env=node.env(), capture_output=True, text=True, timeout=120
        )
        record["target"]["rc"] = out.returncode
        record["target"]["output"] = (out.stdout + out.stderr)[-300:]
        record["met"] = drivers > 0
        record["what"] = f"{drivers} drivers running; node {fault.node}: {busy}"

    def _cache_write(self, fault: Fault, record, done, until, start) -> None:
        """Appends a line to a file of uv's cache that is hardlinked into a ready venv of the
        node (the same inode): the venv changes though nobody opened it. The invariant `whole`
        is asked about that venv at once (`whole_saw_it`: it must say so, unless the write was
        refused); then the file is put back (size and mtime), so the venvs are whole again."""
        node = self.cluster.nodes[fault.node]
        found = self._wait(lambda: cache_link(node.venv_dir, node.uv_cache), done, until, POLL_S)
        if found is None:
            return
        cached, in_venv = found
        venv = node.venv_dir / in_venv.relative_to(node.venv_dir).parts[0]
        # Seed 5 ran two at once on node 0's six.py: the second found the first's line, and
        # put it back, so the file stayed written (and every later build there failed).
        with self.cache_writes:
            self._mark(record, start, {"node": fault.node, "file": str(in_venv)})
            before = os.stat(cached)
            try:
                with open(cached, "a") as f:
                    f.write("\n# written through uv's cache by the chaos run\n")
            except OSError as e:
                record["what"] = f"the write was refused: {e}"
                return
            try:
                meta = ready(venv)
                seen = check_whole(venv, meta) if meta is not None else "no longer ready"
            finally:
                os.truncate(cached, before.st_size)
                os.utime(cached, ns=(before.st_atime_ns, before.st_mtime_ns))
        record["met"], record["whole_saw_it"] = True, seen is not None
        record["what"] = f"wrote {cached}, the inode of {in_venv}; whole: {seen}"[:400]

    def _clock_skew(self, fault: Fault, record, done, until, start) -> None:
        node = self.cluster.nodes[fault.node]
        if self.cluster.clock is None:
            record["what"] = "no clock shim here (no C compiler)"
            return
        self._mark(record, start, {"node": fault.node, "skew_s": fault.skew_s})
        raylets = self.processes("raylet", fault.node)
        mapped = bool(raylets) and clock_skew.loaded(raylets[0])
        try:
            self.cluster.clock.set(fault.skew_s)
            seen = clock_skew.probe(node.host.exec(), node.env())
            record["met"] = mapped and abs(seen - fault.skew_s) < 5
            record["what"] = f"shim in the raylet: {mapped}; a probe on the node saw {seen:+.0f} s"
            time.sleep(fault.hold_s)
        finally:
            self.cluster.clock.set(0)

    def release(self) -> None:
        """Let every process held stopped go (on the way out)."""
        with self.lock:
            pids, self.stopped = list(self.stopped), set()
        for pid in pids:
            _signal(pid, signal.SIGCONT)


def fill(filler: Path) -> int:
    """A file that takes all the room of `filler`'s file system, the blocks kept for root
    included (fallocate, then writes until ENOSPC: what a block group's metadata leaves).
    Its size."""
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        st = os.statvfs(filler.parent)
        try:
            os.posix_fallocate(fd, 0, max(st.f_bfree * st.f_frsize - (1 << 20), 4096))
        except OSError:
            pass
        os.lseek(fd, 0, os.SEEK_END)
        chunk = 1 << 20
        while chunk >= 512:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError:
                chunk //= 2
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def root_cannot_write(directory: Path) -> str:
    """Writes `PROBE` bytes as this process (root) into `directory`: `ENOSPC` if the disk is
    full for root, else what happened."""
    probe = directory / f"probe-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:
        return f"open: {e.strerror}" if e.errno != 28 else "ENOSPC"
    try:
        os.write(fd, b"\0" * PROBE)
        os.fsync(fd)
        return f"root still wrote {PROBE} bytes"
    except OSError as e:
        return "ENOSPC" if e.errno == 28 else f"write: {e.strerror}"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def cache_link(venv_dir: Path, uv_cache: Path) -> tuple[Path, Path] | None:
    """(a file in uv's cache, the same inode in a ready venv of `venv_dir`): a `.py` file a
    hardlink install shares with the cache; None if no ready venv has one."""
    inodes: dict[tuple[int, int], Path] = {}
    for venv in sorted(venv_dir.iterdir()) if venv_dir.is_dir() else []:
        if not (venv / MARKER).exists():
            continue
        for path in venv.glob("lib/python*/site-packages/six.py"):
            st = path.stat()
            if st.st_nlink > 1:
                inodes[(st.st_dev, st.st_ino)] = path
        if inodes:
            break
    if not inodes:
        return None
    for path in uv_cache.glob("archive-v0/*/six.py"):
        st = path.stat()
        if (st.st_dev, st.st_ino) in inodes:
            return path, inodes[(st.st_dev, st.st_ino)]
    return None


def _entries(directory: Path, want: Callable[[str], bool]) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(directory) if want(e.name))
    except OSError:
        return []


def _unmarked(venvs: Path) -> list[str]:
    """The venv dirs (a key's) of `venvs` with no marker yet."""
    found = []
    for name in _entries(venvs, lambda n: len(n) == 16 and "." not in n):
        if not os.path.exists(venvs / name / MARKER):
            found.append(name)
    return found


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
