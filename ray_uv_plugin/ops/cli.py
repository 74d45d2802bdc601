"""`ray-uv`: the operator's command line, a thin layer over plain functions.

Imports stay inside the commands: `ray-uv plugin-config` runs before every `ray start`, and
must not pay for importing Ray.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_uv_plugin import PLUGINS_ENV, plugins_setting
from ray_uv_plugin.agent.uv import format_duration

if TYPE_CHECKING:
    from ray_uv_plugin.ops.check import FoundEnv
    from ray_uv_plugin.ops.inventory import VenvEntry
    from ray_uv_plugin.ops.prepare import NodeResult

EPILOG = "Docs: docs/operations.md. Every command has --help."


class CliError(Exception):
    """A bad input or state; printed as `error: ...` with exit status 2."""


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


# --- --version -------------------------------------------------------------------------------


def versions() -> str:
    """`ray-uv --version`: this package's version first, in `uv --version`'s form, then what
    decides the envs built here: the Ray and Python that run `ray-uv` (a node's, when run in
    the environment of its `ray start`) and the uv that the plugin runs (`uv.find_uv`)."""
    from importlib.metadata import PackageNotFoundError, version

    from ray_uv_plugin.agent.uv import find_uv, uv_version

    def installed(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name}: not installed"

    try:
        uv = find_uv()
        uv_line = f"{uv_version(uv)} at {uv}"
    except (OSError, ImportError) as e:
        uv_line = f"uv: not usable: {e}"
    python = ".".join(map(str, sys.version_info[:3]))
    return "\n".join(
        [
            installed("ray-uv-plugin"),
            installed("ray"),
            uv_line,
            f"python {python} at {sys.executable}",
        ]
    )


class _VersionAction(argparse.Action):
    """`--version`, worked out only when asked: it runs `uv --version`."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(versions(), flush=True)  # a closed pipe fails here, where `main` handles it
        parser.exit()


# --- plugin-config ---------------------------------------------------------------------------


def cmd_plugin_config(args: argparse.Namespace) -> int:
    try:
        plugins = plugins_setting(os.environ.get(PLUGINS_ENV))
    except ValueError as e:
        raise CliError(str(e)) from None
    if not args.shell:
        print(plugins)
        return 0
    from ray_uv_plugin.driver_hook import hook_settings
    from ray_uv_plugin.schema import SCHEMAS_ENV, schemas_setting

    print(f"export {PLUGINS_ENV}={shlex.quote(plugins)}")
    print(f"export {SCHEMAS_ENV}={shlex.quote(schemas_setting(os.environ.get(SCHEMAS_ENV)))}")
    for name, value in hook_settings(os.environ, portable=True).items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


# --- list ------------------------------------------------------------------------------------


def _state(e: VenvEntry) -> str:
    """The STATE column: the state, what is wrong, and whether gc may ever remove it."""
    if e.users:
        return f"in use ({len(e.users)} processes)"
    state = f"{e.state}: {e.note}" if e.note else e.state
    return f"{state}; not ours: {e.not_ours}" if e.not_ours else state


# Where Ray unpacks a job's or actor's working_dir on a node: `<temp dir>/session_<time>/
# runtime_resources/working_dir_files/<package>`, the package named after its content hash
# (`_ray_pkg_<hex>`) or its remote URI. A uv_project there records that path as its project.
RAY_WORKING_DIR = re.compile(r"/session_[^/]+/runtime_resources/working_dir_files/([^/]+)(/.*)?$")
RAY_PACKAGE = re.compile(r"(_ray_pkg_[0-9a-f]{8})[0-9a-f]+")


def project_label(project: str) -> str:
    """The PROJECT column: a project path as it is, but a working_dir that Ray unpacked as
    `(Ray working_dir _ray_pkg_0123abcd)`: the package as Ray's logs name it (its hash cut
    to 8 digits, as git's short hashes), not a session path that nobody typed and that wraps
    over lines. `list --wide` and `--json` show the full path."""
    found = RAY_WORKING_DIR.search(project)
    if found is None:
        return project
    package = RAY_PACKAGE.sub(r"\1", found.group(1))
    return f"(Ray working_dir {package}){found.group(2) or ''}"


