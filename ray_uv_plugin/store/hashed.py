"""What a venv's files were when its manifest hashed them, by inode and by part: a later build
on this node takes a hash, or a whole part of its manifest, from it without reading the files
again, while the inodes are provably unchanged.

uv installs a file as a hardlink from its cache, and a seeded build (`building.seeding`) links a
seed's `.pyc` files: the files of every distribution that did not change are the very inodes an
earlier venv's manifest hashed. Reading them again is most of what a changed lock would cost
(~3 GB for 425 packages), so a build keeps, next to its manifest, each file's
`(inode, size, mtime_ns, sha256)` and the filesystem's own clock when hashing began
(`.ray-uv-ready.hashed`, named by sha256 in the marker as the manifest is).

It is kept by part, as the manifest is (`store.manifest`): each part's rows
(`inode -> (size, mtime_ns, sha256)`, with its clock) are a fragment beside the manifest's, and
the index names them, with what a later build needs to keep the part without reading its rows
(`Part`): two digests of the part's entries as listed (`listing`, `sources`), the dist-info dirs
whose RECORDs list its files, and the bytecode its build compiled or took; and each
distribution's RECORD digest (`record_digest`). Only this node's builds read it: a receiver
writes its own (`ship.install`), and a sender's is never shipped.

- `listing`: each entry's path and kind, a file's inode, size, mtime (ns) and mode, a link's
  text. The same listing as a seed's part is the same inodes, unchanged since the seed's build
  hashed them, so its manifest entries, rows and accounting are the seed's. A part with a file
  written after the clock has none (`""`): it is never kept.
- `sources`: its modules (`.py` files outside `__pycache__` dirs) by size and mtime (seconds)
  only: what a `.pyc` header checks of its source. The same sources as a seed's part: the
  seed's bytecode of that part is bytecode Python takes here (`building.seeding`).

A hash is reused only for the same device and inode, the same size and the same mtime, and only
if that mtime is older than the clock at which hashing began. Any write to a file sets its
mtime to the filesystem's time of the write: a write after hashing began gives a later mtime
than the one recorded, so the entry no longer matches; a write before it was hashed is in the
hash. Setting an mtime back (`utime`) needs the file's owner, which is the plugin (uv's cache
and the venvs are its files), or root; against them no check holds anyway. A file that does not
match is read and hashed, as without this index.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ray_uv_plugin.store import manifest, tree, trust

HASHED = ".ray-uv-ready.hashed"
FORMAT = 2
MAX_BYTES = 64 * 1024 * 1024


def fs_clock(directory: Path) -> int:
    """The filesystem's current time (ns), as it stamps a write: the mtime of a file made
    now. Its clock may run a tick behind the system's, which is why this is read from it."""
    fd, path = tempfile.mkstemp(prefix=".ray-uv-clock-", dir=directory)
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        os.unlink(path)


@dataclass
class Hashed:
    """Inodes of one device hashed after `clock_ns`: inode -> (size, mtime_ns, sha256)."""

    clock_ns: int
    dev: int = -1
    inodes: dict[int, tuple[int, int, str]] = field(default_factory=dict)
    reused: int = 0  # bytes whose hash `sha256` gave, not read again

    def sha256(self, st: os.stat_result) -> str | None:
        """The sha256 of the regular file whose stat is `st`, if this index hashed its inode
        and nothing has written to it since; else None (read it)."""
        if st.st_dev != self.dev:
            return None
        known = self.inodes.get(st.st_ino)
        if known is None:
            return None
        size, mtime_ns, sha = known
        if st.st_size == size and st.st_mtime_ns == mtime_ns and mtime_ns < self.clock_ns:
            self.reused += size
            return sha
        return None

    def add(self, st: os.stat_result, sha256: str) -> None:
        """Record a file hashed (or taken) now, `st` its stat from before its bytes were read;
        a file written since hashing began is left out."""
        if st.st_mtime_ns >= self.clock_ns:
            return
        if self.dev == -1:
            self.dev = st.st_dev
        if st.st_dev == self.dev:
            self.inodes[st.st_ino] = (st.st_size, st.st_mtime_ns, sha256)

    def fragment(self) -> bytes:
        # In the order hashed, unsorted (json writes an inode's int key as the string `rows`
        # reads).
        doc = {"format": FORMAT, "clock_ns": self.clock_ns, "dev": self.dev, "inodes": self.inodes}
        return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Part:
    """What a build knew of one part of its venv (see the module's docstring)."""

    rows: str  # the sha256 of its rows' fragment
    listing: str  # "" where it may not be kept
    sources: str
    owners: tuple[str, ...]  # the dist-info dirs whose RECORDs list its files
    bytecode: tuple[str, ...]  # venv-relative `.pyc` files its build compiled or took


