"""What a venv's files were when its manifest hashed them, by inode: a later build on this node
takes a hash from it without reading the file again, while the inode is provably unchanged.

uv installs a file as a hardlink from its cache, and a seeded build (`agent.seeding`) links a
seed's `.pyc` files: the files of every distribution that did not change are the very inodes an
earlier venv's manifest hashed. Reading them again is most of what a changed lock would cost
(~3 GB for 425 packages), so a build keeps, next to its manifest, each file's
`(inode, size, mtime_ns, sha256)` and the filesystem's own clock when hashing began
(`.ray-uv-ready.hashed`, named by sha256 in the marker as the manifest is).

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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ray_uv_plugin.store import trust

HASHED = ".ray-uv-ready.hashed"
FORMAT = 1
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

    def _canonical(self) -> bytes:
        # In the order hashed, unsorted: its sha256 is of the bytes written, never recomputed
        # from the values (json writes an inode's int key as the string `load` reads).
        doc = {"format": FORMAT, "clock_ns": self.clock_ns, "dev": self.dev, "inodes": self.inodes}
        return json.dumps(doc, separators=(",", ":")).encode()


def write(venv: Path, hashed: Hashed) -> str:
    """Write `<venv>/.ray-uv-ready.hashed`; returns its sha256 for the marker."""
    data = hashed._canonical()
    trust.write_new_file(venv / HASHED, data)
    return hashlib.sha256(data).hexdigest()


def load(venv: Path, sha256: object) -> Hashed | None:
    """The index of `venv` that its marker names; None where there is none to trust (a venv
    built by an earlier version, or received from another node), or it is not the one named,
    or unreadable: its files are then read, as they would be without it."""
    if not isinstance(sha256, str):
        return None
    try:
        data = trust.read_own_file(venv / HASHED, MAX_BYTES, "the venv's index of hashed files")
        if hashlib.sha256(data).hexdigest() != sha256:
            return None
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            return None
        inodes = {
            int(ino): (int(size), int(mtime), str(sha))
            for ino, (size, mtime, sha) in doc["inodes"].items()
        }
        return Hashed(int(doc["clock_ns"]), int(doc["dev"]), inodes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