def _utc(timestamp: float) -> str:
    """ISO 8601 in UTC, to the second: `2026-11-23T12:00:00Z`."""
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_row(e: VenvEntry, size: int) -> dict[str, Any]:
    """A venv in `list --json`: null for what is unknown (an entry without valid metadata
    has no name, project, extras or groups, rather than none), times in UTC as ISO 8601
    and as Unix seconds (to compute with)."""
    meta = e.meta or {}
    return {
        "key": e.key,
        "path": str(e.path),
        "state": e.state,
        "note": e.note or None,
        "not_ours": e.not_ours,
        "name": meta.get("name"),
        "project": meta.get("project"),
        "extras": e.extras if e.meta else None,
        "groups": e.groups if e.meta else None,
        "size_bytes": size,
        "last_used": _utc(e.last_used),
        "last_used_unix": e.last_used,
        "users": list(e.users),
        "ray": meta.get("ray"),
        "python": meta.get("python"),
    }


def cmd_list(args: argparse.Namespace) -> int:
    from ray_uv_plugin.ops import inventory
    from ray_uv_plugin.store import disk, trust
    from ray_uv_plugin.store.layout import VenvDirError, venv_root

    try:
        root = venv_root()
        exists = inventory.check_venv_dir(root, "list")
    except (VenvDirError, trust.UntrustedPathError) as e:
        raise CliError(str(e)) from e
    inv = inventory.scan(root) if exists else inventory.Inventory()
    entries = inv.venvs
    usage = disk.measure([e.path for e in entries])
    now = time.time()
    total = usage.size(*usage.inodes)
    if args.json:
        rows = [_json_row(e, usage.size(e.path)) for e in entries]
        leftovers = [{"path": str(p), "why": "garbage: gc removes it"} for p in inv.garbage]
        leftovers += [{"path": str(o.path), "why": o.why} for o in inv.leftovers]
        others = [{"path": str(o.path), "why": o.why} for o in inv.others]
        out = {
            "venv_dir": str(root),
            "venvs": rows,
            "total_bytes": total,  # shared hardlinks once: less than the sum of size_bytes
            "leftovers": leftovers,
            "others": others,
        }
        print(json.dumps(out, indent=1))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # Piped (`ray-uv list | grep myproj`), nothing is cut: no terminal width to fit.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 1_000_000)
    if not entries:
        console.print(f"No venvs in {root}", markup=False, highlight=False)
    else:
        table = Table(box=None, pad_edge=False)
        for column in ("KEY", "NAME", "PROJECT", "EXTRAS", "GROUPS", "SIZE", "LAST USE", "STATE"):
            table.add_column(
                column,
                justify="right" if column == "SIZE" else "left",
                no_wrap=column in ("KEY", "NAME"),  # never cut: what one greps for
                overflow="fold",
            )
        for e in reversed(entries):  # most recently used first
            cells = (
                e.key,
                e.name,
                e.project if args.wide else project_label(e.project),
                ",".join(e.extras) or "-",
                ",".join(e.groups) or "-",
                inventory.format_bytes(usage.size(e.path)),
                inventory.format_age(now - e.last_used),
                _state(e),
            )
            table.add_row(*map(escape, cells))
        console.print(table, soft_wrap=True)
        footer = f"{len(entries)} venvs, {inventory.format_bytes(total)} in {root}"
        each = sum(usage.size(e.path) for e in entries)
        if each > total:
            footer += (
                f" (the SIZEs add up to {inventory.format_bytes(each)}: files that venvs share "
                "as hardlinks count in each SIZE, once here)"
            )
        console.print(footer, markup=False, highlight=False)
    for o in inv.others:
        console.print(f"{o.path.name}: not ours, left alone: {o.why}", markup=False)
    return 0


# --- gc --------------------------------------------------------------------------------------


def _label(e: VenvEntry) -> str:
    return f"{e.key} ({e.project})" if e.meta else e.key


