"""A venv's manifest: every file, dir and link its build made, to tell that what leaves a node,
or arrives on one, is what was built.

A build writes it after `uv sync` and the Ray check, before the venv is frozen, as
`<key>/.ray-uv-ready.manifest`; the marker, written last, names its sha256, so the two are tied.
Each entry is a path relative to `<key>/` with its kind, size, content (a file's sha256, a
link's text) and mode (a file's, as a receiver writes it: owner read/write, no set-id bits, no
group/other write). Top-level names starting with `.ray-uv-` are the plugin's own (the marker,
this manifest), never listed.

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
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from ray_uv_plugin.store import tree, trust
from ray_uv_plugin.store.hashed import Hashed

MANIFEST = ".ray-uv-ready.manifest"
FORMAT = 1
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
    """Whether a name directly in `<key>/` is the plugin's own, not the venv's."""
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
    venv: Path,
    known: Mapping[str, tuple[int, Entry]] | None = None,
    reuse: Hashed | None = None,
    record: Hashed | None = None,
    heads: dict[str, bytes] | None = None,
    listed: tree.Tree | None = None,
) -> Files:
    """Every entry below `venv` (never following a link), each file read and hashed: a build's
    one pass over its venv. A special file (a FIFO, a device) is an error: a venv has none.
    `known`: files whose hash the caller took itself (path -> (inode, entry)), not read again
    while they are that inode with that size (a seeded build's linked bytecode). `reuse`: an
    index of inodes hashed before and unchanged since (`store.hashed`: a seed's, whose files
    uv linked from the same cache), not read again either. `record`: an index to fill with
    every file's hash, its clock taken before the scan began. `heads`: filled with the first 16
    bytes of each `.pyc` file read (its header, `store.accounting`). `listed`: the venv's
    entries as the build listed them (`store.tree`), else they are listed now."""
    known = known or {}
    if listed is None:
        listed = tree.collect(venv)
    files: Files = {}
    for key, st in listed.entries.items():
        if "/" not in key and own(key):
            continue
        if stat.S_ISLNK(st.st_mode):
            files[key] = link_entry(os.readlink(listed.path(key)))
        elif stat.S_ISDIR(st.st_mode):
            files[key] = DIR
        elif stat.S_ISREG(st.st_mode):
            inode, entry = known.get(key, (None, None))
            if entry is not None and inode == st.st_ino and entry.size == st.st_size:
                sha = entry.content
            elif reuse is None or (sha := reuse.sha256(st)) is None:
                st, sha, head = read_file(listed.path(key))
                if heads is not None and key.endswith(".pyc"):
                    heads[key] = head
            files[key] = file_entry(st.st_mode, st.st_size, sha)
            if record is not None:
                record.add(st, sha)
        else:
            raise ManifestError(f"{listed.path(key)}: a venv holds only files, dirs and links")
    return files


def _canonical(files: Files) -> bytes:
    # An entry is a tuple, which json writes as the list `_parse` reads: no copy of 134,000.
    doc = {"format": FORMAT, "files": files}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def digest(files: Files) -> str:
    """The sha256 of the manifest `write` makes of `files`: what a marker names."""
    return hashlib.sha256(_canonical(files)).hexdigest()


def write(venv: Path, files: Files) -> str:
    """Write (or replace) `<venv>/.ray-uv-ready.manifest`; returns its sha256 for the marker."""
    data = _canonical(files)
    trust.write_new_file(venv / MANIFEST, data)
    return hashlib.sha256(data).hexdigest()


def _parse(data: bytes) -> Files:
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a manifest of format {FORMAT}")
    files: Files = {}
    for path, value in doc["files"].items():
        kind, size, content, mode = value
        if kind not in ("file", "dir", "symlink") or not isinstance(content, str):
            raise ValueError(f"{path!r}: {value!r} is no entry")
        files[path] = Entry(kind, int(size), content, int(mode))
    return files


def load(venv: Path, sha256: object) -> Files:
    """The manifest of `venv` that its marker names by `sha256`. ManifestError, saying why,
    for a venv without one (built by an earlier version), one that is missing, untrusted,
    unreadable, or not the one named."""
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
        return _parse(data)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
        # (nested deeper than json reads; a size of Infinity, which json reads and int not)
        raise ManifestError(f"has an unreadable manifest {path}: {e}") from e


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
