"""Worker groups on clusters that grow: a request the nodes alive now cannot hold waits for nodes
to join where an autoscaler manages the cluster, or where the caller asked to wait, and fails at
once (`InfeasibleClusterError`) where nothing can join.

- A `ray.cluster_utils.Cluster` of one CPU node, waiting asked for with
  `WORKER_GROUPS_WAIT_FOR_NODES=1` (an operator adding nodes by hand): the fast error without it,
  a timeout that says what was asked, what is there and what to do, then a GPU node added while
  the group waits, on which the group comes up.
- Ray's real autoscaler (`ray start --head --autoscaling-config=...` with its fake node provider,
  `RAY_FAKE_CLUSTER=1`), started and stopped here by process group: a group needing a node type
  with 0 workers waits, the autoscaler launches the node, the group runs on it.
- Reading the autoscaler's state (v1 and v2, and the read-only one of a cluster started by
  hand), and the wait setting, as pure functions.

Drivers run as subprocesses, as a user's job does: they start or join their own cluster, and the
progress lines are checked where a user sees them (stderr, with no logging set up).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import worker_groups.cluster
from tests.agent.test_jobs import free_ports, stop_own_cluster
from tests.worker_groups.conftest import WORKER_ENV
from worker_groups import RayVirtualCluster
from worker_groups.autoscaling import (
    NO_AUTOSCALER,
    WAIT_FOR_NODES_ENV,
    AutoscalerState,
    autoscaler_state_from_v1,
    autoscaler_state_from_v2,
)

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
NODE_ID = "ab" * 28
# The autoscaled cluster runs with token auth, its token in the environment of its `ray start`
# (and so of every node the autoscaler adds) and of its driver: a multi-node token cluster.
CLUSTER_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}

# -- pure: the wait setting and the autoscaler's state ---------------------------------------


@pytest.mark.parametrize(
    ("kwarg", "env", "expected"),
    [
        (None, None, None),
        (None, "1", True),
        (None, "true", True),
        (None, "0", False),
        (None, "auto", None),
        (False, "1", False),  # the argument wins over the variable
        (True, "0", True),
    ],
)
def test_wait_for_nodes_from_the_argument_else_the_variable(
    monkeypatch: pytest.MonkeyPatch, kwarg: bool | None, env: str | None, expected: bool | None
) -> None:
    if env is None:
        monkeypatch.delenv(WAIT_FOR_NODES_ENV, raising=False)
    else:
        monkeypatch.setenv(WAIT_FOR_NODES_ENV, env)
    assert RayVirtualCluster([1], wait_for_nodes=kwarg).wait_for_nodes is expected


def test_bad_wait_settings_fail_when_the_cluster_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WAIT_FOR_NODES_ENV, "maybe")
    with pytest.raises(ValueError, match=rf"{WAIT_FOR_NODES_ENV}='maybe': use 1 .* 0 .* unset"):
        RayVirtualCluster([1])
    monkeypatch.delenv(WAIT_FOR_NODES_ENV)
    with pytest.raises(ValueError, match=r"wait_for_nodes='yes': use True"):
        RayVirtualCluster([1], wait_for_nodes="yes")  # type: ignore[arg-type]


def test_progress_lines_come_every_30_s_as_documented() -> None:
    assert worker_groups.cluster.PROGRESS_INTERVAL_S == 30.0


def test_a_progress_line_says_what_is_pending_what_is_there_and_what_is_launching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = worker_groups.cluster
    node = {"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}}
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [node, {"Alive": False, "Resources": {}}])
    monkeypatch.setattr(cluster.ray, "available_resources", lambda: {"CPU": 1.0})
    launching = AutoscalerState(frozenset({"head", "gpu"}), {"gpu": 1})
    monkeypatch.setattr(cluster, "autoscaler_state", lambda: launching)
    pgs = [SimpleNamespace(bundle_specs=[{"CPU": 1, "GPU": 1}] * 2) for _ in range(2)]
    line = RayVirtualCluster([2, 2])._placement_state(pgs, pgs[1:], autoscaling=True)
    assert line == (
        "1 of 2 placement group(s) pending ({CPU: 2, GPU: 2}); the Ray cluster has "
        "{CPU: 2, GPU: 0} over 1 node(s), available now: {CPU: 1, GPU: 0}; the autoscaler is "
        "launching {gpu: 1}"
    )
    assert "launching" not in RayVirtualCluster([2, 2])._placement_state(pgs, pgs, False)


def v1_status(report: dict | None) -> str:
    return json.dumps({"time": 0.0, "autoscaler_report": report, "load_metrics_report": {}})


def test_v1_state_of_a_cluster_started_by_hand_has_no_node_types() -> None:
    # The read-only provider: one made-up type per node, keyed by node id.
    readonly = {
        "active_nodes": {f"node_{NODE_ID}": 1},
        "pending_nodes": [],
        "pending_launches": {},
        "node_type_mapping": {NODE_ID: f"node_{NODE_ID}"},
    }
    assert autoscaler_state_from_v1(v1_status(readonly)) == NO_AUTOSCALER
    assert autoscaler_state_from_v1(None) == NO_AUTOSCALER  # no monitor at all
    assert autoscaler_state_from_v1(v1_status(None)) == NO_AUTOSCALER  # nothing reported yet


def test_v1_state_of_an_autoscaler_names_its_node_types_and_launches() -> None:
    report = {
        "active_nodes": {"head": 1},
        "pending_nodes": [["n1", "10.0.0.5", "gpu", "setting-up"]],  # (id, ip, type, status)
        "pending_launches": {"gpu": 1, "cpu": 0},
        "node_type_mapping": {"10.0.0.1": "head", "10.0.0.5": "gpu"},
    }
    assert autoscaler_state_from_v1(v1_status(report)) == AutoscalerState(
        frozenset({"head", "gpu"}), {"gpu": 2}
    )
    older = {**report, "pending_nodes": [["10.0.0.5", "gpu", "setting-up"]]}  # (ip, type, status)
    assert autoscaler_state_from_v1(v1_status(older)).launching == {"gpu": 2}


def node(type_name: str) -> SimpleNamespace:
    return SimpleNamespace(ray_node_type_name=type_name)


def test_v2_state_from_the_node_types_nodes_were_launched_as() -> None:
    readonly = SimpleNamespace(
        active_nodes=[node("")], idle_nodes=[node("")], pending_nodes=[], pending_launches=[]
    )
    assert autoscaler_state_from_v2(readonly) == NO_AUTOSCALER
    kuberay = SimpleNamespace(
        active_nodes=[node("headgroup")],
        idle_nodes=[],
        pending_nodes=[node("gpu-group")],
        pending_launches=[SimpleNamespace(ray_node_type_name="gpu-group", count=2)],
    )
    assert autoscaler_state_from_v2(kuberay) == AutoscalerState(
        frozenset({"headgroup", "gpu-group"}), {"gpu-group": 3}
    )


# -- a Cluster: waiting asked for, a GPU node added by hand ----------------------------------

ADDED_NODE_DRIVER = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import ray
    from ray.cluster_utils import Cluster
    import worker_groups.cluster
    from worker_groups import (
        ACTOR_ENVIRONMENT_REGISTRY, InfeasibleClusterError, PlacementGroupTimeoutError,
        RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup,
    )

    temp_dir, worker_env = sys.argv[1], json.loads(sys.argv[2])
    worker_groups.cluster.PROGRESS_INTERVAL_S = 1.0
    ACTOR_ENVIRONMENT_REGISTRY["wg_workers.EchoWorker"] = None
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "temp_dir": temp_dir},
    )
    out = {}
    try:
        ray.init(address=nodes.address)
        # No autoscaler and no wait asked for: the fast error, with the way to ask.
        start = time.monotonic()
        try:
            RayVirtualCluster([2], num_gpus_per_node=2).get_placement_groups()
        except InfeasibleClusterError as e:
            out["fast_error"], out["fast_s"] = str(e), time.monotonic() - start

        print("ASK TO WAIT", file=sys.stderr, flush=True)
        cluster = RayVirtualCluster([2], num_gpus_per_node=2, wait_for_nodes=True,
                                    ready_timeout_s=3)
        try:
            cluster.get_placement_groups()
        except PlacementGroupTimeoutError as e:
            out["timeout_error"] = str(e)
        out["pgs_after_timeout"] = [
            pg["state"] for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED"
        ]

        print("WAIT FOR THE NODE", file=sys.stderr, flush=True)
        os.environ["WORKER_GROUPS_WAIT_FOR_NODES"] = "1"  # as an operator would, for a script
        cluster = RayVirtualCluster([2], num_gpus_per_node=2, ready_timeout_s=120)
        made = {}

        def make_group():  # in a thread: Ray adds nodes from the main thread only (signals)
            try:
                made["group"] = RayWorkerGroup(cluster, RayWorkerBuilder("wg_workers.EchoWorker"),
                                               env_vars=worker_env)
            except BaseException as e:
                made["error"] = e

        start = time.monotonic()
        maker = threading.Thread(target=make_group, daemon=True)
        maker.start()
        while maker.is_alive() and not any(
            pg["state"] == "PENDING" for pg in ray.util.placement_group_table().values()
        ):
            time.sleep(0.2)
        time.sleep(3)  # the group is waiting
        out["gpu_node"] = nodes.add_node(num_cpus=2, num_gpus=2).node_id
        out["node_added_after_s"] = time.monotonic() - start
        maker.join(timeout=240)
        if "error" in made:
            raise made["error"]
        group = made["group"]
        out["waited_s"] = time.monotonic() - start
        out["workers"] = ray.get([w.info.remote() for w in group.workers])
        group.shutdown()
        cluster.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        ray.shutdown()
        nodes.shutdown()
    """
)


