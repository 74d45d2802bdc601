"""A ready venv as a stream of verified chunks, and back: what `ship` moves between nodes.

The stream is an uncompressed tar of the venv's tree (its marker left out: the receiver writes
its own), cut into fixed-size chunks, each with its sha256, and a sha256 of the whole. Files that
uv hardlinked from its cache go as content (tar links only files within the stream), so the
receiver needs no uv cache. The receiver unpacks into `<key>.ship-XXXX` beside the venvs while
the chunks arrive, checking each chunk before a byte of it is unpacked and the whole before the
venv is renamed to `<key>` and marked ready. What it unpacks passes the same rules as a build:
its own files and modes (no set-id bits, no group/other write), no device files, no names or
links out of the venv, except `bin/python*` links to this node's interpreter.

A venv unpacked under another venv dir than the one it was built in is relocated: uv writes
the venv's absolute path only into `bin/` (console scripts' shebangs, activate scripts);
`pyvenv.cfg` names the interpreter, and Python fixes `.pyc` file names when it loads them.
"""

from __future__ import annotations

import hashlib
import os
import queue
import stat
import sys
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ray_uv_plugin import trust

CHUNK_BYTES = 64 * 1024 * 1024
SHIP_INFIX = ".ship-"  # `<key>.ship-XXXX`: a venv being received, never used as it is
MARKER = ".ray-uv-ready"  # the same name as venv_cache.MARKER, which imports this module
_END = None


class ArchiveError(RuntimeError):
    """A stream that must not be used: the message says which chunk or member, and why."""


@dataclass(frozen=True)
class Chunk:
    index: int
    data: bytes
    sha256: str
    last: bool


def disk_usage(venv: Path) -> tuple[int, int]:
    """(bytes the venv's files hold, counting each inode once; bytes on disk, as `du` says)."""
    seen: set[tuple[int, int]] = set()
    size = blocks = 0
    for dirpath, dirnames, filenames in os.walk(venv):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
            blocks += st.st_blocks * 512
    return size, blocks


# --- packing -------------------------------------------------------------------------------


class _ChunkWriter:
    """A file object for tarfile's stream mode that hands out fixed-size chunks."""

    def __init__(self, out: queue.Queue, size: int) -> None:
        self.out, self.size, self.buf = out, size, bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        while len(self.buf) >= self.size:
            self.out.put(bytes(self.buf[: self.size]))
            del self.buf[: self.size]
        return len(data)

    def flush_rest(self) -> None:
        if self.buf:
            self.out.put(bytes(self.buf))
        self.buf = bytearray()


def _members(venv: Path) -> Iterator[tuple[str, str]]:
    """(path, name in the stream) for the venv's tree, parents first, the marker left out."""
    for dirpath, dirnames, filenames in os.walk(venv):
        dirnames.sort()
        rel = os.path.relpath(dirpath, venv)
        for name in sorted(dirnames) + sorted(filenames):
            arcname = name if rel == "." else f"{rel}/{name}"
            if rel == "." and name.startswith(MARKER):
                continue
            yield os.path.join(dirpath, name), arcname


