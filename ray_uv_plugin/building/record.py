"""What a built venv records of itself before it is frozen: its manifest (`store.manifest`) and
its marker (`store.layout`), the last file written, which makes it ready."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.building import seeding
from ray_uv_plugin.env.key import VenvRequest
from ray_uv_plugin.env.project import project_name
from ray_uv_plugin.env.uv import UvSyncError
from ray_uv_plugin.store import accounting, hashed, manifest, tree
from ray_uv_plugin.store.layout import DIST_INFO, MARKER_FORMAT, Venv


def _site_packages(venv: Venv) -> str:
    site = venv.site_packages()
    if site is None:
        raise UvSyncError(f"uv_project: uv made {venv.path} without a site-packages dir.")
    return str(site.relative_to(venv.path))


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
    venv: Venv,
    logger: logging.Logger,
    recorded: accounting.Recorded,
    compiled: Bytecode,
    locked: Mapping[str, frozenset[str] | None],
    listed: tree.Tree | None = None,
    uv_cache: Callable[[], Path | None] = lambda: None,
) -> dict[str, Any]:
    """The venv's manifest and index (`store.manifest`, `store.hashed`), before it is frozen,
    once every file in it is accounted for (`store.accounting`: a UvSyncError otherwise, and
    so for a file that differs from its distribution's RECORD: `_not_as_recorded`); returns
    what the marker records of them: their sha256 and how its bytecode was made. `listed`: the
    venv's entries as the build listed them (`store.tree`), else listed now. `uv_cache`: where
    this node's uv cache is (asked only for that error).

    A part of site-packages whose entries are its seed's (`hashed.listing`), owned by the same
    distributions with the same RECORDs, all of the lock, is kept from the seed: its fragments
    are linked, and it is accounted for as the seed's build accounted for it. Every other part
    is listed entry by entry, each file hashed unless the seed's rows prove its inode
    unchanged, and accounted for here."""
    start = time.perf_counter()
    venv_path = venv.path
    if listed is None:
        listed = tree.collect(venv_path)
    clock = hashed.fs_clock(venv_path)
    site = _site_packages(venv)
    groups = manifest.split(listed.entries, site)
    seed = compiled.taken.source if compiled.taken is not None else None
    records = seeding.record_digests(venv_path / site)
    foreign = accounting.foreign_distributions(venv_path, locked)
    parts_of = owners_of(recorded, site)
    listings = compiled.taken.listings if compiled.taken is not None else {}
    dev = _device(venv_path, site)
    kept = _kept(seed, groups, listed, parts_of.owners, records, set(foreign), clock, dev, listings)
    if seed is not None:  # its fragments, linked in and checked: else the part is listed
        fragments = manifest.Fragments(venv_path)
        for name in list(kept):
            shas = (seed.fragments[name], kept[name].rows)
            if not all(fragments.adopt(seed.path, sha) for sha in shas):
                del kept[name]
    fresh = Fresh(venv_path, listed, clock)
    for name, paths in groups.items():
        if name not in kept:
            fresh.add(name, paths, seed)
    scanned = time.perf_counter()
    own = recorded if not kept else parts_of.without(recorded, kept)
    checked = accounting.account(venv_path, fresh.files, own, compiled.paths, foreign, fresh.heads)
    if checked.unaccounted:
        raise UvSyncError(
            f"uv_project: the venv {venv.key} holds {accounting.unaccounted_note(checked)}"
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
    made: dict[str, Any] = {"accounted": {"bytecode": compiled.by}}
    made["manifest"], made["hashed"], written = write_records(
        fresh, site, kept, seed, parts_of.owners, compiled.paths, recorded, records
    )
    logger.info(
        "uv_project %s: manifest of %d entries in %d parts, %d of them kept from the seed "
        "(%d entries), the rest listed (%.0f MB read, %d fragments written) in %.2fs, every "
        "file of those accounted for in %.2fs of it",
        venv.key,
        len(listed.entries),
        len(groups),
        len(kept),
        sum(len(groups[name]) for name in kept),
        fresh.read / 1e6,
        written,
        time.perf_counter() - start,
        accounted - scanned,
    )
    return made


@dataclass
class Owners:
    """Which part each RECORD-listed path is in, and the dist-info dirs listing files of each
    part (`owners_of`)."""

    owners: dict[str, set[str]]
    paths: dict[str, list[str]]  # part -> the paths of it that RECORDs list

    def without(self, recorded: accounting.Recorded, kept: Collection[str]) -> accounting.Recorded:
        """`recorded` less the paths of the parts `kept` (accounted for as the seed's)."""
        left = [path for part, paths in self.paths.items() if part not in kept for path in paths]
        return accounting.Recorded(
            {path: recorded.hashes[path] for path in left},
            {path: recorded.owners[path] for path in left},
            recorded.unreadable,
        )


def write_records(
    fresh: Fresh,
    site: str,
    kept: Mapping[str, hashed.Part],
    seed: seeding.Seed | None,
    owners: Mapping[str, set[str]],
    compiled: Collection[str] | None,
    recorded: accounting.Recorded,
    records: Mapping[str, str],
) -> tuple[str, str, int]:
    """The manifest and index of a venv (`fresh.venv`) whose parts are `fresh`'s and the seed's
    `kept` (their fragments adopted: `manifest.Fragments.adopt`): (the manifest's sha256, the
    index's, the fragments written). `records`: the
    venv's `seeding.record_digests`; `owners`: the dist-info dirs listing each part's files
    (`owners_of`); `compiled`: the bytecode its build compiled or took (None at a receive:
    every `.pyc` no RECORD lists, whose header was checked)."""
    venv = fresh.venv
    index = hashed.Index(_device(venv, site), records=dict(records))
    index.parts.update(kept)
    written = fresh.record(index, owners, compiled, recorded)
    from_seed = {} if seed is None else {name: seed.fragments[name] for name in kept}
    return (
        manifest.write_parts(venv, site, fresh.parts, from_seed),
        hashed.write(venv, index),
        written,
    )


def _device(venv: Path, site: str) -> int:
    """The file system of the venv's site-packages (its index's `dev`)."""
    return os.lstat(venv / site if site else venv).st_dev


def owners_of(recorded: accounting.Recorded, site: str) -> Owners:
    """Which part each path the RECORDs list is in, and the dist-info dirs of each part."""
    prefix = f"{site}/"
    owners: dict[str, set[str]] = {}
    paths: dict[str, list[str]] = {}
    for path, dist in recorded.owners.items():
        name = manifest.part_of(path, prefix)
        owners.setdefault(name, set()).add(dist)
        paths.setdefault(name, []).append(path)
    return Owners(owners, paths)


def _kept(
    seed: seeding.Seed | None,
    groups: Mapping[str, list[str]],
    listed: tree.Tree,
    owners: Mapping[str, set[str]],
    records: Mapping[str, str],
    foreign: set[str],
    clock: int,
    dev: int,
    listings: Mapping[str, tuple[frozenset[str], str]],
) -> dict[str, hashed.Part]:
    """The parts the seed's records are kept for (see `write_manifest`); `listings`: those
    the seeding found (`seeding.Taken.listings`), taken again for the same paths. A listing
    names inodes: only a seed of the new venv's file system (`dev`) keeps any part."""
    if seed is None or seed.index.dev != dev:
        return {}
    kept = {}
    for name, paths in groups.items():
        part = seed.index.parts.get(name)
        if name in manifest.NEVER_KEPT or part is None or not part.listing:
            continue
        if name not in seed.fragments or set(part.owners) != owners.get(name, set()):
            continue
        if any(d in foreign or records.get(d) != seed.index.records.get(d) for d in part.owners):
            continue
        found, listing = listings.get(name, (None, ""))
        if found is None or found != frozenset(paths):  # another part's paths: listed anew
            listing = hashed.listing(listed, paths, clock)
        if listing == part.listing:
            kept[name] = part
    return kept


class Fresh:
    """The parts a build lists entry by entry: their entries, rows and `.pyc` headers."""

    def __init__(self, venv: Path, listed: tree.Tree, clock: int) -> None:
        self.venv, self.listed, self.clock = venv, listed, clock
        self.parts: dict[str, manifest.Files] = {}
        self.files: manifest.Files = {}
        self.rows: dict[str, hashed.Hashed] = {}
        self.heads: dict[str, bytes] = {}
        self.read = 0  # bytes read and hashed

    def add(self, name: str, paths: list[str], seed: seeding.Seed | None) -> None:
        known = None
        if seed is not None and (part := seed.index.parts.get(name)) is not None:
            known = hashed.rows(seed.path, part.rows)
        rows = hashed.Hashed(self.clock)
        entries = manifest.scan(self.listed, paths, known, rows, self.heads)
        self.read += sum(e.size for e in entries.values()) - (known.reused if known else 0)
        self.parts[name] = entries
        self.files.update(entries)
        self.rows[name] = rows

    def take(self, name: str, entries: manifest.Files) -> None:
        """A part whose entries are known (a receiver's: it hashed what it wrote), its rows
        taken from them as listed."""
        rows = hashed.Hashed(self.clock)
        for path, entry in entries.items():
            if entry.kind == "file":
                rows.add(self.listed.entries[path], entry.content)
        self.parts[name] = dict(entries)
        self.files.update(entries)
        self.rows[name] = rows

    def record(
        self,
        index: hashed.Index,
        owners: Mapping[str, set[str]],
        compiled: Collection[str] | None,
        recorded: accounting.Recorded,
    ) -> int:
        """Each fresh part into `index`, its rows written as fragments; returns how many
        fragments were written (the manifest's among them)."""
        fragments = manifest.Fragments(self.venv)
        for name, entries in self.parts.items():
            paths = list(entries)
            whole = name not in manifest.NEVER_KEPT  # may be kept later
            index.parts[name] = hashed.Part(
                fragments.put(self.rows[name].fragment()),
                hashed.listing(self.listed, paths, self.clock) if whole else "",
                hashed.sources(self.listed, paths) if whole else "",
                tuple(sorted(owners.get(name, ()))),
                tuple(
                    sorted(
                        path
                        for path in paths
                        if path.endswith(".pyc")
                        and (compiled is None or path in compiled)
                        and path not in recorded.hashes
                    )
                ),
            )
        fragments.sync()
        return 2 * len(self.parts)


def _not_as_recorded(venv: Venv, mismatches: list[str], uv_cache: Path | None) -> str:
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
        f"uv_project: the venv {venv.key} holds {len(mismatches)} files that differ from "
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
    venv: Venv, request: VenvRequest, seconds: float, immutable: bool, listed: Mapping[str, Any]
) -> None:
    """The marker: what the venv was built from and how (the key's inputs, the build's
    seconds, whether it is immutable), with what `write_manifest` listed."""
    import ray

    spec = request.spec
    venv.write_marker(
        {
            "format": MARKER_FORMAT,
            "key": venv.key,
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
