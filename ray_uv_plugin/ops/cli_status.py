"""`ray-uv status`: where every node of a running cluster stands with an env (the readiness
view, `cluster.readiness`): ready and how, queued, building or receiving with the phase, its
time and bytes, failed with why, or absent. Once, or every second with `--watch`.

Imports stay inside the command, as in `cli`: only it imports Ray.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ray_uv_plugin.ops.cli_common import CliError, UsageError, node_count, selection

if TYPE_CHECKING:
    from ray_uv_plugin.cluster.readiness import NodeSetup

WATCH_EVERY = 1.0  # seconds between two reads with --watch


def _read(args: argparse.Namespace) -> Callable[[], dict[str, NodeSetup]]:
    """Connect as `prepare` does (the project as the job's working_dir, unless --shared or
    --key), and return the read of every alive node."""
    from ray_uv_plugin.cluster import prepare
    from ray_uv_plugin.cluster.connect import ConnectError, connect
    from ray_uv_plugin.cluster.options import PrepareOptions
    from ray_uv_plugin.cluster.readiness import node_setups
    from ray_uv_plugin.env.project import ProjectError
    from ray_uv_plugin.env.spec import UvProjectSpecError

    try:
        if args.key is not None:
            connect(args.address, None)
            return lambda: node_setups(key=args.key, timeout=args.timeout)
        options = PrepareOptions(args.project, selection(args), args.address, args.shared)
        spec = prepare.connect_for(options)
    except (UvProjectSpecError, ProjectError, prepare.PrepareError, ConnectError) as e:
        raise CliError(str(e)) from e
    return lambda: node_setups(spec, timeout=args.timeout)


def _cmd_status(args: argparse.Namespace) -> int:
    import ray

    from ray_uv_plugin.cluster.watch import stop_on_signals
    from ray_uv_plugin.env.spec import ParsedUvProject

    selects = selection(args) != ParsedUvProject()
    if args.key is not None and (args.project is not None or args.shared or selects):
        raise UsageError(
            "--key names the env itself: it goes without --project, --shared and "
            "the selection flags"
        )
    args.project = args.project or "."
    read = _read(args)
    try:
        if not args.watch:
            show(read(), args.json)
            return 0
        with stop_on_signals():
            watch(read, args.json)
    except KeyboardInterrupt:
        pass
    finally:
        ray.shutdown()
    return 0


def show(setups: dict[str, NodeSetup], as_json: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if as_json:
        for line in json_lines(setups):
            print(line, flush=True)
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NODE", "ADDRESS", "KEY", "STATE", "DETAIL"):
        table.add_column(column)
    for s in sorted(setups.values(), key=lambda s: s.address):
        cells = (s.node_id[:8], s.address, s.key or "-", s.state, s.detail)
        table.add_row(*map(escape, cells))
    console = Console(soft_wrap=True)
    console.print(table)
    ready = sum(s.ready for s in setups.values())
    console.print(f"{ready} of {node_count(len(setups))} ready", markup=False)


def json_lines(setups: dict[str, NodeSetup], now: float | None = None) -> list[str]:
    """One JSON object per node, with when it was read (`at`, seconds since the epoch)."""
    at = round(time.time() if now is None else now, 3)
    return [json.dumps({**s.as_json(), "at": at}) for s in setups.values()]


def watch(read: Callable[[], dict[str, NodeSetup]], as_json: bool) -> None:
    """Read every `WATCH_EVERY` seconds until interrupted. JSON: every node, every read; else
    a line per node whose state or phase changed, and one every 10 s for a node in a phase."""
    said: dict[str, tuple[Any, ...]] = {}
    while True:
        start = time.monotonic()
        setups = read()
        if as_json:
            for line in json_lines(setups):
                print(line, flush=True)
        for node, s in setups.items():
            tick = int((s.seconds or 0) // 10)
            now = (s.state, s.phase, s.how, s.cause, tick)
            if not as_json and said.get(node) != now:
                print(s.line(), flush=True)
            said[node] = now
        time.sleep(max(WATCH_EVERY - (time.monotonic() - start), 0.0))


def add_status(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """`ray-uv status`'s options: the env as `prepare` takes it, or its key."""
    from ray_uv_plugin.ops.cli_common import add_selection

    p = command(
        sub,
        _cmd_status,
        "status",
        help="show where every node stands with an env: ready, building (phase), failed...",
        description="Show, for every alive node of a running cluster, where the uv environment "
        "of a project and selection (or a --key) stands: ready (built, seeded or shipped), "
        "queued for a build slot, building or receiving (the phase, its time and bytes), failed "
        "(why), or absent. Read from each node's venv dir and the plugin's records by a task on "
        "the node; nothing is built.",
    )
    p.add_argument(
        "--project",
        metavar="DIR",
        help="the uv project (pyproject.toml + uv.lock), given to the nodes as prepare does "
        "(default: .)",
    )
    add_selection(p)
    p.add_argument(
        "--shared",
        action="store_true",
        help="DIR is at the same path on every node (as prepare --shared)",
    )
    p.add_argument("--key", metavar="KEY", help="the env's key (as `ray-uv list` shows it)")
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="the cluster's GCS address, host:port (default: RAY_ADDRESS, else the local cluster)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a node that does not answer in S seconds is shown failed (default 30)",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per node (a line each), with `at`"
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="read again every second until Ctrl-C or SIGTERM: a line per change (with --json, "
        "every node every second)",
    )
