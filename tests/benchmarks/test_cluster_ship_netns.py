"""The simulated cluster of `benchmarks.cluster_ship --netns`: namespaces and shaped links
(default suite, a few seconds), and real runs of two and three nodes (slow: ~100 s each here),
each checked for what it leaves behind; and the relay tree of `ship` with a stalled relaying
receiver (two raylets of `test_ship` and a third). The namespace tests are skipped where
namespaces cannot be made (not root, no iproute2, a kernel or container that refuses them),
with the reason."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from benchmarks import netns, node_disks
from tests.ship.test_ship import (  # noqa: F401 - two_nodes: the fixture, for this module too
    MiB,
    Node,
    build_on_driver_node,
    driver_node,
    new_project,
    newest_lock,
    on_progress,
    other_node,
    remove,
    two_nodes,
)

ROOT = Path(__file__).resolve().parents[2]
WHY_NOT = netns.unavailable()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")


def ours(run_id: str) -> list[str]:
    return [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{run_id}-")]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Processes whose environment holds `text` (every raylet process has its node's paths)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/environ").read_bytes() and alive(int(pid)):
                found.append(int(pid))
        except OSError:
            pass
    return found


def send(source: netns.Host, target: netns.Host, megabytes: int) -> float:
    """Seconds to push `megabytes` MB over TCP from `source`'s namespace to `target`'s."""
    with netns.inside(target):
        listener = socket.create_server((target.ip, 0))
    received = []

    def take() -> None:
        conn, _ = listener.accept()
        with conn:
            n = 0
            while block := conn.recv(1 << 20):
                n += len(block)
            received.append(n)

    thread = threading.Thread(target=take)
    thread.start()
    with netns.inside(source):
        conn = socket.create_connection((target.ip, listener.getsockname()[1]))
    start = time.monotonic()
    with conn:
        conn.sendall(b"x" * (megabytes * 10**6))
    thread.join(30)
    listener.close()
    assert received == [megabytes * 10**6]
    return time.monotonic() - start


@needs_netns
def test_the_network_is_shaped_counted_isolated_and_removed() -> None:
    """A shaped link runs at its rate, the bridge ports count what each host sent, a host has
    no route beyond the network, and everything (processes in it too) is gone after."""
    with netns.network() as net:
        slow = net.add_host("index", 80, 1000)  # 10 MB/s up
        fast = net.add_host("n0", 1000, 1000)
        took = send(slow, fast, 8)
        assert took > 0.7, f"8 MB over an 80 Mbit/s link took {took:.2f}s: not shaped"
        counted = net.counters()
        assert counted["index"]["sent"] >= 8 * 10**6 > counted["n0"]["sent"]
        assert counted["n0"]["received"] >= 8 * 10**6
        route = subprocess.run(
            [*fast.exec(), sys.executable, "-c", "import socket; socket.create_connection(("
             "'1.1.1.1', 53), timeout=2)"], capture_output=True, text=True,
        )  # fmt: skip
        assert "unreachable" in route.stderr, route.stderr
        sleeper = subprocess.Popen([*fast.exec(), "sleep", "300"])
        run_id = net.run_id
        assert len(ours(run_id)) == 3
    assert ours(run_id) == []
    sleeper.wait(10)  # killed by the teardown (we reap it: it was our child)
    assert sleeper.returncode == -signal.SIGTERM


@needs_netns
def test_a_failing_or_interrupted_run_removes_its_own_namespaces_only() -> None:
    """An exception in the block, and SIGTERM or Ctrl-C to a run, remove that run's namespaces
    and the processes in them; another run's namespaces are left alone."""
    with netns.network() as bystander:
        bystander.add_host("n0", 1000, 1000)
        with pytest.raises(RuntimeError, match="boom"), netns.network() as net:
            net.add_host("n0", 1000, 1000)
            failed = net.run_id
            raise RuntimeError("boom")
        assert ours(failed) == []
        script = textwrap.dedent(
            """\
            import signal, subprocess, time
            from benchmarks import netns, node_disks
            signal.signal(signal.SIGTERM, netns.interrupted)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
            with netns.network() as net:
                host = net.add_host("n0", 1000, 1000)
                child = subprocess.Popen([*host.exec(), "sleep", "300"])
                print(net.run_id, child.pid, flush=True)
                time.sleep(300)
            """
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            run = subprocess.Popen(
                [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
            )
            run_id, pid = run.stdout.readline().split()
            assert len(ours(run_id)) == 2 and alive(int(pid))
            run.send_signal(sig)
            try:
                run.wait(30)
            finally:
                if run.poll() is None:  # the signal did nothing: end the run the way that works
                    run.send_signal(signal.SIGTERM)
                    run.wait(30)
            assert ours(run_id) == [], sig
            assert not alive(int(pid)), sig
        assert len(ours(bystander.run_id)) == 2


def args(nodes: str) -> argparse.Namespace:
    return argparse.Namespace(
        nodes=nodes,
        wheels=2,
        wheel_mb=1,
        build_seconds=3,
        modes=[True],
        json=None,
        plot=None,
        shared_fs=False,
    )


@needs_netns
@pytest.mark.slow  # ~70 s alone, 250 s loaded: raylets in namespaces, Ray from a simulated index
def test_two_simulated_nodes_ship_the_env_built_once() -> None:
    """N = 2, tiny packages, shipping: the index serves each file once, the source-built
    package is built on one node only, the other node gets the venv by shipping (its bytes
    leave the source node's link), and nothing of the run is left."""
    from benchmarks import cluster_ship_netns, package_set

    try:
        mirrored = package_set.mirror_pypi("ray==2.60.0", package_set.WHEEL_CACHE / "pypi")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"Ray's wheels for the simulated index could not be fetched from PyPI: {e}")
    results = cluster_ship_netns.run_netns(args("2"))
    (run,) = results["runs"]
    assert [n["outcome"] for n in run["per_node"]].count("shipped") == 1, run["per_node"]
    assert run["builds"] == 1 and run["failed"] == 0
    served_once = results["wheels"]["bytes"]
    assert run["index_bytes"] == served_once, (run["index_bytes"], served_once)
    assert sum(f.stat().st_size for f in mirrored) < served_once
    assert run["links"]["index"]["sent"] >= served_once
    assert run["source_sent_bytes"] >= run["stream_bytes"] > 0
    assert run["links"]["n1"]["received"] >= run["stream_bytes"]
    assert run["bound_seconds"] > run["first_build_seconds"] >= 3
    receiver_cpu = run["node_cpu_seconds_after_build"][1]  # it received, checked, installed
    assert receiver_cpu > 0 and "cpu_bound_seconds" not in run
    # The floor's figures, measured apart: the venv's tar over the two nodes' link, a plain
    # actor's start on the receiver; the floor at least the build and that pipe.
    plane = run["data_plane"]
    assert 0.5 < plane["pipe_bytes"] / run["stream_bytes"] < 2, (plane, run["stream_bytes"])
    assert plane["send_cpu_seconds"] > 0 and plane["receive_cpu_seconds"] > 0, plane
    assert plane["worker_start_cpu_seconds"] > 0 and plane["worker_start_seconds"] > 0, plane
    floor = run["floor_seconds"]
    assert floor >= round(run["first_build_seconds"] + plane["pipe_seconds"], 2), run
    assert 0 < len(run["host_cpu_busy"]) and all(0 <= s <= 1 for s in run["host_cpu_busy"])
    if node_disks.unavailable() is None:
        assert results["node_disks"].startswith("each node's own ext4"), results["node_disks"]
    assert ours(results["network"]) == []
    assert not Path(results["workdir"]).exists()
    with open("/proc/mounts") as f:
        assert results["workdir"] not in f.read()
    assert processes_mentioning(results["workdir"]) == []


@needs_netns
@pytest.mark.slow
def test_three_simulated_nodes_the_source_node_sends_the_venv_once() -> None:
    """N = 3: the source node's link carries the venv's stream once, and a receiver passes it
    on (left to Ray, both receivers pulled every chunk from the source node: twice)."""
    from benchmarks import cluster_ship_netns

    results = cluster_ship_netns.run_netns(args("3"))
    (run,) = results["runs"]
    assert (run["shipped"], run["builds"], run["failed"]) == (2, 1, 0), run["per_node"]
    stream = run["stream_bytes"]
    assert stream <= run["source_sent_bytes"] < 1.5 * stream, (run["links"], stream)
    relayed = max(run["links"]["n1"]["sent"], run["links"]["n2"]["sent"])
    assert relayed >= stream, (run["links"], stream)
    assert ours(results["network"]) == []


def test_a_stalled_relaying_receiver_costs_the_one_it_relays_to_nothing_but_time(
    two_nodes,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """Three raylets; the first receiver, which passes each chunk on to the second, stops
    (SIGSTOP) after chunk 1: the second takes the sender's copies instead and gets the venv;
    the first is given up on alone."""
    from ray_uv_plugin.ship.options import ShipOptions
    from ray_uv_plugin.ship.relay import relay_parents
    from ray_uv_plugin.ship.transfer import ship

    cluster, _, _ = two_nodes
    c = Node(tmp_path / "node-c")
    node_c = cluster.add_node(num_cpus=1, env_vars=c.env())
    stopped: list[int] = []
    try:
        cluster.wait_for_nodes()
        key = build_on_driver_node(new_project(tmp_path))
        b_id = other_node(node_c.node_id)
        assert relay_parents([node_c.node_id, b_id], 1)[b_id] == node_c.node_id

        def stop_c(p) -> None:
            if p.chunk == 1 and not stopped:
                pid = int(newest_lock(c).read_text().split()[0])  # C's receiver holds it
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)

        options = ShipOptions(chunk_bytes=2 * MiB, stall_timeout=10)
        results = ship(key, driver_node(), [node_c.node_id, b_id], options, on_progress(stop_c))
        assert stopped
        assert results[b_id].outcome == "shipped", results
        on_c = results[node_c.node_id]
        assert on_c.outcome == "failed" and "stalled: no answer for" in on_c.why, results
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # Ray killed it
        remove(cluster, node_c)


def test_the_relay_tree_sends_each_chunk_out_of_a_node_at_most_fanout_times() -> None:
    """The sender passes a chunk to one receiver, each receiver to at most `fanout` more;
    every receiver's parent comes before it (it holds the chunk first); `relay_depth` is the
    depth of the last one."""
    from ray_uv_plugin.ship.relay import relay_depth, relay_parents

    for fanout in (1, 2, 3):
        for count in (1, 2, 3, 7, 127):
            receivers = [f"r{i}" for i in range(count)]
            parents = relay_parents(receivers, fanout)
            assert list(parents) == receivers
            children = list(parents.values())  # each receiver once per child
            assert children.count(None) == 1
            assert all(children.count(r) <= fanout for r in receivers)
            assert all(
                receivers.index(p) < receivers.index(r) for r, p in parents.items() if p is not None
            )
            depth: dict[str, int] = {}
            for r, p in parents.items():
                depth[r] = 1 if p is None else depth[p] + 1
            assert max(depth.values()) == relay_depth(count, fanout), (fanout, count)
    assert [relay_depth(n, 1) for n in (1, 7)] == [1, 7]  # a chain
    assert [relay_depth(n, 2) for n in (1, 2, 3, 4, 7, 8, 127)] == [1, 2, 2, 3, 3, 4, 7]


def test_the_relay_shape_is_a_chain_unless_it_would_be_much_deeper_than_the_stream() -> None:
    """A chain carries the venv once on every link, a chunk per hop behind; a receiver that
    passes each chunk to two others sends the venv twice. The shape that finishes first by
    (chunks + depth - 1) * fanout, within the window's limit; the window covers the depth."""
    from ray_uv_plugin.ship.relay import MAX_WINDOW, WINDOW, relay_depth, relay_fanout, window

    assert relay_fanout(10, 1) == 1
    assert relay_fanout(10, 7) == 1  # 16 chunk-times, against 2 * 12 for a binary tree
    assert relay_fanout(1, 7) == 2  # one chunk: 7 chunk-times against 2 * 3
    assert relay_fanout(100, 14) == 1  # a long one: a chain as deep as the window allows
    assert relay_fanout(100, 127) == 2  # too deep for the window: the binary tree
    for chunks in (1, 10, 100, 1000):
        for receivers in (1, 2, 7, 15, 16, 127, 1000):
            fanout = relay_fanout(chunks, receivers)
            depth = relay_depth(receivers, fanout)
            assert depth + 1 <= MAX_WINDOW or fanout == 4, (chunks, receivers)
            assert window(depth) >= min(depth + 1, MAX_WINDOW), (chunks, receivers)
    assert window(1) == WINDOW and window(7) == 8 and window(100) == MAX_WINDOW
