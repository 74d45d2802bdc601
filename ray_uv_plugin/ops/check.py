"""`ray-uv check`: build (or reuse) a project's env here and list which Ray libraries it would miss.

The env is the one the plugin builds on a node for the same `uv_project` value (same key, in
`RAY_UV_PLUGIN_VENV_DIR`), so a check on a node also prepares it; `--dry-run` (`find_env`)
only looks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ray_uv_plugin.agent.ray_libraries import BY_NAME, LIBRARIES, Status, library_status

if TYPE_CHECKING:
    from ray_uv_plugin.env.project import ProjectFiles
    from ray_uv_plugin.env.spec import ParsedUvProject
    from ray_uv_plugin.store.layout import Venv


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
    notes: tuple[str, ...] = ()  # `node_notes`

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


def _files(project: Path) -> ProjectFiles:
    """The project's files, or what to pass instead."""
    from ray_uv_plugin.env.project import load_project

    if not (project / "pyproject.toml").is_file():
        raise CheckError(
            f"{project} has no pyproject.toml: pass --project DIR, the directory holding "
            "pyproject.toml and uv.lock."
        )
    return load_project(project)


@dataclass(frozen=True)
class FoundEnv:
    """What `ray-uv check --dry-run` finds without building or touching anything: the env's
    key, where its venv is or would be built, and its state there."""

    key: str
    venv: Path
    state: str  # `inventory`'s (`ready`, `building`, ...), or ABSENT
    note: str  # what is wrong, for a state other than ready
    statuses: list[Status] | None  # the libraries of a ready venv
    wanted: tuple[str, ...]

    @property
    def missing(self) -> list[str]:
        """Asked-for libraries that are missing, or that cannot be checked (no ready venv)."""
        if self.statuses is None:
            return list(self.wanted)
        return [s.library.name for s in self.statuses if s.library.name in self.wanted and not s.ok]


ABSENT = "not built"


def find_env(
    project: Path, spec: ParsedUvProject | None = None, libraries: Sequence[str] = ()
) -> FoundEnv:
    """`run_check` without building: the env may be GBs (and `uv sync` minutes), and an
    operator may want to know first. Reads the venv dir as `ray-uv list` does: it creates no
    venv dir, and a reuse is not recorded (the marker is not touched)."""
    from ray_uv_plugin.env.key import make_request
    from ray_uv_plugin.env.spec import ParsedUvProject
    from ray_uv_plugin.store import inventory
    from ray_uv_plugin.store.layout import venv_root

    wanted = parse_libraries(libraries)
    key = make_request(spec or ParsedUvProject(), _files(project), {}).key
    root = venv_root()
    if not inventory.check_venv_dir(root, "check"):
        return FoundEnv(key, root / key, ABSENT, "", None, wanted)
    found = inventory.scan_one(root, key)
    if not found.venvs:
        note = found.others[0].why if found.others else ""
        return FoundEnv(key, root / key, ABSENT, note, None, wanted)
    entry = found.venvs[0]
    try:
        statuses = library_status(entry.path) if entry.state == inventory.READY else None
    except ValueError as e:  # a ready venv without Ray: not one the plugin built
        raise CheckError(str(e)) from e
    return FoundEnv(key, entry.path, entry.state, entry.note, statuses, wanted)


def run_check(
    project: Path,
    spec: ParsedUvProject | None = None,
    libraries: Sequence[str] = (),
    logger: logging.Logger | None = None,
) -> CheckResult:
    """Build or reuse the env of `project` with this selection (default: the project's
    default env), then check it."""
    from ray_uv_plugin.building.ensure import ensure_venv
    from ray_uv_plugin.env.spec import ParsedUvProject

    wanted = parse_libraries(libraries)
    files = _files(project)
    outcome = ensure_venv(spec or ParsedUvProject(), files, logger=logger)
    return CheckResult(
        outcome.key,
        outcome.path,
        outcome.built,
        outcome.seconds,
        library_status(outcome.path),
        wanted,
        tuple(_node_notes(outcome.venv, files.path)),
    )


def _node_notes(venv: Venv, project: Path) -> list[str]:
    """What this node's set-up costs a venv (uv copies instead of hardlinking) or leaves it
    without (chattr +i, as root), each with its fix: what a build's setup log says, for a
    reused venv too."""
    import os

    from ray_uv_plugin.env.cache_split import cache_split_note
    from ray_uv_plugin.env.uv_env import sync_environment
    from ray_uv_plugin.store import freezing

    notes = []
    split = cache_split_note(sync_environment({}), venv.root, project)
    if split:
        notes.append(split)
    if os.geteuid() == 0 and (venv.read_marker() or {}).get("immutable") is False:
        notes.append(freezing.unfrozen_note())
    return notes


def report_lines(result: CheckResult | FoundEnv) -> list[str]:
    """What `ray-uv check` prints: the packages the venv takes from the image (`from_image`),
    one line per library, then what to add."""
    from ray_uv_plugin.env.image import recorded
    from ray_uv_plugin.store.layout import Venv

    lines = [f"  from the image: {line}" for line in recorded(Venv.at(result.venv).read_marker())]
    for s in result.statuses or []:
        asked = " (asked for)" if s.library.name in result.wanted else ""
        node = {True: "node's Ray has it", False: "node's Ray lacks it too", None: "no Ray here"}[
            s.node_has
        ]
        if s.ok:
            lines.append(f"  {s.library.name:<7} ok{asked}")
        else:
            m = s.as_missing()
            lines.append(f"  {s.library.name:<7} MISSING{asked}: {m.describe()} [{node}]")
    missing = [s.as_missing() for s in result.statuses or [] if not s.ok]
    if missing:
        reqs = ", ".join(f'"{m.requirement}"' for m in missing)
        lines.append(
            "To run them, add to [project] dependencies in pyproject.toml (or to the extra or "
            "group you ask for), then `uv lock`:"
        )
        lines.append(f"  {reqs}")
    if isinstance(result, CheckResult):
        lines += [f"note: {note}." for note in result.notes]
    return lines
