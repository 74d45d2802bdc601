"""Actor start-up time for every way a Ray user gets a Python environment, side by side.

    uv run python -m benchmarks.startup --quick --json out.json --plot out.png
    ray-uv bench --address 127.0.0.1:6379      # against a running cluster

Every sample is a fresh Ray session in a process of its own (local Ray by default, a 2-raylet
cluster on this host for the cluster rows, or a new job on the cluster at --address); scenarios
are interleaved round by round; the table shows the median and the min-max over repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.envs import (
    COMMITTED_SETS,
    DEFAULT_SETS,
    PACKAGE_SETS,
    BenchProject,
    remove_tree,
    sync_by_hand,
    write_project,
)
from benchmarks.report import (
    machine,
    plot,
    plot_growth,
    print_report,
    summarize,
    targets,
    write_json,
)
from benchmarks.runner import Case, Sample, Settings, run_all, run_sample, write_uv_wrapper
from benchmarks.scenarios import BY_ID, DEFAULT_SCENARIOS, HAND_SYNC, Inputs, uv_project_env_vars
from ray_uv_plugin.building.ensure import ensure_venv, lookup
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project, resolve_project_dir
from ray_uv_plugin.env.spec import parse_spec

# What --quick and a full run do where the command line does not say.
FULL = {"sets": ",".join(DEFAULT_SETS), "repeats": 5, "actors": "8,32", "multi_repeats": 3}
QUICK = {"sets": "small", "repeats": 1, "actors": "8", "multi_repeats": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ray-uv bench",
        description="Time to a first method call on new actors: uv_project against a prebuilt "
        "venv (the floor), Ray's uv and pip fields and `uv run` as py_executable.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small set, 1 repeat, 8 actors, no 2-raylet cluster (~3 min on 2 cores)",
    )
    p.add_argument(
        "--sets",
        help=f"package sets, comma-separated, of: {', '.join(PACKAGE_SETS)} "
        f"(default: {FULL['sets']})",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"scenarios, comma-separated, of: {', '.join(BY_ID)} (default: "
        f"{', '.join(DEFAULT_SCENARIOS)}; the others compare build settings)",
    )
    p.add_argument(
        "--imports",
        action="store_true",
        help="the first call imports the set's typical modules (benchmarks.envs.PROBE_IMPORTS): "
        "time to a first useful call, with first-import costs",
    )
    p.add_argument("--repeats", type=int, help="samples per single-actor case (default: 5)")
    p.add_argument(
        "--actors",
        help="N for the N-actors-at-once rows, comma-separated, '' for none (default: 8,32)",
    )
    p.add_argument("--multi-repeats", type=int, help="samples per N-actor case (default: 3)")
    p.add_argument(
        "--cluster",
        action=argparse.BooleanOptionalAction,
        help="also run the N-actor rows on a 2-raylet cluster on this host (default: yes, "
        "not with --quick or --address)",
    )
    p.add_argument(
        "--address",
        help="a running cluster: each sample is a new job on it; its "
        "nodes must see this host's --workdir at the same path",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="where projects, venvs and uv caches go (default: a new temp dir, removed afterwards)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per sample")
    p.add_argument("--json", type=Path, help="write every sample and the summary here")
    p.add_argument("--plot", type=Path, help="write a PNG chart here")
    p.add_argument(
        "--growth-plot", type=Path, help="write a PNG of time against N and lock size here"
    )
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cluster is None:
        args.cluster = not args.quick
    return args


def plugin_cost(project: BenchProject, root: Path, calls: int = 2000) -> dict[str, Any]:
    """The plugin's own work for a ready venv, as its `create` does it, timed in-process."""
    value = {"project": str(project.path), "extras": [project.extra]}
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        spec = parse_spec(value)
        files = load_project(resolve_project_dir(spec, None))
        outcome = lookup(make_request(spec, files, {}), root)
        times.append(time.perf_counter() - start)
        assert outcome is not None, "the warm venv is not ready"
    times.sort()
    return {
        "calls": calls,
        "median_ms": statistics.median(times) * 1000,
        "p99_ms": times[int(0.99 * len(times))] * 1000,
    }


