"""What a built venv records of itself before it is frozen: its manifest (`store.manifest`) and
its marker (`store.layout`), the last file written, which makes it ready."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.agent import seeding
from ray_uv_plugin.agent.project import project_name
from ray_uv_plugin.agent.request import VenvRequest
from ray_uv_plugin.agent.uv import UvSyncError
from ray_uv_plugin.store import accounting, hashed, manifest, tree
from ray_uv_plugin.store.layout import DIST_INFO, MARKER_FORMAT, site_packages, write_marker


def _site_packages(venv: Path) -> str:
    site = site_packages(venv)
    if site is None:
        raise UvSyncError(f"uv_project: uv made {venv} without a site-packages dir.")
    return str(site.relative_to(venv))


@dataclass(frozen=True)
class Bytecode:
    """Where a build's bytecode came from: `by` the plugin's compile step ("plugin"), uv's own
    ("uv", where the plugin's failed: it runs the venv's `.pth` files, so such a venv never
    seeds another), or none (`UV_COMPILE_BYTECODE=0`); `paths`: the `.pyc` files the compile
    step may have written and those a seed gave, relative to the venv (`store.accounting`)."""

    by: str
    paths: frozenset[str]
    taken: seeding.Taken | None = None  # what a seed gave (None: no seed)


def write_manifest(
    venv: Path,
    logger: logging.Logger,
    recorded: accounting.Recorded,
    compiled: Bytecode,
    locked: Mapping[str, frozenset[str] | None],
    listed: tree.Tree | None = None,
    uv_cache: Callable[[], Path | None] = lambda: None,
) -> dict[str, Any]:
    """The venv's manifest (`store.manifest`), before it is frozen, once every file in it is
    accounted for (`store.accounting`: a UvSyncError otherwise, and so for a file that differs
    from its distribution's RECORD: `_not_as_recorded`); returns what the marker records of
    it: its sha256 and how its bytecode was made. `listed`: the venv's entries as the build
    listed them (`store.tree`), else listed now. `uv_cache`: where this node's uv cache is
    (asked only for that error)."""
    start = time.perf_counter()
    index = hashed.Hashed(hashed.fs_clock(venv))
    unread = 0  # bytes known without reading them
    taken = compiled.taken
    heads: dict[str, bytes] = {}  # the headers of the `.pyc` files read
    if taken is None:
        files = manifest.scan(venv, record=index, heads=heads, listed=listed)
    else:  # the seed's bytecode was checked as it was linked; uv linked its other files too
        before = taken.hashed.reused if taken.hashed else 0
        files = manifest.scan(venv, taken.known, taken.hashed, index, heads, listed)
        from_index = taken.hashed.reused - before if taken.hashed else 0
        unread = sum(entry.size for _, entry in taken.known.values()) + from_index
    scanned = time.perf_counter()
    foreign = accounting.foreign_distributions(venv, locked)
    checked = accounting.account(venv, files, recorded, compiled.paths, foreign, heads)
    if checked.unaccounted:
        raise UvSyncError(
            f"uv_project: the venv {venv.name} holds {accounting.unaccounted_note(checked)}"
            + (
                f" (and the dist-info dirs {', '.join(foreign)} are of no package of the lock)"
                if foreign
                else ""
            )
            + ". A venv holds only its lock's distributions' files as their RECORDs list them, "
            "the bytecode its build compiled and uv's scaffolding, so something else wrote "
            "these while it was built (a build hook, or a `.pth` file that uv's bytecode step "
            "ran). Nothing was kept: find the package that writes them (`uv tree`), drop or "
            "fix it, and `uv lock`."
        )
    if checked.not_as_recorded:
        raise UvSyncError(_not_as_recorded(venv, checked.not_as_recorded, uv_cache()))
    accounted = time.perf_counter()
    listed: dict[str, Any] = {"accounted": {"bytecode": compiled.by}}
    listed["manifest"] = manifest.write(venv, files)
    listed["hashed"] = hashed.write(venv, index)
    size = sum(entry.size for entry in files.values())
    logger.info(
        "uv_project %s: manifest of %d entries (%.0f MB, %.0f MB of them read, the rest "
        "known unchanged since the seed hashed them) in %.2fs, every file accounted for "
        "in %.2fs of it",
        venv.name,
        len(files),
        size / 1e6,
        (size - unread) / 1e6,
        time.perf_counter() - start,
        accounted - scanned,
    )
    return listed


def _not_as_recorded(venv: Path, mismatches: list[str], uv_cache: Path | None) -> str:
    """Why a venv whose files differ from their distribution's RECORD (`<path> (<dist-info>)`,
    or missing) is not made ready, and what to do. Ready means accounted for: such a file was
    most likely changed in uv's cache, through a hardlink of another venv (a job that wrote
    into its own venv), and would reach every venv made from it; else its wheel's RECORD is
    wrong (some are)."""
    shown = accounting.SHOWN
    more = f" and {len(mismatches) - shown} more" if len(mismatches) > shown else ""
    owners = {m.rpartition(" (")[2].rstrip(")") for m in mismatches}
    packages = sorted({match["name"] for o in owners if (match := DIST_INFO.match(o))})
    where = f"UV_CACHE_DIR={uv_cache} " if uv_cache is not None else ""
    return (
        f"uv_project: the venv {venv.name} holds {len(mismatches)} files that differ from "
        f"their distribution's RECORD: {', '.join(mismatches[:shown])}{more}. Most likely "
        "they changed in this node's uv cache"
        + (f" ({uv_cache})" if uv_cache is not None else "")
        + ", through a hardlink of another venv (a job that wrote into its own venv's files), "
        "and would reach every venv made from them, so the venv was not made ready and "
        f"nothing was kept: run `{where}uv cache clean {' '.join(packages) or '<package>'}` "
        "on this node, then retry. If the files stay different after that, the wheel's own "
        "RECORD is wrong: report it to the package."
    )


def write_marker_of(
    venv: Path, request: VenvRequest, seconds: float, immutable: bool, listed: Mapping[str, Any]
) -> None:
    """The marker: what the venv was built from and how (the key's inputs, the build's
    seconds, whether it is immutable), with what `write_manifest` listed."""
    import ray

    spec = request.spec
    write_marker(
        venv,
        {
            "format": MARKER_FORMAT,
            "key": venv.name,
            "name": project_name(request.files),
            "project": str(request.files.path),
            "extras": ["*"] if spec.all_extras else list(spec.extras),
            "groups": list(spec.groups),
            "ray": ray.__version__,
            "python": sys.version.split()[0],
            "site_packages": _site_packages(venv),
            "built_at": time.time(),
            "build_seconds": round(seconds, 3),
            "immutable": immutable,  # chattr +i below the top dir (root only), else modes alone
            "inputs": request.inputs.as_json(),
            **listed,  # the manifest's sha256 and how its bytecode was made: `write_manifest`
        },
    )
