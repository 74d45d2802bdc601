"""A job's own environment never shapes a venv that another job reuses: real Ray
actors, real uv. A job's variable reaches the build only where the key records it (uv's own,
the known build variables, those it names in `build_env_vars`) or where it cannot change what
is installed (proxies); `PYTHONPATH`, `LD_PRELOAD`, `PATH` and every other variable stay its
workers'."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import ray
from ray.exceptions import RuntimeEnvSetupError

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import VENV_DIR_ENV
from tests.support.uvproject import write_project

pytestmark = pytest.mark.timeout(900)

# A build backend in the library's own tree (no download): its wheel's `mylib.FLAVOR` is the
# build's `MYLIB_FLAVOR`, as a CUDA or CPU flavour chosen by an env var would be.
BACKEND = """\
import base64, hashlib, os, zipfile

NAME, VERSION = "mylib", "0.1.0"
DIST = f"{NAME}-{VERSION}.dist-info"


def _files():
    flavor = os.environ.get("MYLIB_FLAVOR", "plain")
    return {
        f"{NAME}.py": f"FLAVOR = {flavor!r}\\n".encode(),
        f"{DIST}/METADATA": (
            f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n".encode()
        ),
        f"{DIST}/WHEEL": (
            b"Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\n"
            b"Tag: py3-none-any\\n"
        ),
    }


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    files, record = _files(), []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{path},sha256={digest.decode()},{len(data)}")
        record.append(f"{DIST}/RECORD,,")
        wheel.writestr(f"{DIST}/RECORD", "\\n".join(record) + "\\n")
    return name


def build_sdist(sdist_directory, config_settings=None):
    raise NotImplementedError
"""

# Runs in every Python started with this dir on PYTHONPATH: in a venv of `VENVS` it plants a
# `.pth` (a line of code every later Python of that venv runs), as a careless or hostile job's
# `sitecustomize` could; elsewhere it only records where it ran.
SITECUSTOMIZE = """\
import os, sys, sysconfig
with open({log!r}, "a") as log:
    log.write(sys.prefix + "\\n")
if sys.prefix.startswith({venvs!r}):
    try:
        with open(os.path.join(sysconfig.get_paths()["purelib"], "planted.pth"), "w") as f:
            f.write("import os; os.environ['PLANTED'] = '1'\\n")
    except OSError:
        pass
"""


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("job-env")
    venvs = tmp / "venvs"
    saved = os.environ.get(VENV_DIR_ENV)
    os.environ[VENV_DIR_ENV] = str(venvs)
    ray.init(address="local", num_cpus=4)
    try:
        yield tmp, venvs
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop(VENV_DIR_ENV, None)
        else:
            os.environ[VENV_DIR_ENV] = saved


@ray.remote(num_cpus=0)
class Worker:
    def seen(self) -> dict:
        import importlib
        import os
        import sys
        import sysconfig

        try:
            flavor = importlib.import_module("mylib").FLAVOR
        except ImportError:
            flavor = None
        return {
            "venv": sys.prefix,
            "planted": os.environ.get("PLANTED"),
            "pth": os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], "planted.pth")),
            "pythonpath": os.environ.get("PYTHONPATH"),
            "flavor": flavor,
        }


def seen(runtime_env: dict) -> dict:
    actor = Worker.options(runtime_env=runtime_env).remote()
    try:
        return ray.get(actor.seen.remote(), timeout=600)
    finally:
        ray.kill(actor)


def test_a_jobs_pythonpath_never_reaches_the_build_of_a_venv_others_reuse(local_ray) -> None:
    tmp, venvs = local_ray
    project = write_project(tmp / "plain", ["six"])
    plant = tmp / "plant"
    plant.mkdir()
    log = tmp / "sitecustomize.log"
    (plant / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(log=str(log), venvs=str(venvs.resolve()))
    )
    # uv's bytecode step starts the new venv's Python: with the job's PYTHONPATH it would run
    # the job's sitecustomize there.
    compiled = {"UV_COMPILE_BYTECODE": "1"}
    value = {"project": str(project)}
    a = seen({"uv_project": value, "env_vars": {**compiled, "PYTHONPATH": str(plant)}})
    b = seen({"uv_project": value, "env_vars": compiled})
    assert a["venv"] == b["venv"]  # the same key: PYTHONPATH is the workers' alone
    assert a["pythonpath"] == str(plant)  # ...and A's worker still gets it
    assert not b["pth"] and b["planted"] is None, "A's sitecustomize planted code in B's venv"
    ran_in = log.read_text().split() if log.exists() else []
    assert not [p for p in ran_in if p.startswith(str(venvs.resolve())) and p != a["venv"]]


def write_flavored(directory: Path) -> Path:
    """`directory/proj` (ray) depending on `directory/mylib`, a path source whose build reads
    `MYLIB_FLAVOR`."""
    lib = directory / "mylib"
    lib.mkdir(parents=True)
    (lib / "backend.py").write_text(BACKEND)
    (lib / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [project]
            name = "mylib"
            version = "0.1.0"
            requires-python = ">=3.11"

            [build-system]
            requires = []
            build-backend = "backend"
            backend-path = ["."]
            """
        )
    )
    proj = write_project(directory / "proj", ["mylib"], lock=False)
    with open(proj / "pyproject.toml", "a") as f:
        f.write('\n[tool.uv.sources]\nmylib = { path = "../mylib", editable = false }\n')
    subprocess.run([find_uv(), "lock", "--project", str(proj), "--quiet"], check=True, timeout=300)
    return proj