def cmd_gc(args: argparse.Namespace) -> int:
    from ray_uv_plugin.ops import gc, inventory
    from ray_uv_plugin.store import trust
    from ray_uv_plugin.store.layout import VenvDirError, venv_root

    try:
        root = venv_root()
        report = gc.collect(
            root,
            args.older_than,
            args.max_size,
            args.dry_run,
            everything=args.all,
            assume_unused=args.assume_unused,
        )
    except (gc.GcError, VenvDirError, trust.UntrustedPathError) as e:
        raise CliError(str(e)) from e
    verb = "Would remove" if args.dry_run else "Removed"
    for d in report.removed:
        print(f"{verb} {_label(d.entry)}: {d.reason}")
    for d in report.kept:
        print(f"Kept {_label(d.entry)}: {d.reason}")
    for path in report.garbage:
        print(f"{verb} leftover {path.name}")
    for o in report.leftovers:
        print(f"Kept leftover {o.path.name}: {o.why}")
    for o in report.others:
        print(f"{o.path.name}: not ours, left alone: {o.why}")
    freed = inventory.format_bytes(report.freed_bytes)
    left = inventory.format_bytes(report.remaining_bytes)
    print(
        f"{'Would free' if args.dry_run else 'Freed'} {freed} in {root} "
        f"({len(report.removed)} venvs; {len(report.kept)} kept, {left})"
    )
    if args.older_than is None and args.max_size is None and not args.all and report.kept:
        print(
            "hint: only unfinished builds and leftovers go without limits; pass --older-than "
            "DAYS or --max-size GB to remove unused venvs, or --all to remove every venv of "
            "ours that nothing uses"
        )
    return 0


# --- prepare ---------------------------------------------------------------------------------


def node_line(r: NodeResult) -> str:
    """One node's result as rich markup; what came from the node is escaped, so that an error
    about `ray[default]` keeps its `[default]`."""
    from rich.markup import escape

    if r.ok:
        return escape(f"{r.label}: uv_project {r.key}: {r.summary}")
    return f"{escape(r.label)}: [red]failed[/red]: {escape(r.error or 'unknown error')}"


def cmd_prepare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ray_uv_plugin.agent.project import ProjectError
    from ray_uv_plugin.agent.spec import UvProjectSpecError
    from ray_uv_plugin.ops import prepare

    console = Console(stderr=True, soft_wrap=True)  # log-friendly: no hard wraps in pipes
    project = Path(args.project).expanduser().resolve()
    ship = False if args.no_ship else None
    if args.interval is not None and not args.watch:
        raise CliError("--interval goes with --watch (how often it looks for new nodes)")
    if args.watch and args.json:
        raise CliError("--json does not go with --watch: the watch prints a line per node")
    if args.watch:
        from ray_uv_plugin.ops import watch

        interval = watch.DEFAULT_INTERVAL if args.interval is None else args.interval
        try:
            watch.check_interval(interval)
        except prepare.PrepareError as e:
            raise CliError(str(e)) from e
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        sending = None

        def on_result(r: prepare.NodeResult) -> None:
            progress.console.print(node_line(r))

        def on_progress(p: Any) -> None:
            nonlocal sending
            if sending is None:
                what = f"Shipping to {_nodes(p.receivers)}"
                sending = progress.add_task(what, total=p.size)
            progress.update(sending, completed=min(p.sent, p.size))

        def on_start(value: dict[str, Any], nodes: int) -> None:
            line = f"Preparing uv_project {json.dumps(value)} of {project} on {_nodes(nodes)}"
            progress.console.print(line, markup=False)

        run, watching = prepare.prepare_env, {}
        if args.watch:

            def say(line: str) -> None:
                """A line of the watch's own, after the last ship's bar (the next starts anew)."""
                nonlocal sending
                if sending is not None:
                    progress.remove_task(sending)
                    sending = None
                progress.console.print(line, markup=False)

            def on_watching() -> None:
                say(f"Watching for nodes that join, every {interval:g}s (Ctrl-C stops)")

            def on_round(nodes: list[tuple[str, str]], source: Any) -> None:
                names = ", ".join(f"{a} ({n[:8]})" for n, a in nodes)
                how = f"shipping from {source.label}" if source else "building there"
                say(f"{_nodes(len(nodes))} joined: {names}: {how}")

            run = watch.watch_env
            watching = {
                "interval": interval,
                "on_watching": on_watching,
                "on_round": on_round,
                "stop_signals": True,
            }
        try:
            results = run(
                project,
                extras=args.extra or [],
                groups=args.group or [],
                address=args.address,
                shared=args.shared,
                ship=ship,
                timeout=args.timeout,
                on_start=on_start,
                on_result=on_result,
                on_progress=on_progress,
                **watching,
                **_selection_flags(args),
            )
        except (UvProjectSpecError, ProjectError, prepare.PrepareError) as e:
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
            f"error: {len(failed)} of {_nodes(len(results))} failed: "
            + ", ".join(r.label for r in failed),
            markup=False,
        )
        return 1
    console.print(f"Prepared {_nodes(len(results))} ({prepare.outcome_counts(results)})")
    return 0


