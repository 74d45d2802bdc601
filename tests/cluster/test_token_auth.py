"""Token authentication, as Ray 2.61 runs every cluster: a real two-node `ray start` cluster in
token mode, its token in the environment of every node and shell (KubeRay's way).

- With the token, everything works: `ray-uv prepare` ships, `ray job submit` runs a job whose
  actors are in uv_project venvs, and a `uv run` driver runs a worker group over both nodes.
- The token shows nowhere: in no actor's runtime_env (`list_actors(detail=True)`), and in no
  file of the cluster's session dirs or venv dirs, although the driver's environment holds it.
- A shell without it (no token mode, no token, the wrong one) is told, within seconds and in one
  message, what the cluster wants and what to set; never that no cluster runs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ray_uv_plugin.cluster import auth as cluster_auth
from ray_uv_plugin.env.uv import find_uv
from tests.agent.test_jobs import RAY, RAY_UV, REPO, free_ports, stop_own_cluster
from tests.support.uvproject import write_project
from tests.worker_groups.conftest import WORKER_ENV

pytestmark = pytest.mark.timeout(900)

AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
OUR_HOOK = {
    "RAY_RUNTIME_ENV_HOOK": "ray_uv_plugin.driver_hook.hook",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}

MAIN = """\
import json, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init()

@ray.remote(num_cpus=0)
class Where:
    def where(self):
        import six
        return sys.executable, six.__version__, ray.get_runtime_context().get_node_id()

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
actors = [Where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
          for n in nodes]  # one on each node
print("WHERE", json.dumps(ray.get([a.where.remote() for a in actors])))
"""

# A `uv run` driver (the plugin's hook maps it to a job-default uv_project) that runs a worker
# group on both nodes; the group prepares the env itself (built on one node, shipped).
GROUP_DRIVER = textwrap.dedent(
    """
    import json, sys
    import ray
    from worker_groups import (
        ACTOR_ENVIRONMENT_REGISTRY, PY_EXECUTABLES, RayVirtualCluster, RayWorkerBuilder,
        RayWorkerGroup,
    )

    ray.init(runtime_env={"config": {"eager_install": False}})
    out = {"job_uv_project": ray.get_runtime_context().runtime_env.get("uv_project")}
    ACTOR_ENVIRONMENT_REGISTRY["wg_workers.EchoWorker"] = PY_EXECUTABLES.SYSTEM
    cluster = RayVirtualCluster([1, 1], use_gpus=False)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("wg_workers.EchoWorker"),
                           env_vars=json.loads(sys.argv[1]))
    out["workers"] = ray.get([w.info.remote() for w in group.workers])
    group.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out))
    """
)

LIST_ACTORS = """\
import json, sys
from ray.util.state import list_actors
actors = list_actors(address=sys.argv[1], detail=True, limit=10000, raise_on_missing_output=False)
envs = [[a.class_name, json.loads(a.serialized_runtime_env or "{}")] for a in actors]
print("ACTORS " + json.dumps(envs))
"""


# --- pure: what a refused shell is told ----------------------------------------------------------


def test_the_message_names_the_cause_and_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    address = "10.0.0.1:6379"
    monkeypatch.setattr(cluster_auth, "in_token_mode", lambda: False)
    plain = cluster_auth.refused_message(address, {})
    assert plain.startswith(f"the Ray cluster at {address} answered, and it requires token")
    assert "this shell has no RAY_AUTH_MODE: set RAY_AUTH_MODE=token, and set RAY_AUTH_TOKEN" in (
        plain
    )
    off = cluster_auth.refused_message(address, {"RAY_AUTH_MODE": "disabled"})
    assert "this shell has RAY_AUTH_MODE=disabled: set RAY_AUTH_MODE=token" in off
    half = cluster_auth.refused_message(address, {"RAY_AUTH_TOKEN": "t"})
    assert "(Ray sends the token of RAY_AUTH_TOKEN only in token mode)" in half
    monkeypatch.setattr(cluster_auth, "in_token_mode", lambda: True)
    wrong = cluster_auth.refused_message(address, {"RAY_AUTH_TOKEN_PATH": "/etc/t"})
    assert wrong.startswith(
        f"the Ray cluster at {address} refused this shell's token (from /etc/t "
        "(RAY_AUTH_TOKEN_PATH)): it is not the cluster's. Set RAY_AUTH_TOKEN"
    )
    for message in (plain, off, half, wrong):
        assert "`ray get-auth-token` on the head" in message and "Secret" in message
    # Ray's order: the variable, then the file it names, then the default file.
    env = {"RAY_AUTH_TOKEN": "t", "RAY_AUTH_TOKEN_PATH": "/p"}
    assert cluster_auth.token_source(env) == "RAY_AUTH_TOKEN"
    assert cluster_auth.token_source({}) == "~/.ray/auth_token"


def test_a_refused_token_is_found_under_rays_wrapping() -> None:
    """`ray.init`'s retries end in a ConnectionError over a RuntimeError whose text holds the
    last attempt's traceback: the AuthenticationError is only named there."""
    inner = RuntimeError(
        "Failed to connect to GCS. Last connection error: Traceback ...\n"
        "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token "
        "is missing or incorrect"
    )
    try:
        try:
            raise inner
        except RuntimeError as e:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from e
    except ConnectionError as outer:
        assert cluster_auth.is_refused_token(outer)
    assert not cluster_auth.is_refused_token(ConnectionError("Could not find any running Ray"))