def build_cases(args: argparse.Namespace) -> tuple[list[Case], dict[Case, int]]:
    chosen = [BY_ID[s] for s in args.scenarios.split(",") if s]
    topology = "address" if args.address else "local"
    ns = [int(n) for n in args.actors.split(",") if n.strip()]
    cases: list[Case] = []
    repeats: dict[Case, int] = {}
    for set_name in args.sets.split(","):
        for scenario in [*chosen, HAND_SYNC]:
            case = Case(set_name, scenario, 1, topology)
            cases.append(case)
            repeats[case] = args.repeats
        topologies = [topology] + (["cluster2"] if args.cluster and not args.address else [])
        for topo in topologies:
            for n in ns:
                for scenario in (s for s in chosen if s.multi):
                    case = Case(set_name, scenario, n, topo)
                    cases.append(case)
                    repeats[case] = args.multi_repeats
    return cases, repeats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Piped output is 80 columns wide by default: too narrow for the tables.
    console = Console() if sys.stdout.isatty() else Console(width=120)
    unknown = [s for s in args.sets.split(",") if s not in PACKAGE_SETS]
    unknown += [s for s in args.scenarios.split(",") if s and s not in BY_ID]
    if unknown:
        console.print(f"[red]unknown set(s) or scenario(s): {', '.join(unknown)}[/red]")
        return 2
    meta = machine()
    meta["args"] = {k: str(v) for k, v in vars(args).items()}
    console.print(
        f"[bold]ray-uv bench[/bold] on {meta.get('cpu', '?')}, {meta['cpus']} CPUs, "
        f"{meta.get('memory_gib', '?')} GiB, load {meta['loadavg_start'][0]:.1f}"
    )
    console.print(
        "Actors have num_cpus=0 (so N of them are not queued on CPUs); Ray's `uv run` "
        "driver hook is off in every sample (RAY_ENABLE_UV_RUN_RUNTIME_ENV=0)."
    )
    # Short: Ray's socket paths live under it (RAY_TMPDIR) and must stay under 107 characters.
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rub-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, console, workdir, meta)
    finally:
        if args.workdir is None:
            remove_tree(workdir)


