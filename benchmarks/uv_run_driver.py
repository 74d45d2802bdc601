"""A driver started with `uv run`, N plain actors: Ray's per-worker `uv run` hook against ours.

    uv run python -m benchmarks.uv_run_driver --sets realistic,big --actors 1,8,32 \
        --json benchmarks/results/uv-run-driver.json --plot benchmarks/results/uv-run-driver.png

The same driver script (`bench_driver.py`: `benchmarks/sample.py`, the harness `startup` runs,
copied into each set's uv project) starts a local Ray, N actors with no runtime_env of their own,
and times their first calls (each imports the set's typical modules). It is started as users
start it, `uv run --extra <set> python bench_driver.py` in the project's directory, in each of
these ways:

- floor: Ray's `uv run` hook off (`RAY_ENABLE_UV_RUN_RUNTIME_ENV=0`), no hook of ours: workers
  run in the driver's own `.venv` (prepared with bytecode, as the plugin's venvs are);
- ray-hook: Ray's default (`RAY_ENABLE_UV_RUN_RUNTIME_ENV=1`): every worker runs `uv run`;
- ray-env: Ray's hook off, and a job runtime_env without the plugin (`benchmarks.ray_env_hook`:
  the driver's `.venv` as `py_executable`, the project as `working_dir`): what any runtime_env
  costs each worker's start (Ray's `setup_worker` step), with nothing of ours;
- ours-ready / ours-first: after `eval "$(ray-uv plugin-config --shell)"`, the job gets the
  node's cached venv; ready = the venv exists (a second Ray session on the node), first = an
  empty venv dir (the session that builds it, warm uv cache).

Every sample is a fresh driver process and Ray session; ways are interleaved round by round.
`uv sync` by the plugin is counted through `RAY_UV_PLUGIN_UV`, and every `uv run` through the
`uv` that starts the driver (Ray's hook hands its path to the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from benchmarks import sample as harness
from benchmarks.envs import (
    PACKAGE_SETS,
    PROBE_IMPORTS,
    BenchProject,
    clean_env,
    remove_tree,
    write_project,
)
from benchmarks.report import machine
from benchmarks.runner import (
    SYNC_LOG_ENV,
    count_calls,
    rounds,
    run_for_result,
    session_env,
    write_uv_wrapper,
)
from benchmarks.uv_run_report import (
    WAYS,
    Sample,
    markdown,
    plot,
    print_report,
    summarize,
    targets,
    write_json,
)
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import UV_ENV_VAR, VENV_DIR_ENV
from ray_uv_plugin.store.layout import MARKER

ROOT = Path(__file__).resolve().parents[1]
RAY_UV = Path(sys.executable).parent / "ray-uv"
DRIVER_NAME = "bench_driver.py"
# What the benchmark's own environment may carry that would set a way up before we do.
SETUP_VARS = (
    "RAY_RUNTIME_ENV_HOOK",
    "RAY_UV_PLUGIN_PREVIOUS_HOOK",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV",
    "RAY_RUNTIME_ENV_PLUGINS",
    "RAY_RUNTIME_ENV_PLUGIN_SCHEMAS",
    "PYTHONPATH",
)


@dataclass(frozen=True)
class Case:
    set_name: str
    way: str
    actors: int

    @property
    def group(self) -> tuple[str, int]:
        return (self.set_name, self.actors)


@dataclass(frozen=True)
class Bench:
    """Where one run keeps its files; what every sample's environment shares."""

    workdir: Path
    timeout: float
    imports: bool

    @property
    def venv_dir(self) -> Path:
        return self.workdir / "venvs"

    @property
    def sync_log(self) -> Path:
        return self.workdir / "plugin-uv.log"

    @property
    def run_log(self) -> Path:
        return self.workdir / "uv-run.log"

    @property
    def uv(self) -> Path:
        """The `uv` that starts drivers: named `uv` (Ray's hook and ours look for that), it
        logs its subcommand and runs the real uv with its own path as argv[0], so Ray's hook
        hands this path to the workers and their `uv run` is counted too."""
        return self.workdir / "bin" / "uv"


