"""The wheel users install: its metadata and the files the plugin needs at run time.

Built with the real `uv build` from the checkout (hatchling from the registry), no Ray.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(plugin_dist: Path) -> Path:
    (built,) = plugin_dist.glob("ray_uv_plugin-*.whl")
    return built


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


def test_metadata_states_license_pythons_and_typing(wheel: Path) -> None:
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "MIT"
    classifiers = meta.get_all("Classifier") or []
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert meta["Requires-Python"] == ">=3.11"
    # The running interpreter is one the metadata promises.
    assert f"Programming Language :: Python :: {sys.version_info[0]}.{sys.version_info[1]}" in (
        classifiers
    )


def test_ray_has_a_floor_and_no_cap(wheel: Path) -> None:
    """A Ray released after this wheel installs beside it on its release day: the plugin checks
    at load that the Ray internals it uses are there (`agent/ray_compat.py`), and CI tests the
    floor and the newest Ray on the registry."""
    from packaging.requirements import Requirement

    from ray_uv_plugin.agent.ray_compat import OLDEST_RAY

    requires = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    (ray_requirement,) = [r for r in requires if r.name == "ray"]
    assert ray_requirement.extras == {"default"}
    assert [(s.operator, s.version) for s in ray_requirement.specifier] == [(">=", OLDEST_RAY)]


def test_wheel_holds_markers_license_and_run_time_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for needed in (
        "ray_uv_plugin/py.typed",
        "worker_groups/py.typed",
        # Read at run time: the JSON schema Ray validates against, uv's config for builds, and
        # the hook `plugin-config --shell` puts on PYTHONPATH.
        "ray_uv_plugin/schemas/uv_project.json",
        "ray_uv_plugin/env/uv_config/uv/uv.toml",
        "ray_uv_plugin/hook_path/ray_uv_plugin_hook.py",
        # `ray-uv demo` outside a checkout: examples/demo_project, copied in.
        "ray_uv_plugin/ops/demo_project/pyproject.toml",
        "ray_uv_plugin/ops/demo_project/uv.lock",
    ):
        assert needed in names, f"{needed} missing from the wheel"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    # The checkout's benchmarks and tests stay out of an install.
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names)


def test_console_script_is_ray_uv(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(name).decode()
    assert "ray-uv = ray_uv_plugin.ops.cli:main" in text


def test_the_installed_wheels_help_lists_what_runs_from_it(wheel: Path, tmp_path: Path) -> None:
    """Installed from the wheel, run outside any checkout: `ray-uv --help` does not list
    `bench` (a checkout's command, whose `--help` would exit 2), its docs line names no
    checkout path (no `docs/operations.md`), and `prepare` takes every selection field."""
    uv = shutil.which("uv")
    assert uv is not None
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), str(wheel)],
        check=True,
        timeout=600,
    )
    ray_uv = str(venv / "bin" / "ray-uv")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ray_uv, *args], capture_output=True, text=True, cwd=tmp_path)

    top = run("--help")
    assert top.returncode == 0, top.stderr
    assert "bench" not in top.stdout and "demo" in top.stdout
    assert "Docs: " in top.stdout and "docs/operations.md" not in top.stdout
    bench = run("bench", "--help")
    assert bench.returncode == 2 and "not in the wheel" in bench.stderr
    prepare = run("prepare", "--help")
    assert prepare.returncode == 0
    for flag in ("--only-group G", "--no-group G", "--no-extra X", "--package P", "--all-groups"):
        assert flag in prepare.stdout
