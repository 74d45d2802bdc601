"""The receiving side of a venv's stream (see `archive`): hostile until it is whole.

The receiver unpacks into `<key>.ship-XXXX` beside the venvs while the chunks arrive, checking
each chunk before a byte of it is unpacked and the whole before the venv is renamed to `<key>`
and marked ready. It writes every member itself, through directories it made earlier in the
stream and never through a link, each name once; it refuses what a build would not make: set-id
bits and group/other write (dropped), device files, names out of the venv, a `bin` or `lib`
that is no directory, links that lead out of the venv (judged at the end, against the whole
tree) except `bin/python*` to this node's interpreter, more than `MAX_MEMBERS` members or
`MAX_BYTES` of files. The stream must end with the manifest, matching what was unpacked, then
zeros only. It hashes every file as it writes it, and leaves in the tree the manifest of what
it unpacked (`store.manifest`), which `install` installs only if it is the venv's build's.
Every wait between the thread that takes chunks and the one that unpacks them is bounded
(`STALL_SECONDS`), so `add`, `finish` and `abort` always return.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ray_uv_plugin.ship import delta
from ray_uv_plugin.ship.archive import (
    END,
    MANIFEST,
    MANIFEST_FORMAT,
    MAX_BYTES,
    MAX_MEMBERS,
    STALL_SECONDS,
    ArchiveError,
    check_key,
    manifest_entry,
    stream_sha256,
)
from ray_uv_plugin.ship.relocation import check_script_path, check_sender_venv
from ray_uv_plugin.store import freezing, manifest
from ray_uv_plugin.store.layout import SHIP_INFIX

_POLL_SECONDS = 0.2  # how often a waiting thread looks for an error or an abort
_MAX_HEADER_BYTES = 1024 * 1024  # one pax or GNU long-name header (names and link texts only)
_MEMBER_OVERHEAD = 8 * 1024  # stream bytes per member beyond its content: headers, manifest
_COPY_BYTES = 1024 * 1024


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
        if 0 <= n <= len(self.current) - self.pos:  # tarfile's usual read: within one chunk
            self.pos += n
            return self.current[self.pos - n : self.pos]
        out = bytearray()
        while n < 0 or len(out) < n:
            if self.pos >= len(self.current):
                if self.ended:
                    break
                item = self._next_chunk()
                if item is END:
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


def _interpreter_link_ok(target: str) -> bool:
    """A venv's `bin/python` may link to this node's interpreter, and nothing else outside."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return os.path.realpath(target) == base