@pytest.mark.parametrize("refused", [True, False], ids=["token refused", "no GCS there"])
def test_connect_never_says_no_cluster_runs_where_one_answered(
    monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """Where the port answered and `ray.init` still fails to connect, the message is about what
    answered (a refused token, or no GCS on that port), never "start a cluster"."""
    import socket

    import ray

    from ray_uv_plugin.cluster import connect

    def init(**kwargs: object) -> None:
        last = "... InvalidAuthToken" if refused else "Deadline Exceeded"
        cause = RuntimeError(f"Failed to connect to GCS. Last connection error: {last}")
        raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1") from cause

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(connect, "check_token_auth", lambda address: None)  # Ray's own says it
    monkeypatch.setattr(cluster_auth, "in_token_mode", lambda: False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(connect.ConnectError) as e:
            connect.connect(address, {"working_dir": "/p"})
    message = str(e.value)
    assert "start one" not in message and "no Ray cluster" not in message
    if refused:
        assert message.startswith(f"the Ray cluster at {address} answered, and it requires token")
    else:
        assert message.startswith(f"a process answers at {address}, but Ray could not connect")
        assert "RuntimeError: Failed to connect to GCS" in message and "8265" in message


# --- a real token cluster ------------------------------------------------------------------------


@dataclass
class TokenCluster:
    gcs: str
    dashboard: str
    token: str
    temp_dir: Path
    venvs: tuple[Path, Path]  # each node's venv dir
    env: dict[str, str]  # a shell of this cluster: token mode, the token, no RAY_ADDRESS

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return subprocess.run(
            list(args), env=env or self.env, capture_output=True, text=True, timeout=timeout,
            cwd=cwd,
        )  # fmt: skip

    def nodes_alive(self) -> int:
        code = "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        code += "print(sum(n['Alive'] for n in ray.nodes()))"
        out = self.run(sys.executable, "-c", code, self.gcs, timeout=120)
        return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else 0


def start_node(env: dict[str, str], args: list[str], log: Path) -> subprocess.Popen:
    """`ray start --block ...` after the set-up the docs give (the CLI's export lines)."""
    setup = f'eval "$({RAY_UV} plugin-config --shell)"'
    script = f"{setup} && exec {RAY} start --block {' '.join(args)}"
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def node_ports(ports: list[int]) -> list[str]:
    nm, om, listen, grpc, rtenv, metrics, *workers = ports
    return [
        f"--node-manager-port={nm}", f"--object-manager-port={om}",
        f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
        f"--runtime-env-agent-port={rtenv}", f"--metrics-export-port={metrics}",
        "--worker-port-list=" + ",".join(map(str, workers)), "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenCluster]:
    """A head and a second node, each with its own venv dir, both `ray start`ed with
    RAY_AUTH_MODE=token and the cluster's own token in RAY_AUTH_TOKEN."""
    token = secrets.token_hex(32)
    ports = free_ports(2 * 36 + 3)
    gcs, dash, client = ports[:3]
    temp_dir = Path(tempfile.mkdtemp(prefix="ruvt-", dir="/tmp"))  # short: socket paths
    base = tmp_path_factory.mktemp("token-cluster")
    venvs = (base / "venvs-head", base / "venvs-second")
    shell = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_RUNTIME_ENV_PLUGIN", "RAY_AUTH_")) and k != "RAY_ADDRESS"
    }
    shell.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    procs: list[subprocess.Popen] = []
    try:
        head = [
            "--head", f"--port={gcs}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
            f"--ray-client-server-port={client}", "--include-dashboard=true",
            f"--temp-dir={temp_dir}", *node_ports(ports[3:39]),
        ]  # fmt: skip
        env = {**shell, "RAY_UV_PLUGIN_VENV_DIR": str(venvs[0])}
        procs.append(start_node(env, head, base / "ray-start-head.log"))
        cluster = TokenCluster(
            f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", token, temp_dir, venvs, shell
        )
        deadline = time.time() + 180
        version = urllib.request.Request(
            f"{cluster.dashboard}/api/version", headers={"Authorization": f"Bearer {token}"}
        )
        while True:  # the dashboard answers once the head is up (with the token only)
            try:
                urllib.request.urlopen(version, timeout=2).read()
                break
            except OSError:
                if procs[0].poll() is not None or time.time() > deadline:
                    raise RuntimeError((base / "ray-start-head.log").read_text()) from None
                time.sleep(0.5)
        second = [f"--address={cluster.gcs}", *node_ports(ports[39:75])]
        env = {**shell, "RAY_UV_PLUGIN_VENV_DIR": str(venvs[1])}
        procs.append(start_node(env, second, base / "ray-start-second.log"))
        while cluster.nodes_alive() < 2:
            if procs[1].poll() is not None or time.time() > deadline:
                raise RuntimeError((base / "ray-start-second.log").read_text())
            time.sleep(1)
        yield cluster
    finally:
        for proc in reversed(procs):
            stop_own_cluster(proc, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(
        tmp_path_factory.mktemp("tokenproj") / "p",
        extras={"six": ["six"]},
        files={"main.py": MAIN, "group_driver.py": GROUP_DRIVER},
    )


@dataclass
class Runs:
    prepare: subprocess.CompletedProcess[str]
    job: subprocess.CompletedProcess[str]
    group: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def runs(token_cluster: TokenCluster, project: Path) -> Runs:
    """What the plugin's users run against the cluster, each from a shell with the token: a
    prepare that ships, a `ray job submit` of a uv_project job, a `uv run` driver with a worker
    group (whose driver environment holds the token, as a job's on KubeRay's head does)."""
    c = token_cluster
    prepare = c.run(RAY_UV, "prepare", "--address", c.gcs, "--project", str(project), "--extra",
                    "six", "--json")  # fmt: skip
    job_env = json.dumps({"working_dir": str(project), "uv_project": {"extras": ["six"]}})
    job = c.run(RAY, "job", "submit", "--address", c.dashboard, "--runtime-env-json", job_env,
                "--", "python", "main.py")  # fmt: skip
    driver_env = {**c.env, **OUR_HOOK, "RAY_ADDRESS": c.gcs}
    driver_env["UV_PROJECT_ENVIRONMENT"] = str(REPO / ".venv")  # the checkout's: no sync
    driver_env.pop("VIRTUAL_ENV", None)
    group = c.run(
        find_uv(), "run", "--no-sync", "--extra", "six", "python", "group_driver.py",
        json.dumps(WORKER_ENV), env=driver_env, cwd=project, timeout=600,
    )  # fmt: skip
    return Runs(prepare, job, group)


def test_prepare_ships_to_the_second_node_with_the_token(runs: Runs) -> None:
    assert runs.prepare.returncode == 0, runs.prepare.stdout + runs.prepare.stderr
    assert "Prepared 2 nodes (1 built, 1 shipped, 0 reused)" in runs.prepare.stderr


def test_a_submitted_jobs_actors_run_in_the_venv_on_both_nodes(
    runs: Runs, token_cluster: TokenCluster
) -> None:
    text = runs.job.stdout + runs.job.stderr
    assert runs.job.returncode == 0, text
    (line,) = [x for x in text.splitlines() if x.startswith("WHERE ")]
    where = json.loads(line[len("WHERE ") :])
    assert {Path(python).parents[2] for python, _, _ in where} == set(token_cluster.venvs)
    assert all(version.startswith("1.") for _, version, _ in where)


def test_a_uv_run_drivers_worker_group_runs_on_both_nodes(
    runs: Runs, token_cluster: TokenCluster
) -> None:
    assert runs.group.returncode == 0, runs.group.stdout[-3000:] + runs.group.stderr[-3000:]
    line = next(x for x in runs.group.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["job_uv_project"]["extras"] == ["six"] and out["job_uv_project"]["job_default"]
    venv_dirs = {Path(w["executable"]).parents[2] for w in out["workers"]}
    assert venv_dirs == set(token_cluster.venvs)  # a venv on each node, each node's own
    assert len({w["node_id"] for w in out["workers"]}) == 2


def test_the_token_shows_in_no_runtime_env_and_no_file(
    runs: Runs, token_cluster: TokenCluster
) -> None:
    """Not in what `ray list actors --detail` shows (the worker group's workers and
    initializers, the job's actors, prepare's), nor in any log or file of the session dirs, the
    venv dirs or what the commands printed."""
    c = token_cluster
    assert runs.group.returncode == 0 and runs.job.returncode == 0  # there was something to see
    listed = c.run(sys.executable, "-c", LIST_ACTORS, c.dashboard, timeout=120)
    assert listed.returncode == 0, listed.stderr
    (line,) = [x for x in listed.stdout.splitlines() if x.startswith("ACTORS ")]
    actors = json.loads(line[len("ACTORS ") :])
    classes = {name for name, _ in actors}
    assert {"EchoWorker", "Where"} <= {name.rsplit(".", 1)[-1] for name in classes}, classes
    workers = [env.get("env_vars", {}) for name, env in actors if name.endswith("EchoWorker")]
    assert workers and all("HOME" in v and "RANK" in v for v in workers)  # the driver's copy
    assert not [k for v in workers for k in v if k.startswith("RAY_AUTH")]
    assert c.token not in line
    token = c.token.encode()
    seen = []
    for root in (c.temp_dir, *c.venvs):
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                seen.append(path)
                assert token not in path.read_bytes(), path
    assert any(p.name == "runtime_env_agent.log" for p in seen)
    assert any(p.name.startswith("runtime_env_setup") for p in seen)
    for out in (runs.prepare, runs.job, runs.group):
        assert c.token not in out.stdout + out.stderr


# --- shells without the token --------------------------------------------------------------------

SHELLS = {
    "no auth settings": ({}, "this shell has no RAY_AUTH_MODE: set RAY_AUTH_MODE=token"),
    "auth disabled": ({"RAY_AUTH_MODE": "disabled"}, "this shell has RAY_AUTH_MODE=disabled"),
    "the token, not the mode": (
        {"RAY_AUTH_TOKEN": "TOKEN"},
        "(Ray sends the token of RAY_AUTH_TOKEN only in token mode)",
    ),
    "a wrong token": (
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        "refused this shell's token (from RAY_AUTH_TOKEN): it is not the cluster's",
    ),
    "token mode, no token": (
        {"RAY_AUTH_MODE": "token", "HOME": "EMPTY"},  # no ~/.ray/auth_token either
        "RAY_AUTH_MODE=token is set in this shell, but it holds no token",
    ),
}


@pytest.mark.parametrize(
    ("shell", "watch"),
    [*((shell, False) for shell in SHELLS), ("no auth settings", True)],  # --watch connects alike
    ids=[*SHELLS, "no auth settings, --watch"],
)
def test_a_shell_without_the_token_is_told_what_to_set(
    token_cluster: TokenCluster, project: Path, tmp_path: Path, shell: str, watch: bool
) -> None:
    settings, cause = SHELLS[shell]
    env = {k: v for k, v in token_cluster.env.items() if k not in AUTH_VARS}
    for name, value in settings.items():
        env[name] = {"TOKEN": token_cluster.token, "EMPTY": str(tmp_path)}.get(value, value)
    args = [RAY_UV, "prepare", "--address", token_cluster.gcs, "--project", str(project)]
    start = time.monotonic()
    out = token_cluster.run(*args, *(["--watch"] if watch else []), env=env, timeout=120)
    seconds = time.monotonic() - start
    assert out.returncode == 1, out.stdout + out.stderr
    assert seconds < 30
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr  # no Ray warnings
    assert cause in lines[0]
    assert "RAY_AUTH_TOKEN" in lines[0] and "ray get-auth-token" in lines[0]
    assert "no Ray cluster" not in lines[0] and "start one" not in lines[0]
    assert token_cluster.token not in out.stdout + out.stderr


@pytest.mark.parametrize("shell", ["no auth settings", "a wrong token"])
@pytest.mark.parametrize("setup", ["setup_driver()", "plugin-config --shell"])
def test_a_driver_without_the_token_is_told_at_ray_init(
    token_cluster: TokenCluster, shell: str, setup: str
) -> None:
    """A local `ray.init()` (the demo's too) writes ~/.ray/auth_token, so a later plain `ray
    start` requires it: a driver that connected by address without token mode failed after 20 s
    with Ray's bare ConnectionError. Where the package runs on the driver (the hook that
    `setup_driver()` and `plugin-config --shell` set), ray.init says at once what to set."""
    settings, cause = SHELLS[shell]
    env = {k: v for k, v in token_cluster.env.items() if k not in AUTH_VARS}
    env.update({k: "0" * 64 if v == "TOKEN" else v for k, v in settings.items()})
    code = "import ray, ray_uv_plugin, sys\n"
    if setup == "setup_driver()":
        code += "ray_uv_plugin.setup_driver()\n"
    else:
        env.update(OUR_HOOK)  # what `ray-uv plugin-config --shell` exports for the driver hook
    code += "ray.init(address=sys.argv[1])\n"
    start = time.monotonic()
    out = token_cluster.run(sys.executable, "-c", code, token_cluster.gcs, env=env, timeout=120)
    seconds = time.monotonic() - start
    assert out.returncode == 1, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "TokenAuthError: the Ray cluster at " + token_cluster.gcs in last, out.stderr
    assert cause in last and "ray get-auth-token" in last
    assert seconds < 15, out.stderr  # was 20 s of Ray's retries
