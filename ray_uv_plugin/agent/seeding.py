"""A new venv's bytecode from the nearest ready venv of this node: a changed lock costs what
changed.

Users iterate: bump one package, re-lock, run again. Each lock is a new key, and so a new venv.
uv makes its files in seconds (each one a hardlink from its cache); compiling every module's
bytecode is what takes the time (~48 s for 425 packages on 2 cores, against ~4 s for the files),
and the bytecode of every distribution that did not change was compiled before, in the venv of
the old key on this node. So a build (`builder`) runs:

1. `uv sync` of the new lock without bytecode: the venv's files, exactly as uv makes them;
2. `take_bytecode`: from the nearest ready venv of the same interpreter (`choose`: the most
   distributions in common), the `.pyc` files of each distribution whose dist-info is the same
   there (name, version and `RECORD`, byte for byte but for console scripts, which name their
   venv), for each module whose source has the size and mtime the `.pyc`'s header checks;
   each is hardlinked (a `.pyc` is never written in place), then checked against the seed's
   manifest: the linked inode itself, so a seed changed before or during the link is caught,
   and the build falls back to a full one. The inode is read and hashed unless the seed's index
   (`store.hashed`) proves it unchanged since the seed's build hashed it. `THREADS` threads do
   this kernel work (`lstat`, `mkdir`, `link` release the GIL), each on its own files;
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
import stat
import sys
import threading
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ray_uv_plugin.store import accounting, hashed, manifest
from ray_uv_plugin.store.layout import DIST_INFO, MARKER, check_ready, read_marker, site_packages

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
    site: Path  # its site-packages
    common: tuple[str, ...]  # the dist-info dir names it shares with the new venv, RECORD alike
    files: manifest.Files  # its manifest, checked against its marker
    hashed: hashed.Hashed | None = None  # its files' inodes as hashed (`store.hashed`)
    # Files its distributions that the new venv lacks list in their RECORDs (venv-relative).
    listed: frozenset[str] = frozenset()

    @property
    def distributions(self) -> int:
        return len(self.common)


@dataclass(frozen=True)
class Taken:
    """What a seeded venv took from its seed."""

    seed: str  # the seed's key
    distributions: int  # distributions whose bytecode came from the seed
    files: int  # `.pyc` files linked
    bytes: int
    # What was read of them: path in the venv -> (inode, manifest entry), for its manifest.
    known: dict[str, tuple[int, manifest.Entry]] = field(default_factory=dict, repr=False)
    # The seed's index of hashed inodes: uv linked the same ones from its cache into both.
    hashed: hashed.Hashed | None = field(default=None, repr=False)

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


def _record(dist_info: Path) -> bytes | None:
    """A distribution's RECORD, less its entries outside site-packages: console scripts name
    their venv's python, so their hashes differ from venv to venv though nothing else does."""
    try:
        lines = (dist_info / "RECORD").read_bytes().splitlines()
    except OSError:
        return None
    return b"\n".join(line for line in lines if not line.startswith(b"../"))


def _candidates(root: Path, key: str, interpreter: str) -> Iterator[tuple[str, Path, dict]]:
    """Ready venvs of `root` (other than `key`) made from `interpreter`, newest first."""
    found = []
    for name in os.listdir(root):
        venv = root / name
        if name == key or not (venv / MARKER).is_file():
            continue
        try:
            meta = read_marker(venv)
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
    if not check_ready(root, name, use=False):
        return None
    return name, path, meta