def test_a_build_variable_no_list_knows_shapes_only_a_venv_that_keys_it(local_ray) -> None:
    tmp, _ = local_ray
    project = str(write_flavored(tmp / "flavored"))
    a = seen({"uv_project": {"project": project}, "env_vars": {"MYLIB_FLAVOR": "cuda"}})
    b = seen({"uv_project": {"project": project}})
    # A's variable is its workers' (Ray sets it for them); the build never saw it, so B, which
    # sets nothing, does not import A's `cuda` build.
    assert a["venv"] == b["venv"] and a["flavor"] == b["flavor"] == "plain"
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    logs = "".join(p.read_text() for p in session.glob("logs/runtime_env_setup-*.log"))
    assert "env_vars MYLIB_FLAVOR are its workers' and do not reach uv" in logs
    # Named in build_env_vars, it reaches the build and the key: a venv of its own.
    c = seen(
        {
            "uv_project": {"project": project, "build_env_vars": ["MYLIB_FLAVOR"]},
            "env_vars": {"MYLIB_FLAVOR": "cuda"},
        }
    )
    assert c["flavor"] == "cuda" and c["venv"] != a["venv"]
    assert seen({"uv_project": {"project": project}})["flavor"] == "plain"


def test_a_known_build_variable_is_keyed(local_ray) -> None:
    tmp, _ = local_ray
    project = str(write_project(tmp / "cmake", ["six"]))
    plain = seen({"uv_project": {"project": project}})
    cmake = seen({"uv_project": {"project": project}, "env_vars": {"CMAKE_ARGS": "-DGPU=ON"}})
    assert plain["venv"] != cmake["venv"]


def test_an_unknown_uv_variable_is_refused_as_a_typo(local_ray) -> None:
    tmp, venvs = local_ray
    project = str(write_project(tmp / "typo", ["six"]))
    before = set(os.listdir(venvs)) if venvs.exists() else set()
    with pytest.raises(RuntimeEnvSetupError, match=r"UV_JUNK, which uv does not read"):
        seen({"uv_project": {"project": project}, "env_vars": {"UV_JUNK": "1"}})
    after = set(os.listdir(venvs)) if venvs.exists() else set()
    assert not {name for name in after - before if not name.endswith(".lock")}


def test_a_jobs_uv_cache_is_refused_and_says_how_to_set_the_nodes(local_ray) -> None:
    """uv checks a wheel's hash when it downloads it, not when it installs it from its cache: a
    job's UV_CACHE_DIR (a cache it wrote, a dir in its working_dir) or its project's
    `cache-dir` would decide what a venv that other jobs reuse holds. Refused
    before uv runs, saying how to set the node's; nothing is built."""
    tmp, venvs = local_ray
    project = write_project(tmp / "own-cache", ["six"])
    before = set(os.listdir(venvs)) if venvs.exists() else set()
    own = {"UV_CACHE_DIR": str(tmp / "job-cache")}
    with pytest.raises(RuntimeEnvSetupError, match=r"env_vars sets UV_CACHE_DIR, which picks"):
        seen({"uv_project": {"project": str(project)}, "env_vars": own})
    (project / "uv.toml").write_text('cache-dir = ".uv-cache"\n')
    with pytest.raises(RuntimeEnvSetupError, match=r"uv.toml sets cache-dir, which picks") as e:
        seen({"uv_project": {"project": str(project)}})
    assert "UV_CACHE_DIR in the environment of `ray start` on every node" in str(e.value)
    after = set(os.listdir(venvs)) if venvs.exists() else set()
    assert not {name for name in after - before if not name.endswith(".lock")}
    assert not (tmp / "job-cache").exists() and not (project / ".uv-cache").exists()
