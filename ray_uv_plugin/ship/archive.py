"""A ready venv as a stream of verified chunks: what `ship` moves between nodes.

The stream is an uncompressed tar of the venv's tree (its marker left out: the receiver writes
its own), cut into fixed-size chunks, each with its sha256, and the stream's sha256: of its
chunks' sha256s in order, so that checking the whole costs no second pass over it. Files that
uv hardlinked from its cache go as content (tar links only files within the stream), so the
receiver needs no uv cache. The packer fails on any error walking the tree, and on a venv that
was renamed, replaced or re-marked while it was packed; it ends the tar with a manifest (every
member's name, kind, size and link) and the tar's end-of-archive blocks.

What is shipped is what was built: the packer checks every member against the manifest the
venv's build wrote (`store.manifest`), hashing each file as it streams it, and fails with
`DriftError` on the first that differs, was added or removed since the build. Only `.pyc` files
in `__pycache__` dirs that the build did not make are left out instead: Python writes them where
a worker may write (root, whose writes modes do not stop) when the build compiled no bytecode.

This module is the format and the sending side; `unpack` is the receiving side (a stream is
hostile there until it is whole), `relocation` the rewrite of a venv's scripts for a new path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import queue
import re
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.store import manifest
from ray_uv_plugin.store.layout import KEY_LENGTH, MARKER, NOT_AS_RECORDED

CHUNK_BYTES = 64 * 1024 * 1024
MANIFEST = ".ray-uv-manifest"  # the stream's last member: what the sender packed
MANIFEST_FORMAT = 1
# A CUDA torch + vLLM venv has about 60,000 files and 10-15 GB: room for several times that.
MAX_MEMBERS = 250_000
MAX_BYTES = 64 * 1024**3
# The longest wait for the other side of a chunk queue: a chunk not taken, or none arriving.
STALL_SECONDS = 300.0
_KEY = re.compile(rf"[0-9a-f]{{{KEY_LENGTH}}}")
END = None  # what follows the last chunk in a queue of chunks
# The link text of a file the receiver takes from its seed (+ its sha256): `delta`.
SEED_REFERENCE = ".ray-uv-seed/"


class ArchiveError(RuntimeError):
    """A stream that must not be used: the message says which chunk or member, and why."""


class DriftError(ArchiveError):
    """The venv to send is not what its build made (`store.manifest`): it must not be sent,
    and is to be rebuilt."""


@dataclass(frozen=True)
class Chunk:
    index: int
    data: bytes
    sha256: str
    last: bool


def check_key(key: str) -> str:
    """A venv's key, as the receiver gets it from the sender: it names paths under the venv
    dir, so it is checked before anything is made."""
    if not _KEY.fullmatch(key):
        raise ArchiveError(f"{key!r} is no venv key ({KEY_LENGTH} hex digits)")
    return key


def stream_sha256(chunk_sha256s: Iterable[str]) -> str:
    """The whole stream's sha256: of its chunks' sha256s (binary, in order). With each chunk
    checked against its own, it says that the chunks are the sender's, all and in order."""
    whole = hashlib.sha256()
    for digest in chunk_sha256s:
        whole.update(bytes.fromhex(digest))
    return whole.hexdigest()


def manifest_entry(member: tarfile.TarInfo) -> list[Any]:
    """A member as the manifest lists it: name, kind, size (of a file), link text."""
    if member.isreg():
        kind = "file"
    else:
        kinds = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink"}
        kind = kinds.get(member.type, f"type {member.type!r}")
    link = member.linkname if member.issym() or member.islnk() else ""
    return [member.name, kind, member.size if member.isreg() else 0, link]


def write_manifest(tar: tarfile.TarFile, members: Iterable[tarfile.TarInfo]) -> None:
    """Close the stream's content with its manifest: the receiver checks what it unpacked
    against it, so a stream cut short or missing members is never taken as whole."""
    entries = [manifest_entry(m) for m in members]
    data = json.dumps({"format": MANIFEST_FORMAT, "members": entries}).encode()
    info = tarfile.TarInfo(MANIFEST)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    tar.addfile(info, io.BytesIO(data))


# --- packing -------------------------------------------------------------------------------


class _ChunkWriter:
    """A file object for tarfile's stream mode that hands out fixed-size chunks. tarfile
    writes a few KB at a time: each piece is copied once, into a chunk-sized buffer."""

    def __init__(self, put: Callable[[bytes], None], size: int) -> None:
        self.put, self.size = put, size
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.fill = 0

    def write(self, data: bytes) -> int:
        piece = memoryview(data)
        while piece:
            take = min(self.size - self.fill, len(piece))
            self.view[self.fill : self.fill + take] = piece[:take]
            self.fill += take
            piece = piece[take:]
            if self.fill == self.size:
                self.put(bytes(self.buf))
                self.fill = 0
        return len(data)

    def flush_rest(self) -> None:
        if self.fill:
            self.put(bytes(self.view[: self.fill]))
        self.fill = 0