@pytest.fixture
def temp_dir() -> Iterator[Path]:
    """A Ray temp dir of the test's own (short: socket paths), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="wgas-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_driver(
    script: str, tmp_path: Path, temp_dir: Path, *args: str, auth: dict[str, str] | None = None
) -> tuple[dict, str]:
    """Run a driver script in a session of its own (with the cluster's `auth` settings, if it
    has any); its RESULT and its stderr."""
    path = tmp_path / "driver.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{WORKER_ENV['PYTHONPATH']}"}
    env.update(auth or {})
    env.pop("RAY_ADDRESS", None)
    env.pop(WAIT_FOR_NODES_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, str(path), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        stop_own_cluster(proc, temp_dir)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), stderr


@pytest.mark.slow  # a node added by hand after the group waits: a minute and more
@pytest.mark.timeout(450)
def test_a_group_waits_for_a_gpu_node_added_by_hand(tmp_path: Path, temp_dir: Path) -> None:
    out, stderr = run_driver(ADDED_NODE_DRIVER, tmp_path, temp_dir, str(temp_dir), "{}")
    # Nothing can join and nobody asked to wait: at once, with the way to ask.
    assert "missing {GPU: 2}" in out["fast_error"], out["fast_error"]
    assert f"set {WAIT_FOR_NODES_ENV}=1 to wait" in out["fast_error"]
    assert out["fast_s"] < 5
    # Asked to wait, nothing came: what was asked, what is there, what to do; nothing left.
    timeout_error = out["timeout_error"]
    assert "were not ready after 3s: 1 of 1 placement group(s) pending ({CPU: 2, GPU: 2})" in (
        timeout_error
    )
    assert "the Ray cluster has {CPU: 2, GPU: 0} over 1 node(s)" in timeout_error
    assert "Waited for nodes to join (wait_for_nodes / WORKER_GROUPS_WAIT_FOR_NODES)" in (
        timeout_error
    )
    assert "raise ready_timeout_s" in timeout_error
    assert out["pgs_after_timeout"] == []
    # The group waited for the node, then came up on it.
    assert out["node_added_after_s"] > 2
    assert {w["node_id"] for w in out["workers"]} == {out["gpu_node"]}
    assert sorted(w["RANK"] for w in out["workers"]) == ["0", "1"]
    # Progress lines a user sees without setting up logging.
    waited = stderr[stderr.index("WAIT FOR THE NODE") :]
    assert "does not fit the nodes alive now" in waited
    assert f"Waiting up to 120s for nodes to join (wait_for_nodes / {WAIT_FOR_NODES_ENV})" in (
        waited
    )
    assert (
        "virtual cluster [2]: 1 of 1 placement group(s) pending ({CPU: 2, GPU: 2}); the Ray "
        "cluster has {CPU: 2, GPU: 0} over 1 node(s), available now: {CPU: 2, GPU: 0};"
    ) in waited
    assert re.search(r"; \d+s left", waited), waited


# -- Ray's autoscaler with its fake node provider --------------------------------------------

AUTOSCALED_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import ray
    import worker_groups.cluster
    from worker_groups import (
        ACTOR_ENVIRONMENT_REGISTRY, InfeasibleClusterError, RayVirtualCluster, RayWorkerBuilder,
        RayWorkerGroup,
    )
    from worker_groups.cluster import autoscaler_state

    address, worker_env = sys.argv[1], json.loads(sys.argv[2])
    worker_groups.cluster.PROGRESS_INTERVAL_S = 1.0
    ACTOR_ENVIRONMENT_REGISTRY["wg_workers.EchoWorker"] = None
    ray.init(address=address)
    out = {}
    deadline = time.monotonic() + 120
    while not autoscaler_state().node_types:  # the autoscaler's first report
        assert time.monotonic() < deadline, "the autoscaler never reported"
        time.sleep(0.5)
    out["node_types"] = sorted(autoscaler_state().node_types)
    out["gpus_before"] = ray.cluster_resources().get("GPU", 0)
    try:
        RayVirtualCluster([2], num_gpus_per_node=2, wait_for_nodes=False).get_placement_groups()
    except InfeasibleClusterError as e:
        out["opted_out"] = str(e)

    print("WAIT FOR THE AUTOSCALER", file=sys.stderr, flush=True)
    cluster = RayVirtualCluster([2], num_gpus_per_node=2, ready_timeout_s=240)
    start = time.monotonic()
    group = RayWorkerGroup(cluster, RayWorkerBuilder("wg_workers.EchoWorker"),
                           env_vars=worker_env)
    out["waited_s"] = time.monotonic() - start
    out["workers"] = ray.get([w.info.remote() for w in group.workers])
    out["gpu_nodes"] = [n["NodeID"] for n in ray.nodes()
                        if n["Alive"] and n["Resources"].get("GPU")]
    group.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
    ray.shutdown()
    """
)


