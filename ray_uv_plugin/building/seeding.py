"""A new venv's bytecode from the nearest ready venv of this node: a changed lock costs what
changed.

Users iterate: bump one package, re-lock, run again. Each lock is a new key, and so a new venv.
uv makes its files in seconds (each one a hardlink from its cache); compiling every module's
bytecode is what takes the time (~48 s for 425 packages on 2 cores, against ~4 s for the files),
and the bytecode of every distribution that did not change was compiled before, in the venv of
the old key on this node. So a build (`steps`) runs:

1. `uv sync` of the new lock without bytecode: the venv's files, exactly as uv makes them;
2. `take_bytecode`: from the nearest ready venv of the same interpreter (`choose`: the most
   distributions in common), the bytecode of each part of site-packages (`store.manifest`: a
   distribution's top-level package or module) whose sources have the size and mtime the
   `.pyc` headers check, as the seed's index recorded them (`store.hashed`: its `sources`
   digest; no file of the seed is `lstat`ed for it); each `.pyc` its build compiled or took is
   hardlinked (a `.pyc` is never written in place). The linked inodes are then listed, and a
   part whose listing is not the seed's (`listing`: the same inodes, unchanged since the seed's
   build hashed them) has each linked file checked against the seed's manifest, read where the
   seed's rows do not prove it unchanged: a seed changed before or during the link is caught,
   and the build falls back to a full one. `THREADS` threads do the kernel work (`mkdir`,
   `link` release the GIL), each on its own files;
3. `bytecode.compile_missing`: the modules left without bytecode, the changed distributions',
   compiled as uv's bytecode step compiles them (uv's own step, a second `uv sync`, where that
   fails).

The result is what a fresh `uv sync --locked` with bytecode gives: the same files and RECORDs
(step 1 is that sync), and bytecode Python accepts for every module (each one compiled by
`compileall.compile_file` on the same interpreter from the same source, as uv's are). The seed
is only read: it may be in use, frozen, or removed by `gc` meanwhile (a file gone is compiled in
step 3).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from ray_uv_plugin.store import hashed, manifest, tree
from ray_uv_plugin.store.layout import DIST_INFO, MARKER, Venv

CANDIDATES = 8  # the most recently built venvs of this interpreter that are weighed as seeds
# Distributions in common below which a seed saves too little to be worth its checks.
MIN_COMMON = 2
# Threads for the seed's kernel work (`lstat`, `mkdir`, `link` release the GIL): one per CPU
# this process may use, at most 8. More than the CPUs was slower on a loaded 2-core host
# (benchmarks/seed_work.py, RESULTS.md).
THREADS = min(8, len(os.sched_getaffinity(0)) or 1)
CHUNK = 256  # `.pyc` files (or dirs) per task
T = TypeVar("T")


class SeedError(ValueError):
    """A seed that cannot be used (damaged, changed while read, not ours): the build falls back
    to a full one and the setup log says why."""


@dataclass(frozen=True)
class Seed:
    key: str
    path: Path
    site: str  # its site-packages, relative to it: the new venv's
    common: tuple[str, ...]  # the dist-info dir names it shares with the new venv, RECORD alike
    fragments: dict[str, str]  # its manifest's parts: part -> the sha256 of its fragment
    index: hashed.Index  # its index (`store.hashed`), checked against its marker

    @property
    def distributions(self) -> int:
        return len(self.common)


@dataclass(frozen=True)
class Taken:
    """What a seeded venv took from its seed."""

    seed: str  # the seed's key
    distributions: int  # distributions whose RECORD is the seed's
    files: int  # `.pyc` files linked
    bytes: int
    known: frozenset[str] = field(default_factory=frozenset, repr=False)  # venv-relative
    source: Seed | None = field(default=None, repr=False)  # for the manifest's kept parts
    # The parts whose listing was found to be the seed's: part -> (the paths listed, the
    # listing), for the manifest (`record`) while the part holds those paths.
    listings: dict[str, tuple[frozenset[str], str]] = field(default_factory=dict, repr=False)
    unused: frozenset[str] = field(default_factory=frozenset, repr=False)  # `remove_empty`

    def as_json(self) -> dict[str, object]:
        return {
            "how": "seeded",
            "seed": self.seed,
            "distributions": self.distributions,
            "files": self.files,
            "bytes": self.bytes,
        }


def dist_infos(site: Path) -> dict[str, Path]:
    """The dist-info dirs of a site-packages, by name (`six-1.17.0.dist-info`)."""
    try:
        names = os.listdir(site)
    except OSError:
        return {}
    return {name: site / name for name in names if DIST_INFO.match(name)}


def record_digests(site: Path) -> dict[str, str]:
    """Each dist-info dir of a site-packages with its RECORD's digest (`hashed.record_digest`;
    one whose RECORD cannot be read is left out)."""
    found = {}
    for name, dist_info in dist_infos(site).items():
        if (digest := hashed.record_digest(dist_info)) is not None:
            found[name] = digest
    return found


def _candidates(root: Path, key: str, interpreter: str) -> Iterator[tuple[str, Path, dict]]:
    """Ready venvs of `root` (other than `key`) made from `interpreter`, newest first."""
    found = []
    for name in os.listdir(root):
        venv = root / name
        if name == key or not (venv / MARKER).is_file():
            continue
        try:
            meta = Venv.at(venv).read_marker()
        except (OSError, ValueError):
            continue
        inputs = (meta or {}).get("inputs")
        if not isinstance(inputs, dict) or inputs.get("interpreter") != interpreter:
            continue
        found.append((float(meta.get("built_at") or 0), name, venv, meta))
    for _, name, venv, meta in sorted(found, key=lambda item: item[0], reverse=True)[:CANDIDATES]:
        yield name, venv, meta


def seed_site(venv: Path, meta: dict) -> Path | None:
    """The site-packages dir a ready venv's marker names, where it is inside the venv: a path
    relative to it, without `..`, that resolves below it; else None (a marker no build of
    ours wrote). Only what is inside a seed is ever read from it."""
    rel = meta.get("site_packages")
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in rel.split("/"):
        return None
    site = venv / rel
    real, top = os.path.realpath(site), os.path.realpath(venv)
    return site if real.startswith(top + os.sep) else None


def nearest(
    root: Path, key: str, interpreter: str, distributions: Collection[str]
) -> tuple[str, Path, dict] | None:
    """(key, path, marker) of the ready venv of `root` nearest to the venv `key` whose
    site-packages holds the dist-info dirs `distributions`: the same interpreter, the most
    dist-info dirs in common; None where none shares `MIN_COMMON`. One notion of "near" for a
    build (`choose`) and a ship's receiver (`ship.delta`)."""
    new = set(distributions)
    best: tuple[int, str, Path, dict] | None = None
    for name, path, meta in _candidates(root, key, interpreter):
        site = seed_site(path, meta)
        if site is None:
            continue
        shared = len(new & dist_infos(site).keys())
        if shared >= MIN_COMMON and (best is None or shared > best[0]):
            best = (shared, name, path, meta)
    if best is None:
        return None
    _, name, path, meta = best
    # Trusted and whole, but not marked used: a seed is only read, and a venv the node's
    # new keys keep seeding from must stay one that `gc` and the budget may remove (a seed
    # removed meanwhile costs a full build of what it would have given, never a failure).
    if not Venv(root, name).check_ready(use=False):
        return None
    return name, path, meta


