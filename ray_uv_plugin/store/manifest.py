"""A venv's manifest: every file, dir and link its build made, to tell that what leaves a node,
or arrives on one, is what was built.

A build writes it after `uv sync` and the Ray check, before the venv is frozen, as
`<key>/.ray-uv-ready.manifest`; the marker, written last, names its sha256, so the two are tied.
Each entry is a path relative to `<key>/` with its kind, size, content (a file's sha256, a
link's text) and mode (a file's, as a receiver writes it: owner read/write, no set-id bits, no
group/other write). Top-level names starting with `.ray-uv-` are the plugin's own (the marker,
this manifest, its fragments), never listed.

It is stored by part, so that a build after a one-package change writes what changed and keeps
the rest (`building.record`): a part is the first path component below site-packages
(`numpy`, `six.py`, with a top-level module's bytecode, `__pycache__/six.<tag>.pyc`), every
dist-info dir together (`DIST_INFOS`: uv writes each one's RECORD anew, so they never match a
seed's), and the venv's own entries outside them (`VENV`: `bin/`, `pyvenv.cfg`, the dirs above
site-packages). Each part's entries are one fragment, `.ray-uv-ready.parts/<sha256>`, and the
manifest names every fragment by its sha256: a fragment that another venv's manifest names is
linked from it, not written again. What a manifest says is a function of its entries alone
(`digest`): a receiver's list of what it unpacked has the build's sha256.

Who checks it, and when (`docs/operations.md`, "What is shipped is what was built"):
- the sender (`ship.archive.Packer`) checks each file it streams against it, as it reads it;
  a venv that drifted is not sent, and is marked not whole, so its next use rebuilds it;
- a receiver lists what it unpacked (`ship.unpack`) and installs it only if that list is the
  build's (the same sha256), then writes its own manifest for what it installed (relocated
  scripts differ from the sender's), so it can send it on;
- the build accounts for every file (`store.accounting`): a distribution's `RECORD` lists it
  with that hash, its compile step made it, or uv's scaffolding is it.
Reusing a ready venv reads none of it: the warm path stays a few `stat`s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ray_uv_plugin.store import tree, trust

if TYPE_CHECKING:
    from ray_uv_plugin.store.hashed import Hashed

MANIFEST = ".ray-uv-ready.manifest"
FORMAT = 2
OWN_PREFIX = ".ray-uv-"  # a top-level name of the plugin's own (marker, manifest, stream's)
MAX_BYTES = 256 * 1024 * 1024  # a manifest of 250,000 members is about 40 MB


class ManifestError(ValueError):
    """A venv that is not what its build wrote: its manifest missing, not the one its marker
    names, or a file that differs from it. Says which, and why."""


class Entry(NamedTuple):
    kind: str  # file | dir | symlink
    size: int  # a file's bytes; 0 for the others
    content: str  # a file's sha256 (hex), a link's text; "" for a dir
    mode: int  # a file's mode as a receiver writes it (`file_mode`); 0 for the others


Files = dict[str, Entry]  # relative path -> entry
DIR = Entry("dir", 0, "", 0)


def file_mode(mode: int) -> int:
    """The mode a receiver gives a file of mode `mode` (`ship.unpack`): what a manifest lists,
    so that freezing (which drops group/other write) changes nothing in it."""
    return (stat.S_IMODE(mode) & 0o755) | 0o600


def file_entry(mode: int, size: int, sha256: str) -> Entry:
    return Entry("file", size, sha256, file_mode(mode))


def link_entry(target: str) -> Entry:
    return Entry("symlink", 0, target, 0)


def own(top_level_name: str) -> bool:
    """Whether a name directly in `<key>/` is the plugin's own, not the venv's (and so a path
    relative to `<key>/` below one)."""
    return top_level_name.startswith(OWN_PREFIX)


SMALL_FILE = 1 << 20  # read in one call: most of a venv's files (a `.py`, a `.pyc`)


def hash_file(path: str) -> tuple[os.stat_result, str]:
    """(`fstat`, sha256) of the regular file at `path`, opened without following a link."""
    st, sha256, _ = read_file(path)
    return st, sha256


def read_file(path: str) -> tuple[os.stat_result, str, bytes]:
    """`hash_file`, and the file's first 16 bytes (a `.pyc`'s header), read with the rest."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{path} is not a regular file")
        if st.st_size < SMALL_FILE:  # no 256 KiB buffer per file: 30% faster here
            data = b""
            while len(data) <= st.st_size and (part := os.read(fd, st.st_size + 1 - len(data))):
                data += part
            if len(data) <= st.st_size:
                return st, hashlib.sha256(data).hexdigest(), data[:16]
            os.lseek(fd, 0, os.SEEK_SET)  # grew while read: hash what is there now
        head = os.pread(fd, 16, 0)
        return st, hashlib.file_digest(f, "sha256").hexdigest(), head


