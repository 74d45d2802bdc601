"""What the `ray-uv` commands share: the error that `main` prints, and counting nodes."""

from __future__ import annotations

import argparse


class CliError(Exception):
    """A bad input or state; printed as `error: ...` with exit status 2."""


def node_count(count: int) -> str:
    """`1 node`, `3 nodes`."""
    return f"{count} node" if count == 1 else f"{count} nodes"


def selection_flags(args: argparse.Namespace) -> dict[str, bool]:
    """The boolean `uv_project` fields that `_add_selection`'s flags turned on."""
    return {
        name: True
        for name in ("all_extras", "no_default_groups", "frozen", "install_project")
        if getattr(args, name)
    }