def uv_binary() -> str:
    """The uv binary to run: `exec -a` gives a script (pyenv's `uv` shim is one) the name, but
    the script's own `exec` of the binary drops it, and Ray's hook would hand the workers the
    binary's path instead of the counting `uv`."""
    uv = find_uv()
    with open(uv, "rb") as f:
        if f.read(2) != b"#!":
            return uv
    from uv import find_uv_bin  # the `uv` package ray-uv-plugin depends on

    return str(find_uv_bin())


def write_counting_uv(bench: Bench) -> None:
    bench.uv.parent.mkdir(parents=True, exist_ok=True)
    bench.uv.write_text(
        f'#!/bin/bash\necho "$1" >> {bench.run_log}\nexec -a "$0" {uv_binary()} "$@"\n'
    )
    bench.uv.chmod(0o755)
    write_uv_wrapper(bench.workdir / "uv-logged")


def prepare_set(set_name: str, bench: Bench) -> BenchProject:
    """The set's locked project with the driver script, and its `.venv` synced: the floor, and
    what `uv run` finds."""
    project = write_project(set_name, bench.workdir / "projects" / set_name)
    (project.path / DRIVER_NAME).write_text(Path(harness.__file__).read_text())
    sync_dot_venv(project)
    return project


def sync_dot_venv(project: BenchProject) -> None:
    """The project's `.venv` synced to its lock the way the plugin builds venvs (bytecode
    compiled, this Python): what the user's last `uv run` left."""
    subprocess.run(
        [find_uv(), "sync", "--locked", "--quiet", "--extra", project.extra]
        + ["--compile-bytecode", "--python", sys.executable],
        cwd=project.path,
        env=clean_env(UV_PYTHON_DOWNLOADS="never"),
        check=True,
        timeout=3600,
    )


def way_env(way: str, bench: Bench, set_name: str) -> tuple[dict[str, str], str]:
    """The driver's environment and the shell set-up before it, for one way. Each set has a
    venv dir of its own: an `ours-first` sample empties its set's, never another set's."""
    env = {k: v for k, v in clean_env().items() if k not in SETUP_VARS}
    env.update(
        {
            UV_ENV_VAR: str(bench.workdir / "uv-logged"),
            SYNC_LOG_ENV: str(bench.sync_log),
            VENV_DIR_ENV: str(bench.venv_dir / set_name),
            **session_env(bench.workdir),
        }
    )
    if way == "floor":
        return {**env, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}, "true"
    if way == "ray-hook":
        return {**env, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "1"}, "true"
    if way == "ray-env":
        hook = {"RAY_RUNTIME_ENV_HOOK": "benchmarks.ray_env_hook.hook", "PYTHONPATH": str(ROOT)}
        return {**env, **hook, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}, "true"
    # The README's set-up. A local Ray runs its runtime-env agent in the driver's Python, which
    # needs the plugin: PYTHONPATH stands in for a project that depends on ray-uv-plugin.
    env["PYTHONPATH"] = str(ROOT)
    return env, f'eval "$({RAY_UV} plugin-config --shell)"'