def _run(args: argparse.Namespace, console: Console, workdir: Path, meta: dict[str, Any]) -> int:
    settings = Settings(workdir, workdir / "venvs", args.address, args.timeout, args.imports)
    chosen = args.scenarios.split(",")
    write_uv_wrapper(workdir / "uv-logged")
    (workdir / "scratch").mkdir(exist_ok=True)
    pip_shim = _pip_shim(workdir, console) if "ray-pip" in chosen else None
    inputs: dict[str, Inputs] = {}
    costs: dict[str, Any] = {}
    meta["sets"] = {}
    for set_name in args.sets.split(","):
        start = time.perf_counter()
        project = write_project(set_name, workdir / "projects" / set_name)
        floor = workdir / f"floor-{set_name}"
        # The floor: the same venv as the plugin builds (bytecode compiled), made by hand.
        floor_s = sync_by_hand(project, floor)
        requirements = (
            project.pinned_requirements() if set_name in COMMITTED_SETS else project.packages
        )
        inputs[set_name] = Inputs(
            project, floor, workdir / "scratch", tuple(requirements), pip_shim
        )
        spec = parse_spec({"project": str(project.path), "extras": [project.extra]})
        warm_ids = ["warm"] + [s for s in chosen if s == "warm-nobc"]
        for warm_id in warm_ids:
            if args.address:  # the venv must be ready on the cluster's nodes: one unmeasured job
                case = Case(set_name, BY_ID[warm_id], 1, "address")
                run_sample(case, inputs[set_name], settings, -1)
            else:
                env_vars = uv_project_env_vars(BY_ID[warm_id])
                ensure_venv(spec, load_project(project.path), env_vars, settings.venv_dir)
        if not args.address:
            costs[set_name] = plugin_cost(project, settings.venv_dir)
        meta["sets"][set_name] = {
            "asked_for": len(project.packages),
            "locked_packages": project.locked_packages(),
            "ray_field_requirements": len(requirements),
            "floor_venv_mb": _du_mb(floor),
            "floor_sync_s": floor_s,
        }
        console.print(
            f"set {set_name}: {len(project.packages)} packages asked for, "
            f"{meta['sets'][set_name]['locked_packages']} locked; floor venv "
            f"({meta['sets'][set_name]['floor_venv_mb']} MB) built in "
            f"{time.perf_counter() - start:.1f}s (its uv sync: {floor_s:.2f}s)"
        )

    cases, repeats = build_cases(args)
    # One unmeasured sample first: the first Ray session on a machine pays for cold disk caches.
    first = cases[0]
    run_sample(Case(first.set_name, BY_ID["floor"], 1, first.topology), inputs[first.set_name],
               settings, -1)  # fmt: skip
    total = sum(repeats.values())
    console.print(f"{total} samples, interleaved; each one a fresh Ray session")

    so_far: list[Sample] = []

    def progress(sample: Sample, done: int, total: int) -> None:
        so_far.append(sample)
        if args.json:  # after every sample: a run cut short keeps what it measured
            rows = summarize(so_far)
            write_json(args.json, meta, so_far, rows, targets(rows, {}), {})
        status = f"{sample.seconds:.2f}s" if sample.ok else f"[red]failed: {sample.error}[/red]"
        syncs = "" if sample.syncs is None else f", {sample.syncs} sync(s)"
        console.print(
            f"  [{done}/{total}] {sample.set_name} {sample.scenario} "
            f"x{sample.actors} {sample.topology}: {status}{syncs}",
            highlight=False,
        )

    samples = run_all(cases, repeats, inputs, settings, progress)
    meta["loadavg_end"] = os.getloadavg()
    plugin = _plugin_summary(costs, samples)
    rows = summarize(samples)
    found = targets(rows, plugin)
    print_report(console, rows, found)
    if args.json:
        write_json(args.json, meta, samples, rows, found, plugin)
        console.print(f"wrote {args.json}")
    title = f"ray-uv bench, {meta['date']}, {meta.get('cpu', '')} x{meta['cpus']}"
    if args.plot:
        plot(args.plot, rows, title)
        console.print(f"wrote {args.plot}")
    if args.growth_plot:
        sizes = {name: s["locked_packages"] for name, s in meta["sets"].items()}
        plot_growth(args.growth_plot, rows, sizes, title)
        console.print(f"wrote {args.growth_plot}")
    return 0 if all(s.ok for s in samples) else 1


def _plugin_summary(costs: dict[str, Any], samples: list[Sample]) -> dict[str, Any]:
    """In-process lookup cost (worst set) and the `reused in` times of the setup logs."""
    if not costs:
        return {}
    worst = max(costs.values(), key=lambda c: c["median_ms"])
    logged = [
        e["seconds"] * 1000
        for s in samples
        if s.scenario == "warm"
        for e in s.plugin_log
        if e["verb"] == "reused"
    ]
    summary = {**worst, "per_set": costs}
    if logged:
        summary["logged_median_ms"] = statistics.median(logged)
        summary["logged_max_ms"] = max(logged)
    return summary


def _du_mb(path: Path) -> int:
    """Disk use of a dir (hardlinked files once), as `du` counts it."""
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, timeout=600)
    return int(out.stdout.split()[0]) if out.returncode == 0 else -1


def _pip_shim(workdir: Path, console: Console) -> Path | None:
    """Ray's `pip` field needs pip in the node's Python; a uv-made venv has none."""
    if importlib.util.find_spec("pip") is not None:
        return None
    from ray_uv_plugin.env.uv import find_uv

    shim = workdir / "pip-shim"
    subprocess.run(
        [find_uv(), "pip", "install", "--quiet", "--target", str(shim), "pip"],
        check=True,
        timeout=300,
    )
    console.print(
        "This Python has no pip (a uv venv): Ray's `pip` field gets it through "
        "PYTHONPATH in its env_vars."
    )
    return shim


if __name__ == "__main__":
    sys.exit(main())
