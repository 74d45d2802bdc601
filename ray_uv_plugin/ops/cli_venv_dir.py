"""`ray-uv list` and `ray-uv gc`: this host's venv dir, read (`inventory`) and pruned (`gc`).

Imports stay inside the commands, as in `cli`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_uv_plugin.ops.cli_common import CliError, UsageError
from ray_uv_plugin.store.units import built_label, format_age, format_bytes

if TYPE_CHECKING:
    from ray_uv_plugin.store.gc import Decision, GcReport
    from ray_uv_plugin.store.inventory import VenvEntry


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


def _project_label(project: str) -> str:
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
    from ray_uv_plugin.env.image import recorded

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
        "built": meta.get("built") if isinstance(meta.get("built"), dict) else None,
        "from_image": recorded(e.meta),  # `from_image`: the image's packages it runs with
    }


def _limits(root: Path, held: int) -> dict[str, Any]:
    """The venv dir's budget and build limit as this shell's environment sets them (run `list`
    with the node's settings), what the budget holds, and the builds running and queued now."""
    from ray_uv_plugin.settings import NodeSettings
    from ray_uv_plugin.store import budget, build_slots

    node = NodeSettings.read()
    limit = budget.venv_dir_budget(node)
    max_builds = build_slots.max_builds(node)
    tickets = build_slots.living_tickets(root)
    return {
        "budget_bytes": limit,  # null: no budget
        "budget_held_bytes": held,  # venvs and their locks, shared hardlinks once
        "max_builds": max_builds,
        "builds_running": min(tickets, max_builds),
        "builds_waiting": max(0, tickets - max_builds),
    }


def _limit_lines(limits: dict[str, Any]) -> list[str]:
    from ray_uv_plugin.settings import MAX_BUILDS_ENV, VENV_DIR_MAX_BYTES_ENV

    limit, held = limits["budget_bytes"], limits["budget_held_bytes"]
    if limit is None:
        budget = f"Budget: none ({VENV_DIR_MAX_BYTES_ENV} unset): venvs stay until `ray-uv gc`"
    else:
        budget = (
            f"Budget: {format_bytes(held)} of {format_bytes(limit)} ({held / limit:.0%}, "
            f"{VENV_DIR_MAX_BYTES_ENV}): a build that would pass it removes the least recently "
            "used venvs that nothing uses"
        )
    builds = (
        f"Builds: {limits['builds_running']} running, {limits['builds_waiting']} waiting "
        f"(at most {limits['max_builds']} at once, {MAX_BUILDS_ENV})"
    )
    return [budget, builds]


def cmd_list(args: argparse.Namespace) -> int:
    from ray_uv_plugin.settings import VenvDirError
    from ray_uv_plugin.store import disk, inventory, trust
    from ray_uv_plugin.store.layout import Venv, venv_root

    try:
        root = venv_root()
        exists = inventory.check_venv_dir(root, "list")
    except (VenvDirError, trust.UntrustedPathError) as e:
        raise CliError(str(e)) from e
    inv = inventory.scan(root) if exists else inventory.Inventory()
    entries = inv.venvs
    locks = [Venv(root, e.key).lock for e in entries]
    usage = disk.measure([e.path for e in entries] + locks)
    now = time.time()
    total = usage.size(*(e.path for e in entries))
    try:
        limits = _limits(root, usage.size(*usage.inodes))
    except VenvDirError as e:
        raise CliError(str(e)) from e
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
            **limits,
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
        columns = ("KEY", "NAME", "PROJECT", "EXTRAS", "GROUPS", "SIZE", "LAST USE", "BUILT")
        for column in (*columns, "STATE"):
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
                e.project if args.wide else _project_label(e.project),
                ",".join(e.extras) or "-",
                ",".join(e.groups) or "-",
                format_bytes(usage.size(e.path)),
                format_age(now - e.last_used),
                built_label(e.meta),
                _state(e),
            )
            table.add_row(*map(escape, cells))
        console.print(table, soft_wrap=True)
        footer = f"{len(entries)} venvs, {format_bytes(total)} in {root}"
        each = sum(usage.size(e.path) for e in entries)
        if each > total:
            footer += (
                f" (the SIZEs add up to {format_bytes(each)}: files that venvs share "
                "as hardlinks count in each SIZE, once here)"
            )
        console.print(footer, markup=False, highlight=False)
    from ray_uv_plugin.env.image import recorded

    for e in reversed(entries):
        for line in recorded(e.meta):
            console.print(f"{e.key}: from the image: {line}", markup=False, highlight=False)
    for line in _limit_lines(limits):
        console.print(line, markup=False, highlight=False)
    for o in inv.others:
        console.print(f"{o.path.name}: not ours, left alone: {o.why}", markup=False)
    return 0


# --- gc --------------------------------------------------------------------------------------


def _label(e: VenvEntry) -> str:
    return f"{e.key} ({e.project})" if e.meta else e.key


def _gc_json(root: Path, report: GcReport) -> dict[str, Any]:
    """`gc --json`: what went (or would go, `dry_run`) and what stayed, each with why; sizes in
    bytes as `du` counts them. A venv is as `list --json` names it: key, path, project."""

    def venv(d: Decision) -> dict[str, Any]:
        meta = d.entry.meta or {}
        path = str(d.entry.path)
        return {"key": d.entry.key, "path": path, "project": meta.get("project"), "why": d.reason}

    return {
        "venv_dir": str(root),
        "dry_run": report.dry_run,
        "removed": [venv(d) for d in report.removed],
        "kept": [venv(d) for d in report.kept],
        "removed_leftovers": [str(p) for p in report.garbage],
        "kept_leftovers": [{"path": str(o.path), "why": o.why} for o in report.leftovers],
        "others": [{"path": str(o.path), "why": o.why} for o in report.others],
        "freed_bytes": report.freed_bytes,
        "remaining_bytes": report.remaining_bytes,
    }


def cmd_gc(args: argparse.Namespace) -> int:
    from ray_uv_plugin.settings import VenvDirError
    from ray_uv_plugin.store import gc, trust
    from ray_uv_plugin.store.layout import venv_root

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
    except gc.GcError as e:  # limits that do not go together
        raise UsageError(str(e)) from e
    except (VenvDirError, trust.UntrustedPathError) as e:
        raise CliError(str(e)) from e
    if args.json:
        print(json.dumps(_gc_json(root, report), indent=1))
        return 0
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
    freed = format_bytes(report.freed_bytes)
    left = format_bytes(report.remaining_bytes)
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