def choose(root: Path, venv: Path, interpreter: str) -> Seed | None:
    """The ready venv of `root` nearest to the new `venv` (just synced, without bytecode): the
    same interpreter, the most distributions alike; None where none shares `MIN_COMMON`."""
    site = site_packages(venv)
    if site is None:
        return None
    new = dist_infos(site)
    found = nearest(root, venv.name, interpreter, new.keys())
    if found is None:
        return None
    name, path, meta = found
    accounted = meta.get("accounted")
    if not isinstance(accounted, dict) or accounted.get("bytecode") != "plugin":
        return None  # its bytecode is not known to be its compile step's (`build_record`)
    theirs = seed_site(path, meta)
    if theirs is None:  # changed since `nearest` read it
        return None
    common = tuple(
        sorted(
            dist
            for dist in new.keys() & dist_infos(theirs).keys()
            if (record := _record(new[dist])) is not None and record == _record(theirs / dist)
        )
    )
    if len(common) < MIN_COMMON:
        return None
    try:
        files = manifest.load(path, meta.get("manifest"))
    except manifest.ManifestError as e:
        raise SeedError(f"the nearest venv {name} {e}") from None
    # What its other distributions' RECORDs list is theirs, never bytecode its build compiled
    # (the common ones' RECORDs are the new venv's, read by the build).
    others = sorted(dist_infos(theirs).keys() - set(common))
    listed = accounting.read_records(path, others).hashes.keys()
    indexed = hashed.load(path, meta.get("hashed"))
    return Seed(name, path, theirs, common, files, indexed, frozenset(listed))


def _sources(dist_info: Path) -> Iterator[str]:
    """The `.py` files a distribution's RECORD lists, relative to site-packages."""
    for line in (dist_info / "RECORD").read_text(encoding="utf-8").splitlines():
        path = line.split(",", 1)[0]
        if path.endswith(".py") and not path.startswith(("/", "..")) and ".." not in path:
            yield path


def _pycs(seed_site: str, source: str, listed: dict[str, dict[str, list[str]]]) -> list[str]:
    """The seed's bytecode files of one module, relative to site-packages; `listed` keeps each
    `__pycache__` dir's `.pyc` names of this interpreter by module, listed once (twice at most,
    where two threads ask at once)."""
    folder, _, filename = source.rpartition("/")
    cache = f"{folder}/__pycache__" if folder else "__pycache__"
    by_module = listed.get(cache)
    if by_module is None:
        by_module = {}
        tag = f".{sys.implementation.cache_tag}."
        try:
            names = os.listdir(os.path.join(seed_site, cache))
        except OSError:
            names = []
        for name in names:
            module, found, _ = name.partition(tag)
            if found and name.endswith(".pyc"):
                by_module.setdefault(module, []).append(f"{cache}/{name}")
        listed[cache] = by_module  # whole, for another thread's distribution in the same dir
    return by_module.get(filename[:-3], [])


def _same_source(a: str, b: str) -> bool:
    """Whether two sources have what a `.pyc` header checks alike: size and mtime (seconds)."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    if not (stat.S_ISREG(sa.st_mode) and stat.S_ISREG(sb.st_mode)):
        return False
    return sa.st_size == sb.st_size and int(sa.st_mtime) == int(sb.st_mtime)


def take_bytecode(seed: Seed, venv: Path, recorded: accounting.Recorded) -> Taken:
    """Link the seed's `.pyc` files of the distributions it shares into `venv` (see the module's
    docstring); raises SeedError for a seed file that is not what its manifest says. Only
    bytecode the seed's build compiled is taken: never a file that a RECORD lists (the new
    venv's `recorded`, the seed's `listed`), never one whose header is not its source's."""
    found = site_packages(venv)
    assert found is not None  # `choose` found it
    base = str(found.relative_to(venv))
    seed_base = str(seed.site.relative_to(seed.path))
    site, seed_site = str(found), str(seed.site)  # strings: ~44,000 files for 425 packages
    listed: dict[str, dict[str, list[str]]] = {}

    def wanted_of(dist: str) -> list[tuple[str, str]]:
        """(.pyc, its source) of one distribution, relative to site-packages."""
        return [
            (pyc, source)
            for source in _sources(found / dist)
            if _same_source(f"{site}/{source}", f"{seed_site}/{source}")
            for pyc in _pycs(seed_site, source, listed)
            if f"{base}/{pyc}" not in recorded.hashes and f"{seed_base}/{pyc}" not in seed.listed
        ]

    with ThreadPoolExecutor(THREADS) as pool:
        wanted = [pair for part in pool.map(wanted_of, seed.common) for pair in part]
        folders = sorted({f"{site}/{rel.rpartition('/')[0]}" for rel, _ in wanted})
        list(pool.map(_make_cache_dirs, _chunks(folders)))
        link = _Linker(seed, site, seed_site, base, seed_base)
        linked = list(pool.map(link, _chunks(wanted)))  # a SeedError of any chunk: raised here
    known: dict[str, tuple[int, manifest.Entry]] = {}
    for part in linked:
        known.update(part)
    size = sum(entry.size for _, entry in known.values())
    return Taken(seed.key, len(seed.common), len(known), size, known, seed.hashed)


