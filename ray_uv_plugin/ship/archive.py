"""A ready venv as a stream of verified chunks, and back: what `ship` moves between nodes.

The stream is an uncompressed tar of the venv's tree (its marker left out: the receiver writes
its own), cut into fixed-size chunks, each with its sha256, and a sha256 of the whole. Files that
uv hardlinked from its cache go as content (tar links only files within the stream), so the
receiver needs no uv cache. The packer fails on any error walking the tree, and on a venv that
was renamed, replaced or re-marked while it was packed; it ends the tar with a manifest (every
member's name, kind, size and link) and the tar's end-of-archive blocks.

The receiver treats the stream as hostile until it has all of it. It unpacks into
`<key>.ship-XXXX` beside the venvs while the chunks arrive, checking each chunk before a byte of
it is unpacked and the whole before the venv is renamed to `<key>` and marked ready. It writes
every member itself, through directories it made earlier in the stream and never through a
link, each name once; it refuses what a build would not make: set-id bits and group/other write
(dropped), device files, names out of the venv, a `bin` or `lib` that is no directory, links
that lead out of the venv (judged at the end, against the whole tree) except `bin/python*` to
this node's interpreter, more than `MAX_MEMBERS` members or `MAX_BYTES` of files. The stream
must end with the manifest, matching what was unpacked, then zeros only. Every wait between
the thread that takes chunks and the one that unpacks them is bounded (`STALL_SECONDS`), so
`add`, `finish` and `abort` always return.

A venv unpacked under another venv dir than the one it was built in is relocated: uv writes
the venv's absolute path only into `bin/` (console scripts' shebangs, activate scripts);
`pyvenv.cfg` names the interpreter, and Python fixes `.pyc` file names when it loads them.
Shebangs are rewritten in the form uv picks for the new path (`#!<path>`, or a `/bin/sh`
wrapper for a path with a space or too long for the kernel).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import re
import shutil
import stat
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.store import trust
from ray_uv_plugin.store.layout import KEY_LENGTH, MARKER, SHIP_INFIX

CHUNK_BYTES = 64 * 1024 * 1024
MANIFEST = ".ray-uv-manifest"  # the stream's last member: what the sender packed
MANIFEST_FORMAT = 1
# A CUDA torch + vLLM venv has about 60,000 files and 10-15 GB: room for several times that.
MAX_MEMBERS = 250_000
MAX_BYTES = 64 * 1024**3
# The longest wait for the other side of a chunk queue: a chunk not taken, or none arriving.
STALL_SECONDS = 300.0
_POLL_SECONDS = 0.2  # how often a waiting thread looks for an error or an abort
_MAX_HEADER_BYTES = 1024 * 1024  # one pax or GNU long-name header (names and link texts only)
_MEMBER_OVERHEAD = 8 * 1024  # stream bytes per member beyond its content: headers, manifest
_SHEBANG_LIMIT = 127  # the kernel's, as uv counts it: `#!`, the interpreter's path, `\n`
_KEY = re.compile(rf"[0-9a-f]{{{KEY_LENGTH}}}")
# uv quotes or escapes these in scripts, each shell's activate script its own way.
_QUOTED_CHARS = re.compile(r"['\"\\$`\x00-\x1f\x7f]")
_END = None


class ArchiveError(RuntimeError):
    """A stream that must not be used: the message says which chunk or member, and why."""


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


def check_sender_venv(path: str, key: str) -> str:
    """The path the venv had on the sending node, which `relocate` replaces in its scripts:
    absolute, normalised, `<venv dir>/<key>`, and free of characters uv quotes in scripts."""
    check_key(key)
    if not (os.path.isabs(path) and os.path.normpath(path) == path):
        raise ArchiveError(
            f"the sender's venv path {path!r} is not absolute and normalised: set "
            "RAY_UV_PLUGIN_VENV_DIR to such a path on the sending node"
        )
    if os.path.basename(path) != key:
        raise ArchiveError(f"the sender's venv path {path!r} does not end in /{key}")
    _check_script_path(path, "the sender's venv path")
    return path


def _check_script_path(path: str, what: str) -> None:
    bad = _QUOTED_CHARS.search(path)
    if bad:
        raise ArchiveError(
            f"{what} {path!r} holds {bad.group()!r}, which uv quotes in each script its own "
            "way, so the venv's scripts cannot be relocated: use a venv dir path without "
            "quotes, backslashes, `$`, backticks or control characters (a node that cannot "
            "take a shipped venv builds it for itself)"
        )


def _entry(member: tarfile.TarInfo) -> list[Any]:
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
    entries = [_entry(m) for m in members]
    data = json.dumps({"format": MANIFEST_FORMAT, "members": entries}).encode()
    info = tarfile.TarInfo(MANIFEST)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    tar.addfile(info, io.BytesIO(data))


# --- packing -------------------------------------------------------------------------------


class _ChunkWriter:
    """A file object for tarfile's stream mode that hands out fixed-size chunks."""

    def __init__(self, put: Callable[[bytes], None], size: int) -> None:
        self.put, self.size, self.buf = put, size, bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        while len(self.buf) >= self.size:
            self.put(bytes(self.buf[: self.size]))
            del self.buf[: self.size]
        return len(data)

    def flush_rest(self) -> None:
        if self.buf:
            self.put(bytes(self.buf))
        self.buf = bytearray()


