"""The first `uv run` session after a one-package change: ours against Ray's hook.

    uv run python -m benchmarks.uv_run_after_change --sets big --actors 1,8,32 --repeats 2 \
        --change rich==14.3.0 --json benchmarks/results/uv-run-after-change.json

Users iterate: they bump one package, re-lock, and `uv run` the driver again. Before every
sample, the set's project is back at lock A: its `.venv` synced to A (what Ray's hook and the
driver's own `uv run` find) and the node's venv dir holding A's venv, built and ready, and
nothing else. Then the project's lock becomes B (`uv lock --upgrade-package SPEC` of a copy,
made once: `benchmarks.edit_run.changed_lock`) and one `uv run` driver starts, in one of two
ways (`benchmarks.uv_run_driver`):

- ours-change: after `eval "$(ray-uv plugin-config --shell)"`: B's venv is new to the node (its
  key differs), so the plugin builds it, seeded from A's;
- ray-hook: Ray's default hook: every worker runs `uv run` in the job's working_dir.

Each sample is timed from `uv run` to all N actors answered, as the matrix is. For ours, the
plugin's share is the setup Ray's runtime-env agent logged for the job (`uv_project <key>: built
in ...`, and the seeding line with what it took from A); the rest of the time after `ray.init`
is Ray's: starting N workers through `setup_worker` and their first calls; the build's steps
(`step <name> took <s>`: sync, seeding, compile, manifest, freeze) come from the same log. B's
changed package is fetched into the uv cache once beforehand (unmeasured), so that no sample
downloads it. The driver bench's options (`benchmarks.uv_run_driver`) apply, and `--change`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.edit_run import changed_lock
from benchmarks.envs import BenchProject, remove_tree
from benchmarks.report import machine
from benchmarks.uv_run_driver import (
    Bench,
    Case,
    console_for_output,
    in_workdir,
    parser,
    prepare_set,
    run_sample,
    sync_dot_venv,
    write_counting_uv,
)
from benchmarks.uv_run_report import Sample, markdown, summarize
from ray_uv_plugin.store.layout import KEY_LENGTH, Venv

WAYS = ("ours-change", "ray-hook")
_DURATION = r"([\d.]+)(ms|s)"
_STEP = re.compile(r"uv_project \w+: step (\w+) took ([\d.]+)s")


def back_to_a(project: BenchProject, lock_a: str, venvs: Path, key_a: str) -> None:
    """Lock A, its `.venv`, and no venv of the node's but A's."""
    (project.path / "uv.lock").write_text(lock_a)
    sync_dot_venv(project)
    for entry in venvs.iterdir():
        if entry.name[:KEY_LENGTH] != key_a and not entry.name.startswith("."):
            remove_tree(entry) if entry.is_dir() else entry.unlink()


def seconds(text: str) -> float:
    value, unit = re.fullmatch(_DURATION, text).groups()  # type: ignore[union-attr]
    return float(value) / (1000 if unit == "ms" else 1)


def plugin_share(sample: Sample) -> dict[str, Any]:
    """What the setup log says the plugin did for this job: the build's seconds (from the
    agent's request to the venv ready), its steps' seconds, the seeding, compiling and manifest
    lines, and how the venv was built."""
    share: dict[str, Any] = {}
    for line in sample.setup_log:
        if found := re.search(rf"uv_project (\w+): (built|reused) in {_DURATION} ->", line):
            took = seconds(found.group(3) + found.group(4))
            if found.group(2) == "built":
                share["setup_s"] = max(share.get("setup_s", 0.0), took)
            else:
                share["reused"] = share.get("reused", 0) + 1
        elif found := _STEP.search(line):
            share.setdefault("steps_s", {})[found.group(1)] = float(found.group(2))
        elif "seeded from" in line:
            share["seeded"] = line.split("uv_project ", 1)[1]
        elif "modules the seed did not give" in line or "manifest of" in line:
            share.setdefault("steps", []).append(line.split("uv_project ", 1)[1])
    if sample.executables and sample.way == "ours-change":
        marker = Venv.at(Path(sample.executables[0]).parent.parent).read_marker() or {}
        share["built"] = marker.get("built")
        share["uv_seconds"] = marker.get("build_seconds")
    if "setup_s" in share and sample.after_init_s is not None:
        share["ray_rest_s"] = round(sample.after_init_s - share["setup_s"], 2)
    return share


def run(args: argparse.Namespace, sets: list[str], bench: Bench, console: Console) -> int:
    """The after-change samples of every set and N, ways interleaved, `args.repeats` each."""
    meta = machine()
    meta["args"] = {k: str(v) for k, v in vars(args).items()}
    console.print(
        f"[bold]uv run driver after a one-package change ({args.change})[/bold] on "
        f"{meta['cpus']} CPUs, load {meta['loadavg_start'][0]:.1f}"
    )
    write_counting_uv(bench)
    samples: list[Sample] = []
    shares: list[dict[str, Any]] = []
    counts = [int(x) for x in args.actors.split(",") if x.strip()]
    for set_name in sets:
        project = prepare_set(set_name, bench)  # lock A, its .venv
        lock_a = (project.path / "uv.lock").read_text()
        b = changed_lock(project.path, args.change, bench.workdir / f"lock-b-{set_name}")
        lock_b = (b / "uv.lock").read_text()
        shutil.rmtree(b)
        if lock_b == lock_a:
            console.print(f"[red]{set_name}: {args.change} leaves the lock as it is[/red]")
            return 2
        (project.path / "uv.lock").write_text(lock_b)
        sync_dot_venv(project)  # unmeasured: B's package into the uv cache
        (project.path / "uv.lock").write_text(lock_a)
        sync_dot_venv(project)
        for _ in range(3):  # A's venv; on a loaded host Ray's own start may time out
            warm = run_sample(Case(set_name, "ours-first", 1), project, bench, -1)
            if warm.ok:
                break
            console.print(f"[red]{set_name}: A's warm-up failed, again: {warm.error}[/red]")
        if not warm.ok:
            console.print(f"[red]{set_name}: A's venv was not built: {warm.error}[/red]")
            return 1
        key_a = Path(warm.executables[0]).parent.parent.name
        venvs = bench.venv_dir / set_name
        console.print(f"set {set_name}: lock A's venv {key_a} ready, lock B made")
        for n in counts:
            for repeat in range(args.repeats):
                for way in WAYS:
                    back_to_a(project, lock_a, venvs, key_a)
                    (project.path / "uv.lock").write_text(lock_b)
                    sample = run_sample(Case(set_name, way, n), project, bench, repeat)
                    share = {"set": set_name, "way": way, "actors": n, "repeat": repeat}
                    share |= plugin_share(sample)
                    samples.append(sample)
                    shares.append(share)
                    status = f"{sample.total_s:.2f}s" if sample.ok else f"failed: {sample.error}"
                    console.print(f"  {set_name} {way} x{n}: {status}; {share}", highlight=False)
                    if args.json:
                        write_json(args.json, meta, samples, shares)
        (project.path / "uv.lock").write_text(lock_a)
    meta["loadavg_end"] = os.getloadavg()
    rows = summarize(samples)
    print(markdown(rows, []))
    for verdict in verdicts(rows):
        console.print(verdict, highlight=False)
    if args.json:
        write_json(args.json, meta, samples, shares)
    return 0 if all(s.ok for s in samples) else 1


def main(argv: list[str] | None = None) -> int:
    p = parser()
    p.prog = "python -m benchmarks.uv_run_after_change"
    p.description = __doc__.splitlines()[0]
    p.add_argument(
        "--change",
        required=True,
        metavar="SPEC",
        help="the one-package change, as `uv lock --upgrade-package SPEC` takes it "
        "(e.g. rich==14.3.0)",
    )
    args = p.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    console = console_for_output()
    return in_workdir(args, lambda bench: run(args, sets, bench, console))


def verdicts(rows: list[Any]) -> list[str]:
    """The issue's target at each N: ours (first session after the change) below Ray's hook."""
    by = {(r.set_name, r.actors, r.way): r.median for r in rows}
    found = []
    for set_name, n in sorted({(r.set_name, r.actors) for r in rows}):
        ours, theirs = by.get((set_name, n, "ours-change")), by.get((set_name, n, "ray-hook"))
        if ours is None or theirs is None:
            found.append(f"{set_name} x{n}: not measured")
        else:
            met = "met" if ours < theirs else "missed"
            found.append(f"{set_name} x{n}: ours {ours:.2f}s, Ray's hook {theirs:.2f}s: {met}")
    return found


def write_json(
    path: Path, meta: dict[str, Any], samples: list[Sample], shares: list[dict[str, Any]]
) -> None:
    rows = summarize(samples)
    data = {
        "meta": {**meta, "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
        "samples": [asdict(s) for s in samples],
        "plugin_share": shares,
        "rows": [asdict(r) for r in rows],
        "verdicts": verdicts(rows),
    }
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    sys.exit(main())