def choose(venv: Venv, interpreter: str, records: dict[str, str]) -> Seed | None:
    """The ready venv of the venv dir nearest to the new `venv` (just synced, without bytecode;
    `records`: its `record_digests`): the same interpreter and site-packages, an index of this
    node's (`store.hashed`), the most distributions alike; None where none shares
    `MIN_COMMON`."""
    found = nearest(venv.root, venv.key, interpreter, records.keys())
    if found is None:
        return None
    name, path, meta = found
    accounted = meta.get("accounted")
    if not isinstance(accounted, dict) or accounted.get("bytecode") != "plugin":
        return None  # its bytecode is not known to be its compile step's (`record`)
    index = hashed.load(path, meta.get("hashed"))
    if index is None:
        raise SeedError(
            f"the nearest venv {name} has no index of its files that this version reads (built "
            "by an earlier version, or its index was lost or changed)"
        )
    try:
        found_parts = manifest.parts(path, meta.get("manifest"))
    except manifest.ManifestError as e:
        raise SeedError(f"the nearest venv {name} {e}") from None
    if found_parts is None:
        raise SeedError(f"the nearest venv {name} has a manifest of an earlier version")
    if found_parts[0] != manifest.site_of(venv.path):
        return None
    site, fragments = found_parts
    common = tuple(sorted(d for d, digest in records.items() if index.records.get(d) == digest))
    if len(common) < MIN_COMMON:
        return None
    return Seed(name, path, site, common, fragments, index)


