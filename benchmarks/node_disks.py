"""A disk of its own for each simulated node: a journaled ext4 on a loop device.

Simulated nodes on one host would otherwise share one filesystem, and with it one inode
allocator and its history. This host's root filesystem is an ext4 without a journal, where
the kernel passes over every inode freed in the last minute or more when it allocates one:
creating 20,000 files right after 20,000 were removed took 5.2 s here against 1.2 s on a quiet
filesystem, and 0.8 s on a journaled ext4 either way. One node's cleanup (or the previous
scenario's) would slow every other node's writes, which no cluster of separate machines does.

`mounted(paths, images)` makes each of `paths` the mount point of a fresh ext4 in a sparse
image file under `images` (`mount -o loop`: the loop device goes with the unmount), and
unmounts them and removes the images when its block ends, however it ends. A run killed
before that leaves mounts under its work dir (`findmnt | grep ruvship-`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SIZE = "16G"  # sparse: only what is written takes room on the host's disk
UNMOUNT_TRIES = 10  # a process that just ended may hold the mount for a moment


class DiskError(RuntimeError):
    """A node's disk could not be made or removed; the message names the command."""


def _run(*argv: str) -> None:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise DiskError(f"{' '.join(argv)}: {(out.stderr or out.stdout).strip()}")


def unavailable() -> str | None:
    """Why nodes cannot have disks of their own here (None if they can): root, `mkfs.ext4`,
    and a small one made, mounted and removed for real."""
    if os.geteuid() != 0:
        return "loop mounts need root"
    if shutil.which("mkfs.ext4") is None:
        return "`mkfs.ext4` (e2fsprogs) is not installed"
    with tempfile.TemporaryDirectory(prefix="ruvship-disk-") as tmp:
        try:
            with mounted([Path(tmp) / "mnt"], Path(tmp), size="64M"):
                pass
        except (DiskError, OSError) as e:
            return f"cannot mount a loop device here: {e}"
    return None


def _unmount(path: Path) -> str | None:
    """Unmounts `path`; what went wrong, if it stayed mounted."""
    for _ in range(UNMOUNT_TRIES):
        out = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if out.returncode == 0 or not os.path.ismount(path):
            return None
        time.sleep(0.5)
    return f"umount {path}: {out.stderr.strip()}"


@contextmanager
def mounted(
    paths: list[Path], images: Path, size: str = SIZE, reserved_percent: int = 5, fs: str = "ext4"
) -> Iterator[None]:
    """Each of `paths` (made here) the mount point of its own fresh ext4 of `size`, its image
    in `images`; all unmounted and removed when the block ends. `reserved_percent`: the blocks
    kept for root (`mkfs.ext4 -m`; 0: a full disk is full for root too). `fs="xfs"`: an XFS
    with reflinks instead (`mkfs.xfs -m reflink=1`; no blocks kept for root)."""
    made: list[tuple[Path, Path]] = []
    try:
        for path in paths:
            path.mkdir(parents=True)
            image = images / f"{path.name}.{fs}"
            with open(image, "xb") as f:
                f.truncate(_bytes(size))
            made.append((path, image))
            if fs == "xfs":
                _run("mkfs.xfs", "-q", "-f", "-m", "reflink=1", "-K", str(image))
            else:
                reserve = str(reserved_percent)
                _run("mkfs.ext4", "-q", "-F", "-m", reserve, "-E", "nodiscard", str(image))
            _run("mount", "-o", "loop", str(image), str(path))
        yield
    finally:
        left = []
        for path, image in reversed(made):
            why = _unmount(path) if os.path.ismount(path) else None
            if why:
                left.append(why)
            else:
                image.unlink(missing_ok=True)
        if left:
            raise DiskError("could not remove " + "; ".join(left))


def _bytes(size: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
