"""Real drivers started with `uv run`, set up as the README says: every plain worker runs in the
node's cached venv of the driver's project and selection, one `uv sync` per env and node and no
`uv run` by any worker; a flag a lock cannot express leaves Ray's per-worker `uv run`, with one
warning line; an actor that chooses its own interpreter keeps it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import UV_ENV_VAR, VENV_DIR_ENV
from ray_uv_plugin.store.layout import MARKER
from tests.support.uvproject import CountingUv, write_project

ROOT = Path(__file__).resolve().parents[2]
RAY_UV = str(Path(sys.executable).parent / "ray-uv")

DRIVER = textwrap.dedent(
    """
    import importlib.util, json, os, sys
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On

    if sys.argv[1] == "local":
        import ray_uv_plugin  # the Python equivalent of the shell set-up, after Ray's import
        ray_uv_plugin.setup_driver()
        ray.init(address="local", num_cpus=2)
    else:
        ray.init(address=sys.argv[1])

    def seen():
        has = [m for m in ("six", "tabulate", "pyfiglet") if importlib.util.find_spec(m)]
        node = ray.get_runtime_context().get_node_id()
        return {"python": sys.executable, "has": has, "node": node}

    @ray.remote(num_cpus=0)
    def task():
        return seen()

    @ray.remote(num_cpus=0)
    class Plain:
        def seen(self):
            return seen()

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    actors = [Plain.options(scheduling_strategy=On(n, soft=False)).remote() for n in nodes]
    plain = ray.get([a.seen.remote() for a in actors]) + ray.get(
        [task.options(scheduling_strategy=On(n, soft=False)).remote() for n in nodes]
    )
    own = {}
    if sys.argv[2:] == ["own"]:  # actors that choose their own interpreter under the default
        own["node_python"] = ray.get(task.options(runtime_env={"py_executable": ""}).remote())
        explicit = {"py_executable": os.environ["NODE_PYTHON"]}
        chosen = Plain.options(runtime_env=explicit).remote()  # a handle kept: Ray 2.44
        own["explicit"] = ray.get(chosen.seen.remote())
    job_env = ray.get_runtime_context().runtime_env
    print("RESULT", json.dumps({"job_env": job_env, "plain": plain, **own}))
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The driver's project: an extra and a group to choose, a dev group to leave out."""
    return write_project(
        tmp_path / "proj",
        ["packaging"],
        extras={"x": ["six"]},
        groups={"dev": ["pyfiglet"], "g": ["tabulate"]},
        files={"driver.py": DRIVER},
    )


# The bin dir of the interpreter this suite runs on, put first on PATH for drivers and raylets.
SUITE_PYTHON_BIN = str(Path(sys._base_executable).parent)


class Counter:
    """The plugin's syncs (`RAY_UV_PLUGIN_UV`) and every `uv run`: the driver is started by
    `self.uv`, which keeps its own path as argv[0], so Ray's hook gives that path to workers."""

    def __init__(self, directory: Path) -> None:
        self.plugin_uv = CountingUv(directory)
        self.runs = directory / "uv-run.log"
        self.uv = directory / "bin" / "uv"
        self.uv.parent.mkdir()
        self.uv.write_text(
            f'#!/bin/bash\necho "$1" >> {self.runs}\nexec -a "$0" {find_uv()} "$@"\n'
        )
        self.uv.chmod(0o755)
        self.runs.touch()

    def syncs(self) -> int:
        return self.plugin_uv.syncs()

    def uv_runs(self) -> int:
        return self.runs.read_text().splitlines().count("run")


