"""What the `ray-uv` commands share: the errors that `main` prints (and their exit statuses),
the selection flags that `prepare` and `check` take, and counting nodes."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ray_uv_plugin.env.fields import SELECTION

if TYPE_CHECKING:
    from ray_uv_plugin.env.spec import ParsedUvProject


class CliError(Exception):
    """A failure at run time (a bad project, a cluster that does not answer, a venv dir it
    cannot use); printed as `error: ...` with exit status 1."""


class UsageError(CliError):
    """The command line itself is wrong (options that do not go together, a value out of
    range): exit status 2, as argparse's own usage errors."""


def node_count(count: int) -> str:
    """`1 node`, `3 nodes`."""
    return f"{count} node" if count == 1 else f"{count} nodes"


def add_selection(p: argparse.ArgumentParser) -> None:
    """The flags that select an environment (prepare, check): one per `uv_project` field that
    selects packages, from the table of fields, so that `prepare` can warm the key of any job."""
    group = p.add_argument_group(
        "selection", "the uv_project fields, as uv's options (see the README's field table)"
    )
    for f in SELECTION:
        doc = f.doc.replace("%", "%%")
        if f.kind == "bool":
            help = f"`{f.name}: {'false' if f.default else 'true'}`. {doc}"
        else:
            help = f"`{f.name}`{', one per flag' if f.is_list else ''}: {doc}"
        if f.is_list:
            group.add_argument(f.flag, action="append", dest=f.name, metavar=f.metavar, help=help)
        elif f.kind == "bool":
            const = not f.default
            group.add_argument(f.flag, action="store_const", const=const, dest=f.name, help=help)
        else:
            group.add_argument(f.flag, dest=f.name, metavar=f.metavar, help=help)


def selection(args: argparse.Namespace) -> ParsedUvProject:
    """The selection that `add_selection`'s flags gave (what was not given is left to the
    field's default), parsed: flags that no `uv_project` value can hold together are a usage
    error."""
    from ray_uv_plugin.env.spec import UvProjectSpecError, keyword_value, parse_spec

    chosen = {f.name: getattr(args, f.name) for f in SELECTION}
    chosen = {name: value for name, value in chosen.items() if value is not None}
    try:
        return parse_spec(keyword_value(chosen))
    except UvProjectSpecError as e:
        raise UsageError(str(e)) from e
