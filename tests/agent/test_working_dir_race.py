"""The project dir comes from the request alone: two jobs with different working
dirs, set up at the same time on one node, each get their own project's venv.

Ray's working_dir plugin names the unpacked dir in a process-wide env var around the other
plugins' setup; a slow plugin before ours (here the test-only `test_sleep`) lets another job's
setup change it meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

import ray_uv_plugin
from ray_uv_plugin.settings import VENV_DIR_ENV
from tests.support.sleep_plugin import PLUGIN
from tests.support.uvproject import write_project

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import json, sys, ray
from ray.exceptions import RuntimeEnvSetupError
address, project, sleep = sys.argv[1], sys.argv[2], float(sys.argv[3])
ray.init(address=address, runtime_env={"working_dir": project, "test_sleep": sleep},
         log_to_driver=False)

@ray.remote(num_cpus=0)
def where():
    import importlib.util, sys
    return {"python": sys.executable,
            "has": [m for m in ("six", "tomli_w") if importlib.util.find_spec(m)]}

try:
    print(json.dumps(ray.get(where.options(runtime_env={"uv_project": {}}).remote(), timeout=300)))
except RuntimeEnvSetupError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("race")
    keys = ("RAY_RUNTIME_ENV_PLUGINS", VENV_DIR_ENV, "PYTHONPATH")
    saved = {k: os.environ.get(k) for k in keys}
    plugins = json.loads(ray_uv_plugin.plugin_config()) + [PLUGIN]
    os.environ["RAY_RUNTIME_ENV_PLUGINS"] = json.dumps(plugins)
    os.environ[VENV_DIR_ENV] = str(tmp / "venvs")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved["PYTHONPATH"]]))
    ctx = ray.init(address="local", num_cpus=2)
    yield tmp, ctx.address_info["gcs_address"]
    ray.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_two_jobs_set_up_at_once_each_get_their_own_project(cluster):
    tmp, address = cluster
    six = write_project(tmp / "job-a", ["six"])
    tomli = write_project(tmp / "job-b", ["tomli-w"])

    def driver(project: Path, sleep: float) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", DRIVER, address, str(project), str(sleep)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    # Job A's setup sleeps 8 s before uv_project runs; job B's starts meanwhile and stays in
    # its (longer) setup while A's uv_project plugin reads which working dir to use.
    a = driver(six, 8)
    b = driver(tomli, 25)
    out_a, _ = a.communicate(timeout=300)
    out_b, _ = b.communicate(timeout=300)
    got_a, got_b = json.loads(out_a.splitlines()[-1]), json.loads(out_b.splitlines()[-1])
    assert got_a["has"] == ["six"] and got_b["has"] == ["tomli_w"]
    assert got_a["python"] != got_b["python"]


def test_a_lock_left_out_of_the_upload_is_named_as_such(cluster):
    """uv.lock is often in a library's .gitignore, and Ray's upload honours .gitignore."""
    tmp, address = cluster
    project = write_project(tmp / "ignored-lock", ["six"])
    (project / ".gitignore").write_text("uv.lock\n")
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, address, str(project), "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    ).stdout
    error = json.loads(out.splitlines()[-1])["error"]
    assert "has no uv.lock: its upload left the lock out" in error
    assert ".gitignore" in error and "git check-ignore -v uv.lock" in error
