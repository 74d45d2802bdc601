"""What a group checks about each worker's environment, and where its env vars come from:

- a worker that should run in a `uv_project` venv but runs in its node's own Python (that node's
  raylet does not load the plugin) fails the group with the node and the fix;
- env-var precedence as NeMo RL's: `configure_worker` > the group's `env_vars` > the driver's
  environment > the class's `@ray.remote` `env_vars`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.support.uvproject import write_project
from tests.worker_groups.conftest import WORKER_ENV, alive_actors, wait_until
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
)
from worker_groups._initializer import WorkerVenvReport
from worker_groups.worker_env import PluginNotLoadedError, driver_env_vars, runs_outside_its_venv

pytestmark = pytest.mark.timeout(600)

ECHO = "wg_workers.EchoWorker"
DECORATED = "wg_workers.DecoratedWorker"
NO_PLUGIN = "wg_no_plugin_node"  # a custom resource: only the node without the plugin has it
HEAD = "node:__internal_head__"  # Ray's own resource of the head node (which has the plugin)
FIX = 'eval "$(ray-uv plugin-config --shell)"'


# -- pure: which workers should have a venv, which driver variables workers get ----------------


def _report(venv: str | None, **runtime_env: Any) -> WorkerVenvReport:
    return WorkerVenvReport(node_ip="10.0.0.2", node_id="ab" * 28, python="/usr/bin/python3",
                            venv=venv, runtime_env=runtime_env)  # fmt: skip


def test_which_workers_should_run_in_a_venv() -> None:
    assert not runs_outside_its_venv(_report("/venvs/k", uv_project={}))
    assert not runs_outside_its_venv(_report(None))  # no uv_project: the job's interpreter
    assert runs_outside_its_venv(_report(None, uv_project={}))
    assert runs_outside_its_venv(_report(None, uv_project={"extras": ["vllm"]}))
    # A `uv run` driver's job default steps aside for a worker's own interpreter...
    default = {"job_default": True}
    assert not runs_outside_its_venv(_report(None, uv_project=default, py_executable=""))
    assert not runs_outside_its_venv(_report(None, uv_project=default, pip=["six"]))
    # ...but not for Ray's own `uv run` interpreter, which it replaces.
    assert runs_outside_its_venv(_report(None, uv_project=default, py_executable="uv run x"))
    # A value the plugin would refuse: no plugin has seen it.
    assert runs_outside_its_venv(_report(None, uv_project={"no_such_field": 1}))


def test_driver_variables_that_workers_get() -> None:
    environ = {
        "HF_HOME": "/data/hf",
        "PATH": "/driver/.venv/bin:/usr/bin",
        "PYTHONPATH": "/driver/src",
        "CUDA_HOME": "/usr/local/cuda",  # a build variable the plugin keys: not copied
        "CMAKE_ARGS": "-DGPU=ON",  # so that the group's key is a plain actor's
        "MYLIB_FLAVOR": "cuda",  # no build sees it unless named in build_env_vars: copied
        "VIRTUAL_ENV": "/driver/.venv",
        "UV_PROJECT_ENVIRONMENT": "/driver/.venv",
        "RAY_UV_PLUGIN_VENV": "/venvs/driver-key",
        "UV": "/usr/local/bin/uv",
        "UV_CACHE_DIR": "/home/me/.cache/uv",
        "UV_INDEX_URL": "https://mirror.example/simple",
        "RAY_JOB_ID": "01000000",
        "RAY_RAYLET_PID": "42",
        "RAY_CLIENT_MODE": "0",
        "RAY_LD_PRELOAD": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "RAY_ADDRESS": "10.0.0.1:6379",
    }
    assert driver_env_vars(environ) == {
        "HF_HOME": "/data/hf",
        "PATH": "/driver/.venv/bin:/usr/bin",
        "PYTHONPATH": "/driver/src",
        "MYLIB_FLAVOR": "cuda",
        "RAY_ADDRESS": "10.0.0.1:6379",
    }


def test_the_drivers_proxy_keys_a_groups_venv_where_the_lock_builds_from_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers get the driver's proxy and CA variables (they may need them), and so does each
    node's build: with a path source in the lock they are keyed, so a group whose
    driver has another proxy than the node gets a venv of its own, not the node's."""
    from ray_uv_plugin.env.key import make_request
    from ray_uv_plugin.env.project import load_project
    from ray_uv_plugin.env.spec import parse_spec
    from ray_uv_plugin.env.uv_env import SOURCE_FETCH_VARS
    from tests.env.test_key import write_with_mylib

    project = load_project(write_with_mylib(tmp_path, editable=False))
    for name in SOURCE_FETCH_VARS:  # the node's (this machine's CAs): none
        monkeypatch.delenv(name, raising=False)
    driver = {"HTTPS_PROXY": "http://driver-proxy:3128", "SSL_CERT_FILE": "/driver/ca.pem"}
    copied = driver_env_vars(driver)
    assert copied == driver
    group = make_request(parse_spec({}), project, copied)
    assert group.key != make_request(parse_spec({}), project, {}).key
    assert ("HTTPS_PROXY", "http://driver-proxy:3128") in group.inputs.env