class CacheDirs:
    """The `__pycache__` dirs the seed's bytecode goes into, made by `THREADS` threads while the
    caller lists the new venv (the kernel work of `mkdir` overlaps the walk's): those of every
    part the seed has bytecode of, where the new venv has the package's dir. A dir that takes
    no bytecode and is left empty after the compile step is removed (`remove_empty`): a venv
    holds the dirs a fresh build's would."""

    def __init__(self, seed: Seed, venv: Path) -> None:
        prefix = f"{seed.site}/"
        folders = set()
        for name, part in seed.index.parts.items():
            for pyc in part.bytecode:  # the seed's own say, checked against its marker: still
                if manifest.part_of(pyc, prefix) != name or ".." in pyc.split("/"):  # inside
                    raise SeedError(f"the nearest venv {seed.key} lists {pyc} in part {name}")
                folders.add(pyc.rpartition("/")[0])
        self.pool = ThreadPoolExecutor(THREADS)
        make = partial(_make_cache_dirs, str(venv))
        self._making = [self.pool.submit(make, chunk) for chunk in _chunks(sorted(folders))]
        self._made: list[str] | None = None

    def made(self) -> list[str]:
        """The dirs made (venv-relative), once every thread is done."""
        if self._made is None:
            try:
                self._made = [folder for future in self._making for folder in future.result()]
            finally:
                self.pool.shutdown()
        return self._made


def take_bytecode(seed: Seed, venv: Path, listed: tree.Tree, dirs: CacheDirs) -> Taken:
    """Link the seed's bytecode of the parts whose sources are the seed's into `venv` (its
    `dirs` made), and list it into `listed` (see the module's docstring); raises SeedError for
    a seed file that is not what its manifest says."""
    made = dirs.made()
    listed.relist(made)  # listed while they were made: listed again
    groups = manifest.split(listed.entries, seed.site)
    wanted: dict[str, tuple[str, ...]] = {}  # part -> the seed's bytecode of it (`CacheDirs`)
    for name, paths in groups.items():
        part = seed.index.parts.get(name)
        if name in manifest.NEVER_KEPT or part is None or not part.bytecode:
            continue
        if part.sources == hashed.sources(listed, paths):
            wanted[name] = part.bytecode
    with ThreadPoolExecutor(THREADS) as pool:
        link = partial(_link, str(seed.path), str(venv))
        linked = []
        for chunk in pool.map(link, _chunks([pyc for pycs in wanted.values() for pyc in pycs])):
            for pyc, st in chunk:  # each file listed as linked: its dir holds nothing else new
                listed.entries[pyc] = st
                linked.append(pyc)
    folders = {pyc.rpartition("/")[0] for pyc in linked}
    found = set(linked)
    by_part = {}  # what the seed added to each part
    for name, pycs in wanted.items():
        if added := [pyc for pyc in pycs if pyc in found]:
            by_part[name] = added
            groups[name] += added
    listings = _check_linked(seed, venv, listed, by_part, groups)
    size = sum(listed.entries[pyc].st_size for pyc in linked if pyc in listed.entries)
    unused = frozenset(made).difference(folders)
    return Taken(
        seed.key, len(seed.common), len(linked), size, frozenset(linked), seed, listings, unused
    )


