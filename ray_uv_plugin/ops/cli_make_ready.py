"""`ray-uv prepare`, `check` and `demo`: making an environment ready on a cluster's nodes, on
this host, or in a local Ray started for the demo, and rendering what each node or actor got.

Imports stay inside the commands, as in `cli`: only `prepare` and `demo` import Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_uv_plugin.cluster.auth import MODE_ENV
from ray_uv_plugin.env.uv import format_duration
from ray_uv_plugin.ops.cli_common import CliError, UsageError, node_count, selection

if TYPE_CHECKING:
    from ray_uv_plugin.cluster.node_result import NodeResult
    from ray_uv_plugin.env.spec import ParsedUvProject
    from ray_uv_plugin.ops.check import CheckResult, FoundEnv


# --- prepare ---------------------------------------------------------------------------------


def node_line(r: NodeResult) -> str:
    """One node's result as rich markup; what came from the node is escaped, so that an error
    about `ray[default]` keeps its `[default]`."""
    from rich.markup import escape

    if r.ok:
        return escape(f"{r.label}: uv_project {r.key}: {r.summary}")
    return f"{escape(r.label)}: [red]failed[/red]: {escape(r.error or 'unknown error')}"


class PrepareLines:
    """What `ray-uv prepare` shows as it goes (a `cluster.options.WatchReporter`): a line per
    node, a bar while shipping, and the watch's own lines."""

    def __init__(self, bars: Any, project: Path, interval: float | None) -> None:
        self.bars = bars  # a rich Progress
        self.project = project
        self.interval = interval
        self.sending: Any = None  # the ship's bar

    def started(self, spec: ParsedUvProject, nodes: int) -> None:
        value = json.dumps(spec.as_value())
        line = f"Preparing uv_project {value} of {self.project} on {node_count(nodes)}"
        self.bars.console.print(line, markup=False)

    def result(self, result: NodeResult) -> None:
        self.bars.console.print(node_line(result))

    def progress(self, p: Any) -> None:
        if self.sending is None:
            what = f"Shipping to {node_count(p.receivers)}"
            self.sending = self.bars.add_task(what, total=p.size)
        self.bars.update(self.sending, completed=min(p.sent, p.size))

    def say(self, line: str) -> None:
        """A line of the watch's own, after the last ship's bar (the next starts anew)."""
        if self.sending is not None:
            self.bars.remove_task(self.sending)
            self.sending = None
        self.bars.console.print(line, markup=False)

    def watching(self) -> None:
        self.say(f"Watching for nodes that join, every {self.interval:g}s (Ctrl-C stops)")

    def round(self, nodes: list[tuple[str, str]], source: NodeResult | None) -> None:
        names = ", ".join(f"{a} ({n[:8]})" for n, a in nodes)
        how = f"shipping from {source.label}" if source else "building there"
        self.say(f"{node_count(len(nodes))} joined: {names}: {how}")