def scan(
    venv: Path | tree.Tree,
    paths: Iterable[str] | None = None,
    reuse: Hashed | None = None,
    record: Hashed | None = None,
    heads: dict[str, bytes] | None = None,
) -> Files:
    """The entries `paths` of a venv (every entry but the plugin's own top-level names where
    None), as listed (`store.tree`: `venv` itself, or listed now), never following a link, each
    file read and hashed. A special file (a FIFO, a device) is an error: a venv has none.
    `reuse`: an index of inodes hashed before and unchanged since (`store.hashed`: a seed's,
    whose files uv linked from the same cache, or whose bytecode the build linked), not read
    again. `record`: an index to fill with every file's hash, its clock taken before the scan
    began. `heads`: filled with the first 16 bytes of each `.pyc` file read (its header,
    `store.accounting`)."""
    listed = venv if isinstance(venv, tree.Tree) else tree.collect(venv)
    entries = listed.entries
    if paths is None:
        paths = [key for key in entries if not own(key)]  # and what is below its own dirs
    files: Files = {}
    for key in paths:
        st = entries[key]
        if stat.S_ISLNK(st.st_mode):
            files[key] = link_entry(os.readlink(listed.path(key)))
        elif stat.S_ISDIR(st.st_mode):
            files[key] = DIR
        elif stat.S_ISREG(st.st_mode):
            if reuse is None or (sha := reuse.sha256(st)) is None:
                st, sha, head = read_file(listed.path(key))
                if heads is not None and key.endswith(".pyc"):
                    heads[key] = head
            files[key] = file_entry(st.st_mode, st.st_size, sha)
            if record is not None:
                record.add(st, sha)
        else:
            raise ManifestError(f"{listed.path(key)}: a venv holds only files, dirs and links")
    return files


VENV = ""  # the part of the venv's own entries: everything outside site-packages' parts
DIST_INFOS = "*.dist-info"  # every dist-info dir, one part
# Parts a build lists anew each time, never kept from a seed nor seeded: `bin/`'s scripts name
# their venv, and uv writes each dist-info dir's RECORD, INSTALLER and REQUESTED anew.
NEVER_KEPT = frozenset({VENV, DIST_INFOS})
PARTS = ".ray-uv-ready.parts"  # the fragments of the manifest and the index, by sha256
_SITE = re.compile(r"^lib/[^/]+/site-packages$")


def part_of(path: str, prefix: str) -> str:
    """The part of the venv-relative `path` (see the module's docstring); `prefix`:
    site-packages' path and a `/`."""
    if not path.startswith(prefix):
        return VENV
    first, below, rest = path[len(prefix) :].partition("/")
    if first == "__pycache__":  # a top-level module's bytecode goes with its module
        return f"{rest.partition('.')[0]}.py" if below else VENV
    if first.endswith(".dist-info"):
        return DIST_INFOS
    return first


def split(paths: Iterable[str], site: str) -> dict[str, list[str]]:
    """Venv-relative `paths` by part (the plugin's own top-level names left out); `site`:
    site-packages relative to the venv ("" where it has none: one part)."""
    prefix = f"{site}/" if site else "\0"
    parts: dict[str, list[str]] = {}
    for path in paths:
        if own(path):  # a name of its own, or below one (the fragments)
            continue
        parts.setdefault(part_of(path, prefix), []).append(path)
    return parts


def site_of(venv: Path) -> str:
    """The venv's site-packages, relative to it ("" where it has none)."""
    found = sorted(str(p.relative_to(venv)) for p in Path(venv).glob("lib/*/site-packages"))
    return found[0] if found else ""


