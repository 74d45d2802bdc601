"""The ways a Ray user gets a Python environment for an actor, as runtime_envs to compare.

Every scenario asks for the same packages (one package set) its own way; `prepare` returns the
runtime_env for one sample and the paths to delete after it.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.envs import BenchProject, floor_python


@dataclass(frozen=True)
class Scenario:
    id: str
    number: str  # as numbered in the issue: 1 floor, 2 warm, ...
    short: str  # for the terminal table
    label: str
    multi: bool  # also run with N actors at once
    uv_project: bool = False  # the plugin's own scenarios: syncs are counted


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("floor", "1", "floor", "py_executable = prebuilt venv (floor)", multi=True),
    Scenario("warm", "2", "uv_project warm", "uv_project, venv ready", multi=True, uv_project=True),
    Scenario(
        "cold-venv",
        "3",
        "uv_project cold venv",
        "uv_project, new venv, warm uv cache",
        multi=True,
        uv_project=True,
    ),
    Scenario(
        "cold-all",
        "4",
        "uv_project cold cache",
        "uv_project, empty uv cache",
        multi=False,
        uv_project=True,
    ),
    Scenario("ray-uv", "5a", "Ray uv field", "Ray `uv` field (default: --no-cache)", multi=True),
    Scenario("ray-uv-cache", "5b", "Ray uv, cache", "Ray `uv` field, uv cache on", multi=False),
    Scenario("ray-pip", "6", "Ray pip field", "Ray `pip` field", multi=False),
    Scenario("uv-run", "7", "uv run", 'py_executable = "uv run --locked --extra X"', multi=True),
)
BY_ID = {s.id: s for s in SCENARIOS}
# Not a Ray scenario: `uv sync --locked` into a fresh venv, by hand, warm cache (issue 2's bound).
HAND_SYNC = Scenario(
    "hand-sync", "-", "uv sync by hand", "uv sync --locked by hand (no Ray)", multi=False
)


@dataclass
class Prepared:
    runtime_env: dict[str, Any]
    cleanup: list[Path] = field(default_factory=list)
    # Ray uploads a local working_dir only when given to ray.init, as its `uv run` hook does.
    job_runtime_env: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Inputs:
    """What the scenarios of one package set are built from."""

    project: BenchProject  # locked; its venv is ready in the venv dir (scenario 2)
    floor_venv: Path  # built by `uv sync --locked` beforehand (scenario 1)
    scratch: Path  # where per-sample projects and empty uv caches go
    # Ray's `pip` field runs `python -m pip` in a clone of the node's venv; a venv made by uv has
    # no pip, so then pip comes from this dir (PYTHONPATH) instead: `None` when the node has pip.
    pip_shim: Path | None = None


def prepare(scenario: Scenario, inputs: Inputs) -> Prepared:
    project, packages = inputs.project, inputs.project.packages
    uv_project = {"project": str(project.path), "extras": [project.extra]}
    match scenario.id:
        case "floor":
            return Prepared({"py_executable": floor_python(inputs.floor_venv)})
        case "warm":
            return Prepared({"uv_project": uv_project})
        case "cold-venv" | "cold-all":
            # A copy whose pyproject differs by a comment: same lock, a key never built before.
            copy = project.salted_copy(inputs.scratch)
            env: dict[str, Any] = {"uv_project": {**uv_project, "project": str(copy.path)}}
            cleanup = [copy.path]
            if scenario.id == "cold-all":
                cache = Path(tempfile.mkdtemp(prefix="uv-cache-", dir=inputs.scratch))
                env["env_vars"] = {"UV_CACHE_DIR": str(cache)}
                cleanup.append(cache)
            return Prepared(env, cleanup)
        case "ray-uv":
            return Prepared({"uv": {"packages": packages}})
        case "ray-uv-cache":
            # Ray passes `--no-cache` unless told other options; none at all uses uv's cache.
            return Prepared({"uv": {"packages": packages, "uv_pip_install_options": []}})
        case "ray-pip":
            pip: dict[str, Any] = {"pip": {"packages": packages}}
            if inputs.pip_shim is not None:
                pip["env_vars"] = {"PYTHONPATH": str(inputs.pip_shim)}
            return Prepared(pip)
        case "uv-run":
            # What Ray's `uv run` driver hook and NeMo RL's PY_EXECUTABLES do: every worker runs
            # `uv run` in the job's working_dir (unpacked afresh in each Ray session). The node's
            # interpreter is pinned so that the workers' Python matches the driver's. `--project .`
            # because uv finds the project from the script it runs (Ray's default_worker.py, in
            # the node's venv), which is the working_dir's only when Ray lives in that project.
            return Prepared(
                {
                    "py_executable": f"uv run --project . --locked --extra {project.extra}",
                    "env_vars": {"UV_PYTHON": sys.executable},
                },
                job_runtime_env={"working_dir": str(project.path)},
            )
    raise ValueError(f"unknown scenario {scenario.id!r}")