def _walk_error(error: OSError) -> None:
    raise ArchiveError(f"cannot read {error.filename}: {error.strerror}") from error


def _members(venv: Path) -> Iterator[tuple[str, str]]:
    """(path, name in the stream) for the venv's tree, parents first, the marker left out.
    Any error reading the tree fails the pack: a skipped dir would be a venv without it."""
    for dirpath, dirnames, filenames in os.walk(venv, onerror=_walk_error):
        dirnames.sort()
        rel = os.path.relpath(dirpath, venv)
        for name in sorted(dirnames) + sorted(filenames):
            if rel == "." and (name.startswith(MARKER) or name == MANIFEST):
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


def _add(tar: tarfile.TarFile, path: str, arcname: str) -> tarfile.TarInfo:
    info = tar.gettarinfo(path, arcname)
    if info is None or not (info.isdir() or info.isreg() or info.issym() or info.islnk()):
        raise ArchiveError(f"cannot pack {path}: a venv holds only files, dirs and links")
    if info.isreg():
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)
    return info


class Packer:
    """The tar stream of `venv` in chunks of `chunk_bytes`, made by a thread a chunk or two
    ahead of the reader, so that a GB venv never sits in memory whole. A reader that stops
    taking chunks for `stall_s` ends the thread."""

    def __init__(
        self, venv: Path, chunk_bytes: int = CHUNK_BYTES, stall_s: float = STALL_SECONDS
    ) -> None:
        self.venv, self.stall_s = venv, stall_s
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

    def _put(self, data: bytes) -> None:
        try:
            self._queue.put(data, timeout=self.stall_s)
        except queue.Full:
            raise ArchiveError(f"nobody took a chunk for {self.stall_s:.0f}s") from None

    def _write(self, chunk_bytes: int) -> None:
        writer = _ChunkWriter(self._put, chunk_bytes)
        try:
            before = _identity(self.venv)
            with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                packed = [_add(tar, path, arcname) for path, arcname in _members(self.venv)]
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
                self._queue.put(_END, timeout=self.stall_s)
            except queue.Full:
                pass

    def _take(self) -> bytes | None:
        try:
            item = self._queue.get(timeout=self.stall_s)
        except queue.Empty:
            raise ArchiveError(
                f"packing {self.venv} made no chunk for {self.stall_s:.0f}s"
            ) from None
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
    """A file object for tarfile's stream mode, fed chunk by chunk from another thread; it
    raises when no chunk arrives for `stall_s` or the receive is aborted."""

    def __init__(self, stall_s: float, aborted: threading.Event) -> None:
        self.chunks: queue.Queue = queue.Queue(maxsize=2)
        self.stall_s, self.aborted = stall_s, aborted
        self.current, self.pos = b"", 0
        self.ended = False

    def _next_chunk(self) -> bytes | None:
        deadline = time.monotonic() + self.stall_s
        while not self.aborted.is_set():
            try:
                return self.chunks.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise ArchiveError(f"no chunk arrived for {self.stall_s:.0f}s") from None
        raise ArchiveError("the receive was aborted")

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if self.pos >= len(self.current):
                if self.ended:
                    break
                item = self._next_chunk()
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


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a pax or GNU long-name header into memory whole: a hostile stream could
    declare one of many GB. This refuses one over `_MAX_HEADER_BYTES` before it is read."""

    _HEADERS = (
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
    )

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in self._HEADERS and self.size > _MAX_HEADER_BYTES:
            raise ArchiveError(f"a tar header of {self.size} bytes (at most {_MAX_HEADER_BYTES})")
        return super()._proc_member(tar)  # type: ignore[misc]


def interpreter_link_ok(target: str) -> bool:
    """A venv's `bin/python` may link to this node's interpreter, and nothing else outside."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return os.path.realpath(target) == base