class Packer:
    """The tar stream of `venv` in chunks of `chunk_bytes`, made by a thread a chunk or two
    ahead of the reader, so that a GB venv never sits in memory whole."""

    def __init__(self, venv: Path, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.venv = venv
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._index = 0
        self._whole = hashlib.sha256()
        self.total = 0
        self._next: bytes | None = None
        self._started = False
        self._thread = threading.Thread(
            target=self._write, args=(chunk_bytes,), name=f"pack {venv.name}", daemon=True
        )

    def _write(self, chunk_bytes: int) -> None:
        writer = _ChunkWriter(self._queue, chunk_bytes)
        try:
            with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for path, arcname in _members(self.venv):
                    tar.add(path, arcname=arcname, recursive=False)
            writer.flush_rest()
        except BaseException as e:  # noqa: BLE001 - raised to the reader
            self._error = e
        finally:
            self._queue.put(_END)

    def _take(self) -> bytes | None:
        item = self._queue.get()
        if item is _END and self._error is not None:
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
        self._whole.update(data)
        return chunk

    @property
    def whole_sha256(self) -> str:
        return self._whole.hexdigest()


# --- unpacking -----------------------------------------------------------------------------


class _ChunkReader:
    """A file object for tarfile's stream mode, fed chunk by chunk from another thread."""

    def __init__(self) -> None:
        self.chunks: queue.Queue = queue.Queue(maxsize=2)
        self.current, self.pos = b"", 0
        self.ended = False

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if self.pos >= len(self.current):
                if self.ended:
                    break
                item = self.chunks.get()
                if item is _END:
                    self.ended = True
                    break
                self.current, self.pos = item, 0
                continue
            left = len(self.current) - self.pos
            take = left if n < 0 else min(n - len(out), left)
            out += self.current[self.pos : self.pos + take]
            self.pos += take
        return bytes(out)


def interpreter_link_ok(target: str) -> bool:
    """A venv's `bin/python` may link to this node's interpreter, and nothing else outside."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return os.path.realpath(target) == base


def _link_ok(member: tarfile.TarInfo) -> bool:
    """A symlink stays inside the venv (judged by its text: what it points at may not have
    arrived yet), or is a `bin/` link to this node's interpreter."""
    if os.path.isabs(member.linkname):
        top, _, name = member.name.partition("/")
        return top == "bin" and "/" not in name and interpreter_link_ok(member.linkname)
    target = os.path.normpath(os.path.join(os.path.dirname(member.name), member.linkname))
    return not (target == ".." or target.startswith("../") or os.path.isabs(target))


def _member_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    if os.path.isabs(member.name) or ".." in Path(member.name).parts:
        raise ArchiveError(f"{member.name!r}: a name outside the venv")
    if member.issym():
        if not _link_ok(member):
            raise ArchiveError(f"{member.name!r}: a link to {member.linkname}, outside the venv")
        safe = member.replace(uid=None, gid=None, uname=None, gname=None, deep=False)
    else:
        try:
            safe = tarfile.data_filter(member, dest)
        except tarfile.FilterError as e:
            raise ArchiveError(f"{member.name!r}: {e}") from e
    if safe.isdir():
        return safe.replace(mode=0o755, deep=False)
    return safe


class Unpacker:
    """Receives one venv's chunks into `<root>/<key>.ship-XXXX`, checking as it goes.

    The caller holds the key's build lock throughout and installs the result (`finish` returns
    the checked tree); `abort` removes everything it made."""

    def __init__(self, root: Path, key: str, source: str) -> None:
        self.root, self.key, self.source = root, key, source
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{key}{SHIP_INFIX}", dir=root))
        self._reader = _ChunkReader()
        self._whole = hashlib.sha256()
        self._index = 0
        self.total = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._extract, name=f"unpack {key}", daemon=True)
        self._thread.start()

    def _extract(self) -> None:
        try:
            with tarfile.open(fileobj=self._reader, mode="r|") as tar:
                tar.extractall(self.tmp, filter=_member_filter)
        except BaseException as e:  # noqa: BLE001 - raised to the feeder
            self._error = e
            while not self._reader.ended:  # let `add` and `finish` go on to see the error
                if self._reader.chunks.get() is _END:
                    self._reader.ended = True

    def _check_extractor(self) -> None:
        if self._error is not None:
            raise ArchiveError(f"unpacking: {self._error}") from self._error

    def add(self, index: int, sha256: str, data: bytes) -> None:
        """One chunk, in order, checked against the sender's hash before any of it is used."""
        self._check_extractor()
        if index != self._index:
            raise ArchiveError(f"chunk {index} arrived where chunk {self._index} was due")
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise ArchiveError(
                f"chunk {index} ({len(data)} bytes) is corrupt: sha256 {got[:16]}..., "
                f"the sender's {sha256[:16]}..."
            )
        self._index += 1
        self.total += len(data)
        self._whole.update(data)
        self._reader.chunks.put(data)

    def finish(self, chunks: int, total: int, whole_sha256: str) -> Path:
        """The end of the stream: everything arrived, whole and unpacked; returns the tree."""
        self._check_extractor()
        if self._index != chunks or self.total != total:
            raise ArchiveError(
                f"the stream ended after {self._index} chunks ({self.total} bytes); the sender "
                f"sent {chunks} ({total} bytes)"
            )
        if self._whole.hexdigest() != whole_sha256:
            raise ArchiveError("the whole stream's sha256 differs from the sender's")
        self._reader.chunks.put(_END)
        self._thread.join()
        self._check_extractor()
        if not os.path.exists(self.tmp / "bin" / "python"):
            raise ArchiveError("the stream holds no bin/python")
        os.chmod(self.tmp, 0o755)  # as uv makes a venv's top dir (mkdtemp's is 0700)
        return self.tmp

    def abort(self) -> None:
        if self._thread.is_alive():
            self._reader.chunks.put(_END)  # a blocked extractor ends with a truncated stream
            self._thread.join(timeout=30)
        trust.remove_tree(self.tmp)


def relocate(venv: Path, old: str, new: str) -> int:
    """Point the scripts in `venv/bin` that name the venv's old path at its new one; returns
    how many it changed. A no-op when the venv is unpacked where it was built."""
    if old == new:
        return 0
    changed = 0
    for entry in os.scandir(venv / "bin"):
        if not entry.is_file(follow_symlinks=False):
            continue
        data = Path(entry.path).read_bytes()
        if old.encode() not in data or b"\0" in data:
            continue
        mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
        os.chmod(entry.path, mode | stat.S_IWUSR)
        Path(entry.path).write_bytes(data.replace(old.encode(), new.encode()))
        os.chmod(entry.path, mode)
        changed += 1
    return changed


def remove_leftovers(root: Path, key: str) -> int:
    """Remove what a receive of `key` that died left behind (under the key's build lock)."""
    removed = 0
    for entry in os.scandir(root):
        if entry.name.startswith(f"{key}{SHIP_INFIX}"):
            trust.remove_tree(Path(entry.path))
            removed += 1
    return removed