@dataclass
class Index:
    """A venv's index: its parts, and each distribution's RECORD digest (`record_digest`)."""

    dev: int
    parts: dict[str, Part] = field(default_factory=dict)
    records: dict[str, str] = field(default_factory=dict)


def write(venv: Path, index: Index) -> str:
    """Write `<venv>/.ray-uv-ready.hashed` (its rows' fragments are the caller's); returns its
    sha256 for the marker."""
    doc = {
        "format": FORMAT,
        "dev": index.dev,
        "parts": {
            name: [part.rows, part.listing, part.sources, part.owners, part.bytecode]
            for name, part in index.parts.items()
        },
        "records": index.records,
    }
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    trust.write_new_file(venv / HASHED, data)
    return hashlib.sha256(data).hexdigest()


def load(venv: Path, sha256: object) -> Index | None:
    """The index of `venv` that its marker names; None where there is none to trust (a venv
    built by an earlier version), or it is not the one named, or unreadable: its files are
    then read, as they would be without it."""
    if not isinstance(sha256, str):
        return None
    try:
        data = trust.read_own_file(venv / HASHED, MAX_BYTES, "the venv's index of hashed files")
        if hashlib.sha256(data).hexdigest() != sha256:
            return None
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            return None
        parts = {}
        for name, (rows, listing, sources, owners, bytecode) in doc["parts"].items():
            owners, bytecode = tuple(map(str, owners)), tuple(map(str, bytecode))
            parts[str(name)] = Part(str(rows), str(listing), str(sources), owners, bytecode)
        records = {str(dist): str(digest) for dist, digest in doc["records"].items()}
        return Index(int(doc["dev"]), parts, records)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def rows(venv: Path, sha256: str) -> Hashed | None:
    """One part's rows, from the venv's fragment `sha256`; None where it cannot be used."""
    try:
        doc = json.loads(manifest.read_fragment(venv, sha256))
        if doc.get("format") != FORMAT:
            return None
        inodes = {
            int(ino): (int(size), int(mtime), str(sha))
            for ino, (size, mtime, sha) in doc["inodes"].items()
        }
        return Hashed(int(doc["clock_ns"]), int(doc["dev"]), inodes)
    except (
        manifest.ManifestError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        RecursionError,
    ):
        return None


def record_digest(dist_info: Path) -> str | None:
    """The sha256 of a distribution's RECORD, less its entries outside site-packages: console
    scripts name their venv's python, so their hashes differ from venv to venv though nothing
    else does. None where it cannot be read."""
    try:
        lines = (dist_info / "RECORD").read_bytes().splitlines()
    except OSError:
        return None
    kept = b"\n".join(line for line in lines if not line.startswith(b"../"))
    return hashlib.sha256(kept).hexdigest()


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()


def listing(listed: tree.Tree, paths: list[str], clock_ns: int) -> str:
    """The `listing` digest of one part's `paths` as `listed` has them; "" where a file's
    mtime is not older than `clock_ns`."""
    lines = []
    for path in sorted(paths):
        st = listed.entries[path]
        if stat.S_ISREG(st.st_mode):
            if st.st_mtime_ns >= clock_ns:
                return ""
            mode = manifest.file_mode(st.st_mode)
            lines.append(f"{path}\0f\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{mode:o}")
        elif stat.S_ISLNK(st.st_mode):
            lines.append(f"{path}\0l\0{os.readlink(listed.path(path))}")
        else:
            lines.append(f"{path}\0d")
    return _digest(lines)


def sources(listed: tree.Tree, paths: list[str]) -> str:
    """The `sources` digest of one part's `paths` as `listed` has them: its modules (`.py`
    files, not in a `__pycache__`) by size and mtime (seconds), what a `.pyc` header checks."""
    lines = []
    for path in sorted(paths):
        if not path.endswith(".py") or "/__pycache__/" in path:
            continue
        st = listed.entries[path]
        kind = "f" if stat.S_ISREG(st.st_mode) else "x"  # a link: never a module uv compiles
        lines.append(f"{path}\0{kind}\0{st.st_size}\0{int(st.st_mtime)}")
    return _digest(lines)
