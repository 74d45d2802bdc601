"""Ready means accounted for: every file of a venv is one of four things, or the venv is not
made ready (a build fails, a receiver refuses what arrived), with the path named.

1. listed in the `RECORD` of a distribution of the lock (uv writes each RECORD as it installs
   the distribution: a file of the wheel that its own RECORD left out is listed without a hash);
   a listed hash that differs, or a listed file that is missing, is `not_as_recorded`, and the
   build fails naming it (`building.record`): most likely a file changed in uv's cache,
   which would reach every venv made from it. A receiver takes the sending build's word for
   it: what it installs is that build's manifest, and its relocation rewrites scripts that
   RECORDs list (`ship.install`);
2. bytecode the build compiled from such a file (or from uv's scaffolding): at a build, a path
   the build's compile step wrote or a seed gave (`compiled`: a `.pyc` a wheel installed too,
   which its compile step wrote again, included); at a receive, where the sender's build
   vouched for it, a `.pyc` of this interpreter whose header matches its source;
3. uv's venv scaffolding (`pyvenv.cfg`, `bin/activate*`, the interpreter's links...);
4. the plugin's own files (top-level `.ray-uv-*`, never in a manifest, and the `from_image`
   `.pth` file in site-packages, `IMAGE_PTH`, which is).

Directories hold no code and are accounted for by what they hold. The check reads no file the
manifest pass did not read (the RECORDs, a `.pyc`'s 16-byte header at a receive): it works on
the manifest's entries.
"""

from __future__ import annotations

import binascii
import csv
import importlib.util
import os
import re
import sys
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ray_uv_plugin.store import manifest
from ray_uv_plugin.store.layout import DIST_INFO, site_packages

# What `uv venv` makes besides the packages (uv 0.8 to 0.13): files at the top and in `bin/`,
# the interpreter's links (copies with `--link-mode copy` of some uvs) and `lib64`.
_SCAFFOLDING = re.compile(
    r"^(pyvenv\.cfg|\.gitignore|\.lock|CACHEDIR\.TAG|lib64"
    r"|bin/(activate(\.\w+)?|activate_this\.py|deactivate\.bat|pydoc\.bat"
    r"|python|python3|python3\.\d+|pypy|pypy3|pypy3\.\d+))$"
)
_SITE_SCAFFOLDING = ("_virtualenv.py", "_virtualenv.pth")  # in site-packages, older uvs
# The `.pth` file of a venv whose `uv_project` names `from_image` (`env.image`): the plugin's
# own, in site-packages, naming the node interpreter's site-packages dirs.
IMAGE_PTH = "_ray_uv_image.pth"
_TAG = sys.implementation.cache_tag
_PYC = re.compile(rf"^(?P<dir>(?:.*/)?)__pycache__/(?P<module>[^/]+)\.{_TAG}(?:\.opt-\d)?\.pyc$")
SHOWN = 5  # paths named in a message


@dataclass(frozen=True)
class Recorded:
    """Every file the venv's distributions' RECORDs list: venv-relative path -> sha256 hex
    (None where listed without one), and the dist-info dir that lists it."""

    hashes: dict[str, str | None] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    unreadable: tuple[str, ...] = ()  # RECORDs that could not be read: their files are not listed


def _record_sha256(value: str) -> str | None:
    """A RECORD hash (`sha256=<urlsafe base64, unpadded>`) as hex; None for another kind."""
    if not value.startswith("sha256="):
        return None
    encoded = value[7:].replace("-", "+").replace("_", "/")  # `urlsafe_b64decode`'s, faster
    try:
        return binascii.a2b_base64(encoded + "=" * (-len(encoded) % 4)).hex()
    except (binascii.Error, ValueError):
        return None


def _normalised(base: str, path: str) -> str | None:
    """A RECORD path (relative to site-packages `base`) relative to the venv; None out of it."""
    rel = f"{base}/{path}"
    if "/." in rel or "//" in rel:  # else below `base`, as it is
        rel = os.path.normpath(rel)
        if os.path.isabs(rel) or rel == ".." or rel.startswith("../"):
            return None
    return rel


