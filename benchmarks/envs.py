"""The environments the benchmark compares: package sets, their uv projects, the floor venv.

Each package set becomes a small uv project of its own, `ray==<node's version>` as its only base
dependency and the set's packages as an extra named after the set, so that every scenario can ask
for the same packages its own way: `uv_project` with `extras=[set]`, `uv run --extra set`, Ray's
`uv` / `pip` fields with the package list (their venvs inherit the node's Ray).

`small`, `realistic` and `vllm` are locked afresh by each run; `big` (400+ packages) and `torch`
are committed under `benchmarks/sets/<set>/` with their `uv.lock`, so every run installs the same
pinned versions (`ray` pinned too: a run on another Ray says to re-lock them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray

from ray_uv_plugin.env.uv import find_uv

SETS_DIR = Path(__file__).parent / "sets"
# Sets whose pyproject.toml and uv.lock are committed under SETS_DIR.
COMMITTED_SETS = ("big", "torch")


def _committed_packages(set_name: str) -> list[str]:
    pyproject = tomllib.loads((SETS_DIR / set_name / "pyproject.toml").read_text())
    return list(pyproject["project"]["optional-dependencies"][set_name])


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
    # Data, ML, web and cloud SDKs: 425 packages in its lock, ~2.3 GB installed.
    "big": _committed_packages("big"),
    # For machines that can afford them (GBs of wheels): only when asked for with --sets.
    "torch": _committed_packages("torch"),
    "vllm": ["vllm"],
}
# What a worker of the set imports in its first call with `--imports` (the first-import time
# that bytecode compiled at build time saves): typical imports of a worker, not the whole set.
PROBE_IMPORTS: dict[str, list[str]] = {
    "small": ["httpx", "tqdm", "tabulate"],
    "realistic": ["fastapi", "boto3", "pandas", "sklearn.ensemble", "sqlalchemy.orm"],
    "big": [
        "pandas",
        "sklearn.ensemble",
        "boto3",
        "google.cloud.storage",
        "azure.storage.blob",
        "sqlalchemy.orm",
        "fastapi",
        "aiohttp",
        "dask.dataframe",
        "transformers",
        "kubernetes.client",
    ],
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

    def locked_packages(self) -> int:
        """Packages in the lock (Ray's own dependencies included, the project itself not)."""
        lock = tomllib.loads((self.path / "uv.lock").read_text())
        return sum(1 for p in lock["package"] if p["name"] != f"bench-{self.set_name}")

    def pinned_requirements(self) -> list[str]:
        """The set's packages at the lock's versions, less Ray's own closure (which the venvs of
        Ray's `uv`/`pip` fields inherit from the node): what those fields install."""
        base = set(_export(self.path))
        return [r for r in _export(self.path, "--extra", self.extra) if r not in base]

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


def _export(project: Path, *args: str) -> list[str]:
    out = subprocess.run(
        [find_uv(), "export", "--project", str(project), "--frozen", "--no-hashes"]
        + ["--no-emit-project", "--no-header", "--no-annotate", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip() and line[0] not in "#-"]


def write_project(set_name: str, path: Path) -> BenchProject:
    """Write and lock the project of one package set (ray pinned to this node's version); a
    committed set is copied with its lock instead."""
    path.mkdir(parents=True, exist_ok=True)
    if set_name in COMMITTED_SETS:
        source = SETS_DIR / set_name
        pin = re.search(r'"ray==([^"]+)"', (source / "pyproject.toml").read_text())
        if pin is None or pin.group(1) != ray.__version__:
            raise RuntimeError(
                f"{source}/pyproject.toml pins ray=={pin.group(1) if pin else '?'} but this node "
                f"runs Ray {ray.__version__}: change the pin and `uv lock --project {source}`"
            )
        for name in ("pyproject.toml", "uv.lock"):
            shutil.copy2(source / name, path / name)
        return BenchProject(set_name, path)
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


# Dropped from every environment the benchmark starts: the driver's own venv must not leak into
# uv, and a PYTHONDONTWRITEBYTECODE of the machine's (a sandbox sets it) would keep workers from
# caching `.pyc` files where users' workers can (`uv run`'s .venv, Ray's `uv` field's venv).
# The driver hook of `ray-uv plugin-config --shell`, from a shell set up that way, would give
# each sample driver (a descendant of `uv run`) the checkout's env as its job default.
DROPPED_ENV = (
    "VIRTUAL_ENV",
    "UV_LOCKED",
    "PYTHONDONTWRITEBYTECODE",
    "RAY_RUNTIME_ENV_HOOK",
    "RAY_UV_PLUGIN_PREVIOUS_HOOK",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment less DROPPED_ENV, with `extra` over it."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(extra)
    return env


def sync_by_hand(
    project: BenchProject,
    venv: Path,
    cache_dir: Path | None = None,
    settings: dict[str, str] | None = None,
) -> float:
    """`uv sync --locked --extra <set>` into a fresh UV_PROJECT_ENVIRONMENT; seconds it took.

    With the plugin's defaults (`UV_COMPILE_BYTECODE=1`, `UV_LINK_MODE=hardlink`) unless
    `settings` says other: the same venv as the plugin builds.
    """
    if venv.exists():
        shutil.rmtree(venv)
    uv_settings = {"UV_COMPILE_BYTECODE": "1", "UV_LINK_MODE": "hardlink", **(settings or {})}
    env = clean_env(UV_PROJECT_ENVIRONMENT=str(venv), UV_PYTHON_DOWNLOADS="never", **uv_settings)
    if cache_dir is not None:
        env["UV_CACHE_DIR"] = str(cache_dir)
    args = [find_uv(), "sync", "--project", str(project.path), "--locked", "--quiet"]
    args += ["--extra", project.extra, "--no-install-project", "--python", sys.executable]
    start = time.perf_counter()
    subprocess.run(args, check=True, timeout=3600, env=env, cwd=project.path)
    return time.perf_counter() - start


def remove_tree(path: Path) -> None:
    """Remove a dir that may hold the plugin's venvs: they are frozen once built (read-only,
    and immutable dirs where the plugin runs as root), so thaw them first."""
    from ray_uv_plugin.store.freezing import remove_tree as remove_frozen

    remove_frozen(path)


def floor_python(venv: Path) -> str:
    return str(venv / "bin" / "python")