# --- check -----------------------------------------------------------------------------------


LIBRARY_HINT = "hint: pass --library NAME to exit 1 when a library the job uses is missing"


def _report_found(found: FoundEnv) -> int:
    """`check --dry-run`: what is there; exit 1 if a `--library` is missing or, with no
    ready venv to look into, cannot be checked."""
    from ray_uv_plugin.ops import check

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
    from ray_uv_plugin.agent.project import ProjectError
    from ray_uv_plugin.agent.spec import UvProjectSpecError
    from ray_uv_plugin.agent.uv import UvSyncError
    from ray_uv_plugin.ops import check
    from ray_uv_plugin.store import trust
    from ray_uv_plugin.store.layout import VenvDirError

    project = Path(args.project).expanduser().resolve()
    flags = _selection_flags(args)
    try:
        wanted = check.parse_libraries(args.library or [])
        if args.dry_run:
            found = check.find_env(project, args.extra or [], args.group or [], flags, wanted)
            return _report_found(found)
        print(
            f"Checking the uv_project env of {project} (this builds it if needed; --dry-run "
            "builds nothing)...",
            flush=True,
        )
        result = check.run_check(project, args.extra or [], args.group or [], flags, wanted)
    except (
        check.CheckError,
        UvProjectSpecError,
        ProjectError,
        UvSyncError,
        VenvDirError,
        trust.UntrustedPathError,
    ) as e:
        raise CliError(str(e)) from e
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


# --- bench -----------------------------------------------------------------------------------


def find_checkout(start: Path) -> Path | None:
    """The source checkout that holds `start` (the cwd): the nearest dir with the benchmarks
    and the package side by side. The wheel has no benchmarks, and the package never looks for
    them beside itself: only where the operator stands."""
    for path in (start, *start.parents):
        if (path / "benchmarks" / "startup.py").is_file() and (path / "ray_uv_plugin").is_dir():
            return path
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    checkout = find_checkout(Path.cwd())
    if checkout is None:
        raise CliError(
            f"`ray-uv bench` runs the benchmarks of the source checkout, and {Path.cwd()} is in "
            "none (they are in the source checkout only, not in the wheel): clone the "
            "repository and run `uv run ray-uv bench` from its root."
        )
    # A process of its own, run from the checkout by module name, with the cwd kept (paths
    # in the arguments mean what they say) and the checkout first on the path.
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), *([path] if path else [])])}
    command = [sys.executable, "-m", "benchmarks.startup", *args.args]
    return subprocess.run(command, env=env, check=False).returncode


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
            from ray_uv_plugin.ops.prepare import clean_error

            raise CliError(clean_error(e)) from e
        raise
    for r in sorted(results, key=lambda r: r.extra):
        if r.output:
            console.print(f"actor with extras={r.extra} made:", highlight=False)
            console.print(r.output.rstrip(), markup=False, highlight=False)
    console.print(f"Done in {time.perf_counter() - start:.1f}s; Ray is shut down.")
    if any(r.built for r in results):
        console.print("Run `ray-uv demo` again: the venvs are reused.")
    return 0


