"""Real clients against a real multi-process cluster: `ray start --head` with the plugin set up
the way docs/operations.md says, in token mode, the Ray Jobs CLI, `ray-uv prepare`, and `ray-uv
gc` under load.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.raylets import free_ports
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.store.layout import MARKER
from ray_uv_plugin.store.units import format_bytes
from tests.store.test_gc import du_bytes
from tests.support.uvproject import write_project

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
DRIVER_HOOK_ENV = ("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "RAY_RUNTIME_ENV_HOOK")  # conftest sets one
RAY, RAY_UV = str(BIN / "ray"), str(BIN / "ray-uv")

MAIN = """\
import sys, six
print("PY", sys.executable)
print("SIX", six.__version__)
"""

BAD_ACTOR = """\
import ray
ray.init()

@ray.remote
class A:
    def ping(self):
        return 1

a = A.options(runtime_env={"uv_project": {"extrass": ["six"]}}).remote()
print(ray.get(a.ping.remote()))
"""

LOOP = """\
import os, sys, time
import ray
ray.init()

@ray.remote
class Worker:
    def ping(self, i):
        import iniconfig  # only the `ini` extra's venv has it
        return i, sys.executable

stop, beat = sys.argv[1], sys.argv[2]
w = Worker.options(runtime_env={"uv_project": {"extras": ["ini"]}}).remote()
i = 0
while not os.path.exists(stop):
    i, exe = ray.get(w.ping.remote(i + 1))
    with open(beat + ".tmp", "w") as f:
        f.write(f"{i} {exe}")
    os.replace(beat + ".tmp", beat)
    time.sleep(0.2)
print("LOOP DONE", i)
"""


UV_RUN_DRIVER = """\
import json, sys
import ray
ray.init()

@ray.remote(num_cpus=0)
class Plain:
    def where(self):
        from importlib.util import find_spec
        return sys.executable, bool(find_spec("six")), bool(find_spec("iniconfig"))

