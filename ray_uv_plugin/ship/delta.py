"""Shipping sends the difference: a receiver that has a ready venv near the one shipped takes
the unchanged files from it, and only the rest goes over the link.

The exchange, on top of the ordinary ship (`transfer`, `actors`):

1. The sender's offer lists the venv's dist-info dirs and the sha256 of each of its files worth
   taking locally (`offered_files`: at least `MIN_BYTES`; a smaller one costs little more than
   the tar header that would name it), from the manifest its build wrote.
2. A receiver that takes the venv looks for its nearest ready venv (`seeding.nearest`: the same
   interpreter, the most distributions in common, the one notion of "near" that seeded builds
   use), holds that seed's build lock shared (so that neither `gc` nor a rebuild touches it),
   and copies each file the offer wants and the seed's manifest lists into a staging dir of its
   own, `<receive tree>/.ray-uv-seed/<sha256>`, hashing the bytes it writes: a copy whose
   sha256 is not the one asked for (a seed damaged, or changed during the copy) is dropped, and
   that file is sent. It answers with what it staged (`take_answer`), then lets the seed go.
3. The driver asks the sender to refer to the files that every receiver taking the stream
   staged (`shared_files`: the chunks are relayed from receiver to receiver, one stream for
   all; a receiver without a seed gets the whole venv, and so do the others of that ship).
4. The sender streams such a file as a tar hard link to `.ray-uv-seed/<sha256>`: no content,
   but its name, mode and mtime as for any member, after checking that it is still what its
   build made (`archive.Packer`). The receiver puts the staged copy there (`place`).

Why copies, staged before the stream: the seed is read, never changed. A hard link would share
the seed's inodes, whose mode and times the new venv's freezing and removal would change (and a
shipped file's mtime, which its `.pyc` checks, is the sender's, not the seed's). Staging checks
every copy before the stream starts, so a damaged seed costs only the bytes of what it could
not give, never a failed receive, and no seed file is read while the stream is unpacked. The
result is checked as any received venv: the unpacked tree's manifest (staged files included,
with the hashes of their bytes) must be the sender's build's (`install.install_received`), then
it is relocated, frozen and marked; its scripts, which name their venv's path, differ between
keys and so are always sent. A receiver's marker says `shipped`, with the stream's bytes and,
when seeded, the seed's key and the files and bytes taken from it (`built`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_uv_plugin.building import seeding
from ray_uv_plugin.env.key import interpreter_tag
from ray_uv_plugin.ship.archive import SEED_REFERENCE as REFERENCE
from ray_uv_plugin.ship.archive import ArchiveError
from ray_uv_plugin.ship.messages import Offer, OfferAnswer
from ray_uv_plugin.store import freezing, manifest
from ray_uv_plugin.store.build_lock import hold_shared
from ray_uv_plugin.store.layout import Venv, site_packages

SEED_DIR = REFERENCE.rstrip("/")  # in a receive's tree: an own name, never a stream member
MIN_BYTES = 512  # files this small are sent: a reference costs a tar header too
_COPY_BYTES = 1024 * 1024


def offered_files(files: manifest.Files) -> list[str]:
    """The sha256s of a venv's files that a receiver may take from its seed (the offer's)."""
    return sorted({e.content for e in files.values() if e.kind == "file" and e.size >= MIN_BYTES})


def distributions(venv: Path) -> list[str]:
    """The dist-info dir names of a venv: what a receiver weighs its seeds by."""
    site = site_packages(venv)
    return sorted(seeding.dist_infos(site)) if site is not None else []


@dataclass
class Staged:
    """The seed's files that a receive copied and checked (`stage`), and what it placed."""

    seed: str  # the seed's key
    folder: Path  # `<receive tree>/.ray-uv-seed`
    files: dict[str, int]  # sha256 -> size, of each checked copy in `folder`
    dropped: int = 0  # copies that were not what the seed's manifest says
    placed: dict[str, str] = field(default_factory=dict)  # sha256 -> the first path it went to
    reused_files: int = 0
    reused_bytes: int = 0


