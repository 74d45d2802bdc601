"""Ray's libraries (Data, Serve, Tune, Train) run in `uv_project` envs whose lock pins the
library's Ray extra; `ray_uv_plugin.agent.ray_libraries` says what an env's Ray lacks.

One local Ray (the node: this repo's venv, with the plugin, and without Ray's library extras,
as a slim head node) serves every test. Each library's driver is a script run by the job's own
env, as `ray job submit` would run it: the venv built here with `ensure_venv` (the very venv the
plugin then reuses for the job's workers, same key), connected to that Ray by address, with a
job-level `uv_project` (the library's controllers, proxies and tasks import the library too) and
the library's own per-call runtime_env on the UDF actor, replica or Train worker, in a second env
(extra `probe`, adding a small package) so that each test proves the per-call env took effect.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from packaging.version import Version

from ray_uv_plugin.agent import ray_libraries
from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from tests.support.uvproject import write_project

# Ray's libraries (several extras, a Serve app, a Client server): a group of its own that
# .ci/run runs after the default suite, which stays under 15 minutes.
pytestmark = pytest.mark.libraries

RAY_VERSION = ray.__version__
LIBS = ("data", "serve", "tune", "train")
PROBE_PACKAGE = "six"  # small, pure Python: proves the per-call env is the second venv
DRIVER_TIMEOUT = 420


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uv project, one lock: plain `ray` by default, an extra per library pinning
    `ray[<lib>]==<node's Ray>`, and `probe` adding one small package."""
    path = tmp_path_factory.mktemp("libs") / "proj"
    extras = {lib: [f"ray[{lib}]=={RAY_VERSION}"] for lib in LIBS}
    if Version(RAY_VERSION) < Version("2.60"):
        # Ray 2.44's Data uses pandas API that pandas 3 removed, and its Serve protobuf API
        # that protobuf 7 removed: such a lock pins them too.
        extras["data"].append("pandas<3")
        extras["serve"].append("protobuf<6")
    extras["probe"] = [PROBE_PACKAGE]
    return write_project(path, [f"ray=={RAY_VERSION}"], extras=extras, with_ray=False)


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray whose raylet loads the plugin (conftest registered it); stopped at the end."""
    ctx = ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="test_libraries")
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


def venv_python(project: Path, extras: list[str]) -> Path:
    """The job's env, built here as the plugin builds it (same key: the workers reuse it)."""
    spec = parse_spec({"project": str(project), "extras": extras})
    return ensure_venv(spec, load_project(project)).python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELUDE = """\
import json, os, sys
import ray

ADDRESS, PROJECT, LIB = sys.argv[1], sys.argv[2], sys.argv[3]
# Train gives a worker group 60 s to start: slow on a loaded 2-core machine.
# Train v2 (worker_runtime_env) is opt-in before Ray 2.51.
ENV_VARS = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600", "RAY_TRAIN_V2_ENABLED": "1"}
os.environ.update(ENV_VARS)
JOB_ENV = {"uv_project": {"project": PROJECT, "extras": [LIB]}, "env_vars": ENV_VARS}
PROBE_ENV = {"uv_project": {"project": PROJECT, "extras": [LIB, "probe"]}}

def where():
    import six  # only in the probe env
    return {"python": sys.executable, "venv": os.environ.get("RAY_UV_PLUGIN_VENV"),
            "six": six.__version__}

def result(value):
    print("RESULT " + json.dumps(value), flush=True)

ray.init(address=ADDRESS, runtime_env=JOB_ENV, namespace="test_libraries_" + LIB)
"""