def run_sample(case: Case, project: BenchProject, bench: Bench, repeat: int) -> Sample:
    """One `uv run` driver, one fresh Ray session; counts and checks what its workers ran."""
    if case.way == "ours-first":
        remove_tree(bench.venv_dir / case.set_name)
    for log in (bench.sync_log, bench.run_log):
        log.unlink(missing_ok=True)
    env, setup = way_env(case.way, bench, case.set_name)
    config = {
        "actors": case.actors,
        "imports": PROBE_IMPORTS[case.set_name] if bench.imports else [],
        "timeout": bench.timeout,
    }
    command = [str(bench.uv), "run", "--extra", project.extra, "python", DRIVER_NAME]
    script = f'{setup} && BENCH_T0=$(date +%s.%N) exec "$@"'
    try:
        result = run_for_result(
            ["bash", "-c", script, "-", *command, json.dumps(config)],
            project.path,
            env,
            bench.timeout,
            "driver",
        )
        setup_log = plugin_setup_lines(bench.workdir / "ray")
    finally:
        remove_tree(bench.workdir / "ray")
    ok, first_calls = bool(result.get("ok")), result.get("first_call_s") or []
    sample = Sample(
        case.set_name,
        case.way,
        case.actors,
        repeat,
        ok=ok,
        total_s=result.get("total_s") if ok else None,
        after_init_s=max(first_calls) if ok else None,  # from `ray.init` returning
        ray_init_s=result.get("ray_start_s"),
        driver_start_s=result.get("driver_start_s"),
        syncs=count_calls(bench.sync_log, "sync"),
        worker_uv_runs=max(0, count_calls(bench.run_log, "run") - 1),
        executables=result.get("executables", []),
        import_s=result.get("import_s", []),
        job_runtime_env=result.get("job_runtime_env") or {},
        error=result.get("error"),
        setup_log=setup_log,
    )
    if sample.ok and (wrong := wrong_env(sample, project, bench)):
        sample.ok, sample.error = False, wrong
    return sample