def _json(doc: object) -> bytes:
    # An entry is a tuple, which json writes as the list `_entries` reads: no copy of 134,000.
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def fragment(part: str, files: Mapping[str, Entry]) -> bytes:
    """The bytes of one part's fragment: its entries."""
    return _json({"format": FORMAT, "part": part, "files": files})


def _document(site: str, parts: Mapping[str, str]) -> bytes:
    return _json({"format": FORMAT, "site": site, "parts": parts})


def _parts(files: Mapping[str, Entry], site: str) -> dict[str, Files]:
    by_part: dict[str, Files] = {}
    prefix = f"{site}/" if site else "\0"
    for path, entry in files.items():
        by_part.setdefault(part_of(path, prefix), {})[path] = entry
    return by_part


def digest(files: Files) -> str:
    """The sha256 of the manifest `write` makes of `files`: what a marker names."""
    sites = sorted(p for p, e in files.items() if e.kind == "dir" and _SITE.match(p))
    site = sites[0] if sites else ""
    shas = {
        part: hashlib.sha256(fragment(part, entries)).hexdigest()
        for part, entries in _parts(files, site).items()
    }
    return hashlib.sha256(_document(site, shas)).hexdigest()


class Fragments:
    """A venv's fragments (`<venv>/.ray-uv-ready.parts/<sha256>`): written once, each named by
    its content, linked from a seed where a part is the seed's. Written without a sync each,
    then synced together (`sync`) before the document that names them."""

    def __init__(self, venv: Path) -> None:
        self.dir = venv / PARTS
        os.makedirs(self.dir, 0o755, exist_ok=True)
        self.made: list[Path] = []

    def put(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.dir / sha
        try:
            fd = trust.open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        except FileExistsError:  # the same bytes: two parts alike
            return sha
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        self.made.append(path)
        return sha

    def adopt(self, seed: Path, sha: str) -> bool:
        """The seed's fragment `sha` linked in, then read and checked here (what this venv
        holds is what its name says); False, nothing kept, where it cannot be (gone, changed,
        on another file system)."""
        target = self.dir / sha
        try:
            os.link(seed / PARTS / sha, target, follow_symlinks=False)
        except FileExistsError:
            pass
        except OSError:
            return False
        try:
            read_fragment(self.dir.parent, sha)
        except ManifestError:
            os.unlink(target)
            return False
        return True

    def sync(self) -> None:
        for path in self.made:  # the first one's sync commits the others' data with it
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.made.clear()


def read_fragment(venv: Path, sha: str) -> bytes:
    """The bytes of the venv's fragment `sha`, checked against it; ManifestError otherwise."""
    path = venv / PARTS / sha
    try:
        data = trust.read_own_file(path, MAX_BYTES, "a fragment of the venv's manifest")
    except FileNotFoundError:
        raise ManifestError(f"has lost a fragment of its manifest, {path}") from None
    except OSError as e:
        raise ManifestError(f"has a fragment of its manifest that cannot be used: {e}") from e
    if hashlib.sha256(data).hexdigest() != sha:
        raise ManifestError(f"has a fragment of its manifest, {path}, that is not its build's")
    return data


def write(venv: Path, files: Files) -> str:
    """Write (or replace) `<venv>/.ray-uv-ready.manifest` and its fragments, every part anew;
    returns the manifest's sha256 for the marker."""
    site = site_of(venv)
    return write_parts(venv, site, _parts(files, site), {})


def write_parts(venv: Path, site: str, fresh: Mapping[str, Files], kept: Mapping[str, str]) -> str:
    """Write the manifest of the parts `fresh` (their entries, written as fragments) and `kept`
    (part -> the sha256 of a fragment already in the venv: `Fragments.adopt`); returns its
    sha256."""
    fragments = Fragments(venv)
    shas = {part: fragments.put(fragment(part, entries)) for part, entries in fresh.items()}
    fragments.sync()
    data = _document(site, {**shas, **kept})
    trust.write_new_file(venv / MANIFEST, data)
    return hashlib.sha256(data).hexdigest()


def _entries(found: object) -> Files:
    if not isinstance(found, dict):
        raise ValueError("no entries")
    files: Files = {}
    for path, value in found.items():
        kind, size, content, mode = value
        if kind not in ("file", "dir", "symlink") or not isinstance(content, str):
            raise ValueError(f"{path!r}: {value!r} is no entry")
        files[path] = Entry(kind, int(size), content, int(mode))
    return files


def _read(venv: Path, sha256: object) -> dict:
    """The manifest document of `venv` that its marker names (see `load`)."""
    if not isinstance(sha256, str):
        raise ManifestError(
            "has no manifest of its files (it was built by an earlier version of the plugin)"
        )
    path = venv / MANIFEST
    try:
        data = trust.read_own_file(path, MAX_BYTES, "the venv's manifest")
    except FileNotFoundError:
        raise ManifestError(f"has lost its manifest {path}") from None
    except OSError as e:  # untrusted included: someone else's file where ours belongs
        raise ManifestError(f"has a manifest that cannot be used: {e}") from e
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ManifestError(
            f"has a manifest {path} that is not its build's (sha256 {got[:12]}..., the "
            f"marker's {sha256[:12]}...)"
        )
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") not in (1, FORMAT):
            raise ValueError(f"not a manifest of format 1 or {FORMAT}")
        return doc
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"has an unreadable manifest {path}: {e}") from e