def cmd_prepare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ray_uv_plugin.cluster import prepare, watch
    from ray_uv_plugin.cluster.connect import ConnectError
    from ray_uv_plugin.cluster.node_result import outcome_counts
    from ray_uv_plugin.cluster.options import DEFAULT_INTERVAL, PrepareOptions, WatchOptions
    from ray_uv_plugin.env.project import ProjectError
    from ray_uv_plugin.env.spec import UvProjectSpecError

    console = Console(stderr=True, soft_wrap=True)  # log-friendly: no hard wraps in pipes
    project = Path(args.project).expanduser().resolve()
    ship = False if args.no_ship else None
    if args.interval is not None and not args.watch:
        raise UsageError("--interval goes with --watch (how often it looks for new nodes)")
    if args.watch and args.json:
        raise UsageError("--json does not go with --watch: the watch prints a line per node")
    chosen = selection(args)  # every selection field, parsed
    interval: float | None = None
    if args.watch:
        interval = DEFAULT_INTERVAL if args.interval is None else args.interval
        try:
            watch.check_interval(interval)
        except prepare.PrepareError as e:
            raise UsageError(str(e)) from e
    where = (project, chosen, args.address, args.shared, ship, args.timeout)
    options = PrepareOptions(*where)
    if interval is not None:
        options = WatchOptions(*where, interval=interval, stop_signals=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bars:
        shown = PrepareLines(bars, project, interval)
        try:
            if isinstance(options, WatchOptions):
                results = watch.watch_env(options, shown)
            else:
                results = prepare.prepare(options, shown)
        except (UvProjectSpecError, ProjectError, prepare.PrepareError, ConnectError) as e:
            raise CliError(str(e)) from e
    if args.watch:
        console.print("Stopped watching", markup=False)
    if args.json:
        print(json.dumps({"nodes": [r.as_json() for r in results]}, indent=1))
    else:
        table = Table(box=None, pad_edge=False)
        for column in ("NODE", "ADDRESS", "RESULT", "UV SYNC", "VENV"):
            table.add_column(column)
        for r in sorted(results, key=lambda r: r.address):
            cells = (
                r.node_id[:8],
                r.address,
                r.summary,
                "-" if r.build_seconds is None else f"{r.build_seconds:.2f}",
                r.key or "-",
            )
            table.add_row(*map(escape, cells))
        Console().print(table, soft_wrap=True)
    failed = [r for r in results if not r.ok]
    if failed:
        console.print(
            f"error: {len(failed)} of {node_count(len(results))} failed: "
            + ", ".join(r.label for r in failed),
            markup=False,
        )
        return 1
    console.print(f"Prepared {node_count(len(results))} ({outcome_counts(results)})")
    return 0


# --- check -----------------------------------------------------------------------------------


LIBRARY_HINT = "hint: pass --library NAME to exit 1 when a library the job uses is missing"


def _check_json(project: Path, result: CheckResult | FoundEnv) -> dict[str, Any]:
    """`check --json`: the env's key and venv, its state (`ready` after a check; a dry run's
    as `list` says it), and per Ray library whether its Ray can run it; null for what a dry
    run did not see (no ready venv: no libraries) or does not do (build, time)."""
    from ray_uv_plugin.ops.check import CheckResult

    libraries = None
    if result.statuses is not None:
        libraries = [
            {
                "name": s.library.name,
                "ok": s.ok,
                "asked": s.library.name in result.wanted,
                "missing": list(s.missing),  # the distributions of its extra the venv lacks
                "requirement": None if s.ok else s.as_missing().requirement,
                "node_has": s.node_has,  # the node's own Ray has it (null: unknown)
            }
            for s in result.statuses
        ]
    return {
        "project": str(project),
        "key": result.key,
        "venv": str(result.venv),
        "state": "ready" if isinstance(result, CheckResult) else result.state,
        "note": None if isinstance(result, CheckResult) else result.note or None,
        "built": result.built if isinstance(result, CheckResult) else None,
        "seconds": result.seconds if isinstance(result, CheckResult) else None,
        "libraries": libraries,
        "wanted": list(result.wanted),
        # asked for and lacking (or, with no ready venv, not checked): exit status 1
        "missing": [s.library.name for s in result.failed]
        if isinstance(result, CheckResult)
        else result.missing,
        "notes": list(result.notes) if isinstance(result, CheckResult) else [],
    }


def _report_found(found: FoundEnv, as_json: bool = False, project: Path | None = None) -> int:
    """`check --dry-run`: what is there; exit 1 if a `--library` is missing or, with no
    ready venv to look into, cannot be checked."""
    from ray_uv_plugin.ops import check

    if as_json:
        print(json.dumps(_check_json(project or found.venv, found), indent=1))
        if found.missing:
            print(f"error: the env cannot run {', '.join(found.missing)}", file=sys.stderr)
        return 1 if found.missing else 0
    state = f"{found.state}: {found.note}" if found.note else found.state
    print(f"uv_project {found.key}: {state} -> {found.venv}")
    if found.statuses is None:
        print(
            "Nothing built (--dry-run): `ray-uv check` without it, or the first job that asks "
            "for this env here, builds it."
        )
    else:
        print("Ray libraries this env's Ray can run:")
        for line in check.report_lines(found):
            print(line)
        if not found.wanted and any(not s.ok for s in found.statuses):
            print(LIBRARY_HINT)
    if found.missing:
        names = ", ".join(found.missing)
        why = "lacks what" if found.statuses is not None else "is not built here to check what"
        print(f"error: the env {why} {names} needs", file=sys.stderr)
        return 1
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from ray_uv_plugin.env.project import ProjectError
    from ray_uv_plugin.env.spec import UvProjectSpecError
    from ray_uv_plugin.env.uv import UvSyncError
    from ray_uv_plugin.ops import check
    from ray_uv_plugin.settings import VenvDirError
    from ray_uv_plugin.store import trust

    project = Path(args.project).expanduser().resolve()
    spec = selection(args)
    try:
        wanted = check.parse_libraries(args.library or [])
    except check.CheckError as e:
        raise UsageError(str(e)) from e
    try:
        if args.dry_run:
            found = check.find_env(project, spec, wanted)
            return _report_found(found, args.json, project)
        print(
            f"Checking the uv_project env of {project} (this builds it if needed; --dry-run "
            "builds nothing)...",
            file=sys.stderr if args.json else sys.stdout,  # --json: stdout holds JSON alone
            flush=True,
        )
        result = check.run_check(project, spec, wanted)
    except (
        check.CheckError,
        UvProjectSpecError,
        ProjectError,
        UvSyncError,
        VenvDirError,
        trust.UntrustedPathError,
    ) as e:
        raise CliError(str(e)) from e
    if args.json:
        print(json.dumps(_check_json(project, result), indent=1))
        if result.failed:
            names = ", ".join(s.library.name for s in result.failed)
            print(f"error: the env lacks what {names} needs", file=sys.stderr)
        return 1 if result.failed else 0
    verb = "built" if result.built else "reused"
    print(f"uv_project {result.key}: {verb} in {format_duration(result.seconds)} -> {result.venv}")
    print("Ray libraries this env's Ray can run:")
    for line in check.report_lines(result):
        print(line)
    if result.failed:
        names = ", ".join(s.library.name for s in result.failed)
        print(
            f"error: the env lacks what {names} needs: add the requirements above", file=sys.stderr
        )
        return 1
    if not result.wanted and any(not s.ok for s in result.statuses):
        print(LIBRARY_HINT)
    return 0


# --- demo ------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ray_uv_plugin.ops import demo
    from ray_uv_plugin.store.layout import venv_root

    console = Console(soft_wrap=True)
    try:
        project = demo.find_demo_project(Path(args.project) if args.project else None)
    except demo.DemoError as e:
        raise CliError(str(e)) from e
    console.print(f"Driver: {sys.executable}")
    console.print(f"Project: {project} (extras: {', '.join(demo.DEMO_EXTRAS)})")
    console.print(f"Venvs: {venv_root()}")
    console.print("Starting a local Ray with the uv_project plugin...")
    start = time.perf_counter()
    auth_mode = os.environ.get(MODE_ENV)

    def on_result(r: demo.EnvResult) -> None:
        marker = r.report.get("marker") or {}
        verb = f"built (uv sync {marker.get('build_seconds', 0):.2f}s)" if r.built else "reused"
        console.print(
            f"uv_project {r.key} (extras={r.extra}): {verb}, actor ready in "
            f"{format_duration(r.seconds)}",
            highlight=False,
        )
        packages = ", ".join(
            f"{name} {r.report['packages'].get(name) or '(not installed)'}"
            for name in demo.DEMO_PACKAGES
        )
        console.print(f"    python: {r.report['python']}", highlight=False)
        console.print(f"    packages: {packages}", highlight=False)

    try:
        results = demo.run(project, on_result)
    except demo.DemoError as e:
        raise CliError(str(e)) from e
    except Exception as e:
        if type(e).__name__ == "RuntimeEnvSetupError":
            from ray_uv_plugin.cluster.connect import clean_error

            raise CliError(clean_error(e)) from e
        raise
    for r in sorted(results, key=lambda r: r.extra):
        if r.output:
            console.print(f"actor with extras={r.extra} made:", highlight=False)
            console.print(r.output.rstrip(), markup=False, highlight=False)
    console.print(f"Done in {time.perf_counter() - start:.1f}s; Ray is shut down.")
    if any(r.built for r in results):
        console.print("Run `ray-uv demo` again: the venvs are reused.")
    note = demo.token_note(auth_mode)
    if note is not None:
        console.print(note, highlight=False)
    return 0