def run_driver(
    project: Path, counter: Counter, env: dict[str, str], *args: str, setup: str = "true"
) -> tuple[dict, str]:
    """`uv run <args>` in the project, from a shell after `setup`."""
    command = [str(counter.uv), "run", *args]
    env = {k: v for k, v in env.items() if k != "VIRTUAL_ENV"}  # this test's own, from uv run
    # The driver's venv on the interpreter Ray runs on here: uv would pick the first `python3` on
    # PATH, which need not be the one this suite runs on (Ray refuses a driver of another
    # version), and a pyenv shim of uv puts its own version's bin dir first. So the user's pin:
    # UV_PYTHON=<the suite's X.Y> (the hook accepts a request for the driver's own version),
    # found through PATH.
    env["PATH"] = SUITE_PYTHON_BIN + os.pathsep + env.get("PATH", "")
    env["UV_PYTHON"] = "{}.{}".format(*sys.version_info[:2])
    proc = subprocess.run(
        ["bash", "-c", f'{setup} && exec "$@"', "-", *command],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), proc.stderr


def assert_in_job_venv(seen: dict, tmp_path: Path) -> Path:
    """The worker ran in a cached venv holding exactly the extra x and the group g."""
    venv = Path(seen["python"]).parent.parent
    assert venv.parent.parent == tmp_path and (venv / MARKER).is_file(), seen
    assert seen["has"] == ["six", "tabulate"], seen  # the extra and the group, not dev's
    return venv


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Cluster, Counter]]:
    """Two raylets, each with a venv dir of its own; uv counted. The suite's interpreter first
    on the raylets' PATH, as a node's own Python is (workers' `uv run` looks there)."""
    counter = Counter(tmp_path / "uvbin")
    monkeypatch.setenv("PATH", SUITE_PYTHON_BIN + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv(UV_ENV_VAR, str(counter.plugin_uv.path))
    monkeypatch.setenv(VENV_DIR_ENV, str(tmp_path / "venvs-1"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        monkeypatch.setenv(VENV_DIR_ENV, str(tmp_path / "venvs-2"))
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster, counter
    finally:
        cluster.shutdown()


SETUP = f'eval "$({RAY_UV} plugin-config --shell)"'


def test_a_uv_run_driver_on_a_cluster_gets_the_cached_venv_on_every_node(
    project: Path, cluster: tuple[Cluster, Counter], tmp_path: Path
) -> None:
    """Its project's venv has Ray but not the plugin: the hook imports from PYTHONPATH."""
    ray_cluster, counter = cluster
    env = {**os.environ, "NODE_PYTHON": sys.executable}
    flags = ["--extra", "x", "--group", "g", "--no-dev", "python", "driver.py"]
    result, stderr = run_driver(
        project, counter, env, *flags, ray_cluster.address, "own", setup=SETUP
    )
    assert "ray-uv-plugin" not in stderr  # no warning
    assert result["job_env"]["uv_project"] == {
        "extras": ["x"],
        "groups": ["g"],
        "no_groups": ["dev"],
        "locked": True,
        "job_default": True,
    }
    assert "py_executable" not in result["job_env"]
    venvs = {assert_in_job_venv(seen, tmp_path) for seen in result["plain"]}
    assert {venv.parent.name for venv in venvs} == {"venvs-1", "venvs-2"}  # one per node
    assert len({seen["node"] for seen in result["plain"]}) == 2
    assert counter.syncs() == 2  # one per env and node
    assert counter.uv_runs() == 1  # the driver's own; none by a worker
    # An actor's own interpreter wins over the job's default, as without the plugin.
    assert result["node_python"]["python"] == sys.executable
    assert result["explicit"]["python"] == sys.executable


def test_a_flag_a_lock_cannot_express_keeps_rays_uv_run_with_one_warning(
    project: Path, cluster: tuple[Cluster, Counter]
) -> None:
    ray_cluster, counter = cluster
    flags = ["--with", "tabulate", "python", "driver.py", ray_cluster.address]
    result, stderr = run_driver(project, counter, dict(os.environ), *flags, setup=SETUP)
    warnings = [line for line in stderr.splitlines() if "ray-uv-plugin" in line]
    assert warnings == [
        "ray-uv-plugin: this job's workers keep Ray's own per-worker `uv run`, not the node's "
        "cached venv: `uv run --with tabulate` adds packages that uv.lock does not hold."
    ]
    assert "uv_project" not in result["job_env"]
    # Ray's hook names the uv it finds (Ray 2.44 the parent process's, 2.60 the command line's).
    assert " run --with tabulate" in result["job_env"]["py_executable"]
    for seen in result["plain"]:  # Ray's `uv run` env: the project's and --with's packages
        assert "tabulate" in seen["has"] and "venvs-" not in seen["python"], seen
    assert counter.syncs() == 0
    if result["job_env"]["py_executable"].startswith(str(counter.uv)):  # Ray 2.60's form
        assert counter.uv_runs() > 1  # the driver's and the workers' own


def test_a_uv_run_driver_of_a_local_ray_with_setup_driver(project: Path, tmp_path: Path) -> None:
    """`ray_uv_plugin.setup_driver()` after `import ray`, in a driver whose Python has the
    plugin (here through PYTHONPATH, as a project that depends on ray-uv-plugin has it)."""
    counter = Counter(tmp_path / "uvbin")
    env = {
        **os.environ,
        UV_ENV_VAR: str(counter.plugin_uv.path),
        VENV_DIR_ENV: str(tmp_path / "venvs"),
        "PYTHONPATH": str(ROOT),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "1",  # Ray's default, which setup_driver turns off
    }
    env.pop("RAY_RUNTIME_ENV_HOOK", None)
    flags = ["--extra", "x", "--all-groups", "--no-group", "dev", "python", "driver.py", "local"]
    result, _ = run_driver(project, counter, env, *flags)
    assert result["job_env"]["uv_project"] == {
        "extras": ["x"],
        "all_groups": True,
        "no_groups": ["dev"],
        "locked": True,
        "job_default": True,
    }
    for seen in result["plain"]:
        assert assert_in_job_venv(seen, tmp_path).parent == tmp_path / "venvs"
    assert counter.syncs() == 1 and counter.uv_runs() == 1


CHOICES = textwrap.dedent(
    """
    import json, os
    from ray._private.runtime_env import uv_runtime_env_hook
    from ray_uv_plugin.driver.hook import hook

    def outcome(f, env):
        try:
            return f(dict(env))
        except RuntimeError as e:
            return "raised: " + str(e)

    out = {}
    for name, env in [
        ("none", {}),
        ("own_uv_project", {"uv_project": {"extras": ["x"]}}),
        ("own_py_executable", {"py_executable": "/opt/python"}),
        ("pip", {"pip": ["six"]}),
        ("outside", {"working_dir": os.environ["ELSEWHERE"]}),
    ]:
        out[name] = {"ours": outcome(hook, env), "rays": outcome(uv_runtime_env_hook.hook, env)}
    print("RESULT", json.dumps(out))
    """
)


def test_a_job_that_chose_its_workers_python_keeps_rays_hook(project: Path, tmp_path: Path) -> None:
    """The hook alone, under `uv run`: a job runtime_env with its own uv_project, py_executable
    or pip, or whose project is outside its working_dir, gets exactly what Ray's own hook gives
    it (a result or an error; it differs between Ray versions), as without the plugin."""
    (project / "choices.py").write_text(CHOICES)
    counter = Counter(tmp_path / "uvbin")
    (tmp_path / "elsewhere").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ELSEWHERE": str(tmp_path / "elsewhere")}
    out, _ = run_driver(project, counter, env, "--extra", "x", "python", "choices.py")
    assert out["none"]["ours"]["uv_project"]["job_default"] is True
    assert "py_executable" not in out["none"]["ours"]
    assert out["none"]["rays"]["py_executable"].endswith("python")  # what ours replaced
    for name in ("own_uv_project", "own_py_executable", "pip", "outside"):
        assert out[name]["ours"] == out[name]["rays"], name
    assert "uv_project" not in out["own_py_executable"]["ours"]