def parts(venv: Path, sha256: object) -> tuple[str, dict[str, str]] | None:
    """(site-packages, part -> its fragment's sha256) of the manifest the marker names; None
    for a manifest of format 1 (whole, no parts). ManifestError as `load`."""
    return _parts_in(venv, _read(venv, sha256))


def _parts_in(venv: Path, doc: dict) -> tuple[str, dict[str, str]] | None:
    if doc["format"] == 1:
        return None
    try:
        found = doc["parts"]
        if not isinstance(doc["site"], str) or not isinstance(found, dict):
            raise TypeError("no parts")
        return doc["site"], {str(part): str(sha) for part, sha in found.items()}
    except (KeyError, TypeError) as e:
        raise ManifestError(f"has an unreadable manifest {venv / MANIFEST}: {e}") from e


def load_part(venv: Path, part: str, sha: str) -> Files:
    """The entries of one part, from the fragment `sha` (checked); ManifestError otherwise."""
    data = read_fragment(venv, sha)
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("part") != part:
            raise ValueError(f"not a fragment of part {part!r}")
        return _entries(doc["files"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
        # (nested deeper than json reads; a size of Infinity, which json reads and int not)
        raise ManifestError(f"has an unreadable fragment {venv / PARTS / sha}: {e}") from e


def load(venv: Path, sha256: object) -> Files:
    """The manifest of `venv` that its marker names by `sha256`, every part. ManifestError,
    saying why, for a venv without one (built by an earlier version), one that is missing,
    untrusted, unreadable, or not the one named, or a fragment that is."""
    doc = _read(venv, sha256)
    found = _parts_in(venv, doc)
    if found is None:  # format 1: the whole venv in one document
        try:
            return _entries(doc["files"])
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise ManifestError(f"has an unreadable manifest {venv / MANIFEST}: {e}") from e
    files: Files = {}
    for part, sha in found[1].items():
        files.update(load_part(venv, part, sha))
    return files


def difference(path: str, built: Entry | None, now: Entry | None) -> str | None:
    """How `path` differs from its build (`built`: its manifest's entry, `now`: what it is),
    in words; None if it does not."""
    if built == now:
        return None
    if built is None:
        return f"{path} was added after the build"
    if now is None:
        return f"{path} was removed after the build"
    if built.kind != now.kind:
        return f"{path} is a {now.kind} now, a {built.kind} when built"
    if built.kind == "symlink":
        return f"{path} links to {now.content!r} now, to {built.content!r} when built"
    if built.size != now.size:
        return f"{path} has {now.size} bytes now, {built.size} when built"
    if built.content != now.content:
        return (
            f"{path} has other content now (sha256 {now.content[:12]}..., "
            f"{built.content[:12]}... when built)"
        )
    return f"{path} has mode {oct(now.mode)} now, {oct(built.mode)} when built"


def first_difference(built: Files, now: Files) -> str | None:
    """The first path (in order) where `now` differs from `built`, in words; None if none."""
    if built == now:
        return None
    for path in sorted(built.keys() | now.keys()):
        why = difference(path, built.get(path), now.get(path))
        if why:
            return why
    return None
