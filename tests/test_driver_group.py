"""README "Install", from a uv project: the plugin's wheel inside the project, in a `driver`
group. Real uv and a real Ray started by a `uv run --group driver` driver: the driver has the
plugin, its workers' venvs (the job's default and an actor's own) do not, the lock holds a
relative path, and the project's path is not in the venvs' key."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from ray_uv_plugin.agent.project import load_project
from ray_uv_plugin.agent.request import make_request
from ray_uv_plugin.agent.spec import parse_spec
from tests.support.uvproject import write_project

ROOT = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent(
    """
    import importlib.util, json, sys
    import ray
    import ray_uv_plugin

    ray_uv_plugin.setup_driver()
    ray.init(address="local", num_cpus=1, include_dashboard=False)

    @ray.remote(num_cpus=0)
    def seen():
        found = {m: importlib.util.find_spec(m) is not None for m in ("ray_uv_plugin", "six")}
        return {"python": sys.executable, **found}

    print(json.dumps({
        "job_default": ray.get(seen.remote(), timeout=600),
        "actor": ray.get(seen.options(runtime_env={"uv_project": {}}).remote(), timeout=600),
        "job_env": ray.get_runtime_context().runtime_env.get("uv_project"),
    }))
    ray.shutdown()
    """
)


def readme_commands(dist: Path) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### From a uv project\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    return [line.replace("/path/to/ray-uv-plugin/dist", str(dist)) for line in block.splitlines()]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        ["uv", "build", "--wheel", "--quiet", "--out-dir", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    return out


def test_the_plugin_as_a_driver_group_stays_out_of_the_workers_venvs(
    tmp_path: Path, dist: Path
) -> None:
    project = write_project(tmp_path / "proj", ["six"])
    (project / "driver.py").write_text(DRIVER)
    *setup, run = readme_commands(dist)
    assert run == "uv run --group driver python driver.py"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for key in ("VIRTUAL_ENV", "RAY_RUNTIME_ENV_PLUGINS", "RAY_RUNTIME_ENV_HOOK"):
        env.pop(key, None)  # the driver sets itself up
    for command in setup:
        subprocess.run(["bash", "-c", command], cwd=project, env=env, check=True, timeout=600)

    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    (wheel,) = (project / "wheels").glob("ray_uv_plugin-*.whl")
    relative = f"wheels/{wheel.name}"
    assert pyproject["tool"]["uv"]["sources"]["ray-uv-plugin"] == {"path": relative}
    assert pyproject["dependency-groups"]["driver"] == ["ray-uv-plugin"]
    lock = (project / "uv.lock").read_text()
    assert f'path = "{relative}"' in lock and str(tmp_path) not in lock

    out = subprocess.run(
        ["bash", "-c", run], cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    venvs = Path(os.environ["RAY_UV_PLUGIN_VENV_DIR"])
    for who in ("job_default", "actor"):  # the driver's `uv run` selection, an actor's own
        assert Path(seen[who]["python"]).parent.parent.parent == venvs, seen
        assert seen[who]["six"] and not seen[who]["ray_uv_plugin"], seen
    assert seen["job_env"]["no_groups"] == ["driver"] and "groups" not in seen["job_env"]

    # The wheel is keyed by content: the project unpacked elsewhere (another Ray session's
    # working_dir) is the same venv.
    elsewhere = tmp_path / "session-2" / "proj"
    shutil.copytree(project, elsewhere, ignore=shutil.ignore_patterns(".venv"))
    spec = parse_spec({})
    keys = {make_request(spec, load_project(p), {}).key for p in (project, elsewhere)}
    assert len(keys) == 1
