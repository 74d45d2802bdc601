"""`store.freezing`: a built venv read-only, the plugin's own files included, uv's cache's not."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ray_uv_plugin.store import freezing, manifest

PYC = "lib/python3.11/site-packages/__pycache__/six.cpython-311.pyc"
SOURCE = "lib/python3.11/site-packages/six.py"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_plugins_own_files_lose_their_write_bits_and_uvs_cache_files_keep_theirs(
    tmp_path: Path,
) -> None:
    """A seed's `.pyc` is hardlinked into the venvs seeded from it: a write in place to it in
    one changed them all. uv's files are its cache's inodes: a chmod would change
    the cache's file, so they keep their owner's write bit."""
    cache = tmp_path / "uv-cache" / "six.py"
    cache.parent.mkdir()
    cache.write_text("x = 1\n")
    cache.chmod(0o644)
    seed, venv = tmp_path / "seed", tmp_path / "venv"
    for tree in (seed, venv):
        (tree / PYC).parent.mkdir(parents=True)
        os.link(cache, tree / SOURCE)  # as uv links it from its cache
    (seed / PYC).write_bytes(b"bytecode")
    (seed / PYC).chmod(0o664)
    os.link(seed / PYC, venv / PYC)  # as a seeded build takes it
    before = manifest.file_entry(os.lstat(venv / PYC).st_mode, 8, "x")

    freezing.freeze(venv, {PYC})

    assert mode(venv / PYC) == mode(seed / PYC) == 0o444  # one inode: the seed's too
    assert mode(venv / SOURCE) == mode(cache) == 0o644  # uv's cache's file: as it was
    assert mode(venv / "lib") == 0o555
    # The manifest's mode of a file is the same with or without its write bits.
    assert manifest.file_entry(os.lstat(venv / PYC).st_mode, 8, "x") == before