def remove_empty(listed: tree.Tree, taken: Taken) -> None:
    """The dirs `CacheDirs` made that took no bytecode and are empty still, removed (and from
    `listed`)."""
    for folder in taken.unused:
        try:
            os.rmdir(listed.path(folder))
        except OSError:  # the compile step wrote into it
            continue
        listed.entries.pop(folder, None)


def _chunks(items: list[T]) -> list[list[T]]:
    """`items` in runs of `CHUNK`, one task each: neighbours, so threads rarely share a dir."""
    return [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]


def _make_cache_dirs(top: str, folders: list[str]) -> list[str]:
    """`__pycache__` dirs for the seed's bytecode, where their packages' dirs (uv's) are: those
    made."""
    made = []
    for folder in folders:
        try:
            os.mkdir(f"{top}/{folder}", 0o755)
        except (FileExistsError, FileNotFoundError):  # a wheel's own; a package not here
            continue
        made.append(folder)
    return made


def _link(seed: str, top: str, chunk: list[str]) -> list[tuple[str, os.stat_result]]:
    """One chunk of the seed's `.pyc` files linked into the new venv: those linked, each with
    its `lstat` taken after the link (what the venv now holds, checked in `_check_linked`)."""
    linked = []
    for pyc in chunk:
        path = f"{top}/{pyc}"
        try:
            os.link(f"{seed}/{pyc}", path, follow_symlinks=False)
        except (FileNotFoundError, FileExistsError):
            continue  # removed meanwhile (gc), or a wheel's own: compiled in step 3 instead
        linked.append((pyc, os.lstat(path)))
    return linked


def _check_linked(
    seed: Seed,
    venv: Path,
    listed: tree.Tree,
    by_part: dict[str, list[str]],
    groups: dict[str, list[str]],
) -> dict[str, tuple[frozenset[str], str]]:
    """Each linked file is the seed's, as its manifest lists it: a part whose listing is the
    seed's is (the same inodes, unchanged since its build hashed them); in another, each file
    is looked up in the seed's rows, or read. SeedError (the file unlinked) for one that is
    not. Returns the listings found to be the seed's (`Taken.listings`)."""
    clock = hashed.fs_clock(venv)
    listings = {}
    for name, pycs in by_part.items():
        part = seed.index.parts[name]
        listing = hashed.listing(listed, groups[name], clock) if part.listing else ""
        if listing and listing == part.listing:
            listings[name] = (frozenset(groups[name]), listing)
            continue
        try:
            built = manifest.load_part(seed.path, name, seed.fragments[name])
        except (manifest.ManifestError, KeyError) as e:
            raise SeedError(f"the nearest venv {seed.key} {e}") from None
        rows = hashed.rows(seed.path, part.rows)
        for pyc in pycs:
            entry, st = built.get(pyc), listed.entries.get(pyc)
            sha = rows.sha256(st) if rows is not None and st is not None else None
            if sha is None:
                st, sha, _ = manifest.read_file(listed.path(pyc))
            found = ("file", st.st_size, sha)
            if entry is None or (entry.kind, entry.size, entry.content) != found:
                os.unlink(listed.path(pyc))
                raise SeedError(
                    f"the nearest venv {seed.key} has {pyc} with other content than when it "
                    "was built"
                )
    return listings


def untrusted_seed(error: BaseException) -> bool:
    """Whether `error` (from `choose` or `take_bytecode`) is one a full build recovers from:
    any error of a seed's files or marker, an untrusted path's (an OSError) among them: a full
    build never reads them."""
    return isinstance(error, (ValueError, OSError, LookupError, TypeError))


def has_candidates(venv: Venv, interpreter: str) -> bool:
    """Whether the venv dir holds a ready venv that could seed `venv` (a few marker reads):
    else the build is one `uv sync`, as without seeding."""
    try:
        return next(_candidates(venv.root, venv.key, interpreter), None) is not None
    except OSError:
        return False
