"""Running and timing: one subprocess (one fresh Ray session) per sample, interleaved rounds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray_uv_plugin
from benchmarks.envs import PROBE_IMPORTS, clean_env, sync_by_hand
from benchmarks.sample import RESULT_PREFIX
from benchmarks.scenarios import Inputs, Scenario, prepare
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import VENV_DIR_ENV

SYNC_LOG_ENV = "RAY_UV_BENCH_SYNC_LOG"


@dataclass(frozen=True)
class Case:
    """One cell of the table: a scenario for a package set, N actors, on a topology."""

    set_name: str
    scenario: Scenario
    actors: int = 1
    # "local" (one raylet), "cluster2" (2 raylets sharing the venv dir), "address" (--address)
    topology: str = "local"

    @property
    def group(self) -> tuple[str, int, str]:
        return (self.set_name, self.actors, self.topology)


@dataclass
class Sample:
    set_name: str
    scenario: str
    actors: int
    topology: str
    repeat: int
    ok: bool
    seconds: float | None  # time until every actor answered its first call
    first_call_s: list[float] = field(default_factory=list)
    syncs: int | None = None  # `uv sync` runs by the plugin during the sample
    plugin_log: list[dict[str, Any]] = field(default_factory=list)
    executables: list[str] = field(default_factory=list)
    ray_start_s: float | None = None
    error: str | None = None
    import_s: list[float] = field(default_factory=list)  # in each worker, with --imports

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Settings:
    workdir: Path
    venv_dir: Path
    address: str | None
    timeout: float
    imports: bool = False  # the first call imports the set's PROBE_IMPORTS


def write_uv_wrapper(path: Path) -> Path:
    """A `uv` that logs each call to $RAY_UV_BENCH_SYNC_LOG, then execs the real one."""
    path.write_text(
        "#!/bin/sh\n"
        f'[ -n "${SYNC_LOG_ENV}" ] && echo "$*" >> "${SYNC_LOG_ENV}"\n'
        f'exec "{find_uv()}" "$@"\n'
    )
    path.chmod(0o755)
    return path


def session_env(workdir: Path) -> dict[str, str]:
    """What every sample's Ray session runs with, whoever starts the driver."""
    return {
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray's own files (sessions, its `uv`/`pip` venvs, the current-cluster address) in a dir
        # of ours: other Rays on this host neither join ours nor are joined by it.
        "RAY_TMPDIR": str(workdir / "ray"),
        # Workers that Ray prestarts for the first driver would compete with the measured ones.
        "RAY_prestart_worker_first_driver": "0",
    }


def sample_env(settings: Settings, sync_log: Path) -> dict[str, str]:
    """The environment of a sample's driver, and so of the local Ray it starts."""
    return clean_env(
        RAY_RUNTIME_ENV_PLUGINS=ray_uv_plugin.plugin_config(),
        RAY_UV_PLUGIN_UV=str(settings.workdir / "uv-logged"),
        **{VENV_DIR_ENV: str(settings.venv_dir), SYNC_LOG_ENV: str(sync_log)},
        # Ray's `uv run` hook would put py_executable="uv run ..." into every job's runtime_env
        # when the driver runs under `uv run`; with it, Ray's `uv` field never comes up here.
        RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
        **session_env(settings.workdir),
    )


def count_calls(log: Path, verb: str) -> int:
    """How many calls a counting `uv` (`write_uv_wrapper`) logged with subcommand `verb`."""
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if line.split(" ")[0] == verb)


def run_sample(case: Case, inputs: Inputs, settings: Settings, repeat: int) -> Sample:
    base = dict(
        set_name=case.set_name,
        scenario=case.scenario.id,
        actors=case.actors,
        topology=case.topology,
        repeat=repeat,
    )
    if case.scenario.hand:
        venv = inputs.scratch / f"{case.scenario.id}-{case.set_name}"
        try:
            seconds = sync_by_hand(inputs.project, venv, settings=dict(case.scenario.settings))
        finally:
            shutil.rmtree(venv, ignore_errors=True)
        return Sample(**base, ok=True, seconds=seconds, first_call_s=[seconds])
    prepared = prepare(case.scenario, inputs)
    if prepared.node_env and settings.address is not None:
        for path in prepared.cleanup:
            shutil.rmtree(path, ignore_errors=True)
        error = f"{case.scenario.id} sets the node's environment: only a local Ray takes it"
        return Sample(**base, ok=False, seconds=None, error=error)
    sync_log = settings.workdir / "sync.log"
    sync_log.unlink(missing_ok=True)
    config = {
        "runtime_env": prepared.runtime_env,
        "job_runtime_env": prepared.job_runtime_env,
        "actors": case.actors,
        "imports": PROBE_IMPORTS[case.set_name] if settings.imports else [],
        "cluster": case.topology == "cluster2",
        "address": settings.address,
        "timeout": settings.timeout,
    }
    try:
        env = {**sample_env(settings, sync_log), **prepared.node_env}
        result = _run_child(config, env, settings)
    finally:
        for path in [*prepared.cleanup, settings.workdir / "ray"]:
            shutil.rmtree(path, ignore_errors=True)
    first = result.get("first_call_s") or []
    syncs = None
    if case.scenario.uv_project:
        if settings.address is None:
            syncs = count_calls(sync_log, "sync")
        elif result.get("setup_log"):
            syncs = sum(1 for entry in result["setup_log"] if entry["verb"] == "built")
    return Sample(
        **base,
        ok=bool(result.get("ok")),
        seconds=max(first) if result.get("ok") else None,
        first_call_s=first,
        import_s=result.get("import_s") or [],
        syncs=syncs,
        plugin_log=result.get("setup_log", []),
        executables=result.get("executables", []),
        ray_start_s=result.get("ray_start_s"),
        error=result.get("error"),
    )


def _run_child(config: dict[str, Any], env: dict[str, str], settings: Settings) -> dict[str, Any]:
    """Run `benchmarks.sample` for one sample."""
    cmd = [sys.executable, "-m", "benchmarks.sample", json.dumps(config)]
    return run_for_result(cmd, settings.workdir, env, settings.timeout, "sample process")


def run_for_result(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, what: str
) -> dict[str, Any]:
    """Run `cmd` in its own process group and return the JSON it printed after
    `RESULT_PREFIX`; kill only that group if it hangs past `timeout` (+ 120 s of start-up)."""
    with subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            output, _ = proc.communicate()
            return {"ok": False, "error": f"{what} hung; killed: {output[-500:]}"}
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    return {"ok": False, "error": f"{what} exited {proc.returncode}: {output[-1500:]}"}


def _kill_group(proc: subprocess.Popen[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        time.sleep(5)


def rounds(cases: list[Case], repeats: dict[Case, int]) -> Iterator[tuple[int, Case]]:
    """Interleaved: round r runs every case that still needs a repeat, rotated by r."""
    most = max(repeats.values(), default=0)
    for r in range(most):
        todo = [c for c in cases if repeats[c] > r]
        shift = r % len(todo) if todo else 0
        for case in todo[shift:] + todo[:shift]:
            yield r, case


def run_all(
    cases: list[Case],
    repeats: dict[Case, int],
    inputs: dict[str, Inputs],
    settings: Settings,
    on_sample: Callable[[Sample, int, int], None],
) -> list[Sample]:
    total = sum(repeats.values())
    samples: list[Sample] = []
    for r, case in rounds(cases, repeats):
        sample = run_sample(case, inputs[case.set_name], settings, r)
        samples.append(sample)
        on_sample(sample, len(samples), total)
    return samples
