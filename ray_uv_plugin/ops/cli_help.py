"""What `ray-uv --help` and `--version` say: where the docs are (from the installed package's
metadata, which a wheel has), the options' defaults, and the versions that decide the envs
built here. Worked out only when asked: `--version` runs `uv --version`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

# The package's metadata is what an installed wheel has (a checkout's docs/ it has not).
DOCS_URL_LABELS = ("documentation", "docs", "homepage", "home", "source", "repository")
NO_DOCS_URL = (
    "Docs: README.md (the package's description on its index) and docs/ of the ray-uv-plugin "
    "source distribution"
)


def docs_line() -> str:
    """Where the docs are, in a way that works from a wheel: the Documentation URL (else the
    home page or source) in the installed package's metadata ([project.urls]); without one,
    where the pages travel with the package's releases. Never a path in a checkout."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata("ray-uv-plugin").get_all("Project-URL") or []
    except PackageNotFoundError:
        urls = []
    found = {}
    for entry in urls:
        label, _, url = entry.partition(",")
        found.setdefault(label.strip().lower(), url.strip())
    for label in DOCS_URL_LABELS:
        if found.get(label):
            return f"Docs: {found[label]}"
    return NO_DOCS_URL


class HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default where it has one that says something (`--timeout`: 3600),
    not `None` or `False`, and not where the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        default = action.default
        if (
            "default" in help
            or default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return help
        return f"{help} (default: %(default)s)"


# --- --version -------------------------------------------------------------------------------


def versions() -> str:
    """`ray-uv --version`: this package's version first, in `uv --version`'s form, then what
    decides the envs built here: the Ray and Python that run `ray-uv` (a node's, when run in
    the environment of its `ray start`) and the uv that the plugin runs (`uv.find_uv`)."""
    from importlib.metadata import PackageNotFoundError, version

    from ray_uv_plugin.env.uv import find_uv, uv_version

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


class VersionAction(argparse.Action):
    """`--version`, worked out only when asked: it runs `uv --version`."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(versions(), flush=True)  # a closed pipe fails here, where `main` handles it
        parser.exit()
