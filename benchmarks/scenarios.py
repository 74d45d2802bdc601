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
    # uv settings over the plugin's defaults (uv_project: the runtime_env's env_vars; hand
    # syncs: the sync's environment)
    settings: tuple[tuple[str, str], ...] = ()
    hand: bool = False  # a `uv sync` by hand, no Ray


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
# The plugin's build settings against each other: not in a default run.
NO_BYTECODE = (("UV_COMPILE_BYTECODE", "0"),)
SETTINGS_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "warm-nobc",
        "2n",
        "warm, no bytecode",
        "uv_project, venv ready, built with UV_COMPILE_BYTECODE=0",
        multi=True,
        uv_project=True,
        settings=NO_BYTECODE,
    ),
    Scenario(
        "cold-venv-nobc",
        "3n",
        "cold venv, no bytecode",
        "uv_project, new venv, UV_COMPILE_BYTECODE=0",
        multi=True,
        uv_project=True,
        settings=NO_BYTECODE,
    ),
    Scenario(
        "cold-venv-copy",
        "3c",
        "cold venv, copy",
        "uv_project, new venv, UV_LINK_MODE=copy",
        multi=True,
        uv_project=True,
        settings=(("UV_LINK_MODE", "copy"),),
    ),
    Scenario(
        "hand-sync-nobc",
        "-n",
        "uv sync by hand, no bytecode",
        "uv sync --locked by hand, UV_COMPILE_BYTECODE=0 (no Ray)",
        multi=False,
        settings=NO_BYTECODE,
        hand=True,
    ),
    Scenario(
        "hand-sync-copy",
        "-c",
        "uv sync by hand, copy",
        "uv sync --locked by hand, UV_LINK_MODE=copy (no Ray)",
        multi=False,
        settings=(("UV_LINK_MODE", "copy"),),
        hand=True,
    ),
)
DEFAULT_SCENARIOS = tuple(s.id for s in SCENARIOS)
BY_ID = {s.id: s for s in (*SCENARIOS, *SETTINGS_SCENARIOS)}
# Not a Ray scenario: `uv sync --locked` into a fresh venv, by hand, warm cache (a sync's bound),
# with the plugin's defaults (bytecode compiled, hardlinks): the venv the plugin builds.
HAND_SYNC = Scenario(
    "hand-sync", "-", "uv sync by hand", "uv sync --locked by hand (no Ray)", multi=False, hand=True
)


@dataclass
class Prepared:
    runtime_env: dict[str, Any]
    cleanup: list[Path] = field(default_factory=list)
    # Ray uploads a local working_dir only when given to ray.init, as its `uv run` hook does.
    job_runtime_env: dict[str, Any] = field(default_factory=dict)
    # The local Ray's environment for this sample: the uv cache is the node's (a job's is
    # refused: `env.uv_cache`), so an empty one goes here.
    node_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Inputs:
    """What the scenarios of one package set are built from."""

    project: BenchProject  # locked; its venv is ready in the venv dir (scenario 2)
    floor_venv: Path  # built by `uv sync --locked` beforehand (scenario 1)
    scratch: Path  # where per-sample projects and empty uv caches go
    requirements: tuple[str, ...]  # what Ray's `uv` / `pip` fields install
    # Ray's `pip` field runs `python -m pip` in a clone of the node's venv; a venv made by uv has
    # no pip, so then pip comes from this dir (PYTHONPATH) instead: `None` when the node has pip.
    pip_shim: Path | None = None


def uv_project_env_vars(scenario: Scenario) -> dict[str, str]:
    """The env_vars of a uv_project scenario: its uv settings. Without bytecode, workers must not
    write `.pyc` files into the venv either, as workers of a non-root user cannot (it is made
    read-only; the benchmark may run as root, who could)."""
    env = dict(scenario.settings)
    if env.get("UV_COMPILE_BYTECODE") == "0":
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def prepare(scenario: Scenario, inputs: Inputs) -> Prepared:
    project, packages = inputs.project, list(inputs.requirements)
    uv_project = {"project": str(project.path), "extras": [project.extra]}
    env_vars = uv_project_env_vars(scenario)
    match scenario.id:
        case "floor":
            return Prepared({"py_executable": floor_python(inputs.floor_venv)})
        case "warm" | "warm-nobc":
            return Prepared(
                {"uv_project": uv_project, **({"env_vars": env_vars} if env_vars else {})}
            )
        case "cold-venv" | "cold-all" | "cold-venv-nobc" | "cold-venv-copy":
            # A copy whose pyproject differs by a comment: same lock, a key never built before.
            copy = project.salted_copy(inputs.scratch)
            env: dict[str, Any] = {"uv_project": {**uv_project, "project": str(copy.path)}}
            cleanup, node_env = [copy.path], {}
            if scenario.id == "cold-all":
                cache = Path(tempfile.mkdtemp(prefix="uv-cache-", dir=inputs.scratch))
                node_env["UV_CACHE_DIR"] = str(cache)
                cleanup.append(cache)
            if env_vars:
                env["env_vars"] = env_vars
            return Prepared(env, cleanup, node_env=node_env)
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
