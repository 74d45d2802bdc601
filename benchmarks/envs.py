"""The environments the benchmark compares: package sets, their uv projects, the floor venv.

Each package set becomes a small uv project of its own, `ray==<node's version>` as its only base
dependency and the set's packages as an extra named after the set, so that every scenario can ask
for the same packages its own way: `uv_project` with `extras=[set]`, `uv run --extra set`, Ray's
`uv` / `pip` fields with the package list (their venvs inherit the node's Ray).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray

from ray_uv_plugin.uv import find_uv

PACKAGE_SETS: dict[str, list[str]] = {
    # A few pure-Python packages that the node's own environment does not have.
    "small": ["httpx", "tqdm", "tabulate"],
    # An HTTP stack and scientific Python: ~40 packages besides Ray's own dependencies.
    "realistic": [
        "fastapi",
        "uvicorn",
        "httpx",
        "requests",
        "jinja2",
        "sqlalchemy",
        "boto3",
        "numpy",
        "pandas",
        "scipy",
        "scikit-learn",
    ],
    # For machines that can afford them (GBs of wheels): only when asked for with --sets.
    "torch": ["torch"],
    "vllm": ["vllm"],
}
DEFAULT_SETS = ("small", "realistic")


@dataclass(frozen=True)
class BenchProject:
    """One package set as a locked uv project on disk."""

    set_name: str
    path: Path

    @property
    def packages(self) -> list[str]:
        return PACKAGE_SETS[self.set_name]

    @property
    def extra(self) -> str:
        return self.set_name

    def salted_copy(self, parent: Path) -> BenchProject:
        """Same lock, same packages, a new venv key: a pyproject comment changes the key only.

        This makes a venv cold for one sample without touching the venv dir, so it also works
        against a running cluster whose venv dir we do not own.
        """
        copy = parent / f"{self.set_name}-{uuid.uuid4().hex[:8]}"
        copy.mkdir(parents=True)
        shutil.copy2(self.path / "uv.lock", copy / "uv.lock")
        text = (self.path / "pyproject.toml").read_text()
        (copy / "pyproject.toml").write_text(f"{text}# benchmark sample {copy.name}\n")
        return BenchProject(self.set_name, copy)


def write_project(set_name: str, path: Path) -> BenchProject:
    """Write and lock the project of one package set (ray pinned to this node's version)."""
    path.mkdir(parents=True, exist_ok=True)
    packages = ", ".join(f'"{p}"' for p in PACKAGE_SETS[set_name])
    (path / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "bench-{set_name}"
            version = "0.1.0"
            requires-python = ">={sys.version_info.major}.{sys.version_info.minor}"
            dependencies = ["ray=={ray.__version__}"]

            [project.optional-dependencies]
            {set_name} = [{packages}]

            [tool.uv]
            environments = ["sys_platform == '{sys.platform}'"]
            """
        )
    )
    subprocess.run(
        [find_uv(), "lock", "--project", str(path), "--quiet"],
        check=True,
        timeout=600,
        env=clean_env(),
    )
    return BenchProject(set_name, path)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the driver's own venv, which must not leak into uv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_LOCKED")}
    env.update(extra)
    return env


def sync_by_hand(project: BenchProject, venv: Path, cache_dir: Path | None = None) -> float:
    """`uv sync --locked --extra <set>` into a fresh UV_PROJECT_ENVIRONMENT; seconds it took."""
    if venv.exists():
        shutil.rmtree(venv)
    env = clean_env(UV_PROJECT_ENVIRONMENT=str(venv), UV_PYTHON_DOWNLOADS="never")
    if cache_dir is not None:
        env["UV_CACHE_DIR"] = str(cache_dir)
    args = [find_uv(), "sync", "--project", str(project.path), "--locked", "--quiet"]
    args += ["--extra", project.extra, "--no-install-project", "--python", sys.executable]
    start = time.perf_counter()
    subprocess.run(args, check=True, timeout=1800, env=env, cwd=project.path)
    return time.perf_counter() - start


def floor_python(venv: Path) -> str:
    return str(venv / "bin" / "python")