def _chunks(items: list[T]) -> list[list[T]]:
    """`items` in runs of `CHUNK`, one task each: neighbours, so threads rarely share a dir."""
    return [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]


def _make_cache_dirs(folders: list[str]) -> None:
    """`__pycache__` dirs for the seed's bytecode: their packages' dirs are uv's."""
    for folder in folders:
        try:
            os.mkdir(folder, 0o755)
        except FileExistsError:
            pass


class _Linker:
    """Links one chunk of the seed's `.pyc` files into the new venv and checks each linked
    inode against the seed's manifest (`take_bytecode`); called from several threads, which
    share nothing but the seed's index (its count of bytes reused is kept under a lock)."""

    def __init__(self, seed: Seed, site: str, seed_site: str, base: str, seed_base: str) -> None:
        self.seed, self.site, self.seed_site = seed, site, seed_site
        self.base, self.seed_base = base, seed_base
        self.index_lock = threading.Lock()

    def __call__(self, chunk: list[tuple[str, str]]) -> dict[str, tuple[int, manifest.Entry]]:
        seed, site = self.seed, self.site
        known: dict[str, tuple[int, manifest.Entry]] = {}
        for rel, source in chunk:
            entry = seed.files.get(f"{self.seed_base}/{rel}")
            if entry is None or entry.kind != "file":
                raise SeedError(f"the nearest venv {seed.key} has {rel}, which its manifest lacks")
            target = f"{site}/{rel}"
            try:
                os.link(f"{self.seed_site}/{rel}", target, follow_symlinks=False)
            except (FileNotFoundError, FileExistsError):
                continue  # removed meanwhile (gc): compiled in step 3 instead
            st = os.lstat(target)  # the linked inode itself
            sha = None
            if seed.hashed is not None:
                with self.index_lock:
                    sha = seed.hashed.sha256(st)
            if sha != entry.content:  # not provably unchanged: read it
                st, sha, head = manifest.read_file(target)
                if not accounting.header_of(head, f"{site}/{source}"):
                    os.unlink(target)  # not bytecode Python takes for this source: compiled
                    continue
            # else: the bytes its build read, whose header it checked against the same source
            if st.st_size != entry.size or sha != entry.content:
                os.unlink(target)
                raise SeedError(
                    f"the nearest venv {seed.key} has {rel} with other content than when it "
                    "was built"
                )
            known[f"{self.base}/{rel}"] = (st.st_ino, entry)
        return known


def untrusted_seed(error: BaseException) -> bool:
    """Whether `error` (from `choose` or `take_bytecode`) is one a full build recovers from:
    any error of a seed's files or marker, an untrusted path's (an OSError) among them: a full
    build never reads them."""
    return isinstance(error, (ValueError, OSError, LookupError, TypeError))


def has_candidates(root: Path, key: str, interpreter: str) -> bool:
    """Whether `root` holds a ready venv that could seed `key` (a few marker reads): else the
    build is one `uv sync`, as without seeding."""
    try:
        return next(_candidates(root, key, interpreter), None) is not None
    except OSError:
        return False