def fake_cluster_config(gcs_address: str) -> dict:
    """A head without GPUs and one node type with 2 logical GPUs, 0 of them to start with."""
    return {
        "cluster_name": "wg-autoscaling",
        "max_workers": 1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,  # else the provider's nodes join 6379, maybe not ours
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            "gpu_node": {
                "resources": {"CPU": 2, "GPU": 2, "object_store_memory": 200 * 1024**2},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "docker": {},
        **dict.fromkeys(
            (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
                "cluster_synced_files",
                "rsync_exclude",
                "rsync_filter",
            ),
            [],
        ),
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }


@pytest.fixture
def autoscaling_head(temp_dir: Path) -> Iterator[str]:
    """`ray start --head --block --autoscaling-config=...` with the fake node provider and Ray's
    default autoscaler (v1), on ports and a temp dir of its own; stopped by its process group
    and temp dir (the autoscaler's nodes included), never by `ray stop`. Yields the GCS address.
    (Autoscaler v2 with this provider needs `fake_multi_node/example.yaml`, which Ray's wheels
    lack: its monitor dies at start, so v2 is covered by `autoscaler_state_from_v2` only.)"""
    import ray._private.services

    ip = ray._private.services.get_node_ip_address()
    gcs, client, nm, om, rtenv, metrics, listen, grpc, *workers = free_ports(28)
    gcs_address = f"{ip}:{gcs}"
    config = fake_cluster_config(gcs_address)
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    env.pop("RAY_ADDRESS", None)
    env.update(CLUSTER_AUTH)  # the autoscaler's `ray start` of each node it adds inherits it
    config_path = temp_dir / "autoscaling.json"
    config_path.write_text(json.dumps(config))
    start = [
        RAY, "start", "--head", "--block", f"--autoscaling-config={config_path}",
        f"--node-ip-address={ip}", f"--port={gcs}", f"--ray-client-server-port={client}",
        f"--node-manager-port={nm}", f"--object-manager-port={om}",
        f"--runtime-env-agent-port={rtenv}", f"--metrics-export-port={metrics}",
        f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
        "--worker-port-list=" + ",".join(map(str, workers)), f"--temp-dir={temp_dir}",
        "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
        f"--object-store-memory={200 * 1024**2}",
    ]  # fmt: skip
    log_path = temp_dir / "ray-start.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            start, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ray start failed:\n" + log_path.read_text())
            time.sleep(0.5)
        yield gcs_address
    finally:
        stop_own_cluster(proc, temp_dir)


@pytest.mark.timeout(600)
def test_a_group_waits_for_the_autoscaler_to_launch_a_gpu_node(
    tmp_path: Path, temp_dir: Path, autoscaling_head: str
) -> None:
    out, stderr = run_driver(
        AUTOSCALED_DRIVER, tmp_path, temp_dir, autoscaling_head, "{}", auth=CLUSTER_AUTH
    )
    assert out["node_types"] == ["ray.head.default"]  # no GPU node yet
    assert out["gpus_before"] == 0
    # Opting out keeps the fast error, even where the cluster could grow.
    assert "missing {GPU: 2}" in out["opted_out"] and WAIT_FOR_NODES_ENV not in out["opted_out"]
    # On its own the group waited for the autoscaler's node and runs on it.
    assert len(out["gpu_nodes"]) == 1
    assert {w["node_id"] for w in out["workers"]} == set(out["gpu_nodes"])
    waited = stderr[stderr.index("WAIT FOR THE AUTOSCALER") :]
    assert (
        "Waiting up to 240s for nodes to join (an autoscaler runs; node types now: "
        "['ray.head.default'])"
    ) in waited, waited