def _link_text_ok(member: tarfile.TarInfo) -> bool:
    """A symlink's text stays inside the venv, or is a `bin/` link to this node's interpreter.
    (Where it really leads depends on links that may not have arrived yet: judged at the end.)"""
    if os.path.isabs(member.linkname):
        top, _, name = member.name.partition("/")
        return top == "bin" and "/" not in name and interpreter_link_ok(member.linkname)
    target = os.path.normpath(os.path.join(os.path.dirname(member.name), member.linkname))
    return not (target == ".." or target.startswith("../") or os.path.isabs(target))


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.isdir():
        return "dir"
    if member.isreg() and not member.issparse():
        return "file"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    raise ArchiveError(f"{member.name!r}: a tar member of type {member.type!r}, not in a venv")


class Unpacker:
    """Receives one venv's chunks into `<root>/<key>.ship-XXXX`, checking as it goes.

    The caller holds the key's build lock throughout and installs the result (`finish` returns
    the checked tree); `abort` removes everything it made, and must be called after any error.
    `sender_venv` (the venv's path on the sender, which `install_received` relocates from) is
    checked here, before anything is written, where the caller has it. The limits default to
    the module's constants."""

    def __init__(
        self,
        root: Path,
        key: str,
        source: str,
        sender_venv: str | None = None,
        max_members: int = MAX_MEMBERS,
        max_bytes: int = MAX_BYTES,
        stall_s: float = STALL_SECONDS,
    ) -> None:
        check_key(key)
        _check_script_path(str(root / key), "this node's venv path")  # `relocate` writes it
        if sender_venv is not None:
            check_sender_venv(sender_venv, key)
        self.root, self.key, self.source = root, key, source
        self.max_members, self.max_bytes, self.stall_s = max_members, max_bytes, stall_s
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{key}{SHIP_INFIX}", dir=root))
        self._aborted = threading.Event()
        self._reader = _ChunkReader(stall_s, self._aborted)
        self._whole = hashlib.sha256()
        self._index = 0
        self.total = 0
        self._kinds: dict[str, str] = {}  # every member unpacked so far: name -> kind
        self._entries: list[list[Any]] = []  # the same, as the manifest lists them
        self._symlinks: list[str] = []
        self._file_bytes = 0
        self._complete = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._extract, name=f"unpack {key}", daemon=True)
        self._thread.start()

    # -- the unpacking thread --

    def _extract(self) -> None:
        try:
            with tarfile.open(fileobj=self._reader, mode="r|", tarinfo=_BoundedTarInfo) as tar:
                while (member := tar.next()) is not None and member.name != MANIFEST:
                    tar.members.clear()  # tarfile keeps every member; `_kinds` is enough
                    self._unpack(tar, member)
                if member is None:
                    raise ArchiveError("the stream ends without the sender's manifest: cut short")
                self._check_manifest(tar, member)
                self._check_links()
                self._check_end(tar)
            self._complete = True
        except BaseException as e:  # noqa: BLE001 - raised to the feeder
            self._error = e

    def _unpack(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = member.name
        if len(self._kinds) >= self.max_members:
            raise ArchiveError(f"more than {self.max_members} members, more than a venv has")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise ArchiveError(f"{name!r}: a name outside the venv (absolute, empty, . or ..)")
        if name in self._kinds:
            raise ArchiveError(f"{name!r} is in the stream twice")
        parent, _, base = name.rpartition("/")
        if parent and self._kinds.get(parent) != "dir":
            raise ArchiveError(f"{name!r}: {parent!r} is no directory earlier in the stream")
        if not parent and base.startswith(MARKER):
            raise ArchiveError(f"{name!r}: the sender's marker (the receiver writes its own)")
        kind = _member_kind(member)
        if not parent and base in ("bin", "lib") and kind != "dir":
            raise ArchiveError(f"{name!r} is a {kind}, not a directory")
        path = os.path.join(self.tmp, name)  # every parent is a dir made here: no link
        if kind == "dir":
            os.mkdir(path)
            os.chmod(path, 0o755)
        elif kind == "file":
            self._write_file(tar, member, path)
        elif kind == "symlink":
            if not _link_text_ok(member):
                raise ArchiveError(f"{name!r}: a link to {member.linkname}, outside the venv")
            os.symlink(member.linkname, path)
            self._symlinks.append(name)
        else:
            if self._kinds.get(member.linkname) != "file":
                raise ArchiveError(
                    f"{name!r}: a hard link to {member.linkname!r}: no file earlier in the stream"
                )
            os.link(os.path.join(self.tmp, member.linkname), path, follow_symlinks=False)
        self._kinds[name] = kind
        self._entries.append(_entry(member))

    def _write_file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        self._file_bytes += member.size
        if self._file_bytes > self.max_bytes:
            raise ArchiveError(f"{member.name!r}: more than {self.max_bytes} bytes of files")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(path, flags, 0o600), "wb") as out:
            source = tar.extractfile(member)
            assert source is not None  # a regular file's
            shutil.copyfileobj(source, out, 1024 * 1024)
            out.flush()
            # Its own, no set-id bits, no group/other write (as tarfile's data filter does).
            os.fchmod(out.fileno(), (member.mode & 0o755) | 0o600)
            os.utime(out.fileno(), (member.mtime, member.mtime))  # .pyc files check it

    def _check_manifest(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        if not member.isreg() or member.size > self.max_members * 1024 + _MAX_HEADER_BYTES:
            raise ArchiveError(f"the sender's manifest is no file of a venv's size ({member.size})")
        source = tar.extractfile(member)
        assert source is not None
        try:
            manifest = json.loads(source.read())
            listed = manifest["members"] if manifest["format"] == MANIFEST_FORMAT else None
        except (ValueError, KeyError, TypeError) as e:
            raise ArchiveError(f"the sender's manifest is unreadable: {e}") from e
        if listed == self._entries:
            return
        if not isinstance(listed, list):
            raise ArchiveError("the sender's manifest is of another format")
        for n, (theirs, mine) in enumerate(zip(listed, self._entries, strict=False)):
            if theirs != mine:
                raise ArchiveError(f"member {n} is {mine}; the sender's manifest says {theirs}")
        raise ArchiveError(
            f"the stream holds {len(self._entries)} members; the sender's manifest lists "
            f"{len(listed)}"
        )

    def _check_links(self) -> None:
        """Where each link leads, through the links it passes, in the whole tree."""
        top = os.path.realpath(self.tmp)
        for name in self._symlinks:
            real = os.path.realpath(os.path.join(self.tmp, name))
            if real == top or real.startswith(top + "/"):
                continue
            if name.rpartition("/")[0] == "bin" and interpreter_link_ok(real):
                continue
            raise ArchiveError(f"{name!r} leads to {real}, outside the venv")

    def _check_end(self, tar: tarfile.TarFile) -> None:
        """After the manifest: its padding and the end-of-archive blocks, zeros up to the
        record's end, and nothing else."""
        stream = tar.fileobj  # tarfile's reader of the chunks, just after the manifest's data
        assert stream is not None
        needed = tar.offset + 2 * tarfile.BLOCKSIZE - stream.tell()
        seen = 0
        while block := stream.read(tarfile.RECORDSIZE):
            seen += len(block)
            if block.count(0) != len(block) or seen > needed + 2 * tarfile.RECORDSIZE:
                raise ArchiveError("data after the end of the archive")
        if seen < needed:
            raise ArchiveError("the stream ends without the tar's end-of-archive blocks")

    # -- the feeding thread (the caller's) --

    def _check_extractor(self) -> None:
        if self._error is not None:
            raise ArchiveError(f"unpacking: {self._error}") from self._error

    def _put(self, item: bytes | None) -> None:
        """Hand the unpacker an item; never waits more than `stall_s` for it to take it."""
        deadline = time.monotonic() + self.stall_s
        while True:
            self._check_extractor()
            if not self._thread.is_alive():
                raise ArchiveError("unpacking ended before the stream did")
            try:
                self._reader.chunks.put(item, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise ArchiveError(
                        f"unpacking took no chunk for {self.stall_s:.0f}s (writing to "
                        f"{self.tmp} stalled)"
                    ) from None

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
        if self.total + len(data) > self.max_bytes + self.max_members * _MEMBER_OVERHEAD:
            raise ArchiveError(f"chunk {index}: the stream is longer than a venv's may be")
        self._index += 1
        self.total += len(data)
        self._whole.update(data)
        self._put(data)

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
        self._put(_END)
        self._thread.join(timeout=self.stall_s)
        if self._thread.is_alive():
            raise ArchiveError(f"unpacking did not end {self.stall_s:.0f}s after the last chunk")
        self._check_extractor()
        if not self._complete:
            raise ArchiveError("unpacking ended without checking the whole stream")
        if self._kinds.get("bin/python") not in ("file", "symlink"):
            raise ArchiveError("the stream holds no bin/python")
        os.chmod(self.tmp, 0o755)  # as uv makes a venv's top dir (mkdtemp's is 0700)
        return self.tmp

    def abort(self) -> None:
        """Stop unpacking (the thread stops at its next read) and remove the tree."""
        self._aborted.set()
        self._thread.join(timeout=min(self.stall_s, 30.0))
        trust.remove_tree(self.tmp)


# --- relocating ------------------------------------------------------------------------------

# The two shebangs uv writes (`format_shebang` in uv's wheel installer), naming `<venv>/bin/...`.
_SH_SHEBANG = re.compile(rb"#!/bin/sh\n'''exec' '(?P<exe>[^'\n]*)' \"\$0\" \"\$@\"\n' '''")
_PLAIN_SHEBANG = re.compile(rb"#!(?P<exe>[^\s]+)(?=\n)")


def shebang(executable: bytes) -> bytes:
    """The shebang uv writes for `executable`: a `/bin/sh` wrapper where a plain `#!` line
    would not work (a space splits it, the kernel cuts one over 127 bytes), else plain."""
    if len(executable) + 3 > _SHEBANG_LIMIT or b" " in executable:
        return b"#!/bin/sh\n'''exec' '" + executable + b"' \"$0\" \"$@\"\n' '''"
    return b"#!" + executable


def _relocated(data: bytes, old: bytes, new: bytes) -> bytes:
    """A bin/ script naming the venv at `old`, naming it at `new` instead."""
    match = _SH_SHEBANG.match(data) or _PLAIN_SHEBANG.match(data)
    if match and match["exe"].startswith(old + b"/"):
        header = shebang(new + match["exe"][len(old) :])
        return header + data[match.end() :].replace(old, new)
    return data.replace(old, new)


def relocate(venv: Path, old: str, new: str) -> int:
    """Point the scripts in `venv/bin` that name the venv's old path at its new one; returns
    how many it changed. A no-op when the venv is unpacked where it was built. Only regular
    files directly in a real `bin/` dir are read and replaced, never through a link."""
    if old == new:
        return 0
    _check_script_path(old, "the venv's old path")
    _check_script_path(new, "the venv's new path")
    bin_dir = venv / "bin"
    if not stat.S_ISDIR(os.lstat(bin_dir).st_mode):
        raise ArchiveError(f"{bin_dir} is not a directory")
    changed = 0
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for entry in list(os.scandir(bin_dir)):  # listed first: replacing adds and removes names
        if not entry.is_file(follow_symlinks=False):
            continue
        with open(os.open(entry.path, flags), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                continue
            data = f.read()
        if b"\0" in data or old.encode() not in data:
            continue
        fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=".relocating-")
        try:
            with open(fd, "wb") as out:
                out.write(_relocated(data, old.encode(), new.encode()))
                os.fchmod(out.fileno(), stat.S_IMODE(st.st_mode))
            os.replace(tmp, entry.path)
        except BaseException:
            os.unlink(tmp)
            raise
        changed += 1
    return changed
