"""Many keys built at once on one node: the build limit (`RAY_UV_PLUGIN_MAX_BUILDS`) and the venv
dir's budget (`RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES`), measured in one process without Ray.

N distinct keys (salted copies of the `small` set's project: Ray, httpx, tqdm, tabulate; one
lock; bytecode compiled, as the plugin builds) are asked for the way Ray's runtime-env agent asks:
every request at once on one event loop (`ensure_venv_async`). For each N, in this order:

- `one after another`: the same keys built one at a time (the total work, without overlap);
- `at once, default limit`: all at once under the default limit (the usable cores);
- `at once, no limit`: all at once with the limit set to N, as every build ran before;
- `budget`: all at once under the default limit, N new keys, in the venv dir of the first run,
  whose N venvs are made to look last used an hour ago, with a budget of that dir's size plus
  `--budget-slack` times what one venv adds to it: room for N venvs and a few more, so most
  old ones must go. (A build takes the bytecode of the nearest ready venv, `building.seeding`, and
  marks it used: a venv used in the last 2 minutes is never removed, so the slack covers the
  old venvs that new builds seed from.)

Reported: wall time; the most `uv sync`s that ran at once (a wrapper around uv logs each one's
start and end); requests that waited for a slot; for the budget run, the venv dir's size (`du`:
venvs and locks, hardlinks once, as the budget counts it) sampled every `--sample-s` seconds
and at the end, and the venvs removed. uv's cache is warmed first.

    uv run python -m benchmarks.build_limits [--keys 6 24] [--no-bytecode] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray

from ray_uv_plugin.building.ensure import ensure_venv_async
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import MAX_BUILDS_ENV, UV_ENV_VAR, VENV_DIR_MAX_BYTES_ENV
from ray_uv_plugin.store import disk
from ray_uv_plugin.store.build_slots import default_max_builds
from ray_uv_plugin.store.freezing import remove_tree
from ray_uv_plugin.store.layout import MARKER, Venv
from ray_uv_plugin.store.units import format_bytes

from .envs import BenchProject, write_project
from .log_lines import capturing_logger

SET = "small"
HOUR = 3600.0
REAL_UV = find_uv()  # before any wrapper is set as the node's uv


def write_span_uv(path: Path, spans: Path, uv: str) -> None:
    """A uv that logs `start <t>` and `end <t>` around each sync of the real `uv`, then exits
    as uv did."""
    log = f'[ "$1" = sync ] && echo "%s $(date +%%s.%%N)" >> {spans}'
    path.write_text(f'#!/bin/sh\n{log % "start"}\n{uv} "$@"\nrc=$?\n{log % "end"}\nexit $rc\n')
    path.chmod(0o755)


def peak(spans: Path) -> int:
    """The most syncs running at one time, from the wrapper's log."""
    events = sorted(
        (float(t), 1 if what == "start" else -1)
        for what, t in (line.split() for line in spans.read_text().splitlines())
    )
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def held(root: Path, venvs: list[Path] | None = None, ready: disk.ReadyTrees | None = None) -> int:
    """What the budget counts: the venvs (all of `root`'s by default) and their locks, each
    inode once; `ready`: ready venvs measured before are not walked again."""
    if venvs is None:
        venvs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    paths = venvs + [Venv(root, v.name).lock for v in venvs]
    return disk.measure(paths, ready).size(*paths)


class SizeSampler:
    """`held(root)` every `every` seconds in a thread, until stopped: the largest seen. Ready
    venvs are walked once (they do not change), so sampling costs the builds little CPU."""

    def __init__(self, root: Path, every: float) -> None:
        self.root, self.every, self.samples = root, every, []
        self.ready = disk.ReadyTrees()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(held(self.root, ready=self.ready))
            self._stop.wait(self.every)

    def __enter__(self) -> SizeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def build_all(
    projects: list[BenchProject], root: Path, work: Path, label: str, at_once: bool
) -> dict[str, Any]:
    """Build every project's key in `root`, all at once or one after another."""
    spans = work / f"spans-{label}.log"
    spans.touch()
    write_span_uv(work / f"uv-{label}", spans, REAL_UV)
    os.environ[UV_ENV_VAR] = str(work / f"uv-{label}")
    spec = parse_spec({"extras": [SET]})
    requests = [make_request(spec, load_project(p.path), {}) for p in projects]
    logger, lines = capturing_logger(f"build-limits-{label}", propagate=False)

    async def run() -> list[Any]:
        if at_once:
            builds = (ensure_venv_async(r, root, logger) for r in requests)
            return await asyncio.gather(*builds, return_exceptions=True)
        return [await ensure_venv_async(r, root, logger) for r in requests]

    start = time.perf_counter()
    outcomes = asyncio.run(run())
    wall = time.perf_counter() - start
    failed = [str(o) for o in outcomes if isinstance(o, BaseException)]
    assert all(o.built for o in outcomes if not isinstance(o, BaseException)), "all keys new"
    return {
        "keys": len(projects),
        "failed": len(failed),
        "first_failure": failed[0] if failed else None,
        "wall_s": round(wall, 2),
        "peak_syncs": peak(spans),
        "syncs": sum(1 for line in spans.read_text().splitlines() if line.startswith("start")),
        "waited_for_a_slot": lines.keys("waiting for a build slot ("),
        "removed_venvs": lines.count(": removed venv "),
        "budget_check_s": lines.budget_checks(),
    }


