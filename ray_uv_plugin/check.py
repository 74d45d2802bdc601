"""`ray-uv check`: build (or reuse) a project's env here and list which Ray libraries it would miss.

The env is the one the plugin builds on a node for the same `uv_project` value (same key, in
`RAY_UV_PLUGIN_VENV_DIR`), so a check on a node also prepares it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.libraries import BY_NAME, LIBRARIES, Status, library_status


class CheckError(ValueError):
    """A bad input to the check; says what to pass instead."""


@dataclass(frozen=True)
class CheckResult:
    key: str
    venv: Path
    built: bool
    seconds: float
    statuses: list[Status]
    wanted: tuple[str, ...]  # the libraries the user asked for (`--library`)

    @property
    def failed(self) -> list[Status]:
        """Asked-for libraries that the env's Ray lacks: the exit status is 1 if any."""
        return [s for s in self.statuses if s.library.name in self.wanted and not s.ok]


def parse_libraries(names: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for name in names:
        for part in name.split(","):
            part = part.strip().lower()
            if not part:
                continue
            if part not in BY_NAME:
                raise CheckError(
                    f"unknown library {part!r}: pass --library with one of "
                    f"{', '.join(lib.name for lib in LIBRARIES)}."
                )
            if part not in out:
                out.append(part)
    return tuple(out)


def run_check(
    project: Path,
    extras: Sequence[str] = (),
    groups: Sequence[str] = (),
    flags: Mapping[str, bool] | None = None,
    libraries: Sequence[str] = (),
    logger: logging.Logger | None = None,
) -> CheckResult:
    """Build or reuse the env of `project` with these extras and groups, then check it."""
    from ray_uv_plugin.project import load_project
    from ray_uv_plugin.spec import UvProject, parse_spec
    from ray_uv_plugin.venv_cache import ensure_venv

    wanted = parse_libraries(libraries)
    if not (project / "pyproject.toml").is_file():
        raise CheckError(
            f"{project} has no pyproject.toml: pass --project DIR, the directory holding "
            "pyproject.toml and uv.lock."
        )
    value: dict[str, Any] = dict(
        UvProject(extras=list(extras), groups=list(groups), **dict(flags or {}))
    )
    spec = parse_spec(value)
    files = load_project(project)
    outcome = ensure_venv(spec, files, logger=logger)
    return CheckResult(
        outcome.key,
        outcome.path,
        outcome.built,
        outcome.seconds,
        library_status(outcome.path),
        wanted,
    )


def report_lines(result: CheckResult) -> list[str]:
    """What `ray-uv check` prints: one line per library, then what to add."""
    lines = []
    for s in result.statuses:
        asked = " (asked for)" if s.library.name in result.wanted else ""
        node = {True: "node's Ray has it", False: "node's Ray lacks it too", None: "no Ray here"}[
            s.node_has
        ]
        if s.ok:
            lines.append(f"  {s.library.name:<7} ok{asked}")
        else:
            m = s.as_missing()
            lines.append(f"  {s.library.name:<7} MISSING{asked}: {m.describe()} [{node}]")
    missing = [s.as_missing() for s in result.statuses if not s.ok]
    if missing:
        reqs = ", ".join(f'"{m.requirement}"' for m in missing)
        lines.append(
            "To run them, add to [project] dependencies in pyproject.toml (or to the extra or "
            "group you ask for), then `uv lock`:"
        )
        lines.append(f"  {reqs}")
    return lines