# --- parser ----------------------------------------------------------------------------------


def _switch(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An on/off flag (`store_true`): most of the commands' options."""
    p.add_argument(flag, action="store_true", help=help)


def _add_selection(p: argparse.ArgumentParser) -> None:
    """The flags that select an environment, as the `uv_project` fields do (prepare, check)."""
    p.add_argument("--extra", action="append", metavar="X", help="an extra (repeatable)")
    p.add_argument("--group", action="append", metavar="G", help="a dependency group (repeatable)")
    _switch(p, "--all-extras", "every extra")
    _switch(p, "--no-default-groups", "skip uv's default groups")
    _switch(p, "--frozen", "use uv.lock as it is (no --locked)")
    _switch(p, "--install-project", "install the project too")


def _amount(text: str) -> float:
    """A number of days or GiB for `gc`: `nan` compares false with every age (it was taken,
    and kept every venv), `inf` and negative amounts mean nothing either."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def _selection_flags(args: argparse.Namespace) -> dict[str, bool]:
    """The boolean `uv_project` fields that `_add_selection`'s flags turned on."""
    return {
        name: True
        for name in ("all_extras", "no_default_groups", "frozen", "install_project")
        if getattr(args, name)
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-uv",
        description="Operate the uv_project Ray runtime_env plugin: register it, build envs "
        "on a cluster, list and clean up venvs.",
        epilog=EPILOG,
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the versions of ray-uv-plugin, and of the Ray, uv and Python it uses here",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "plugin-config",
        help="print the RAY_RUNTIME_ENV_PLUGINS value",
        description="Print the RAY_RUNTIME_ENV_PLUGINS value that registers the uv_project "
        "field: `export RAY_RUNTIME_ENV_PLUGINS=$(ray-uv plugin-config)` before `ray start` "
        "on every node.",
    )
    _switch(
        p,
        "--shell",
        "print `export` lines for `eval`, also setting RAY_RUNTIME_ENV_PLUGIN_SCHEMAS to "
        "the package's JSON schema (driver-side checks of the field) and RAY_RUNTIME_ENV_HOOK "
        "to the plugin's hook, with Ray's own `uv run` hook off (RAY_ENABLE_UV_RUN_RUNTIME_ENV"
        "=0): a driver started with `uv run` gives its job the node's cached venv of its "
        "project (a hook set before is kept: RAY_UV_PLUGIN_PREVIOUS_HOOK)",
    )
    p.set_defaults(func=cmd_plugin_config)

    p = sub.add_parser(
        "prepare",
        help="build an env on every alive node of a running cluster",
        description="Make the uv environment ready on every alive node of a running cluster: "
        "one node's plugin builds it (or finds it), then the venv is shipped to the other nodes "
        "through Ray's object store and checked there; a node that cannot take it builds its "
        "own. Exits 1 and names the nodes that failed.",
    )
    p.add_argument(
        "--project",
        default=".",
        metavar="DIR",
        help="the uv project (pyproject.toml + uv.lock); shipped to the nodes as working_dir "
        "(default: .)",
    )
    _add_selection(p)
    _switch(
        p,
        "--shared",
        "DIR is at the same path on every node (e.g. NFS): use it there instead of shipping it",
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="the cluster's GCS address, host:port (default: RAY_ADDRESS, else the local cluster)",
    )
    p.add_argument(
        "--timeout", type=float, default=3600.0, metavar="S", help="give up after S seconds"
    )
    _switch(
        p,
        "--no-ship",
        "let every node build the env itself (as RAY_UV_PLUGIN_SHIP=0 does), instead of "
        "building it on one node and shipping that venv to the others",
    )
    _switch(p, "--json", "print the per-node results as JSON on stdout")
    _switch(
        p,
        "--watch",
        "then keep running: every --interval, prepare the nodes that joined since "
        "(autoscaling), shipping the venv from a node that has it; stop with Ctrl-C or SIGTERM",
    )
    p.add_argument(
        "--interval",
        type=float,
        metavar="S",
        help="with --watch: look for new nodes every S seconds (default 10, at least 2)",
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "list",
        help="list venvs under RAY_UV_PLUGIN_VENV_DIR",
        description="List the venvs under RAY_UV_PLUGIN_VENV_DIR (default "
        "~/.cache/ray-uv-plugin/venvs) on this host: key, project, extras, size (as du "
        "counts it), last use, state.",
    )
    _switch(
        p, "--json", "machine-readable output: full paths, null for what is unknown, times in UTC"
    )
    _switch(
        p, "--wide", "show each project's full path, also where Ray unpacked it (a working_dir)"
    )
    p.set_defaults(func=cmd_list)

    p = sub.add_parser(
        "gc",
        help="remove unused venvs",
        description="Remove venvs under RAY_UV_PLUGIN_VENV_DIR that no live process on this "
        "host runs in and that are not being built; dead builds (after an hour) and leftovers "
        "always go. Nothing that is not provably the plugin's is touched: it is listed with why. "
        "Prints what `du` sees freed.",
    )
    p.add_argument(
        "--older-than",
        type=_amount,
        metavar="DAYS",
        help="remove venvs unused for DAYS days (0: every unused venv)",
    )
    p.add_argument(
        "--max-size",
        type=_amount,
        metavar="GB",
        help="then remove least recently used venvs until the dir holds at most GB GiB",
    )
    _switch(
        p,
        "--all",
        "remove every venv of ours that no process uses and no build holds, whatever "
        "its age (one used in the last 2 minutes stays), dead builds and what is left of a "
        "venv removed by hand included, then lock files and leftovers",
    )
    _switch(
        p,
        "--assume-unused",
        "remove venvs even where gc cannot see every process that may use them "
        "(another user's, in a venv dir shared by a trusted group; the host's and other "
        "containers', when gc runs in a container; all, without /proc): only when you know "
        "that none does",
    )
    _switch(p, "--dry-run", "only print what would go")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "check",
        help="build a project's env here and list the Ray libraries it would miss",
        description="Build (or reuse) the uv_project env of a project on this machine, as the "
        "plugin would on a node, and list which of Ray's libraries (data, serve, tune, train, "
        "client) its Ray lacks the extra of, with the requirement to add to pyproject.toml. "
        "Exits 1 if a library named by --library is missing: run it before a job, e.g. "
        "`ray-uv check --extra train --library train` before a Ray Train run.",
    )
    p.add_argument(
        "--project",
        default=".",
        metavar="DIR",
        help="the uv project (pyproject.toml + uv.lock) (default: .)",
    )
    _add_selection(p)
    p.add_argument(
        "--library",
        action="append",
        metavar="NAME",
        help="a Ray library the job uses (data, serve, tune, train, client; repeatable): exit "
        "1 if the env lacks it",
    )
    _switch(
        p,
        "--dry-run",
        "build nothing: print the env's key, whether its venv is here and ready, and, "
        "if it is, the libraries it lacks (a --library it cannot check exits 1)",
    )
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "bench",
        help="venv and actor startup benchmarks (args go to benchmarks.startup)",
        description="Run benchmarks.startup with the remaining arguments "
        "(`ray-uv bench --help` prints its options).",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "demo",
        help="run the demo: a local Ray, one actor per extra of examples/demo_project",
        description="Start a local Ray with the plugin, run one actor in each of two uv "
        "environments of examples/demo_project, print what each saw and how long its env "
        "took, and shut Ray down. Run it twice: the second run reuses the venvs.",
    )
    p.add_argument("--project", metavar="DIR", help="another project with the same extras")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:  # everything after it, --help included, is the benchmark's
            args = argparse.Namespace(func=cmd_bench, args=argv[1:])
        else:
            args = build_parser().parse_args(argv)
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return code
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ray-uv list | head -1`: as Python's docs on SIGPIPE recommend, stdout goes to
        # devnull so that the flush at exit cannot fail again, and the exit status says so.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:  # what the system refused (a file, a disk, no uv): the message says what
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