def test_no_credential_ray_reads_reaches_a_worker() -> None:
    """What KubeRay puts in every Ray container of a token cluster, and the rest Ray reads."""
    credentials = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": "s3cr3t",
        "RAY_AUTH_TOKEN_PATH": "/etc/ray/token",
        "RAY_AUTH_SOMETHING_LATER": "x",  # a later Ray's: the prefix covers it
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_KEY": "/etc/tls/key.pem",
        "RAY_REDIS_PASSWORD": "pw",
        "RAY_REDIS_CA_CERT": "/etc/redis/ca.pem",
        "REDIS_PASSWORD": "pw",
        "RAY_JOB_HEADERS": '{"Authorization": "Bearer t"}',
        "RAY_RUNTIME_ENV_BEARER_TOKEN": "t",
        "RAY_KUBERAY_CLIENT_KEY_PATH": "/etc/k/key.pem",
    }
    kept = {"HF_HOME": "/data/hf", "RAY_ADDRESS": "10.0.0.1:6379"}
    assert driver_env_vars({**credentials, **kept}) == kept


def test_every_credential_variable_of_this_ray_is_left_out() -> None:
    """Each `RAY_*` name in Ray's installed source that reads like a secret (a token, password,
    key, certificate or headers) is a credential here, or named below as something else: a new
    Ray's new credential fails this test until it is classified."""
    import re

    from worker_groups.credentials import is_ray_credential

    not_credentials = {
        "RAY_NODE_ZONE_KEY", "RAY_NODE_REGION_KEY", "RAY_NODE_MARKET_TYPE_KEY",  # label names
        "RAY_NODE_ACCELERATOR_TYPE_KEY", "RAY_NODE_GROUP_KEY", "RAY_NODE_ID_KEY",
        "RAY_NODE_TPU_POD_TYPE_KEY", "RAY_NODE_TPU_SLICE_NAME_KEY", "RAY_NODE_TPU_TOPOLOGY_KEY",
        "RAY_NODE_TPU_WORKER_ID_KEY",
        "RAY_SERVE_SESSION_ID_HEADER_KEY",  # a header's name
        "RAY_TRIM_AUTOSCALER_SSH_KEYS",  # a switch
    }  # fmt: skip
    name = rb"RAY_[A-Z0-9_]*(?:TOKEN|PASSWORD|SECRET|KEY|CERT|HEADERS|AUTH)[A-Z0-9_]*"
    # A whole string: a literal in the Python source, a C string in Ray's core (_raylet.so).
    literal = re.compile(rb"[\"'](" + name + rb")[\"']|\x00(" + name + rb")\x00")
    found = set()
    ray_dir = Path(ray.__file__).parent
    for path in [*ray_dir.rglob("*.py"), *ray_dir.glob("_raylet*.so")]:
        if "tests" not in path.parts:
            for m in literal.finditer(path.read_bytes()):
                found.add((m.group(1) or m.group(2)).decode())
    found = {n for n in found if not n.startswith("RAY_SERVE_LLM_KV_TOKEN_")}  # LLM tokens
    assert "RAY_AUTH_TOKEN" in found
    unclassified = sorted(n for n in found if not is_ray_credential(n) and n not in not_credentials)
    assert not unclassified, f"classify these in worker_groups/credentials.py: {unclassified}"


# -- a node whose raylet lacks the plugin ----------------------------------------------------


@pytest.fixture(scope="module")
def check_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    project = write_project(tmp_path_factory.mktemp("wg-check") / "proj", name="wg-check")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, ECHO, {"project": str(project)})
        yield project