def plugin_setup_lines(ray_dir: Path) -> list[str]:
    """The plugin's lines (`uv_project ...`) in the session's runtime_env setup logs: how its
    venv was set up and how long that took, which the agent logs there for every job."""
    return [
        line
        for log in sorted(ray_dir.glob("**/logs/runtime_env_setup*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "uv_project " in line
    ]


def wrong_env(sample: Sample, project: BenchProject, bench: Bench) -> str | None:
    """Why the workers did not run where this way puts them, or None: a timing of the wrong
    environment (a silent fallback) must not pass for a result."""
    venv_dir = str(bench.venv_dir) + os.sep
    in_cache = all(e.startswith(venv_dir) for e in sample.executables)
    if sample.way.startswith("ours"):
        if not in_cache or not all(
            (Path(e).parent.parent / MARKER).is_file() for e in sample.executables
        ):
            return f"workers not in the node's cached venv: {sample.executables}"
        if sample.way == "ours-ready" and sample.syncs:
            return f"the venv was not ready: {sample.syncs} sync(s) in this session"
    elif sample.way in ("floor", "ray-env"):
        if sample.executables != [str(project.path / ".venv" / "bin" / "python")]:
            return f"workers not in the driver's .venv: {sample.executables}"
        has_env = "py_executable" in sample.job_runtime_env
        if has_env != (sample.way == "ray-env"):
            return f"the job's runtime_env is not this way's: {sample.job_runtime_env}"
    elif sample.worker_uv_runs == 0 or any(e.startswith(venv_dir) for e in sample.executables):
        return f"workers did not run `uv run`: {sample.executables}"
    return None


def parser() -> argparse.ArgumentParser:
    """The options of a driver bench (`benchmarks.uv_run_after_change` adds its own)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.uv_run_driver",
        description="A driver started with `uv run --extra <set>`, N plain actors: the floor, "
        "Ray's per-worker `uv run` hook and the plugin's hook (venv ready / first session).",
    )
    p.add_argument("--sets", default="realistic,big", help="package sets, comma-separated")
    p.add_argument("--actors", default="1,8,32", help="N, comma-separated")
    p.add_argument("--ways", default=",".join(WAYS), help=f"of: {', '.join(WAYS)}")
    p.add_argument("--repeats", type=int, default=2, help="samples per case (default 2)")
    p.add_argument(
        "--first-repeats",
        type=int,
        default=1,
        help="samples per ours-first case (default 1: each rebuilds the venv)",
    )
    p.add_argument(
        "--imports",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each actor's first call imports the set's typical modules (default: yes)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per sample")
    p.add_argument("--workdir", type=Path, help="default: a new temp dir, removed afterwards")
    p.add_argument("--json", type=Path, help="write every sample, the rows and targets here")
    p.add_argument("--plot", type=Path, help="write a PNG chart here")
    p.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def console_for_output() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=140)


def in_workdir(args: argparse.Namespace, run: Callable[[Bench], int]) -> int:
    """`run` with a Bench in `--workdir`, or in a new temp dir removed afterwards."""
    # Short: Ray's socket paths live under it (RAY_TMPDIR) and must stay under 107 characters.
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rud-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return run(Bench(workdir, args.timeout, args.imports))
    finally:
        if args.workdir is None:
            remove_tree(workdir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = console_for_output()
    sets = [s for s in args.sets.split(",") if s]
    ways = [w for w in args.ways.split(",") if w]
    unknown = [s for s in sets if s not in PACKAGE_SETS] + [w for w in ways if w not in WAYS]
    if unknown:
        console.print(f"[red]unknown set(s) or way(s): {', '.join(unknown)}[/red]")
        return 2
    return in_workdir(args, lambda bench: _run(args, sets, ways, bench, console))


def _run(
    args: argparse.Namespace, sets: list[str], ways: list[str], bench: Bench, console: Console
) -> int:
    meta = machine()
    meta["args"] = {k: str(v) for k, v in vars(args).items()}
    console.print(
        f"[bold]uv run driver bench[/bold] on {meta.get('cpu', '?')}, {meta['cpus']} CPUs, "
        f"load {meta['loadavg_start'][0]:.1f}; actors num_cpus=0, ray.init() on all cores"
    )
    write_counting_uv(bench)
    projects: dict[str, BenchProject] = {}
    for set_name in sets:
        start = time.perf_counter()
        projects[set_name] = prepare_set(set_name, bench)
        # Unmeasured: the first Ray session pays cold disk caches, and it builds the venv that
        # ours-ready finds (every ours-first sample builds it again).
        warm = run_sample(Case(set_name, "ours-first", 1), projects[set_name], bench, -1)
        if not warm.ok:
            console.print(f"[red]{set_name}: the warm-up driver failed: {warm.error}[/red]")
            return 1
        console.print(
            f"set {set_name}: project, .venv and cached venv in {time.perf_counter() - start:.1f}s"
        )
    cases, repeats = [], {}
    for set_name in sets:
        for n in (int(x) for x in args.actors.split(",") if x.strip()):
            for way in ways:
                case = Case(set_name, way, n)
                cases.append(case)
                repeats[case] = args.first_repeats if way == "ours-first" else args.repeats
    total = sum(repeats.values())
    samples: list[Sample] = []
    for r, case in rounds(cases, repeats):  # type: ignore[arg-type]
        sample = run_sample(case, projects[case.set_name], bench, r)
        samples.append(sample)
        status = f"{sample.total_s:.2f}s" if sample.ok else f"[red]failed: {sample.error}[/red]"
        console.print(
            f"  [{len(samples)}/{total}] {case.set_name} {case.way} x{case.actors}: {status}, "
            f"{sample.syncs} sync(s), {sample.worker_uv_runs} worker uv run(s)",
            highlight=False,
        )
        if args.json:  # after every sample: a run cut short keeps what it measured
            write_json(args.json, meta, samples)
    meta["loadavg_end"] = os.getloadavg()
    rows = summarize(samples)
    print_report(console, rows, targets(rows))
    if args.markdown:
        print(markdown(rows, targets(rows)))
    if args.json:
        write_json(args.json, meta, samples)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(
            args.plot,
            rows,
            f"`uv run` driver, {meta['date']}, {meta.get('cpu', '')} x{meta['cpus']}",
        )
        console.print(f"wrote {args.plot}")
    return 0 if all(s.ok for s in samples) else 1


if __name__ == "__main__":
    sys.exit(main())
