"""Finding and running the uv binary."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

UV_ENV_VAR = "RAY_UV_PLUGIN_UV"


def find_uv() -> str:
    """`RAY_UV_PLUGIN_UV`, else `uv` on PATH, else the binary of the `uv` package we depend on."""
    configured = os.environ.get(UV_ENV_VAR)
    if configured:
        return configured
    on_path = shutil.which("uv")
    if on_path:
        return on_path
    from uv import find_uv_bin

    return find_uv_bin()


def format_duration(seconds: float) -> str:
    """`432.0ms` or `2.41s`: timings as uv prints them, for our log lines and CLI output."""
    return f"{seconds * 1000:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


@dataclass(frozen=True)
class UvResult:
    returncode: int
    output: str
    seconds: float

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])


def _die_with_parent() -> None:
    # A uv left running after the process that started it died would go on writing into a
    # venv directory that the next request is rebuilding.
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_uv(
    args: list[str],
    env: dict[str, str],
    cwd: Path | None = None,
    on_line: Callable[[str], None] | None = None,
) -> UvResult:
    """Run uv with stdout and stderr merged, as one would read it in a terminal."""
    start = time.perf_counter()
    lines: list[str] = []
    with subprocess.Popen(
        [find_uv(), *args],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        preexec_fn=_die_with_parent,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
    return UvResult(proc.returncode, "".join(lines), time.perf_counter() - start)


class UvSyncError(RuntimeError):
    """`uv sync` did not give a usable venv; the message says why and what to do."""


# Substrings of uv's output, and what the user should do about each.
_HINTS: list[tuple[tuple[str, ...], str]] = [
    (
        ("needs to be updated, but `--locked`", "lockfile needs to be updated"),
        "uv.lock is out of date with pyproject.toml: run `uv lock` in the project and ship the "
        "new lock (or set uv_project.frozen to use the lock as it is).",
    ),
    (
        ("incompatible with the project's Python requirement", "No interpreter found"),
        "the project's requires-python does not admit this node's Python: widen it and run "
        "`uv lock`, or run Ray on a matching interpreter.",
    ),
    (
        (
            "Failed to fetch",
            "Failed to download",
            "dns error",
            "Connection refused",
            "error sending request",
            "Could not connect",
            "tcp connect error",
            "Network connectivity is disabled",
        ),
        "the package index could not be reached and the uv cache on this node lacks the "
        "packages: give the node access to the index (env_vars UV_INDEX_URL / HTTPS_PROXY), or "
        "build the env while it has access (`ray-uv prepare`), or share a warm UV_CACHE_DIR.",
    ),
    (
        ("is not defined in the project's `optional-dependencies`",),
        "ask only for extras the project defines in [project.optional-dependencies].",
    ),
    (
        ("Group `", "is not defined in the project's `dependency-groups`"),
        "ask only for groups the project defines in [dependency-groups].",
    ),
]


def explain_failure(project: Path, result: UvResult) -> str:
    hint = next(
        (h for needles, h in _HINTS if any(n in result.output for n in needles)),
        "see uv's output below; `uv sync --locked` in the project reproduces it.",
    )
    return (
        f"uv_project: `uv sync` failed for {project} (exit {result.returncode}): {hint}\n"
        f"--- uv output (last lines) ---\n{result.tail()}"
    )