@pytest.fixture(scope="module")
def no_plugin_node(two_node_cluster: Cluster) -> Iterator[Any]:
    """A third raylet, started without `RAY_RUNTIME_ENV_PLUGINS`: it ignores `uv_project` and
    starts workers in its own Python. One CPU, so a bundle placed there takes all of it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_RUNTIME_ENV_PLUGINS")
        node = two_node_cluster.add_node(num_cpus=1, resources={NO_PLUGIN: 1})
    two_node_cluster.wait_for_nodes()
    try:
        yield node
    finally:
        two_node_cluster.remove_node(node)


def _virtual_cluster(unified: bool, second_bundle: dict[str, float]) -> RayVirtualCluster:
    """Two one-CPU bundles: the first on the head node, the second where `second_bundle` says."""
    cluster = RayVirtualCluster(
        [1, 1], use_gpus=False, node_resource_constraints=[{HEAD: 0.001}, second_bundle]
    )
    if unified:
        cluster._init_placement_groups(use_unified_pg=True)
    return cluster


def _group(cluster: RayVirtualCluster, unified: bool) -> RayWorkerGroup:
    # Unified: one tied group over both bundles, so its one initializer is on the head node and
    # only the worker of rank 1 lands on the other node. Per node: one initializer per node.
    tied = [(0, [0, 1])] if unified else None
    return RayWorkerGroup(
        cluster, RayWorkerBuilder(ECHO), bundle_indices_list=tied, env_vars=WORKER_ENV
    )


@pytest.mark.parametrize("unified", [True, False], ids=["tied-across-nodes", "pg-per-node"])
def test_a_worker_on_a_node_without_the_plugin_fails_the_group(
    check_project: Path, no_plugin_node: Any, unified: bool
) -> None:
    before = {a["ActorID"] for a in alive_actors()}
    cluster = _virtual_cluster(unified, {NO_PLUGIN: 1})
    try:
        with pytest.raises(Exception) as error:
            _group(cluster, unified)
        # Nothing of the group is left: its workers and initializers are killed.
        wait_until(lambda: {a["ActorID"] for a in alive_actors()} <= before, what="no leftovers")
    finally:
        cluster.shutdown()
    message = str(error.value)
    assert isinstance(error.value, PluginNotLoadedError), message
    assert FIX in message and "before `ray start`" in message
    assert "its raylet does not load the uv_project plugin" in message
    assert message.endswith("The group has been shut down.")
    if unified:  # each worker's readiness call: the node and its ranks
        assert f"(id {no_plugin_node.node_id[:12]}) ran ranks [1] in its own Python" in message
    else:  # the initializer on that node, before it imports the class
        assert message.startswith("uv_project: node ") and "ran this worker in its own" in message


def test_workers_with_the_plugin_pass_the_check(check_project: Path, two_node_cluster: Any) -> None:
    cluster = _virtual_cluster(True, {HEAD: 0.001})
    try:
        group = _group(cluster, True)
        try:
            infos = ray.get(group.run_all_workers_single_data("info"))
        finally:
            group.shutdown()
    finally:
        cluster.shutdown()
    venvs = Path(os.environ["RAY_UV_PLUGIN_VENV_DIR"])
    assert {Path(i["executable"]).parent.parent.parent for i in infos} == {venvs}


# -- env-var precedence, as NeMo RL's -------------------------------------------------------


@pytest.fixture(scope="module")
def head_cluster(two_node_cluster: Any) -> Iterator[RayVirtualCluster]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, DECORATED, None)
        cluster = RayVirtualCluster([1], use_gpus=False, node_resource_constraints=[{HEAD: 0.001}])
        yield cluster
        cluster.shutdown()


def test_env_var_precedence_is_nemo_rls(
    head_cluster: RayVirtualCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DecoratedWorker's decorator sets WG_LAYER_1..3 and its configure_worker WG_LAYER_1."""
    for name in ("WG_LAYER_1", "WG_LAYER_2", "WG_LAYER_3", "WG_DRIVER_ONLY"):
        monkeypatch.setenv(name, "driver")
    # Never copied: the driver's own venv, the plugin's venv mark, uv's settings.
    monkeypatch.setenv("VIRTUAL_ENV", "/driver/.venv")
    monkeypatch.setenv("RAY_UV_PLUGIN_VENV", "/driver/venv-mark")
    monkeypatch.setenv("UV_WG_DRIVER_SETTING", "driver")
    group = RayWorkerGroup(
        head_cluster,
        RayWorkerBuilder(DECORATED),
        env_vars={**WORKER_ENV, "WG_LAYER_1": "group", "WG_LAYER_2": "group"},
    )
    try:
        env = ray.get(group.run_single_worker_single_data("env", 0))
        others = ray.get(
            group.workers[0].__ray_call__.remote(
                fn=lambda _, names: {n: os.environ.get(n) for n in names},
                names=["VIRTUAL_ENV", "RAY_UV_PLUGIN_VENV", "UV_WG_DRIVER_SETTING"],
            )
        )
    finally:
        group.shutdown()
    # A builder used without a group copies nothing from the driver (NeMo RL's does not either).
    pg = head_cluster.get_placement_groups()[0]
    worker = RayWorkerBuilder(DECORATED)(pg, 0, 0, runtime_env={"env_vars": WORKER_ENV})
    try:
        alone = ray.get(worker.env.remote())
    finally:
        ray.kill(worker)
        ray.kill(worker._RAY_INITIALIZER_ACTOR_REF_TO_AVOID_GC)
    assert alone["WG_LAYER_3"] == "decorator" and "WG_DRIVER_ONLY" not in alone
    assert env["WG_LAYER_1"] == "configure_worker"  # configure_worker > group (> driver)
    assert env["WG_LAYER_2"] == "group"  # group > driver (> decorator)
    assert env["WG_LAYER_3"] == "driver"  # driver > decorator
    assert env["WG_DRIVER_ONLY"] == "driver"  # set in the driver only, after Ray started
    assert others["VIRTUAL_ENV"] != "/driver/.venv"
    assert others["RAY_UV_PLUGIN_VENV"] is None
    assert others["UV_WG_DRIVER_SETTING"] is None