def stage(root: Path, tree: Path, key: str, source: Offer) -> Staged | None:
    """Copy into `tree/.ray-uv-seed` each file the offer `source` wants that the nearest ready
    venv of `root` has (see the module's docstring); None where there is no seed to use."""
    wanted = set(source.files)
    try:
        found = seeding.nearest(root, key, interpreter_tag(), list(source.distributions))
    except Exception as e:  # a venv dir entry we may not touch, a marker gone: no seed
        if not seeding.untrusted_seed(e):
            raise
        return None
    if not wanted or found is None:
        return None
    name, path, meta = found
    try:
        lock_fd = hold_shared(Venv(root, name).lock)
    except (BlockingIOError, FileNotFoundError):  # being rebuilt or removed: no seed
        return None
    try:
        try:
            files = manifest.load(path, meta.get("manifest"))
        except manifest.ManifestError:
            return None
        sources: dict[str, tuple[str, int]] = {}
        for rel, entry in files.items():
            if entry.kind == "file" and entry.content in wanted:
                sources.setdefault(entry.content, (rel, entry.size))
        staged = Staged(name, tree / SEED_DIR, {})
        os.mkdir(staged.folder, 0o700)
        for sha256, (rel, size) in sources.items():
            if _copy_checked(path / rel, staged.folder / sha256, sha256, size):
                staged.files[sha256] = size
            else:
                staged.dropped += 1
        return staged
    finally:
        os.close(lock_fd)


def _copy_checked(source: Path, target: Path, sha256: str, size: int) -> bool:
    """Copy the seed's file `source` to `target` (new), hashing the bytes written; whether they
    are `size` bytes of `sha256`. A copy that is not (or a source gone) is removed. Errors
    writing `target` (a full disk) are raised: the receive could not go on anyway."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(source, flags)
    except OSError:  # removed meanwhile, or a link where a file was
        return False
    digest, written = hashlib.sha256(), 0
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        out_flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(target, out_flags, 0o600), "wb") as out:
            while written <= size and (data := f.read(_COPY_BYTES)):
                digest.update(data)
                out.write(data)
                written += len(data)
    if written == size and digest.hexdigest() == sha256:
        return True
    os.unlink(target)
    return False


def take_answer(staged: Staged | None) -> OfferAnswer:
    """A receiver's answer when it takes the venv: the sha256s it can place from its seed."""
    if staged is None:
        return OfferAnswer("take")
    return OfferAnswer("take", seed=staged.seed, have=tuple(sorted(staged.files)))


def shared_files(answers: list[OfferAnswer]) -> list[str]:
    """The files that every receiver taking the one stream staged (their answers' `have`)."""
    if not answers:
        return []
    common = set(answers[0].have)
    for answer in answers[1:]:
        common &= set(answer.have)
    return sorted(common)


def place(staged: Staged | None, member: tarfile.TarInfo, path: str) -> manifest.Entry:
    """Put the staged copy a referring member names at `path` (new, in the receive's tree),
    with the member's mode and mtime; returns its manifest entry. The first member of a content
    takes the staged file itself, the others a copy of it."""
    sha256 = member.linkname[len(REFERENCE) :]
    if staged is None or sha256 not in staged.files:
        raise ArchiveError(
            f"{member.name!r} refers to a file ({sha256[:12]}...) that this node did not take "
            "from a seed"
        )
    first = staged.placed.get(sha256)
    if first is None:
        os.rename(staged.folder / sha256, path)
        staged.placed[sha256] = path
    else:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(first, "rb") as src, open(os.open(path, flags, 0o600), "wb") as out:
            while data := src.read(_COPY_BYTES):
                out.write(data)
    mode = manifest.file_mode(member.mode)
    os.chmod(path, mode)
    os.utime(path, (member.mtime, member.mtime))  # .pyc files check it
    size = staged.files[sha256]
    staged.reused_files += 1
    staged.reused_bytes += size
    return manifest.file_entry(mode, size, sha256)


def discard(staged: Staged | None) -> None:
    """Remove the staging dir and what was staged but not placed, before the tree is a venv."""
    if staged is not None:
        freezing.remove_tree(staged.folder)


def built(host: str, sent: int, staged: Staged | None) -> dict[str, Any]:
    """A received venv's marker's `built`: shipped from `host`, `sent` stream bytes, and where
    seeded, from which key, and how many files and bytes came from it instead."""
    how: dict[str, Any] = {"how": "shipped", "from": host, "bytes": sent}
    if staged is not None and staged.reused_files:
        how.update(
            seed=staged.seed, reused_files=staged.reused_files, reused_bytes=staged.reused_bytes
        )
    return how