def start_driver(
    tmp_path: Path, project: Path, lib: str, address: str, body: str, *args: str
) -> tuple[subprocess.Popen[str], Path]:
    python = venv_python(project, [lib])
    venv_python(project, [lib, "probe"])  # built here: the library's start timeouts see a stat
    script = tmp_path / f"driver_{lib}.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.Popen(
        [str(python), str(script), address, str(project), lib, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    return proc, python


def run_driver(tmp_path: Path, project: Path, lib: str, address: str, body: str) -> dict:
    proc, python = start_driver(tmp_path, project, lib, address, body)
    try:
        out, _ = proc.communicate(timeout=DRIVER_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"the {lib} driver failed:\n{out[-6000:]}"
    value = read_result(out)
    assert value["driver"] == str(python), value
    return value


def read_result(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result from the driver:\n{out[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def assert_probe_env(seen: dict, project: Path, lib: str) -> None:
    """The worker ran in the per-call env (extras [lib, probe]), not the job's or the node's."""
    probe = venv_python(project, [lib, "probe"])
    assert seen["python"] == str(probe), seen
    assert seen["venv"] == str(probe.parent.parent), seen
    assert seen["six"], seen


def test_ray_data_actor_pool_in_uv_project(project: Path, ray_address: str, tmp_path: Path) -> None:
    """`map_batches(..., runtime_env=...)` with an actor pool: the UDF actor runs in its env."""
    body = """
        import ray.data

        class Probe:
            def __init__(self):
                import pandas
                self.info = {**where(), "pandas": pandas.__version__}

            def __call__(self, batch):
                batch["doubled"] = batch["id"] * 2
                batch["info"] = [json.dumps(self.info)] * len(batch["id"])
                return batch

        ds = ray.data.range(8).map_batches(
            Probe,
            compute=ray.data.ActorPoolStrategy(size=1),
            runtime_env=PROBE_ENV,
            batch_format="pandas",
            num_cpus=0.5,
        )
        rows = ds.take_all()
        infos = {r["info"] for r in rows}
        result({
            "driver": sys.executable,
            "doubled": sorted(int(r["doubled"]) for r in rows),
            "infos": [json.loads(i) for i in infos],
        })
    """
    value = run_driver(tmp_path, project, "data", ray_address, body)
    assert value["doubled"] == [2 * i for i in range(8)]
    assert len(value["infos"]) == 1, value["infos"]  # one actor in the pool
    assert_probe_env(value["infos"][0], project, "data")
    assert value["infos"][0]["pandas"]


def test_ray_serve_replica_in_uv_project_over_http(
    project: Path, ray_address: str, tmp_path: Path
) -> None:
    """A Serve replica with `ray_actor_options={"runtime_env": ...}` answers a real HTTP
    request on 127.0.0.1; the driver shuts Serve down when the test is done with it."""
    port = free_port()
    body = """
        from ray import serve

        PORT = int(sys.argv[4])
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        try:
            @serve.deployment(ray_actor_options={"runtime_env": PROBE_ENV, "num_cpus": 0.1})
            class Where:
                def __init__(self):
                    import starlette
                    self.info = {**where(), "starlette": starlette.__version__}

                async def __call__(self, request):
                    return {**self.info, "path": request.url.path}

            serve.run(Where.bind(), name="where", route_prefix="/where")
            result({"driver": sys.executable, "port": PORT})
            sys.stdin.readline()  # the test's request happens now
        finally:
            serve.shutdown()
        print("SERVE SHUT DOWN", flush=True)
    """
    proc, python = start_driver(tmp_path, project, "serve", ray_address, body, str(port))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + DRIVER_TIMEOUT
        assert proc.stdout is not None
        while not any(line.startswith("RESULT ") for line in lines):
            line = proc.stdout.readline()
            if not line:
                proc.wait(timeout=60)
                pytest.fail("the serve driver exited:\n" + "".join(lines)[-6000:])
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)[-6000:]
        assert read_result("".join(lines))["driver"] == str(python)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/where", timeout=120) as r:
            assert r.status == 200
            seen = json.loads(r.read())
    finally:
        if proc.poll() is None:
            try:  # the driver's `serve.shutdown()`, then its exit
                rest, _ = proc.communicate(input="\n", timeout=180)
                lines.append(rest)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, "".join(lines)[-6000:]
    assert "SERVE SHUT DOWN" in "".join(lines)
    assert seen["path"] == "/where"
    assert seen["starlette"]
    assert_probe_env(seen, project, "serve")


def test_ray_tune_trainable_in_uv_project(project: Path, ray_address: str, tmp_path: Path) -> None:
    """Tune trainables (job-level env) run in the venv that has `ray[tune]`."""
    body = """
        from ray import tune

        report = getattr(tune, "report", None) or __import__("ray.train").train.report  # < 2.41
        RunConfig = getattr(tune, "RunConfig", None) or __import__("ray.train").train.RunConfig

        def trainable(config):
            import pandas
            report({"score": config["x"] * 2, "python": sys.executable,
                         "venv": os.environ.get("RAY_UV_PLUGIN_VENV"),
                         "pandas": pandas.__version__})

        tuner = tune.Tuner(
            tune.with_resources(trainable, {"cpu": 0.5}),
            param_space={"x": tune.grid_search([1, 2])},
            run_config=RunConfig(storage_path=os.path.abspath("tune"), name="t",
                                      verbose=0),
        )
        results = tuner.fit()
        assert not results.errors, results.errors
        result({"driver": sys.executable,
                "trials": [{k: r.metrics[k] for k in ("score", "python", "venv", "pandas")}
                           for r in results]})
    """
    value = run_driver(tmp_path, project, "tune", ray_address, body)
    job_python = venv_python(project, ["tune"])
    assert sorted(t["score"] for t in value["trials"]) == [2, 4]
    for trial in value["trials"]:
        assert trial["python"] == str(job_python), trial
        assert trial["venv"] == str(job_python.parent.parent), trial
        assert trial["pandas"]


def train_v2_worker_env() -> bool:
    """Train v2 with `RunConfig(worker_runtime_env=...)` in the node's Ray (read, not imported:
    the node's Ray here has no `ray[train]`)."""
    config = Path(ray.__file__).parent / "train" / "v2" / "api" / "config.py"
    return config.is_file() and "worker_runtime_env" in config.read_text()


needs_train_v2 = pytest.mark.skipif(
    not train_v2_worker_env(),
    reason=f"Ray {RAY_VERSION}'s Train has no RunConfig(worker_runtime_env=...) (Train v2)",
)


@needs_train_v2
def test_ray_train_worker_group_in_uv_project(
    project: Path, ray_address: str, tmp_path: Path
) -> None:
    """A Train worker group (`ScalingConfig(num_workers=1)`) runs in the env that
    `RunConfig(worker_runtime_env=...)` names; the controller in the job's."""
    body = """
        import ray.train
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        def loop(config):
            import fsspec
            info = {**where(), "fsspec": fsspec.__version__,
                    "rank": ray.train.get_context().get_world_rank()}
            with open(config["out"], "w") as f:  # Train V2 keeps metrics with checkpoints only
                json.dump(info, f)
            ray.train.report({"rank": info["rank"]})

        out = os.path.abspath("worker.json")
        trainer = DataParallelTrainer(
            loop,
            train_loop_config={"out": out},
            scaling_config=ray.train.ScalingConfig(num_workers=1,
                                                   resources_per_worker={"CPU": 0.5}),
            run_config=ray.train.RunConfig(storage_path=os.path.abspath("train"), name="t",
                                           worker_runtime_env=PROBE_ENV,
                                           failure_config=ray.train.FailureConfig(max_failures=0)),
        )
        res = trainer.fit()
        assert res.error is None, res.error
        with open(out) as f:
            result({"driver": sys.executable, "worker": json.load(f)})
    """
    value = run_driver(tmp_path, project, "train", ray_address, body)
    assert value["worker"]["rank"] == 0
    assert value["worker"]["fsspec"]
    assert_probe_env(value["worker"], project, "train")


# --- what an env's Ray lacks -----------------------------------------------------------------


def test_missing_libraries_of_plain_ray_and_of_extras(project: Path) -> None:
    """A plain `ray==X` env lacks every library's extra; `ray[serve]` has Serve's but not
    Data's. The node here (this repo's venv) has `ray[default]`: grpcio, so Client only."""
    plain = venv_python(project, []).parent.parent
    serve = venv_python(project, ["serve"]).parent.parent
    statuses = {s.library.name: s for s in ray_libraries.library_status(plain)}
    assert set(statuses) == {"data", "serve", "tune", "train", "client"}
    assert not any(s.ok for s in statuses.values())
    assert "pandas" in statuses["data"].missing
    assert statuses["serve"].missing[0] == "starlette"
    assert statuses["client"].missing == ("grpcio",)
    assert statuses["client"].node_has is True
    assert statuses["train"].as_missing().requirement == f"ray[train]=={RAY_VERSION}"
    # Only what the node has counts for the plugin's warning: here Ray Client alone.
    assert [m.library.name for m in ray_libraries.missing_libraries(plain)] == ["client"]
    by_name = {s.library.name: s for s in ray_libraries.library_status(serve)}
    assert by_name["serve"].ok and by_name["client"].ok
    assert not by_name["data"].ok


def test_check_libraries_warns_and_refuses_a_client_server(
    project: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The plugin's hook: a warning naming the extra to add; an error, at once, for a Ray
    Client server (the agent's logger `runtime_env_ray_client_server_<port>`) without
    `ray[client]`."""
    plain = venv_python(project, []).parent.parent
    logger = logging.getLogger("runtime_env_01000000")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        missing = ray_libraries.check_libraries("k1", plain, logger)
    assert [m.library.name for m in missing] == ["client"]
    assert f"ray[client]=={RAY_VERSION}" in caplog.text
    assert "ray-uv check --library client" in caplog.text
    server_logger = logging.getLogger("runtime_env_ray_client_server_23456")
    with pytest.raises(ray_libraries.MissingLibraryError) as e:
        ray_libraries.check_libraries("k1", plain, server_logger)
    assert f"ray[client]=={RAY_VERSION}" in str(e.value)
    assert "per task or actor" in str(e.value)
    serve = venv_python(project, ["serve"]).parent.parent  # ray[serve] brings grpcio
    assert ray_libraries.check_libraries("k2", serve, server_logger) == []


def test_library_status_of_a_dir_without_ray(tmp_path: Path) -> None:
    (tmp_path / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    with pytest.raises(ValueError, match="no Ray installed"):
        ray_libraries.library_status(tmp_path)
    assert ray_libraries.check_libraries("k", tmp_path) == []
    assert sys.executable  # the node's Ray is this interpreter's


@needs_train_v2
def test_train_worker_env_without_ray_train_stops_with_a_failure_limit(
    project: Path, ray_address: str, tmp_path: Path
) -> None:
    """A worker env whose Ray lacks `ray[train]`: the worker group cannot start. Train retries
    that as a controller failure, for ever by default (`controller_failure_limit=-1`); with a
    limit the run stops and says why. `ray-uv check --library train` catches it before."""
    body = """
        import ray.train
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        def loop(config):
            ray.train.report({"ok": 1})

        plain = {"uv_project": {"project": PROJECT}}  # plain ray: no pydantic, no ray[train]
        trainer = DataParallelTrainer(
            loop,
            scaling_config=ray.train.ScalingConfig(num_workers=1,
                                                   resources_per_worker={"CPU": 0.5}),
            run_config=ray.train.RunConfig(
                storage_path=os.path.abspath("train"), name="t", worker_runtime_env=plain,
                failure_config=ray.train.FailureConfig(max_failures=0,
                                                       controller_failure_limit=1)),
        )
        try:
            trainer.fit()
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        result({"driver": sys.executable, "error": error})
    """
    venv_python(project, [])
    value = run_driver(tmp_path, project, "train", ray_address, body)
    # "ControllerError: Training failed due to controller error: One of the worker actors
    # failed to initialize ... ModuleNotFoundError: No module named 'fsspec'"
    assert value["error"] and value["error"].startswith("ControllerError"), value
    assert "No module named" in value["error"], value["error"]
    plain = venv_python(project, []).parent.parent
    train = {s.library.name: s for s in ray_libraries.library_status(plain)}["train"]
    assert "pydantic" in train.missing or "pandas" in train.missing
