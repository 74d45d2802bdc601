"""`ray-uv`: the operator's command line, a thin layer over plain functions. This module reads
the command line (argparse) and runs the small commands; `cli_venv_dir` (list, gc: this host's
venv dir) and `cli_make_ready` (prepare, check, demo: an env made ready on nodes, here, or in
the demo's Ray) run and render the others.

Imports stay inside the commands: `ray-uv plugin-config` runs before every `ray start`, and
must not pay for importing Ray.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ray_uv_plugin.ops.cli_common import CliError, UsageError, add_selection
from ray_uv_plugin.ops.cli_help import HelpFormatter, VersionAction, docs_line
from ray_uv_plugin.ops.cli_make_ready import cmd_check, cmd_demo, cmd_prepare
from ray_uv_plugin.ops.cli_status import add_status
from ray_uv_plugin.ops.cli_venv_dir import cmd_gc, cmd_list
from ray_uv_plugin.settings import PLUGINS_ENV, plugins_setting

# --- plugin-config ---------------------------------------------------------------------------


def _cmd_plugin_config(args: argparse.Namespace) -> int:
    try:
        plugins = plugins_setting(os.environ.get(PLUGINS_ENV))
    except ValueError as e:
        raise CliError(str(e)) from None
    if not args.shell:
        print(plugins)
        return 0
    from ray_uv_plugin.driver.hook import hook_settings
    from ray_uv_plugin.schema import SCHEMAS_ENV, schemas_setting
    from ray_uv_plugin.store.trust import UntrustedPathError

    try:  # all of it or nothing: `eval` runs what is printed
        hook = hook_settings(os.environ, portable=True)
    except UntrustedPathError as e:
        raise CliError(str(e)) from None
    print(f"export {PLUGINS_ENV}={shlex.quote(plugins)}")
    print(f"export {SCHEMAS_ENV}={shlex.quote(schemas_setting(os.environ.get(SCHEMAS_ENV)))}")
    for name, value in hook.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


# --- bench -----------------------------------------------------------------------------------


def _find_checkout(start: Path) -> Path | None:
    """The source checkout that holds `start` (the cwd): the nearest dir with the benchmarks
    and the package side by side. The wheel has no benchmarks, and the package never looks for
    them beside itself: only where the operator stands."""
    for path in (start, *start.parents):
        if (path / "benchmarks" / "startup.py").is_file() and (path / "ray_uv_plugin").is_dir():
            return path
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    checkout = _find_checkout(Path.cwd())
    if checkout is None:  # not listed in the help here either (`build_parser`)
        raise UsageError(
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


# --- parser ----------------------------------------------------------------------------------


def _command(
    sub: Any, func: Callable[[argparse.Namespace], int], name: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand that `main` runs as `func`."""
    p = sub.add_parser(name, formatter_class=HelpFormatter, **kwargs)
    p.set_defaults(func=func)
    return p


def _switch(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An on/off flag (`store_true`): most of the commands' options."""
    p.add_argument(flag, action="store_true", help=help)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-uv",
        description="Operate the uv_project Ray runtime_env plugin: register it, build envs "
        "on a cluster, list and clean up venvs.",
        epilog=f"{docs_line()}. Every command has --help. Exit status: 0 done, 1 a failure "
        "while running (the message says what), 2 a wrong command line.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version",
        action=VersionAction,
        help="print the versions of ray-uv-plugin, and of the Ray, uv and Python it uses here",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(
        sub,
        _cmd_plugin_config,
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

    p = _command(
        sub,
        cmd_prepare,
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
        help="the uv project (pyproject.toml + uv.lock); uploaded to the nodes as working_dir "
        "(default: .)",
    )
    add_selection(p)
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

    add_status(sub, _command)

    p = _command(
        sub,
        cmd_list,
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

    p = _command(
        sub,
        cmd_gc,
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
    _switch(
        p,
        "--json",
        "machine-readable output: the venvs removed and kept, each with why, leftovers, and "
        "the bytes freed and left",
    )

    p = _command(
        sub,
        cmd_check,
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
    add_selection(p)
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
    _switch(
        p,
        "--json",
        "machine-readable output: the key, the venv and its state, and per Ray library "
        "whether the env's Ray can run it (null for what a --dry-run did not see)",
    )

    # The benchmarks are the source checkout's, never the wheel's (a top-level `benchmarks`
    # package in users' site-packages, and a harness of test helpers and example projects):
    # `bench` is listed only where it runs, from within a checkout.
    if _find_checkout(Path.cwd()) is not None:
        p = _command(
            sub,
            _cmd_bench,
            "bench",
            help="venv and actor startup benchmarks (args go to benchmarks.startup)",
            description="Run benchmarks.startup with the remaining arguments "
            "(`ray-uv bench --help` prints its options).",
            add_help=False,
        )
        p.add_argument("args", nargs=argparse.REMAINDER)

    p = _command(
        sub,
        cmd_demo,
        "demo",
        help="run the demo: a local Ray, one actor per extra of examples/demo_project",
        description="Start a local Ray with the plugin, run one actor in each of two uv "
        "environments of examples/demo_project, print what each saw and how long its env "
        "took, and shut Ray down. Run it twice: the second run reuses the venvs.",
    )
    p.add_argument("--project", metavar="DIR", help="another project with the same extras")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:  # everything after it, --help included, is the benchmark's
            args = argparse.Namespace(func=_cmd_bench, args=argv[1:])
        else:
            args = build_parser().parse_args(argv)
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return code
    except UsageError as e:  # as argparse's own: the command line is wrong
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
        return 1


if __name__ == "__main__":
    sys.exit(main())