def age(root: Path, hours: float) -> None:
    t = time.time() - hours * HOUR
    for venv in root.iterdir():
        if (venv / MARKER).exists():
            os.utime(venv / MARKER, (t, t))


def one_n(base: BenchProject, n: int, work: Path, slack: float, sample_s: float) -> dict:
    keys_dir = work / f"projects-{n}"
    keys_dir.mkdir()
    projects = [base.salted_copy(keys_dir) for _ in range(n)]
    default = default_max_builds()
    out: dict[str, Any] = {"keys": n, "default_limit": default}
    os.environ.pop(MAX_BUILDS_ENV, None)
    os.environ.pop(VENV_DIR_MAX_BYTES_ENV, None)
    kept = work / f"venvs-{n}-serial"  # the budget run's old venvs
    out["one_after_another"] = build_all(projects, kept, work, f"{n}-serial", at_once=False)
    root = work / f"venvs-{n}-default"
    out["at_once_default_limit"] = build_all(projects, root, work, f"{n}-default", at_once=True)
    remove_tree(root)
    os.environ[MAX_BUILDS_ENV] = str(n)
    root = work / f"venvs-{n}-unlimited"
    out["at_once_no_limit"] = build_all(projects, root, work, f"{n}-unlimited", at_once=True)
    remove_tree(root)
    os.environ.pop(MAX_BUILDS_ENV)
    age(kept, 1)
    before = held(kept)
    # What a venv adds to a dir that holds one already: its own files (bytecode, scripts,
    # dirs); the rest are hardlinks from uv's cache that every venv shares.
    first = next(p for p in kept.iterdir() if (p / MARKER).exists())
    own = (before - held(kept, [first])) // max(1, n - 1)
    budget = before + int(own * slack)
    os.environ[VENV_DIR_MAX_BYTES_ENV] = str(budget)
    fresh = [base.salted_copy(keys_dir) for _ in range(n)]
    with SizeSampler(kept, sample_s) as sizes:
        run = build_all(fresh, kept, work, f"{n}-budget", at_once=True)
    os.environ.pop(VENV_DIR_MAX_BYTES_ENV)
    run.update(
        budget_bytes=budget,
        venv_own_bytes=own,
        before_bytes=before,
        peak_sampled_bytes=max([*sizes.samples, before]),
        end_bytes=held(kept),
        venvs_left=sum(1 for p in kept.iterdir() if (p / MARKER).exists()),
    )
    out["budget"] = run
    remove_tree(kept)
    return out


def markdown(results: dict[str, Any]) -> str:
    rows = [
        "| keys | how | builds at once (limit) | wall s | peak syncs at once | "
        "x one after another | requests that waited | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        serial = r["one_after_another"]["wall_s"]
        for name, how, limit in (
            ("one_after_another", "one after another", 1),
            ("at_once_default_limit", "all at once, default limit", r["default_limit"]),
            ("at_once_no_limit", "all at once, no limit", r["keys"]),
            ("budget", "all at once, default limit, budget", r["default_limit"]),
        ):
            m = r[name]
            rows.append(
                f"| {r['keys']} | {how} | {limit} | {m['wall_s']:.1f} | {m['peak_syncs']} | "
                f"{m['wall_s'] / serial:.2f} | {m['waited_for_a_slot']} | {m['failed']} |"
            )
    rows += [
        "",
        "| keys | budget | one venv adds | venv dir before (N old venvs) | largest sampled | "
        "at end | venvs removed | venvs left | making room per build, s (median / max) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        b = r["budget"]
        rows.append(
            f"| {r['keys']} | {format_bytes(b['budget_bytes'])} | "
            f"{format_bytes(b['venv_own_bytes'])} | {format_bytes(b['before_bytes'])}"
            f" | {format_bytes(b['peak_sampled_bytes'])} | {format_bytes(b['end_bytes'])} | "
            f"{b['removed_venvs']} | {b['venvs_left']} | "
            f"{statistics.median(b['budget_check_s']):.2f} / {max(b['budget_check_s']):.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[6, 24])
    parser.add_argument("--budget-slack", type=float, default=2.5)
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="UV_COMPILE_BYTECODE=0 on the node: syncs that link files only, and no seeding",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="build-limits-"))
    settings = (UV_ENV_VAR, MAX_BUILDS_ENV, VENV_DIR_MAX_BYTES_ENV, "UV_COMPILE_BYTECODE")
    saved = {name: os.environ.get(name) for name in settings}  # each run sets its own
    try:
        base = write_project(SET, work / "base")
        os.environ[UV_ENV_VAR] = REAL_UV
        if args.no_bytecode:
            os.environ["UV_COMPILE_BYTECODE"] = "0"
        warm = asyncio.run(  # uv's cache: every later build links from it
            ensure_venv_async(
                make_request(parse_spec({"extras": [SET]}), load_project(base.path), {}),
                work / "warm-up",
            )
        )
        remove_tree(warm.path.parent)
        results = {
            "machine": {
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
                "ray": ray.__version__,
                "loadavg_start": os.getloadavg(),
            },
            "set": SET,
            "bytecode": not args.no_bytecode,
            "runs": [one_n(base, n, work, args.budget_slack, args.sample_s) for n in args.keys],
        }
        results["machine"]["loadavg_end"] = os.getloadavg()
    finally:
        remove_tree(work)  # venvs are read-only (frozen as root): not for shutil.rmtree
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