def _walk_error(error: OSError) -> None:
    raise ArchiveError(f"cannot read {error.filename}: {error.strerror}") from error


def _members(venv: Path) -> Iterator[tuple[str, str]]:
    """(path, name in the stream) for the venv's tree, parents first, the plugin's own files
    (the marker, the build's manifest and its fragments: `manifest.own`) left out. Any error
    reading the tree fails the pack: a skipped dir would be a venv without it."""
    for dirpath, dirnames, filenames in os.walk(venv, onerror=_walk_error):
        rel = os.path.relpath(dirpath, venv)
        if rel == ".":  # its own dirs (the manifest's fragments) are not walked either
            dirnames[:] = [name for name in dirnames if not manifest.own(name)]
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            if rel == "." and manifest.own(name):
                continue
            yield os.path.join(dirpath, name), name if rel == "." else f"{rel}/{name}"


def _identity(venv: Path) -> tuple[int, int, bytes | None]:
    """What says the venv at `venv` is still the one being packed: its inode, and its marker
    (a rebuilt venv gets a new marker; a reuse only touches it)."""
    st = os.lstat(venv)
    if not stat.S_ISDIR(st.st_mode):
        raise ArchiveError(f"{venv} is not a directory")
    try:
        fd = os.open(venv / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return st.st_dev, st.st_ino, None
    with open(fd, "rb") as f:
        return st.st_dev, st.st_ino, f.read(1024 * 1024)


def _tarinfo(path: str, arcname: str, seen: dict[tuple[int, int], str]) -> tarfile.TarInfo:
    """The member for `path`: its kind, permission bits and size, a file met before in the
    stream (uv hardlinks from its cache) as a link to it. The mtime in whole seconds (what a
    .pyc checks of its source; a fraction would cost a pax header per member) and no owner:
    the receiver writes every file as itself."""
    st = os.lstat(path)
    info = tarfile.TarInfo(arcname)
    info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
    if stat.S_ISREG(st.st_mode):
        inode = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and inode in seen:
            info.type, info.linkname = tarfile.LNKTYPE, seen[inode]
        else:
            info.size = st.st_size
            if st.st_nlink > 1:
                seen[inode] = arcname
    elif stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
    else:
        raise ArchiveError(f"cannot pack {path}: a venv holds only files, dirs and links")
    return info


class _Hashing:
    """A file for tarfile to read, hashed as it is read: the bytes streamed are those checked."""

    def __init__(self, f: io.BufferedReader) -> None:
        self.f, self.sha256 = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sha256.update(data)
        return data


def _add(
    tar: tarfile.TarFile,
    path: str,
    arcname: str,
    seen: dict[tuple[int, int], str],
    refer: bool = False,
) -> tuple[tarfile.TarInfo, manifest.Entry | None]:
    """Stream the member at `path`; returns it and its manifest entry as streamed (None for a
    hard link to a member streamed before: the same inode, so that member's entry). `refer`: a
    file the receiver has, streamed as a link to `SEED_REFERENCE` + its sha256 (`delta`)."""
    info = _tarinfo(path, arcname, seen)
    if info.isreg() and refer:
        st, sha256 = manifest.hash_file(path)  # checked against the build's all the same
        info.type, info.linkname, info.size = tarfile.LNKTYPE, SEED_REFERENCE + sha256, 0
        tar.addfile(info)
        return info, manifest.file_entry(info.mode, st.st_size, sha256)
    if info.isreg():
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            hashing = _Hashing(f)
            tar.addfile(info, hashing)
        return info, manifest.file_entry(info.mode, info.size, hashing.sha256.hexdigest())
    tar.addfile(info)
    if info.isdir():
        return info, manifest.DIR
    return info, manifest.link_entry(info.linkname) if info.issym() else None


def _leftover_bytecode(path: str, name: str) -> bool:
    """Whether `path`, which the build did not make, is a `__pycache__` dir or a `.pyc` file in
    one: Python writes them in a venv that a worker can write (root) if the build compiled none."""
    parent, base = posixpath.split(name)
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        return base == "__pycache__"
    in_cache = posixpath.basename(parent) == "__pycache__"
    return stat.S_ISREG(mode) and in_cache and base.endswith(".pyc")


class Packer:
    """The tar stream of `venv` in chunks of `chunk_bytes`, made by a thread a chunk or two
    ahead of the reader, so that a GB venv never sits in memory whole. A reader that stops
    taking chunks for `stall_s` ends the thread."""

    def __init__(
        self, venv: Path, chunk_bytes: int = CHUNK_BYTES, stall_s: float = STALL_SECONDS
    ) -> None:
        """Raises `DriftError` for a venv without its build's manifest (or not the one its
        marker names): nothing of it may be sent."""
        self.venv, self.stall_s = venv, stall_s
        self._before = _identity(venv)  # the marker read once: what names the manifest
        try:
            marker = json.loads(self._before[2] or b"{}")
            marker = marker if isinstance(marker, dict) else {}
            self.built = manifest.load(venv, marker.get("manifest"))
        except ValueError as e:  # ManifestError included
            raise DriftError(f"{venv} {e}") from e
        if marker.get(NOT_AS_RECORDED):  # an earlier version's marker: never ready here
            differ = marker[NOT_AS_RECORDED]
            differ = differ if isinstance(differ, dict) else {}
            first = differ.get("first") if isinstance(differ.get("first"), list) else []
            raise ArchiveError(
                f"{venv} holds {differ.get('count')} files that differ from their "
                f"distribution's RECORD ({', '.join(map(str, first))}): a file changed "
                "in this node's uv cache would reach every node, so it is not sent and each "
                "node builds its own (if the file changed here, `uv cache clean <package>` and "
                "a rebuild restore it; else the wheel's RECORD is wrong)"
            )
        self.left_out = 0  # `.pyc` files the build did not make (`_leftover_bytecode`)
        self.refer: frozenset[str] = frozenset()  # sha256s the receivers have (`delta`)
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._index = 0
        self._digests: list[str] = []  # each chunk's sha256, in order
        self.total = 0
        self._next: bytes | None = None
        self._started = False
        self._thread = threading.Thread(
            target=self._write, args=(chunk_bytes,), name=f"pack {venv.name}", daemon=True
        )

    def _put(self, data: bytes) -> None:
        try:
            self._queue.put(data, timeout=self.stall_s)
        except queue.Full:
            raise ArchiveError(f"nobody took a chunk for {self.stall_s:.0f}s") from None

    def _pack(self, tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
        """Stream every member the build made, each checked against its manifest entry."""
        seen: dict[tuple[int, int], str] = {}
        packed: list[tarfile.TarInfo] = []
        entries: dict[str, manifest.Entry] = {}
        for path, name in _members(self.venv):
            built = self.built.get(name)
            if built is None:
                if not _leftover_bytecode(path, name):
                    raise DriftError(f"{self.venv}: {name} was added after the build")
                self.left_out += 1
                continue
            refer = built.kind == "file" and built.content in self.refer
            info, entry = _add(tar, path, name, seen, refer)
            if entry is None:
                entry = entries[info.linkname]  # the same inode: checked under its first name
            why = manifest.difference(name, built, entry)
            if why:
                raise DriftError(f"{self.venv}: {why}")
            entries[name] = entry
            packed.append(info)
        missing = self.built.keys() - entries.keys()
        if missing:
            raise DriftError(f"{self.venv}: {min(missing)} was removed after the build")
        return packed

    def _write(self, chunk_bytes: int) -> None:
        writer = _ChunkWriter(self._put, chunk_bytes)
        try:
            before = self._before
            with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                packed = self._pack(tar)
                try:
                    same = _identity(self.venv) == before
                except OSError:
                    same = False
                if not same:
                    raise ArchiveError(
                        f"{self.venv} was renamed, replaced or rebuilt while it was packed"
                    )
                write_manifest(tar, packed)
            writer.flush_rest()
        except BaseException as e:  # noqa: BLE001 - raised to the reader
            self._error = e
        finally:
            try:
                self._queue.put(END, timeout=self.stall_s)
            except queue.Full:
                pass

    def _take(self) -> bytes | None:
        try:
            item = self._queue.get(timeout=self.stall_s)
        except queue.Empty:
            raise ArchiveError(
                f"packing {self.venv} made no chunk for {self.stall_s:.0f}s"
            ) from None
        if item is END and self._error is not None:
            if isinstance(self._error, DriftError):
                raise DriftError(str(self._error)) from self._error
            raise ArchiveError(f"packing {self.venv} failed: {self._error}") from self._error
        return item

    def next_chunk(self) -> Chunk:
        if not self._started:
            self._started = True
            self._thread.start()
            self._next = self._take()
        data = self._next
        if data is None:
            raise ArchiveError(f"the stream of {self.venv} has no chunk {self._index}")
        self._next = self._take()
        chunk = Chunk(self._index, data, hashlib.sha256(data).hexdigest(), self._next is None)
        self._index += 1
        self.total += len(data)
        self._digests.append(chunk.sha256)
        return chunk

    @property
    def whole_sha256(self) -> str:
        """The stream's sha256 (`stream_sha256`) of the chunks made so far."""
        return stream_sha256(self._digests)
