"""README "From a uv project", run as written from `uv init` (the uv of the lock): the plugin's
wheel in a folder that the `.gitignore` of `uv init` keeps, a `driver` group, two extras that pin
two versions of one package, and a `uv run --group driver` driver whose local Ray uploads the
project as its working_dir. Its actors get their own extra's version and not the plugin; the
lock holds relative paths, and the project's path is not in the actors' key."""

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

import ray

from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec

ROOT = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent(
    """
    import importlib.metadata, importlib.util, json, os, sys
    import ray
    import ray_uv_plugin
    from ray_uv_plugin import UvProject

    ray_uv_plugin.setup_driver()
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"working_dir": "."})

    def report():
        try:
            tomli_w = importlib.metadata.version("tomli-w")
        except importlib.metadata.PackageNotFoundError:
            tomli_w = None
        plugin = importlib.util.find_spec("ray_uv_plugin") is not None
        return {"python": sys.executable, "cwd": os.getcwd(), "tomli_w": tomli_w, "plugin": plugin}

    seen = ray.remote(num_cpus=0)(report)

    @ray.remote(num_cpus=0)
    class Seen:
        def env(self):
            return report()

    actors = {x: Seen.options(runtime_env={"uv_project": UvProject(extras=[x])}).remote()
              for x in ("old", "new")}
    print(json.dumps({
        **{x: ray.get(actor.env.remote(), timeout=600) for x, actor in actors.items()},
        "job_default": ray.get(seen.remote(), timeout=600),
        "job_env": ray.get_runtime_context().runtime_env.get("uv_project"),
    }))
    ray.shutdown()
    """
)


def readme_commands(dist: Path) -> list[str]:
    """The README's commands, with the wheel's dir and the Ray of this test's nodes."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### From a uv project\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    assert 'uv add "ray==2.60.0"' in block
    block = block.replace("/path/to/ray-uv-plugin/dist", str(dist))
    return block.replace("ray==2.60.0", f"ray=={ray.__version__}").splitlines()


def test_the_readme_recipe_works_in_a_project_that_uv_init_makes(
    tmp_path: Path, plugin_dist: Path
) -> None:
    """Was: the wheel in `wheels/`, which the .gitignore of `uv init` ignores, so Ray's upload
    left it out and every actor failed ("put it inside the working_dir", where it was)."""
    *setup, run = readme_commands(plugin_dist)
    assert setup[0].startswith("uv init ") and run.startswith("uv run --group driver python ")
    uv_bin = Path(sys.executable).parent  # the uv of the lock, and the Python of the nodes
    env = {**os.environ, "PATH": f"{uv_bin}{os.pathsep}{os.environ['PATH']}"}
    for key in ("VIRTUAL_ENV", "RAY_RUNTIME_ENV_PLUGINS", "RAY_RUNTIME_ENV_HOOK"):
        env.pop(key, None)  # the driver sets itself up
    script = "\n".join(["set -euo pipefail", *setup])
    subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, check=True, timeout=600)

    project = tmp_path / "rl-job"
    assert "wheels/" in (project / ".gitignore").read_text().splitlines()  # the trap is there
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    (wheel,) = (project / "vendor").glob("ray_uv_plugin-*.whl")
    relative = f"vendor/{wheel.name}"
    assert pyproject["tool"]["uv"]["sources"]["ray-uv-plugin"] == {"path": relative}
    assert pyproject["dependency-groups"]["driver"] == ["ray-uv-plugin"]
    assert pyproject["project"]["optional-dependencies"] == {
        "old": ["tomli-w==1.0.0"],
        "new": ["tomli-w==1.1.0"],
    }
    lock = (project / "uv.lock").read_text()
    assert f'path = "{relative}"' in lock and str(tmp_path) not in lock

    (project / "driver.py").write_text(DRIVER)
    out = subprocess.run(
        ["bash", "-c", run], cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    venvs = Path(os.environ["RAY_UV_PLUGIN_VENV_DIR"])
    for who, tomli_w in (("old", "1.0.0"), ("new", "1.1.0"), ("job_default", None)):
        assert Path(seen[who]["python"]).parent.parent.parent == venvs, seen
        assert seen[who]["tomli_w"] == tomli_w and not seen[who]["plugin"], seen
        assert "_ray_pkg_" in seen[who]["cwd"], seen  # the working_dir as Ray uploaded it
    assert seen["old"]["python"] != seen["new"]["python"]
    assert seen["job_env"]["no_groups"] == ["driver"] and "groups" not in seen["job_env"]

    # The wheel is keyed by content: the project unpacked elsewhere (another Ray session's
    # working_dir) is the same venv.
    elsewhere = tmp_path / "session-2" / "rl-job"
    shutil.copytree(project, elsewhere, ignore=shutil.ignore_patterns(".venv"))
    spec = parse_spec({"extras": ["old"]})
    keys = {make_request(spec, load_project(p), {}).key for p in (project, elsewhere)}
    assert len(keys) == 1
