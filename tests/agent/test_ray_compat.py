"""The Ray internals the package uses: all there on this Ray (CI runs this file on the oldest Ray
in pyproject's range and on the newest on the registry), and a Ray that lacks one fails each
`uv_project` setup with a message that names the Ray version and the missing piece."""

from __future__ import annotations

import ast
import json
import os
import re
import tomllib
from pathlib import Path

import pytest
import ray
from ray._private import ray_constants
from ray._private.runtime_env import packaging
from ray.exceptions import RuntimeEnvSetupError

from ray_uv_plugin.agent import ray_compat
from ray_uv_plugin.agent.ray_compat import AGENT, DRIVER, RayInternal, problems, resolve
from tests.support.changed_ray_plugin import PLUGIN
from tests.support.uvproject import write_project

ROOT = Path(__file__).resolve().parents[2]


def test_every_internal_the_package_uses_is_there_on_this_ray() -> None:
    assert problems(AGENT, ray.__version__) == []
    assert problems(DRIVER, ray.__version__) == []
    assert ray_compat.check() is None


def _ray_internals_named(path: Path) -> set[str]:
    """The `ray._private` names a module's code uses: imported, or written out in a string."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray._private"):
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            named.update(a.name for a in node.names if a.name.startswith("ray._private"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named.update(re.findall(r"^ray\._private(?:\.\w+)+$", node.value))
        elif isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if dotted.startswith("ray._private."):
                named.add(dotted)
    return named


def test_every_ray_internal_the_package_names_is_listed() -> None:
    """Each `ray._private` name in the package's code is a listed internal or a module on the
    way to one: a new use cannot skip the check."""
    listed = [i.path for i in (*AGENT, *DRIVER)]
    named: set[str] = set()
    for path in [*(ROOT / "ray_uv_plugin").rglob("*.py"), *(ROOT / "worker_groups").rglob("*.py")]:
        named |= _ray_internals_named(path)
    assert "ray._private.runtime_env.plugin.RuntimeEnvPlugin" in named  # the scan works
    unlisted = {n for n in named if not any(p == n or p.startswith(n + ".") for p in listed)}
    assert unlisted == set()


def test_a_missing_internal_is_named_with_the_ray_version(monkeypatch) -> None:
    monkeypatch.delattr(ray_constants, "RAY_RUNTIME_ENV_HOOK")
    message = ray_compat.check()
    assert message is not None
    assert f"this node's Ray {ray.__version__}" in message
    assert (
        "ray._private.ray_constants.RAY_RUNTIME_ENV_HOOK is missing "
        "(ray._private.ray_constants has no 'RAY_RUNTIME_ENV_HOOK'); the plugin uses it for "
        "the variable that names a driver's runtime_env hook"
    ) in message
    assert f"ray[default]=={ray_compat.LOCKED_RAY}" in message
    assert message.count("\n  - ") == 1  # only what changed


def test_a_changed_signature_or_value_is_named(monkeypatch) -> None:
    monkeypatch.setattr(packaging, "get_local_dir_from_uri", lambda path, base: path)
    monkeypatch.setattr(ray_constants, "RAY_RUNTIME_ENV_HOOK", "RAY_DRIVER_HOOK")
    found = problems(AGENT, ray.__version__)
    assert len(found) == 2
    assert "get_local_dir_from_uri takes (path, base), not (uri, base_directory, ...)" in found[0]
    assert "RAY_RUNTIME_ENV_HOOK is 'RAY_DRIVER_HOOK', not 'RAY_RUNTIME_ENV_HOOK'" in found[1]


def test_the_uv_run_switch_is_looked_for_from_the_ray_that_brought_it(monkeypatch) -> None:
    monkeypatch.delattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", raising=False)
    assert problems(AGENT, "2.44.1") == []
    (found,) = problems(AGENT, "2.47.0")
    assert found.startswith("ray._private.ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is missing")


def test_a_module_that_is_gone_is_named() -> None:
    with pytest.raises(LookupError, match="ray._private.runtime_env has no 'gone'"):
        resolve("ray._private.runtime_env.gone.Thing")
    gone = RayInternal("ray._private.gone_agent.main", "a script", script=True)
    assert problems([gone], ray.__version__) == [
        "ray._private.gone_agent.main is missing (no module 'ray._private.gone_agent.main'); "
        "the plugin uses it for a script"
    ]


def test_the_versions_named_are_pyproject_floor_and_the_lock() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (ray_req,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("ray[")]
    assert ray_req == f"ray[default]>={ray_compat.OLDEST_RAY}"  # a floor, no cap
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (locked,) = [p["version"] for p in lock["package"] if p["name"] == "ray"]
    assert locked == ray_compat.LOCKED_RAY


@pytest.fixture
def changed_ray(tmp_path, monkeypatch):
    """A local Ray whose agent loads the plugin as it would be on a Ray lacking an internal."""
    import ray._private.worker as worker

    # The driver's check that the plugin is registered (`registration`), armed by an earlier
    # test, knows the plugin by its class: this stand-in's is another.
    monkeypatch.setattr(worker, "_post_init_hooks", [])
    monkeypatch.setenv("RAY_RUNTIME_ENV_PLUGINS", json.dumps([PLUGIN]))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        yield write_project(tmp_path / "proj", ["six"])
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
class Where:
    def python(self) -> str:
        import sys

        return sys.executable


def test_a_ray_without_an_internal_fails_each_setup_with_what_is_missing(changed_ray) -> None:
    actor = Where.options(runtime_env={"uv_project": {"project": str(changed_ray)}}).remote()
    with pytest.raises(RuntimeEnvSetupError) as error:
        ray.get(actor.python.remote(), timeout=180)
    message = str(error.value)
    assert f"cannot run on this node's Ray {ray.__version__}" in message
    assert "RuntimeEnvContext has no 'gone_in_a_newer_ray'" in message
    assert "a piece a newer Ray dropped (a test)" in message
    assert not list(changed_ray.glob(".venv*"))  # nothing was built