actors = [Plain.remote() for _ in range(3)]
print("ACTORS", json.dumps(ray.get([a.where.remote() for a in actors])))
print("JOB_UV_PROJECT", json.dumps(ray.get_runtime_context().runtime_env.get("uv_project")))
"""


@dataclass
class Cluster:
    gcs: str
    dashboard: str
    venvs: Path
    temp_dir: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def job(
        self, command: str, *args: str, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return self.run(RAY, "job", command, "--address", self.dashboard, *args, timeout=timeout)


def stop_own_cluster(proc: subprocess.Popen, temp_dir: Path) -> None:
    """Stop only our own cluster: its process group, then anything naming our temp dir."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if str(temp_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ports = free_ports(40)
    temp_dir = Path(tempfile.mkdtemp(prefix="ruvj-", dir="/tmp"))  # short: socket paths
    venvs = tmp_path_factory.mktemp("cluster-venvs")
    gcs, dash, client, listen, grpc, rtenv, metrics, nm, om = ports[:9]
    start = [
        RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        f"--port={gcs}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={listen}",
        f"--dashboard-agent-grpc-port={grpc}", f"--runtime-env-agent-port={rtenv}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={nm}",
        f"--object-manager-port={om}", "--worker-port-list=" + ",".join(map(str, ports[9:])),
        f"--temp-dir={temp_dir}", "--num-cpus=2", "--include-dashboard=true",
    ]  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_RUNTIME_ENV_PLUGIN", "RAY_AUTH_")) and k != "RAY_ADDRESS"
    }
    # Token auth, as Ray 2.61 runs every cluster; the token in a file of the cluster's own, the
    # way a machine's shells hold it. Every shell below (`ray job`, `ray-uv`, drivers) has both.
    token_file = temp_dir / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    env.update(RAY_UV_PLUGIN_VENV_DIR=str(venvs))
    # Exactly the set-up that the docs give: eval the CLI's export lines, then `ray start`.
    script = f'eval "$({RAY_UV} plugin-config --shell)" && exec {" ".join(start)}'
    log = open(temp_dir / "ray-start.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        ["bash", "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    dashboard = f"http://127.0.0.1:{dash}"
    version = urllib.request.Request(
        f"{dashboard}/api/version", headers={"Authorization": f"Bearer {token_file.read_text()}"}
    )
    try:
        deadline = time.time() + 120
        while True:  # the dashboard answers once the head is up (with the token only)
            try:
                urllib.request.urlopen(version, timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(
                        "ray start failed:\n" + (temp_dir / "ray-start.log").read_text()
                    ) from None
                time.sleep(0.5)
        yield Cluster(f"127.0.0.1:{gcs}", dashboard, venvs, temp_dir, env)
    finally:
        stop_own_cluster(proc, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(
        tmp_path_factory.mktemp("jobproj") / "p",
        extras={"six": ["six"], "ini": ["iniconfig"]},
        groups={"lint": ["tomli-w"]},
        files={
            "main.py": MAIN,
            "bad_actor.py": BAD_ACTOR,
            "loop.py": LOOP,
            "uv_driver.py": UV_RUN_DRIVER,
        },
    )


def runtime_env(project: Path, **uv_project: object) -> str:
    return json.dumps({"working_dir": str(project), "uv_project": uv_project})


def test_job_submit_runs_the_entrypoint_in_the_uv_env(cluster: Cluster, project: Path) -> None:
    out = cluster.job(
        "submit", "--runtime-env-json", runtime_env(project, extras=["six"]), "--",
        "python", "main.py",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    (python,) = [line.split()[1] for line in text.splitlines() if line.startswith("PY ")]
    assert Path(python).parent.parent.parent == cluster.venvs  # <venvs>/<key>/bin/python
    assert "SIX 1." in text
    assert "succeeded" in text


def test_job_with_a_bad_spec_fails_with_the_clear_message(cluster: Cluster, project: Path) -> None:
    """The job's own runtime_env is bad: Ray never starts its driver. The message is in
    `ray job submit`'s and `ray job status`'s output, and in the job's driver log on the head;
    Ray 2.60's `ray job logs` serves that log only from a started driver's node."""
    sid = f"bad-extra-{os.getpid()}"
    out = cluster.job(
        "submit", "--submission-id", sid, "--runtime-env-json",
        runtime_env(project, extras=["nope"]), "--", "python", "main.py",
    )  # fmt: skip
    message = "uv_project: unknown extra(s) nope for"
    assert out.returncode != 0
    assert message in out.stdout + out.stderr
    assert "ini, six" in out.stdout + out.stderr  # the extras it does have
    status = cluster.job("status", sid)
    assert "failed" in (status.stdout + status.stderr).lower()
    assert message in status.stdout + status.stderr
    driver_log = cluster.temp_dir / "session_latest" / "logs" / f"job-driver-{sid}.log"
    assert message in driver_log.read_text()


def test_actor_with_a_bad_spec_fails_the_job_with_the_message_in_job_logs(
    cluster: Cluster, project: Path
) -> None:
    sid = f"bad-actor-{os.getpid()}"
    out = cluster.job(
        "submit", "--submission-id", sid, "--working-dir", str(project), "--",
        sys.executable, "bad_actor.py",
    )  # fmt: skip
    assert out.returncode != 0
    logs = cluster.job("logs", sid)
    assert logs.returncode == 0
    assert "RuntimeEnvSetupError" in logs.stdout
    said = "uv_project has unknown field(s) 'extrass' (did you mean 'extras'?); the fields are "
    assert said in logs.stdout


def test_prepare_builds_on_every_node_then_reuses(cluster: Cluster, project: Path) -> None:
    args = [RAY_UV, "prepare", "--address", cluster.gcs, "--project", str(project)]
    first = cluster.run(*args, "--group", "lint", "--extra", "ini", "--extra", "six")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "built in" in first.stderr
    assert "Prepared 1 node (1 built, 0 shipped, 0 reused)" in first.stderr
    second = cluster.run(*args, "--extra", "six", "--extra", "ini", "--group", "lint")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Prepared 1 node (0 built, 0 shipped, 1 reused)" in second.stderr
    (row,) = [line.split() for line in second.stdout.splitlines() if "reused" in line]
    key = row[-1]
    meta = json.loads((cluster.venvs / key / MARKER).read_text())
    assert meta["extras"] == ["ini", "six"]  # the very venv a job with these extras gets


def test_prepare_warms_the_key_of_a_job_that_selects_with_any_field(
    cluster: Cluster, project: Path
) -> None:
    """Every selection field is a `prepare` flag: here `no_extras`
    and `no_groups` beside `all_extras`; the venv it makes ready is the one `check` finds for
    the same flags, which is the key a job with that `uv_project` value gets."""
    flags = ["--all-extras", "--no-extra", "six", "--no-group", "lint"]
    args = [RAY_UV, "prepare", "--address", cluster.gcs, "--project", str(project), *flags]
    out = cluster.run(*args, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (node,) = json.loads(out.stdout)["nodes"]
    found = cluster.run(RAY_UV, "check", "--project", str(project), *flags, "--dry-run", "--json")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["key"] == node["key"]
    assert json.loads(found.stdout)["state"] == "ready"
    python = cluster.venvs / node["key"] / "bin" / "python"
    code = "import importlib.util as u; print([bool(u.find_spec(m)) for m in %r])"
    names = ("iniconfig", "six", "tomli_w")  # all extras but six; the lint group left out
    seen = subprocess.run([str(python), "-c", code % (names,)], capture_output=True, text=True)
    assert seen.stdout.strip() == "[True, False, False]", seen.stderr


def test_prepare_names_the_failed_nodes(cluster: Cluster, tmp_path: Path) -> None:
    missing = tmp_path / "not-on-the-nodes"
    out = cluster.run(
        RAY_UV, "prepare", "--address", cluster.gcs, "--project", str(missing), "--shared"
    )
    assert out.returncode == 1
    assert "failed" in out.stdout
    assert f"project directory {missing} does not exist on this node" in out.stderr
    assert "error: 1 of 1 node failed: " in out.stderr


def test_prepare_checks_the_request_before_touching_the_cluster(
    cluster: Cluster, project: Path
) -> None:
    out = cluster.run(
        RAY_UV, "prepare", "--address", cluster.gcs, "--project", str(project), "--extra", "nop"
    )
    assert out.returncode == 1  # a failure at run time, not a wrong command line
    assert "error: uv_project: unknown extra(s) nop" in out.stderr
    assert "Preparing" not in out.stderr


@pytest.mark.slow
def test_gc_under_load_keeps_a_live_workers_venv(
    cluster: Cluster, project: Path, tmp_path: Path
) -> None:
    stop, beat = tmp_path / "stop", tmp_path / "beat"
    sid = f"loop-{os.getpid()}"
    out = cluster.job(
        "submit", "--no-wait", "--submission-id", sid, "--working-dir", str(project), "--",
        sys.executable, "loop.py", str(stop), str(beat),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr

    def beats() -> tuple[int, str]:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                i, exe = beat.read_text().split()
                return int(i), exe
            except (FileNotFoundError, ValueError):
                time.sleep(0.2)
        raise AssertionError("the job's actor never answered: " + cluster.job("logs", sid).stdout)

    _, exe = beats()
    venv = Path(exe).parent.parent
    assert venv.parent == cluster.venvs
    old = time.time() - 30 * 86400
    os.utime(venv / MARKER, (old, old))  # idle for a month, as far as the marker says
    gc = cluster.run(RAY_UV, "gc", "--older-than", "0")
    assert gc.returncode == 0, gc.stderr
    (kept,) = [line for line in gc.stdout.splitlines() if line.startswith(f"Kept {venv.name}")]
    assert "in use by pid" in kept
    before, _ = beats()
    time.sleep(1.5)
    after, _ = beats()
    assert after > before  # the actor kept answering after gc ran
    stop.touch()
    logs = cluster.job("logs", "--follow", sid, timeout=120)
    assert "LOOP DONE" in logs.stdout

    # The job is over and its actor gone: now gc removes the venv, and du agrees on the bytes.
    deadline = time.time() + 60
    while True:
        os.utime(venv / MARKER, (old, old))
        du_before = du_bytes(cluster.venvs)
        gc = cluster.run(RAY_UV, "gc", "--older-than", "0")
        if not venv.exists():
            break
        assert time.time() < deadline, gc.stdout
        time.sleep(1)
    assert f"Removed {venv.name} (" in gc.stdout
    freed_line = [line for line in gc.stdout.splitlines() if line.startswith("Freed ")][0]
    listed = json.loads(cluster.run(RAY_UV, "list", "--json").stdout)
    assert venv.name not in [v["key"] for v in listed["venvs"]]
    dropped = du_before - du_bytes(cluster.venvs)
    assert dropped > 0
    assert freed_line.startswith(f"Freed {format_bytes(dropped)} in {cluster.venvs}")


def test_list_shows_the_cluster_venvs_with_du_sizes(cluster: Cluster, project: Path) -> None:
    args = ["--address", cluster.gcs, "--project", str(project), "--extra", "six"]
    assert cluster.run(RAY_UV, "prepare", *args).returncode == 0  # at least one venv
    listed = json.loads(cluster.run(RAY_UV, "list", "--json").stdout)
    assert listed["venv_dir"] == str(cluster.venvs)
    assert listed["venvs"]
    for v in listed["venvs"]:
        assert v["state"] == "ready"
        assert v["size_bytes"] == du_bytes(Path(v["path"]))
    table = cluster.run(RAY_UV, "list")
    assert table.returncode == 0
    for v in listed["venvs"]:
        assert v["key"] in table.stdout
    assert f"{len(listed['venvs'])} venvs" in table.stdout


def test_ray_job_cli_works_with_the_clusters_token(cluster: Cluster) -> None:
    """The `ray job` CLI of a shell with RAY_AUTH_MODE=token and the token's file: no warning,
    and the token is not printed."""
    out = cluster.job("list")
    assert out.returncode == 0, out.stderr
    token = Path(cluster.env["RAY_AUTH_TOKEN_PATH"]).read_text()
    assert token not in out.stdout + out.stderr
    assert "InvalidAuthToken" not in out.stderr and "Unauthenticated" not in out.stderr


@pytest.mark.parametrize(
    "shell",
    [
        "true",  # a shell without set-up: Ray's own `uv run` hook (its default since 2.47)
        f'eval "$({RAY_UV} plugin-config --shell)"',  # the set-up the docs give: our hook
    ],
    ids=["ray-hook", "plugin-config"],
)
def test_prepare_connects_from_under_uv_run_in_another_project(
    cluster: Cluster, project: Path, shell: str
) -> None:
    """`uv run ray-uv prepare --project P` from another uv project (this checkout): no driver
    hook rewrites the CLI's own job, so Ray neither refuses P as a working_dir without the
    checkout's pyproject.toml nor gives the probes the checkout's `uv run`."""
    command = [find_uv(), "run", "--no-sync", "ray-uv", "prepare", "--address", cluster.gcs]
    command += ["--project", str(project), "--extra", "six", "--json"]
    out = subprocess.run(
        ["bash", "-c", f'{shell} && exec "$@"', "-", *command],
        cwd=REPO,
        env={k: v for k, v in cluster.env.items() if k not in DRIVER_HOOK_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Prepared 1 node" in out.stderr
    (node,) = json.loads(out.stdout)["nodes"]
    meta = json.loads((cluster.venvs / node["key"] / MARKER).read_text())
    assert meta["extras"] == ["six"] and meta["name"] == "testproj"  # P's env, not the checkout's


def test_a_uv_run_job_runs_its_plain_actors_in_the_cached_venv(
    cluster: Cluster, project: Path
) -> None:
    """`ray job submit -- uv run --extra six python ...` on a head set up with `plugin-config
    --shell`: the job's plain actors run in the node's cached venv of the project with exactly
    that extra (not `uv run` each), as a job-default uv_project: the very venv that `ray-uv
    prepare --extra six` makes ready."""
    args = ["--address", cluster.gcs, "--project", str(project), "--extra", "six", "--json"]
    prepared = cluster.run(RAY_UV, "prepare", *args)
    assert prepared.returncode == 0, prepared.stderr
    (node,) = json.loads(prepared.stdout)["nodes"]
    out = cluster.job(
        "submit", "--working-dir", str(project), "--",
        find_uv(), "run", "--extra", "six", "python", "uv_driver.py",
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    (actors,) = [
        json.loads(x.split(" ", 1)[1]) for x in text.splitlines() if x.startswith("ACTORS")
    ]
    (value,) = [x.split(" ", 1)[1] for x in text.splitlines() if x.startswith("JOB_UV_PROJECT")]
    assert json.loads(value) == {"extras": ["six"], "locked": True, "job_default": True}
    assert len({python for python, _, _ in actors}) == 1, actors  # one venv for all of them
    python, has_six, has_iniconfig = actors[0]
    venv = Path(python).parents[1]
    assert venv == cluster.venvs / node["key"] and (has_six, has_iniconfig) == (True, False)
    assert json.loads((venv / MARKER).read_text())["extras"] == ["six"]
