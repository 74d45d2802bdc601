"""The chaos run's faults (`benchmarks.chaos_faults`) and what they are made with: the plan
keeps nodes 1 and 2 up while builds, ships and fills are hit, a fill leaves root without room,
a cut parts two hosts only, node 1's clock moves, a hardlink from uv's cache into a ready venv
is found; and the report counts a fault only where it met its operation. The pieces that need
root (a loop disk, namespaces) are skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks import chaos, netns, node_disks
from benchmarks.chaos_cluster import ChaosCluster, Node
from benchmarks.chaos_faults import (
    DISK_STEPS,
    KINDS,
    LATE_MAX_S,
    LATE_S,
    MEETS,
    STEP_S,
    WANT_AFTER_BUILD_S,
    WANT_S,
    Fault,
    Injector,
    LateGate,
    cache_link,
    cold_job,
    cold_starts,
    fill,
    node_killing,
    plan,
    root_cannot_write,
)
from benchmarks.chaos_jobs import Job
from benchmarks.clock_skew import Clock, loaded, probe
from ray_uv_plugin.store.layout import MARKER

DISKS = node_disks.unavailable()
NETNS = netns.unavailable()


def test_the_plan_is_the_seeds_alone_and_each_kind_says_what_it_must_meet() -> None:
    first = [plan(7, r, 2 * len(KINDS), 40.0, 3) for r in range(5)]
    assert first == [plan(7, r, 2 * len(KINDS), 40.0, 3) for r in range(5)]
    assert first != [plan(8, r, 2 * len(KINDS), 40.0, 3) for r in range(5)]
    assert set(MEETS) == set(KINDS)
    for faults in first:
        assert sorted(f.kind for f in faults) == sorted(2 * KINDS)
        assert [f.offset_s for f in faults] == sorted(f.offset_s for f in faults)


def test_node_killing_faults_come_after_every_other_and_never_take_the_head() -> None:
    """Builds, ships and fills on nodes 1 and 2 are hit while both are up: whatever takes a
    node down falls past the window, when its ships have had time to end (a kill after a
    marker and a GCS partition first, as they wait for a build, in two waves; SIGKILLs; the
    head's restart last)."""
    for r in range(20):
        faults = plan(3, r, 2 * len(KINDS), 40.0, 3)
        waiting = [f for f in faults if f.kind in ("marker_kill", "gcs_partition")]
        sigkills = [f for f in faults if f.kind in ("agent", "raylet") and f.action == "kill"]
        others = [f for f in faults if not node_killing(f.kind, f.action)]
        late = 40.0 + LATE_S
        assert max(f.offset_s for f in others) <= 40.0
        for f in waiting:  # two waves
            assert late + (f.wave - 1) * STEP_S <= f.offset_s <= late + f.wave * STEP_S, f
        assert all(late + 2 * STEP_S <= f.offset_s <= late + 3 * STEP_S for f in sigkills)
        assert faults[-1].kind == "head_restart" and faults[-1].offset_s >= late + 3 * STEP_S
        assert all(f.node != 0 for f in [*waiting, *sigkills])


def test_a_rounds_node_killing_faults_meet_both_nodes_and_kills_are_fewer_than_stops() -> None:
    """Seed 4 drew a round's kills after a marker onto one node, where all but the first found
    it down, and 12 of its 18 agent and raylet kills found their node down already; seed 7
    put both kinds on both nodes, where the first of either took the node from the other. In
    each of a round's two waves its kills after a marker go to one node, its partitions to the
    other, swapped in the second wave and from round to round."""
    for r in range(20):
        faults = plan(5, r, 4 * len(KINDS), 40.0, 3)
        for wave in (1, 2):
            kills = {f.node for f in faults if f.kind == "marker_kill" and f.wave == wave}
            cuts = {f.node for f in faults if f.kind == "gcs_partition" and f.wave == wave}
            first = 1 + (r + wave - 1) % 2
            assert kills == {first} and cuts == {3 - first}, (r, wave, kills, cuts)
    faults = [f for r in range(30) for f in plan(5, r, 3 * len(KINDS), 40.0, 3)]
    for kind in ("agent", "raylet"):
        actions = [f.action for f in faults if f.kind == kind]
        assert 0 < actions.count("kill") < actions.count("stop"), kind


def test_sync_faults_aim_at_every_node_and_fills_at_every_step() -> None:
    faults = [f for r in range(30) for f in plan(5, r, 2 * len(KINDS), 40.0, 3)]
    assert {f.node for f in faults if f.kind == "uv_sync"} == {0, 1, 2}
    assert {f.step for f in faults if f.kind == "disk_full"} == set(DISK_STEPS)
    assert {f.node for f in faults if f.kind == "disk_full"} == {2}
    assert all(f.skew_s != 0 and f.node == 1 for f in faults if f.kind == "clock_skew")
    assert all(25 <= f.hold_s <= 35 for f in faults if f.kind == "gcs_partition")


def test_each_fault_that_needs_an_operation_has_one_start_at_its_moment() -> None:
    faults = plan(2, 0, 2 * len(KINDS), 40.0, 3)
    starts = cold_starts(faults)
    ships = [f for f in faults if f.kind in ("ship_sender", "ship_receiver") or f.step == "receive"]
    builds = [
        f for f in faults
        if f.kind in ("uv_sync", "marker_kill", "gcs_partition")
        or (f.kind == "disk_full" and f.step != "receive")
    ]  # fmt: skip
    assert starts == sorted([(f.offset_s, "cold_ship") for f in ships]
                            + [(f.offset_s, "cold") for f in builds])  # fmt: skip
    assert cold_starts([f for f in faults if f.kind in ("driver", "gc", "link_drop")]) == []


def test_late_faults_wait_for_the_windows_ships_and_keep_their_spacing() -> None:
    """A ship still running at `LATE_S` past the window holds the node-killing faults (and
    the jobs they start) until it ends, each shifted by as much, order and spacing kept; a
    fault of the window is never held; ships ended early change nothing."""
    window, late = 40.0, 40.0 + LATE_S
    start = time.monotonic() - late - 5  # the round began 5 s past the late part's plan
    shipping = threading.Event()
    gate = LateGate(start, window, lambda: not shipping.is_set(), threading.Event())
    shipping.set()
    assert gate.moment(10.0) == start + 10.0  # in the window: as planned, at once
    ended = threading.Timer(0.6, shipping.clear)
    ended.start()
    first = gate.moment(late + 1.0)
    assert first - time.monotonic() > -0.1  # held until the ship ended, 5 s past its plan
    assert first > start + late + 1.0 + 4
    assert gate.moment(late + 9.0) - first == pytest.approx(8.0)  # the plan's spacing
    ended.join()
    now = time.monotonic()  # a round that just began, its ships already over: as planned
    early = LateGate(now, window, lambda: True, threading.Event())
    assert early.moment(late + 1.0) == now + late + 1.0


def test_a_late_stage_begins_once_the_stages_before_it_have_ended() -> None:
    """Agent and raylet SIGKILLs wait for the round's partitions and kills after a marker to
    end, the head's restart for those too; a fault of the window waits for nothing."""
    from benchmarks.chaos_faults import late_stage

    faults = plan(7, 0, 2 * len(KINDS), 40.0, 3)
    for kind in ("gcs_partition", "marker_kill"):
        assert sorted(late_stage(f) for f in faults if f.kind == kind) == [1, 2]
    stages = {
        (f.kind, f.action): late_stage(f)
        for f in faults
        if f.kind not in ("gcs_partition", "marker_kill")
    }
    assert stages[("head_restart", "restart")] == 4
    assert all(s == 3 for (k, a), s in stages.items() if k in ("agent", "raylet") and a == "kill")
    assert all(s == 0 for (k, a), s in stages.items() if a == "stop" or k == "uv_sync")
    injector = Injector.__new__(Injector)  # its stage bookkeeping only: no cluster
    injector.lock = threading.Lock()
    injector.plan_round(faults)
    done = threading.Event()
    waited = time.monotonic()
    injector._earlier_stages_ended(1, done, time.monotonic() + 5)  # nothing before stage 1
    assert time.monotonic() - waited < 0.1
    ended = threading.Timer(0.5, lambda: injector.pending.update({1: 0}))
    ended.start()
    waited = time.monotonic()
    injector._earlier_stages_ended(2, done, time.monotonic() + 5)
    assert 0.4 < time.monotonic() - waited < 3
    ended.join()
    injector.pending[3] = 1  # a SIGKILL not ended: the head waits, at most its bound
    waited = time.monotonic()
    injector._earlier_stages_ended(4, done, time.monotonic() + 0.5)
    assert 0.4 < time.monotonic() - waited < 2


def test_the_second_wave_and_its_jobs_begin_once_the_nodes_are_up_again() -> None:
    """The first of the second wave's faults or jobs to begin starts the nodes again
    (`heal_between`, once a round); the rest wait for that, then begin."""
    from types import SimpleNamespace

    from benchmarks.chaos_faults import cold_faults

    heals: list[float] = []

    def heal() -> list[int]:
        heals.append(time.monotonic())
        time.sleep(0.3)
        return [1, 2]

    injector = Injector.__new__(Injector)
    injector.lock, injector.gate = threading.Lock(), None
    injector.cluster = SimpleNamespace(heal=heal)
    injector.heal_lock = threading.Lock()
    faults = plan(3, 1, 4 * len(KINDS), 40.0, 3)
    injector.plan_round(faults)
    injector.pending[1] = 0  # the first wave has ended
    second = [f for f in faults if f.wave == 2]
    begun: list[float] = []
    start, done = time.monotonic() - 1000, threading.Event()  # every moment is past
    threads = [
        threading.Thread(
            target=lambda f=f: (injector.begin(f, start, done), begun.append(time.monotonic()))
        )
        for f in second
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(heals) == 1 and injector.healed == [1, 2]
    assert len(begun) == len(second) and min(begun) >= heals[0] + 0.3
    needing = cold_faults(faults)  # each job begins with its own fault, in start order
    assert sorted(needing, key=lambda f: f.offset_s) == needing
    assert {id(f) for f in needing} == {id(f) for f in faults if cold_job(f) is not None}
    assert [(f.offset_s, cold_job(f)) for f in needing] == cold_starts(faults)


def test_late_faults_wait_for_ships_at_most_late_max_s() -> None:
    start = time.monotonic() - 40.0 - LATE_MAX_S  # the bound has passed
    gate = LateGate(start, 40.0, lambda: False, threading.Event())  # a ship that never ends
    begun = time.monotonic()
    assert gate.moment(40.0 + LATE_S) <= time.monotonic() + 0.01
    assert time.monotonic() - begun < 1.0


def test_faults_whose_operation_follows_a_build_wait_longer_for_it() -> None:
    from benchmarks.chaos_faults import want_s

    for kind in ("ship_sender", "ship_receiver", "marker_kill", "gcs_partition"):
        assert want_s(kind) == WANT_AFTER_BUILD_S > WANT_S
    assert want_s("uv_sync") == want_s("link_drop") == WANT_S


@pytest.mark.skipif(DISKS is not None, reason=f"no loop mounts: {DISKS}")
@pytest.mark.parametrize("reserved", [0, 5])
def test_a_fill_leaves_root_without_room(tmp_path: Path, reserved: int) -> None:
    """The filler before took `f_bavail`: on a default ext4 (5% kept for root) root still wrote
    after it. `fill` takes the blocks kept for root as well."""
    disk = tmp_path / "disk"
    with node_disks.mounted([disk], tmp_path, size="64M", reserved_percent=reserved):
        st = os.statvfs(disk)
        old = disk / "old-filler"  # what the filler did before: root kept its reserve
        with open(old, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 4096)
            except OSError:
                pass
        before = root_cannot_write(disk)
        old.unlink()
        if reserved:
            assert before == "root still wrote 1048576 bytes"
        size = fill(disk / "filler")
        assert size > 50 << 20
        assert root_cannot_write(disk) == "ENOSPC"
        (disk / "filler").unlink()
        assert root_cannot_write(disk) == "root still wrote 1048576 bytes"


@pytest.mark.skipif(NETNS is not None, reason=f"no network namespaces: {NETNS}")
def test_a_cut_parts_two_hosts_and_leaves_their_other_links() -> None:
    def reaches(a: netns.Host, b: netns.Host) -> bool:
        code = f"import socket; socket.create_connection(('{b.ip}', 9), timeout=1)"
        out = subprocess.run([*a.exec(), sys.executable, "-c", code], capture_output=True,
                             text=True)  # fmt: skip
        return "refused" in out.stderr  # the host answered (nothing listens on port 9)

    with netns.network() as net:
        head, n1, n2 = (net.add_host(f"n{i}", 1000, 1000) for i in range(3))
        assert reaches(n1, n2) and reaches(n2, n1)
        with netns.cut(n1, n2):
            assert not reaches(n1, n2) and not reaches(n2, n1)
            assert reaches(n1, head) and reaches(n2, head) and reaches(head, n1)
        assert reaches(n1, n2) and reaches(n2, n1)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: no clock library")
def test_the_clock_library_moves_the_wall_clock_of_its_processes_only(tmp_path: Path) -> None:
    clock = Clock.make(tmp_path)
    assert clock is not None
    env = {**os.environ, **clock.env()}
    assert abs(probe([], env)) < 2
    clock.set(-900)
    assert abs(probe([], env) + 900) < 2  # read at each call: no restart
    assert abs(probe([], dict(os.environ))) < 2  # a process without it keeps the host's
    sleeper = subprocess.Popen(["sleep", "5"], env=env)
    try:
        for _ in range(50):
            if loaded(sleeper.pid):
                break
            subprocess.run(["sleep", "0.05"])
        assert loaded(sleeper.pid) and not loaded(os.getpid())
    finally:
        sleeper.kill()
        sleeper.wait()
    clock.set(0)
    assert abs(probe([], env)) < 2


def test_a_file_of_uv_cache_hardlinked_into_a_ready_venv_is_found(tmp_path: Path) -> None:
    venvs, cache = tmp_path / "venvs", tmp_path / "cache"
    cached = cache / "archive-v0" / "abc" / "six.py"
    cached.parent.mkdir(parents=True)
    cached.write_text("x = 1\n")
    venv = venvs / "0123456789abcdef"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    shutil.copy(cached, site / "six.py")  # a copy: nothing to write through
    (venv / MARKER).write_text("{}")
    assert cache_link(venvs, cache) is None
    (site / "six.py").unlink()
    os.link(cached, site / "six.py")
    assert cache_link(venvs, cache) == (cached, site / "six.py")
    (venv / MARKER).unlink()  # not ready: not the fault's target
    assert cache_link(venvs, cache) is None


def test_cache_writes_at_once_each_put_back_what_they_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed 5 ran two `cache_write`s at once on one file: the second found the first's line and
    put that back, so uv's file stayed written. One at a time, the file ends as it began."""
    from types import SimpleNamespace

    from benchmarks import chaos_faults

    venvs, cache = tmp_path / "venvs", tmp_path / "cache"
    cached = cache / "archive-v0" / "abc" / "six.py"
    cached.parent.mkdir(parents=True)
    cached.write_text("x = 1\n")
    site = venvs / "0123456789abcdef" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    os.link(cached, site / "six.py")
    (venvs / "0123456789abcdef" / MARKER).write_text("{}")
    node = SimpleNamespace(venv_dir=venvs, uv_cache=cache)
    injector = Injector(SimpleNamespace(nodes=[node] * 3), lambda: [])
    monkeypatch.setattr(chaos_faults, "ready", lambda venv: time.sleep(0.5))  # a slow check
    fault = Fault(0, "cache_write", "write", 0, 0.0, 1.0)
    records = [{} for _ in range(2)]
    writers = [
        threading.Thread(
            target=injector._cache_write,
            args=(fault, r, threading.Event(), time.monotonic() + 5, time.monotonic()),
        )
        for r in records
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert all(r["met"] for r in records), records
    assert cached.read_text() == "x = 1\n"


def test_the_report_counts_a_fault_only_where_it_met_its_operation(tmp_path: Path) -> None:
    def fault(kind: str, sent: bool, met: bool) -> dict:
        return {"type": "fault", "kind": kind, "action": "kill", "target": {} if sent else None,
                "sent": sent, "met": met}  # fmt: skip

    lines = [
        fault("uv_sync", True, True), fault("uv_sync", True, False), fault("uv_sync", False, False),
        fault("disk_full", True, True),
        {"type": "job", "job": "cold_ship", "rc": 0, "hung": False, "shipped": 2},
        {"type": "round", "restarted": [1], "workers_started": 3, "violations": {}},
    ]  # fmt: skip
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = chaos.report(path)
    assert "| `uv_sync` | 3 | 2 | 1 |" in text
    assert "| `disk_full` | 1 | 1 | 1 |" in text
    assert "4 faults planned, 3 sent, 2 met; 2 venvs shipped" in text
    assert "1 fills that left root without room" in text
    summary = chaos.summarize([x for x in lines if x["type"] == "fault"], 1, [], chaos.Counter())
    assert (summary["faults_sent"], summary["faults_met"]) == (3, 2)
    assert summary["faults_met_per_kind"] == {"disk_full": 1, "uv_sync": 1}


def fake_cluster(net: netns.Network, base: Path) -> ChaosCluster:
    """Three nodes in namespaces, each a `sleep` standing for its `ray start` (alive while it
    runs), with venv dirs and uv caches under `base`; no Ray."""
    nodes = []
    for i in range(3):
        host = net.add_host(f"n{i}", 1000, 1000)
        node = Node(i, host, base / f"node{i}" / "venvs", base / f"node{i}" / "uv-cache")
        node.venv_dir.mkdir(parents=True, exist_ok=True)
        node.proc = subprocess.Popen([*host.exec(), "sleep", "120"])
        nodes.append(node)
    return ChaosCluster(net, nodes, base / "ray")


@pytest.fixture
def named() -> Iterator[Callable[[netns.Host, str], subprocess.Popen]]:
    """Start a process in a host's namespace whose argv[0] is a title (as Ray titles its own),
    living until the test kills it or ends (a loaded machine may take minutes)."""
    started: list[subprocess.Popen] = []

    def start(host: netns.Host, title: str) -> subprocess.Popen:
        command = f"exec -a '{title}' tail -f /dev/null"
        started.append(subprocess.Popen([*host.exec(), "bash", "-c", command]))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(NETNS is not None, reason=f"no network namespaces: {NETNS}")
def test_marker_kill_kills_the_agent_as_a_fresh_marker_appears(
    tmp_path: Path, named: Callable[[netns.Host, str], subprocess.Popen]
) -> None:
    with netns.network() as net:
        cluster = fake_cluster(net, tmp_path)
        agent = named(cluster.nodes[1].host, "ray::RuntimeEnvAgent")
        other = named(cluster.nodes[2].host, "ray::RuntimeEnvAgent")
        venv = cluster.nodes[1].venv_dir / "0123456789abcdef"
        venv.mkdir()  # a build under way
        injector = Injector(cluster, lambda: [], tmp_path / "reports")
        (tmp_path / "reports").mkdir()
        fault = Fault(0, "marker_kill", "kill", 1, 0.0, 5.0)
        done = threading.Event()

        def build() -> None:
            time.sleep(1.0)
            (venv / MARKER).write_text("{}")

        threading.Thread(target=build).start()
        twin: dict = {}  # a second marker_kill waiting on the same node at once
        waiting = threading.Thread(
            target=lambda: twin.update(injector.run(fault, time.monotonic(), done))
        )
        waiting.start()
        first = injector.run(fault, time.monotonic(), done)
        assert agent.wait(5) == -signal.SIGKILL
        assert other.poll() is None  # node 2's agent untouched
        done.set()
        waiting.join()
        done.clear()
        # One marker meets one fault: whichever saw it first; the other found none of its own.
        record, unmet = (first, twin) if first["sent"] else (twin, first)
        assert record["sent"] and record["met"], record
        assert record["target"]["venv"] == venv.name and "ms later" in record["what"]
        assert not unmet["sent"] and not unmet["met"], unmet
        # a worker already started in it: the kill came after the setup returned, not met
        agent = named(cluster.nodes[1].host, "ray::RuntimeEnvAgent")
        later = cluster.nodes[1].venv_dir / "fedcba9876543210"
        later.mkdir()
        (tmp_path / "reports" / "1.json").write_text(json.dumps({"prefix": str(later)}))
        threading.Thread(
            target=lambda: (time.sleep(1.0), (later / MARKER).write_text("{}"))
        ).start()
        record = injector.run(fault, time.monotonic(), done)
        assert agent.wait(5) == -signal.SIGKILL
        assert record["sent"] and not record["met"], record
        other.kill()
        for node in cluster.nodes:
            node.proc.kill()


@pytest.mark.skipif(NETNS is not None, reason=f"no network namespaces: {NETNS}")
def test_a_process_fault_waits_for_its_operation_on_the_node_it_names(tmp_path: Path) -> None:
    """A `uv sync` on another node is not what a sync fault on node 1 must meet; with none on
    node 1 until the jobs end, it is neither sent nor met."""
    with netns.network() as net:
        cluster = fake_cluster(net, tmp_path)
        elsewhere = subprocess.Popen(
            [*cluster.nodes[2].host.exec(), "bash", "-c", "exec -a uv tail -F sync 2>/dev/null"]
        )
        injector = Injector(cluster, lambda: [])
        done = threading.Event()
        threading.Timer(1.0, done.set).start()
        fault = Fault(0, "uv_sync", "kill", 1, 0.0, 1.0)
        record = injector.run(fault, time.monotonic(), done)
        assert not record["sent"] and not record["met"] and elsewhere.poll() is None
        here = subprocess.Popen(
            [*cluster.nodes[1].host.exec(), "bash", "-c", "exec -a uv tail -F sync 2>/dev/null"]
        )
        record = injector.run(fault, time.monotonic(), threading.Event())
        assert record["met"] and record["target"]["node"] == 1
        assert here.wait(5) == -signal.SIGKILL and elsewhere.poll() is None
        elsewhere.kill()
        for node in cluster.nodes:
            node.proc.kill()


@pytest.mark.skipif(NETNS or DISKS, reason=f"no namespaces or loop mounts: {NETNS or DISKS}")
def test_a_disk_fault_fills_at_its_step_and_is_met_when_root_cannot_write(tmp_path: Path) -> None:
    with (
        netns.network() as net,
        node_disks.mounted([tmp_path / "node2"], tmp_path, size="64M", reserved_percent=0),
    ):
        cluster = fake_cluster(net, tmp_path)
        injector = Injector(cluster, lambda: [])
        venvs = cluster.nodes[2].venv_dir
        fault = Fault(0, "disk_full", "fill", 2, 0.0, 0.5, step="marker")
        done = threading.Event()
        threading.Timer(1.0, done.set).start()
        record = injector.run(fault, time.monotonic(), done)
        assert not record["sent"]  # no build at that step: nothing filled
        venv = venvs / "0123456789abcdef"
        venv.mkdir()
        (venv / f"{MARKER}.manifest").write_text("{}")  # the manifest written, no marker yet
        record = injector.run(fault, time.monotonic(), threading.Event())
        assert record["met"] and record["what"] == "marker: ENOSPC", record
        assert record["target"]["filled_bytes"] > 50 << 20
        assert root_cannot_write(venvs) == "root still wrote 1048576 bytes"  # removed after
        syncing = subprocess.Popen(
            [*cluster.nodes[2].host.exec(), "bash", "-c", "exec -a uv tail -F sync 2>/dev/null"]
        )
        linking = Fault(0, "disk_full", "fill", 2, 0.0, 0.5, step="uv_link")
        record = injector.run(linking, time.monotonic(), threading.Event())
        assert record["met"] and record["what"] == "uv_link: ENOSPC", record
        syncing.kill()
        for node in cluster.nodes:
            node.proc.kill()


def test_the_venvs_a_prepare_shipped_are_counted_from_its_lines_also_when_it_failed(
    tmp_path: Path,
) -> None:
    log = tmp_path / "r000-cold_ship3.log"
    log.write_text(
        "198.18.0.2 (68e1d3c0): uv_project 5a1eb6aa538248df: built in 22.94s\n"
        "198.18.0.3 (f86361bc): uv_project 5a1eb6aa538248df: shipped 212.4MiB in 9.10s\n"
        "198.18.0.4 (b59118f3): failed: The task is not schedulable\n"
        "error: 1 of 3 nodes failed: 198.18.0.4 (b59118f3)\n"
    )
    job = Job("cold_ship", 0, [], tmp_path, {}, log=log)
    assert chaos.shipped(job) == 1
    assert chaos.shipped(Job("cold", 0, [], tmp_path, {}, log=log)) == 0


def test_the_small_disk_s_node_has_a_venv_dir_budget_and_the_others_none(tmp_path: Path) -> None:
    """Without a budget seed 9's own venvs filled node 2's 3 GB disk by round 5; with one the
    plugin removes idle venvs there before it builds."""
    from benchmarks.chaos_cluster import LOOP_NODE, LOOP_VENV_BUDGET

    def env(index: int) -> dict[str, str]:
        return Node(index, None, tmp_path / "v", tmp_path / "c").env()  # type: ignore[arg-type]

    assert env(LOOP_NODE)["RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES"] == str(LOOP_VENV_BUDGET)
    assert "RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES" not in env(0)
    assert LOOP_VENV_BUDGET < 3 * 1024**3 // 2 + 1