def read_records(venv: Path, distributions: Collection[str] | None = None) -> Recorded:
    """The RECORDs of the venv's dist-info dirs (of `distributions`, dist-info dir names, where
    given). A RECORD names files relative to site-packages; data files and scripts reach out of
    it (`../../../bin/x`), and paths out of the venv are left out."""
    site = site_packages(venv)
    recorded = Recorded()
    if site is None:
        return recorded
    base = str(site.relative_to(venv))
    names = distributions
    if names is None:
        names = sorted(name for name in os.listdir(site) if DIST_INFO.match(name))
    unreadable = []
    for dist in names:
        try:
            with open(site / dist / "RECORD", encoding="utf-8", newline="") as f:
                rows = list(csv.reader(f))  # a quoted name may hold a "\n"
        except (OSError, UnicodeDecodeError, csv.Error):
            unreadable.append(f"{base}/{dist}/RECORD")
            continue
        for row in rows:
            if not row or not row[0]:
                continue
            rel = _normalised(base, row[0])
            if rel is None:
                continue
            recorded.hashes[rel] = _record_sha256(row[1]) if len(row) > 1 and row[1] else None
            recorded.owners[rel] = dist
    return Recorded(recorded.hashes, recorded.owners, tuple(unreadable))


def locked_distributions(lock: bytes) -> dict[str, frozenset[str] | None]:
    """The packages of a `uv.lock`: normalised name -> its versions (None: a package whose
    version the lock leaves dynamic, as a project's own may be)."""
    return distributions_of(tomllib.loads(lock.decode("utf-8")).get("package", []))


def distributions_of(packages: list[dict]) -> dict[str, frozenset[str] | None]:
    """`locked_distributions` of a lock's `[[package]]` tables, parsed already."""
    found: dict[str, set[str] | None] = {}
    for package in packages:
        name = canonicalize_name(str(package.get("name", "")))
        version = package.get("version")
        if version is None:
            found[name] = None
        elif found.get(name, set()) is not None:
            found.setdefault(name, set()).add(_version(str(version)))  # type: ignore[union-attr]
    return {name: None if v is None else frozenset(v) for name, v in found.items()}


def _version(text: str) -> str:
    try:
        return str(Version(text))
    except InvalidVersion:
        return text


def foreign_distributions(venv: Path, locked: Mapping[str, frozenset[str] | None]) -> list[str]:
    """The dist-info dirs of the venv that are no package of the lock (name and version)."""
    site = site_packages(venv)
    if site is None:
        return []
    foreign = []
    for name in sorted(os.listdir(site)):
        match = DIST_INFO.match(name)
        if not match:
            continue
        versions = locked.get(canonicalize_name(match["name"]), frozenset())
        if versions is not None and _version(match["version"]) not in versions:
            foreign.append(name)
    return foreign


def bytecode_source(path: str) -> str | None:
    """The source a `.pyc` of this interpreter is compiled from (`a/__pycache__/m.<tag>.pyc`
    -> `a/m.py`, at any optimisation level); None for any other path."""
    match = _PYC.match(path)
    return f"{match['dir']}{match['module']}.py" if match else None


def _is_scaffolding(path: str, site: str) -> bool:
    """Whether the venv-relative `path` is what `uv venv` makes besides packages."""
    if _SCAFFOLDING.match(path):
        return True
    folder, _, name = path.rpartition("/")
    return folder == site and (name in _SITE_SCAFFOLDING or name == IMAGE_PTH)