def _link_text_ok(member: tarfile.TarInfo) -> bool:
    """A symlink's text stays inside the venv, or is a `bin/` link to this node's interpreter.
    (Where it really leads depends on links that may not have arrived yet: judged at the end.)"""
    if os.path.isabs(member.linkname):
        top, _, name = member.name.partition("/")
        return top == "bin" and "/" not in name and _interpreter_link_ok(member.linkname)
    target = os.path.normpath(os.path.join(os.path.dirname(member.name), member.linkname))
    return not (target == ".." or target.startswith("../") or os.path.isabs(target))


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.isdir():
        return "dir"
    if member.isreg() and not member.issparse():
        return "file"
    if member.issym():
        return "symlink"
    if member.islnk():  # to a member before, or to a file staged from the seed (`delta`)
        return "seeded" if member.linkname.startswith(delta.REFERENCE) else "hardlink"
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
        check_script_path(str(root / key), "this node's venv path")  # `relocate` writes it
        if sender_venv is not None:
            check_sender_venv(sender_venv, key)
        self.root, self.key, self.source = root, key, source
        self.max_members, self.max_bytes, self.stall_s = max_members, max_bytes, stall_s
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{key}{SHIP_INFIX}", dir=root))
        self._aborted = threading.Event()
        self._reader = _ChunkReader(stall_s, self._aborted)
        self._digests: list[str] = []  # each chunk's checked sha256, in order
        self._index = 0
        self.total = 0
        self._kinds: dict[str, str] = {}  # every member unpacked so far: name -> kind
        self._entries: list[list[Any]] = []  # the same, as the manifest lists them
        self._files: manifest.Files = {}  # the same, as the venv's manifest lists them
        self.heads: dict[str, bytes] = {}  # each `.pyc` written: its header (`store.accounting`)
        self._symlinks: list[str] = []
        self._file_bytes = 0
        self._complete = False
        self.staged: delta.Staged | None = None  # files taken from a seed, set before the stream
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
        except tarfile.TarError as e:  # a header that is no tar's, a stream cut mid-member
            self._error = ArchiveError(f"the stream is not a tar the packer writes: {e}")
            self._error.__cause__ = e
        except BaseException as e:  # noqa: BLE001 - raised to the feeder
            self._error = e

    def _unpack(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = member.name
        if len(self._kinds) >= self.max_members:
            raise ArchiveError(f"more than {self.max_members} members, more than a venv has")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise ArchiveError(f"{name!r}: a name outside the venv (absolute, empty, . or ..)")
        if "\x00" in name + member.linkname:  # a pax header may hold one; no path can
            raise ArchiveError(f"{name!r}: a NUL byte in its name or link")
        if name in self._kinds:
            raise ArchiveError(f"{name!r} is in the stream twice")
        parent, _, base = name.rpartition("/")
        if parent and self._kinds.get(parent) != "dir":
            raise ArchiveError(f"{name!r}: {parent!r} is no directory earlier in the stream")
        if not parent and manifest.own(base):
            raise ArchiveError(f"{name!r}: the sender's marker or manifest (the receiver's own)")
        kind = _member_kind(member)
        if not parent and base in ("bin", "lib") and kind != "dir":
            raise ArchiveError(f"{name!r} is a {kind}, not a directory")
        if kind in ("symlink", "hardlink") and not member.linkname:
            raise ArchiveError(f"{name!r}: a {kind} to nowhere (its target is empty)")
        try:
            self._make(tar, member, kind)
        except OSError as e:  # a name too long here, a full disk: this node cannot take it
            raise ArchiveError(f"{name!r} cannot be made here: {e.strerror}") from e
        self._kinds[name] = "file" if kind == "seeded" else kind
        self._entries.append(manifest_entry(member))

    def _make(self, tar: tarfile.TarFile, member: tarfile.TarInfo, kind: str) -> None:
        name = member.name
        path = os.path.join(self.tmp, name)  # every parent is a dir made here: no link
        if kind == "dir":
            os.mkdir(path)
            os.chmod(path, 0o755)
            self._files[name] = manifest.DIR
        elif kind == "file":
            self._files[name] = self._write_file(tar, member, path)
        elif kind == "symlink":
            if not _link_text_ok(member):
                raise ArchiveError(f"{name!r}: a link to {member.linkname}, outside the venv")
            os.symlink(member.linkname, path)
            self._symlinks.append(name)
            self._files[name] = manifest.link_entry(member.linkname)
        elif kind == "seeded":
            self._files[name] = delta.place(self.staged, member, path)
        else:
            if self._kinds.get(member.linkname) != "file":
                raise ArchiveError(
                    f"{name!r}: a hard link to {member.linkname!r}: no file earlier in the stream"
                )
            os.link(os.path.join(self.tmp, member.linkname), path, follow_symlinks=False)
            self._files[name] = self._files[member.linkname]
            if member.linkname in self.heads and name.endswith(".pyc"):
                self.heads[name] = self.heads[member.linkname]

    def _write_file(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str
    ) -> manifest.Entry:
        """Write a file member; returns its manifest entry, of the bytes written."""
        self._file_bytes += member.size
        if self._file_bytes > self.max_bytes:
            raise ArchiveError(f"{member.name!r}: more than {self.max_bytes} bytes of files")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        sha256 = hashlib.sha256()
        with open(os.open(path, flags, 0o600), "wb") as out:
            source = tar.extractfile(member)
            assert source is not None  # a regular file's
            while data := source.read(_COPY_BYTES):
                if out.tell() == 0 and member.name.endswith(".pyc"):
                    self.heads[member.name] = data[:16]
                sha256.update(data)
                out.write(data)
            out.flush()
            # Its own, no set-id bits, no group/other write (as tarfile's data filter does).
            mode = manifest.file_mode(member.mode)
            os.fchmod(out.fileno(), mode)
            os.utime(out.fileno(), (member.mtime, member.mtime))  # .pyc files check it
        return manifest.file_entry(mode, member.size, sha256.hexdigest())

    def _check_manifest(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        if not member.isreg() or member.size > self.max_members * 1024 + _MAX_HEADER_BYTES:
            raise ArchiveError(f"the sender's manifest is no file of a venv's size ({member.size})")
        source = tar.extractfile(member)
        assert source is not None
        try:
            manifest = json.loads(source.read())
            listed = manifest["members"] if manifest["format"] == MANIFEST_FORMAT else None
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # nested too deep
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
            if name.rpartition("/")[0] == "bin" and _interpreter_link_ok(real):
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
        self._digests.append(got)
        self._put(data)

    def finish(self, chunks: int, total: int, whole_sha256: str) -> Path:
        """The end of the stream: everything arrived, whole and unpacked; returns the tree."""
        self._check_extractor()
        if self._index != chunks or self.total != total:
            raise ArchiveError(
                f"the stream ended after {self._index} chunks ({self.total} bytes); the sender "
                f"sent {chunks} ({total} bytes)"
            )
        if stream_sha256(self._digests) != whole_sha256:
            raise ArchiveError("the whole stream's sha256 differs from the sender's")
        self._put(END)
        self._thread.join(timeout=self.stall_s)
        if self._thread.is_alive():
            raise ArchiveError(f"unpacking did not end {self.stall_s:.0f}s after the last chunk")
        self._check_extractor()
        if not self._complete:
            raise ArchiveError("unpacking ended without checking the whole stream")
        if self._kinds.get("bin/python") not in ("file", "symlink"):
            raise ArchiveError("the stream holds no bin/python")
        delta.discard(self.staged)  # what was staged and not placed
        manifest.write(self.tmp, self._files)  # what was unpacked: `install` checks it
        os.chmod(self.tmp, 0o755)  # as uv makes a venv's top dir (mkdtemp's is 0700)
        return self.tmp

    def abort(self) -> None:
        """Stop unpacking (the thread stops at its next read) and remove the tree."""
        self._aborted.set()
        self._thread.join(timeout=min(self.stall_s, 30.0))
        freezing.remove_tree(self.tmp)