def header_matches(pyc: str, source: str) -> bool:
    """Whether the `.pyc` file at `pyc` is bytecode Python takes for the source at `source`
    (`_header_of`)."""
    try:
        fd = os.open(pyc, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            header = os.read(fd, 16)
        finally:
            os.close(fd)
    except OSError:
        return False
    return _header_of(header, source)


def _header_of(header: bytes, source: str) -> bool:
    """Whether a `.pyc`'s first 16 bytes are bytecode Python takes for the source at `source`:
    this interpreter's magic, and the source's mtime and size (a timestamp `.pyc`) or its hash
    (a checked hash-based one, as `SOURCE_DATE_EPOCH` makes). An unchecked hash-based `.pyc` is
    never one: no compile step of a build makes one, and Python runs it without looking."""
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    try:
        if flags == 0:
            st = os.lstat(source)
            return (
                int.from_bytes(header[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                and int.from_bytes(header[12:16], "little") == st.st_size & 0xFFFFFFFF
            )
        if flags == 3:
            with open(source, "rb") as f:
                return importlib.util.source_hash(f.read()) == header[8:16]
    except OSError:
        pass
    return False


@dataclass(frozen=True)
class Accounting:
    not_as_recorded: list[str]  # `<path> (<dist-info>)`: listed with another hash, or missing
    unaccounted: list[str]  # paths that are none of the four things


def account(
    venv: Path,
    files: manifest.Files,
    recorded: Recorded,
    compiled: Collection[str] | None,
    foreign: Collection[str] = (),
    heads: Mapping[str, bytes] | None = None,
) -> Accounting:
    """Account for every entry of `files` (the venv's manifest): see the module's docstring.
    `compiled`: the `.pyc` paths the build's compile step wrote or its seed gave; None at a
    receive, where an unlisted `.pyc` is taken for the sender's build's if its header matches
    its listed source. `foreign`: dist-info dirs of no package of the lock, whose RECORDs
    account for nothing. `heads`: the headers of the `.pyc` files the manifest pass read
    (`manifest.scan`) or a receiver wrote (`ship.unpack`); a compiled one's must be its
    source's too (a seed's, not read, was checked so when its own build read it:
    `building.seeding`), and a receiver reads the header of one it did not write."""
    site = site_packages(venv)
    base = str(site.relative_to(venv)) if site is not None else ""
    hashes = recorded.hashes
    if foreign:
        left_out = set(foreign)
        hashes = {p: h for p, h in hashes.items() if recorded.owners.get(p) not in left_out}
    mismatches, unaccounted = [], []

    def compiled_here(path: str) -> bool:  # bytecode of a listed source, that the build made
        source = bytecode_source(path)
        if source is None or not (source in hashes or _is_scaffolding(source, base)):
            return False
        head = heads.get(path) if heads is not None else None
        if compiled is None:
            if head is None:
                return header_matches(str(venv / path), str(venv / source))
            return _header_of(head, str(venv / source))
        return path in compiled and (head is None or _header_of(head, str(venv / source)))

    for path, entry in files.items():
        if entry.kind == "dir":
            continue
        if path in hashes:
            expected = hashes[path]
            if entry.kind != "file":
                unaccounted.append(path)
            # A wheel's `.pyc` that the build's compile step wrote again is the build's.
            elif expected is not None and entry.content != expected and not compiled_here(path):
                mismatches.append(f"{path} ({recorded.owners[path]})")
            continue
        if _is_scaffolding(path, base):
            continue
        if entry.kind == "file" and compiled_here(path):
            continue
        unaccounted.append(path)
    for path in sorted(p for p, h in hashes.items() if h is not None and p not in files):
        mismatches.append(f"{path} ({recorded.owners[path]})")
    mismatches += [f"{record} (unreadable)" for record in recorded.unreadable]
    return Accounting(sorted(mismatches), sorted(unaccounted))


def unaccounted_note(accounting: Accounting) -> str:
    """The unaccounted paths, the first `SHOWN` named, for a message."""
    paths = accounting.unaccounted
    more = f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
    return (
        f"{len(paths)} files that no distribution of the lock installed and no compile step "
        f"of its build made: {', '.join(paths[:SHOWN])}{more}"
    )
